"""Time to the first optimizer step: torchrun, `--quick-start` and the full path, side by side:
`python -m bench.quick_start`.

Three commands from a cold start, alternated over --rounds rounds, OMP_NUM_THREADS=1 for all: torchrun on
bench/launch_script.py (a small CNN on in-memory data, DistributedSampler, SGD: the torchrun baseline), and the
built-in loop (the small CNN on the built-in data) as a user runs it, `python -m raytrain_ddp.run --num-workers 2`,
with `--quick-start` (N local processes under Ray Train's local mode) and without (its own local Ray, Ray Train's
controller and worker actors). Figure: seconds from the command's start to the end of rank zero's first optimizer
step (the built-in loop's: a :class:`FirstStep` hook, RAYTRAIN_WORKER_HOOKS), median (min..max), and each against
torchrun's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import ROOT, first_step_time, save_results, summarise
from raytrain_ddp.worker.hooks import HOOKS_ARGS_ENV, HOOKS_ENV, WorkerHooks

SCRIPT = ROOT / "bench" / "launch_script.py"
RESULTS = ROOT / "bench" / "results"
CONTENDERS = ("torchrun", "quick-start", "full path")


@dataclass
class FirstStep(WorkerHooks):
    """Rank zero writes {"first_step": time.time()} to `probe_out` after its first optimizer step."""

    probe_out: str
    written: bool = False

    def on_optimizer_step(self, rank: int, epoch: int, step: int) -> None:
        if rank == 0 and not self.written:
            self.written = True
            Path(self.probe_out).write_text(json.dumps({"first_step": time.time()}))


def commands(storage: Path, round_: int, rows: int, probe: Path) -> dict[str, list[str]]:
    python = sys.executable
    ours = [python, "-m", "raytrain_ddp.run", "--num-workers", "2", "--epochs", "1", "--train-size", str(rows),
            "--val-size", "256", "--storage-path", str(storage), "--no-tensorboard", "--no-report"]  # fmt: skip
    torchrun = [python, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT),
                "--rows", str(rows), "--epochs", "1", "--probe-out", str(probe)]  # fmt: skip
    return {
        "torchrun": torchrun,
        "quick-start": [*ours, "--quick-start", "--name", f"quick-{round_}"],
        "full path": [*ours, "--name", f"full-{round_}"],
    }


def first_step_s(command: list[str], probe: Path) -> float:
    """Seconds from the command's start to its first optimizer step's end."""
    probe.unlink(missing_ok=True)
    hooks = {HOOKS_ENV: "bench.quick_start:FirstStep", HOOKS_ARGS_ENV: json.dumps({"probe_out": str(probe)})}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **hooks}
    started = time.time()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} failed ({done.returncode}): {done.stderr[-2000:]}")
    probed = json.loads(probe.read_text())
    return (probed["first_step"] if "first_step" in probed else first_step_time(probed["events"])) - started


def table(result: dict) -> str:
    rows = ["| Command | First step from command start (s) | Against torchrun |", "|---|---|---|"]
    for name in CONTENDERS:
        own, ratio = result[name], result["ratio"].get(name)
        against = f"{ratio['median']:.2f}x ({ratio['min']:.2f}..{ratio['max']:.2f})" if ratio else "1"
        rows.append(f"| {name} | {own['median']:.1f} ({own['min']:.1f}..{own['max']:.1f}) | {against} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1024, help="training rows (one epoch)")
    parser.add_argument("--out", default=str(RESULTS / "quick_start.json"), help="JSON results (a .md table beside)")
    args = parser.parse_args(argv)
    seconds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.json"
        for round_ in range(1, args.rounds + 1):
            for name, command in commands(Path(tmp) / "runs", round_, args.rows, probe).items():
                seconds[name].append(first_step_s(command, probe))
                print(f"round {round_} {name}: first step {seconds[name][-1]:.1f}s", flush=True)
    result: dict = {name: summarise(values) for name, values in seconds.items()}
    result["ratio"] = {
        name: summarise([ours / theirs for ours, theirs in zip(seconds[name], seconds["torchrun"])])
        for name in CONTENDERS[1:]
    }
    result["setup"] = {"rounds": args.rounds, "rows": args.rows, "workers": 2, "batch": 64, "per_round": seconds}
    save_results(args.out, result, table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
