"""`raytrain-ddp launch` against torchrun on the same unmodified script: `python -m bench.launch_vs_torchrun`.

bench/launch_script.py (a small CNN on in-memory data, DistributedSampler, SGD) runs under
`torchrun --nproc-per-node 2` and under `raytrain-ddp launch --num-workers 2` (its own local Ray, as on a laptop),
alternated over --rounds rounds, OMP_NUM_THREADS=1 on both. Figures: time from the command's start to the first
optimizer step, and steady-state samples/s over epochs 2+ (bench.common), median (min..max) and ours / torchrun.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, first_step_time, save_results, steady_samples_per_s, summarise

SCRIPT = ROOT / "bench" / "launch_script.py"
RESULTS = ROOT / "bench" / "results"


def contenders(storage: Path, round_: int, script_args: list[str]) -> dict[str, list[str]]:
    python = sys.executable
    return {
        "torchrun": [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT), *script_args],
        "launch": [python, "-m", "raytrain_ddp.launch", "--num-workers", "2", "--storage-path", str(storage),
                   "--name", f"round-{round_}", "--no-tensorboard", str(SCRIPT), *script_args],
    }  # fmt: skip


def measure(command: list[str], probe: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    started = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{command[2]} failed ({done.returncode}): {done.stderr[-2000:]}")
    events = json.loads(probe.read_text())["events"]
    return {
        "first_step_s": first_step_time(events) - started,
        "samples_per_s": steady_samples_per_s(events, world_size=2),
        "wall_s": time.time() - started,
    }


def table(result: dict) -> str:
    rows = [
        "| Figure | launch (Ray) | torchrun | Ratio |",
        "|---|---|---|---|",
    ]
    for key, label, fmt in (("samples_per_s", "Steady-state throughput (samples/s)", ",.0f"),
                            ("first_step_s", "Time to first step from command start (s)", ".1f")):  # fmt: skip
        ours, theirs, ratio = (result[name][key] for name in ("launch", "torchrun", "ratio"))
        rows.append(
            f"| {label} | {ours['median']:{fmt}} ({ours['min']:{fmt}}..{ours['max']:{fmt}}) "
            f"| {theirs['median']:{fmt}} ({theirs['min']:{fmt}}..{theirs['max']:{fmt}}) "
            f"| {ratio['median']:.2f} ({ratio['min']:.2f}..{ratio['max']:.2f}) |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=str(RESULTS / "launch.json"), help="JSON results (a .md table beside it)")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {"torchrun": [], "launch": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(1, args.rounds + 1):
            probe = Path(tmp) / "probe.json"
            script_args = ["--rows", str(args.rows), "--epochs", str(args.epochs), "--probe-out", str(probe)]
            for name, command in contenders(Path(tmp) / "runs", round_, script_args).items():
                runs[name].append(measure(command, probe))
                print(f"round {round_} {name}: {runs[name][-1]}", flush=True)
    result: dict = {
        name: {key: summarise([r[key] for r in measured]) for key in measured[0]} for name, measured in runs.items()
    }
    result["ratio"] = {
        key: summarise([ours[key] / theirs[key] for ours, theirs in zip(runs["launch"], runs["torchrun"])])
        for key in ("samples_per_s", "first_step_s")
    }
    result["setup"] = {"rounds": args.rounds, "rows": args.rows, "epochs": args.epochs, "workers": 2, "batch": 64}
    save_results(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
