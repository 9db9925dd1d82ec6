"""`python -m bench`: ours (Ray Train, this project) versus plain DDP started by torchrun.

One invocation runs every contender REPEATS times, in rounds; inside a round
the contenders alternate and the order flips every round (A B, then B A), so
slow drift of the machine falls on both sides. Every contender is a fresh
process tree started from here, as a user would start it:

* ours: `python -m raytrain_ddp.run --num-workers W ...` (through
  bench/ours_cli.py, which only adds a timing probe to rank 0's loop);
* plain: `python -m torch.distributed.run --nproc-per-node W bench/plain_ddp.py`.

Both use the project's model (cnn, 3x32x32, 10 classes), the same per-worker
batch, SGD(lr 0.02, momentum 0.9, weight decay 5e-4), the same data
(synthetic images from raytrain_ddp.data.synthetic in memory, or the same PNG
Parquet files written by raytrain_ddp.data.prepare.from_arrays) and
OMP_NUM_THREADS=1 in every process (what Ray sets for a 1-CPU worker and what
torchrun sets for nproc > 1; the probes record torch.get_num_threads()).

Figures (each: median and min..max over the repeats; ratios are taken per round):
1. steady-state samples/s: rank 0's clock, epochs >= 2, from step 10 to the
   last step of each epoch (epoch boundaries left out on both sides);
2. time to first step: from launching the command to the end of rank 0's
   first optimizer step, the same event on both sides;
3. ingest images/s to 2 consumers from PNG Parquet files of their own,
   `ingest_rows` training rows (larger than the training figures' files, so
   that a rank's pass is several Ray Data tasks long and the window does not
   hinge on when one task's output lands): the project's
   Ray Data pipeline (build_datasets + ShardingDataConfig) versus DataLoader +
   DistributedSampler, same number of loader CPUs, in the steady state: each
   side makes `ingest_epochs` passes, and the rate is the rows delivered
   between the moment the last consumer ends pass 1 (start-up: processes,
   imports, loader workers) and the moment the first consumer ends the
   second-to-last pass, over that time. Both consumers are mid-stream all
   through the window (both start pass 1 together), and every pass in it has a
   successor, so a pipeline that reads the next pass ahead (ours does) pays in
   the window for the head start it got before it (ours also reads a warm-up
   pass before pass 1, on a stream of its own: see bench/ours_ingest.py);
4. scaling: ours with 1 and 2 workers, efficiency = thr_2 / (2 * thr_1).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from bench.common import ROOT, first_step_time, steady_samples_per_s

PY = sys.executable
RESULTS = ROOT / "bench" / "results"
RUN_TIMEOUT_S = 420
TARGETS = {  # figure -> (comparison, bound)
    "throughput": (">=", 0.98),
    "throughput_parquet": (">=", 0.98),
    "first_step": ("<=", 2.0),
    "ingest": (">=", 1.0),
}


@dataclass(frozen=True)
class Sizes:
    train_size: int  # training rows (in memory; the Parquet train split is about as large)
    val_size: int
    epochs: int
    batch_size: int
    repeats: int
    ingest_rows: int  # training rows of the ingest figure's own Parquet files (an epoch many tasks long)
    ingest_epochs: int
    loader_cpus: int  # loader CPUs for ingest (Ray Data's logical CPUs / DataLoader workers, in total)
    parquet_pair: bool = True  # the Parquet PNG training pair (ours and plain reading the same files)
    scaling: bool = True  # ours with 1 worker too (the 2-worker run is the in-memory pair's)


QUICK = Sizes(  # the smallest that still has a steady-state window (micro-batches 10.. of 32 per epoch)
    train_size=1024, val_size=64, epochs=2, batch_size=16, repeats=1, ingest_rows=8192, ingest_epochs=5, loader_cpus=2
)
# every part runs once, on the least data that still has a window: a check, not a measurement; not the Parquet pair
# nor the 1-worker run (the in-memory pair's command with another --num-workers)
SMOKE = dataclasses.replace(
    QUICK, train_size=512, val_size=32, ingest_rows=4096, ingest_epochs=16, parquet_pair=False, scaling=False
)  # 16 passes: a window two consumers started apart still share beside `make test`'s other lane (8 did not)
FULL = Sizes(
    train_size=4096, val_size=256, epochs=3, batch_size=64, repeats=3, ingest_rows=32768, ingest_epochs=8, loader_cpus=2
)


# ----------------------------------------------------------------- processes
def _env() -> dict:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # always a fresh local Ray of our own
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(cmd: list[str], log: Path) -> float:
    """Run a contender to completion; returns its launch time (time.time())."""
    with open(log, "w") as out:
        launched = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"{' '.join(cmd)} failed ({rc}); last lines of {log}:\n{tail}")
    return launched


def _torchrun(workers: int) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers)]


class Bench:
    def __init__(self, sizes: Sizes, work: Path):
        self.sizes, self.work, self.count = sizes, work, 0
        self.parquet_dir = work / "parquet"
        self.ingest_dir = work / "parquet-ingest"

    def _next(self, label: str) -> Path:
        self.count += 1
        return self.work / f"{self.count:02d}-{label}"

    def prepare_parquet(self) -> None:
        """The Parquet files both contenders read (the synthetic images, PNG-encoded): one set for training,
        a larger one for ingest, whose passes are long against one Ray Data task (about 4,000 rows here)."""
        import numpy as np

        from raytrain_ddp.data import synthetic
        from raytrain_ddp.data.prepare import from_arrays

        for out, train_rows in ((self.parquet_dir, self.sizes.train_size), (self.ingest_dir, self.sizes.ingest_rows)):
            rows = synthetic.image_rows(np.arange(round(train_rows / 0.9)), seed=0)
            from_arrays(
                rows["image"],
                rows["label"],
                [str(c) for c in range(synthetic.NUM_CLASSES)],
                str(out),
                val_fraction=0.1,
                seed=0,
                layout="NCHW",
                encoding="png",
                rows_per_file=1024,
            )

    def ours_train(self, workers: int, data: str) -> dict:
        s = self.sizes
        base = self._next(f"ours-{data}-{workers}w")
        probe = base.with_suffix(".probe.json")
        args = [
            "--num-workers",
            str(workers),
            "--epochs",
            str(s.epochs),
            "--batch-size",
            str(s.batch_size),
            "--storage-path",
            str(self.work / "runs"),
            "--name",
            base.name,
            "--no-tensorboard",
            "--no-report",
            "--seed",
            "0",
        ]
        args += (
            ["--data", str(self.parquet_dir)]
            if data == "parquet"
            else ["--train-size", str(s.train_size), "--val-size", str(s.val_size)]
        )
        launched = _run([PY, "-m", "bench.ours_cli", "--probe-out", str(probe), "--", *args], base.with_suffix(".log"))
        result = self._figures(json.loads(probe.read_text()), launched)
        metrics = [
            json.loads(line) for line in (self.work / "runs" / base.name / "metrics.jsonl").read_text().splitlines()
        ]
        result["epoch_samples_per_s"] = statistics.mean(m["samples_per_second"] for m in metrics[1:] or metrics)
        return result

    def plain_train(self, workers: int, data: str) -> dict:
        s = self.sizes
        base = self._next(f"plain-{data}-{workers}w")
        probe = base.with_suffix(".probe.json")
        launched = _run(
            [
                *_torchrun(workers),
                "bench/plain_ddp.py",
                "--data",
                "memory" if data == "memory" else str(self.parquet_dir),
                "--train-size",
                str(s.train_size),
                "--epochs",
                str(s.epochs),
                "--batch-size",
                str(s.batch_size),
                "--loader-workers",
                "1",
                "--out",
                str(probe),
            ],
            base.with_suffix(".log"),
        )
        return self._figures(json.loads(probe.read_text()), launched)

    @staticmethod
    def _figures(probe: dict, launched: float) -> dict:
        return {
            "samples_per_s": steady_samples_per_s(probe["events"], probe["world_size"]),
            "first_step_s": first_step_time(probe["events"]) - launched,
            "torch_threads": probe["torch_threads"],
            "omp_num_threads": probe["omp_num_threads"],
        }

    def ours_ingest(self) -> dict:
        s = self.sizes
        base = self._next("ours-ingest")
        out = base.with_suffix(".json")
        _run(
            [
                PY,
                "-m",
                "bench.ours_ingest",
                "--data",
                str(self.ingest_dir),
                "--epochs",
                str(s.ingest_epochs),
                "--batch-size",
                str(s.batch_size),
                "--data-cpus",
                str(s.loader_cpus),
                "--out",
                str(out),
            ],
            base.with_suffix(".log"),
        )
        return _ingest_rate(json.loads(out.read_text())["consumers"])

    def plain_ingest(self) -> dict:
        s = self.sizes
        base = self._next("plain-ingest")
        _run(
            [
                *_torchrun(2),
                "bench/plain_ingest.py",
                "--data",
                str(self.ingest_dir),
                "--epochs",
                str(s.ingest_epochs),
                "--batch-size",
                str(s.batch_size),
                "--loader-workers",
                str(max(1, s.loader_cpus // 2)),
                "--out",
                str(base),
            ],
            base.with_suffix(".log"),
        )
        return _ingest_rate([json.loads(Path(f"{base}.{r}.json").read_text()) for r in range(2)])


def _ingest_rate(consumers: list[dict]) -> dict:
    """Steady-state images/s delivered to all consumers together (figure 3 in the module docstring),
    and the slowest consumer's wait for a pass's first batch, mean over the passes after the first
    and before the last. Each consumer: {"passes": [(start, end, rows, first batch)], "batches": [(time, rows)]}."""
    start = max(c["passes"][0][1] for c in consumers)
    end = min(c["passes"][-2][1] for c in consumers)
    if end <= start:
        raise RuntimeError("ingest: the consumers ran too far apart for a steady-state window; use more passes")
    rows = sum(n for c in consumers for t, n in c["batches"] if start < t <= end)
    waits = [
        max(c["passes"][p][3] - c["passes"][p][0] for c in consumers) for p in range(1, len(consumers[0]["passes"]) - 1)
    ]
    return {"images_per_s": rows / (end - start), "first_batch_s": statistics.mean(waits)}


# ------------------------------------------------------------------- figures
def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": values}


def machine() -> dict:
    model = platform.processor() or "?"
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cores": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "torch": metadata.version("torch"),
        "ray": metadata.version("ray"),
        "os": f"{platform.system()} {platform.release()}",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


def run_suite(sizes: Sizes, log=print) -> dict:
    samples: dict[str, list] = {
        k: [] for k in ("ours_mem", "plain_mem", "ours_1w", "ours_pq", "plain_pq", "ours_ingest", "plain_ingest")
    }
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="raytrain-bench-") as tmp:
        bench = Bench(sizes, Path(tmp))
        bench.prepare_parquet()
        for round_ in range(sizes.repeats):
            flip = round_ % 2 == 1  # A B in even rounds, B A in odd ones

            def pair(first, second):
                return (second(), first())[::-1] if flip else (first(), second())  # noqa: B023 (this round's)

            def say(text):
                log(f"  [round {round_ + 1}/{sizes.repeats}, {time.time() - started:4.0f}s] {text}")  # noqa: B023

            o, p = pair(lambda: bench.ours_train(2, "memory"), lambda: bench.plain_train(2, "memory"))
            samples["ours_mem"].append(o), samples["plain_mem"].append(p)
            say(
                f"in memory: ours {o['samples_per_s']:.0f}, plain {p['samples_per_s']:.0f} samples/s; "
                f"first step ours {o['first_step_s']:.1f}s, plain {p['first_step_s']:.1f}s"
            )
            if sizes.scaling:
                one = bench.ours_train(1, "memory")
                samples["ours_1w"].append(one)
                say(f"ours, 1 worker: {one['samples_per_s']:.0f} samples/s")
            if sizes.parquet_pair:
                o, p = pair(lambda: bench.ours_train(2, "parquet"), lambda: bench.plain_train(2, "parquet"))
                samples["ours_pq"].append(o), samples["plain_pq"].append(p)
                say(f"Parquet PNG: ours {o['samples_per_s']:.0f}, plain {p['samples_per_s']:.0f} samples/s")
            o, p = pair(bench.ours_ingest, bench.plain_ingest)
            samples["ours_ingest"].append(o), samples["plain_ingest"].append(p)
            say(
                f"ingest: ours {o['images_per_s']:.0f}, plain {p['images_per_s']:.0f} images/s "
                f"(first batch after {o['first_batch_s']:.2f}s / {p['first_batch_s']:.2f}s)"
            )
    return summarise(samples, sizes, time.time() - started)


def summarise(samples: dict, sizes: Sizes, seconds: float) -> dict:
    def field(name, key):
        return [r[key] for r in samples[name]]

    figures = {
        "throughput": ("samples/s", field("ours_mem", "samples_per_s"), field("plain_mem", "samples_per_s")),
        "throughput_parquet": ("samples/s", field("ours_pq", "samples_per_s"), field("plain_pq", "samples_per_s")),
        "first_step": ("s", field("ours_mem", "first_step_s"), field("plain_mem", "first_step_s")),
        "ingest": ("images/s", field("ours_ingest", "images_per_s"), field("plain_ingest", "images_per_s")),
    }
    out: dict = {"figures": {}}
    for name, (unit, ours, plain) in figures.items():
        if not ours:  # a part this mode leaves out (--smoke: the Parquet pair)
            continue
        ratios = [a / b for a, b in zip(ours, plain)]
        cmp, bound = TARGETS[name]
        median = statistics.median(ratios)
        out["figures"][name] = {
            "unit": unit,
            "ours": spread(ours),
            "plain": spread(plain),
            "ratio": spread(ratios),
            "target": f"{cmp} {bound}",
            "met": median >= bound if cmp == ">=" else median <= bound,
        }
        out[f"{name}_ratio"] = median
    if sizes.scaling:
        one, two = field("ours_1w", "samples_per_s"), field("ours_mem", "samples_per_s")
        efficiency = [b / (2 * a) for a, b in zip(one, two)]
        out["figures"]["scaling"] = {
            "unit": "samples/s",
            "workers_1": spread(one),
            "workers_2": spread(two),
            "efficiency": spread(efficiency),
        }
        out["scaling_efficiency"] = statistics.median(efficiency)
    out["threads"] = {
        name: sorted({(r["torch_threads"], r["omp_num_threads"]) for r in samples[name]})
        for name in ("ours_mem", "plain_mem", "ours_1w", "ours_pq", "plain_pq")
        if samples[name]
    }
    out["ingest_first_batch_s"] = {
        "ours": spread(field("ours_ingest", "first_batch_s")),
        "plain": spread(field("plain_ingest", "first_batch_s")),
    }
    out["ours_epoch_samples_per_s"] = spread(field("ours_mem", "epoch_samples_per_s"))
    out["sizes"] = sizes.__dict__
    out["machine"] = machine()
    out["seconds"] = round(seconds, 1)
    return out


# ------------------------------------------------------------------- output
def _fmt(value: float, unit: str) -> str:
    return f"{value:.1f}" if unit == "s" else f"{value:,.0f}"


def _cell(s: dict, unit: str) -> str:
    return f"{_fmt(s['median'], unit)} ({_fmt(s['min'], unit)}..{_fmt(s['max'], unit)})"


def _ratio(s: dict) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}..{s['max']:.2f})"


def markdown(result: dict, mode: str) -> str:
    m, sz, f = result["machine"], result["sizes"], result["figures"]
    labels = {
        "throughput": "Steady-state throughput, in memory (samples/s)",
        "throughput_parquet": "Steady-state throughput, Parquet PNG (samples/s)",
        "first_step": "Time to first step from command start (s)",
        "ingest": "Ingest to 2 consumers, Parquet PNG (images/s)",
    }
    lines = [
        f"# raytrain-ddp benchmark ({mode})",
        "",
        f"Machine: {m['cores']} cores, {m['cpu']}; {m['os']}; Python {m['python']}, torch {m['torch']}, "
        f"ray {m['ray']}; {m['date']}.",
        f"Sizes: {sz['train_size']} training rows, batch {sz['batch_size']} per worker, {sz['epochs']} epochs, "
        f"{sz['repeats']} repeat(s) alternating ours/plain; OMP_NUM_THREADS=1 everywhere; "
        f"{sz['loader_cpus']} loader CPUs for ingest. Total {result['seconds']:.0f}s.",
        "",
        "Values: median (min..max) over the repeats; ratios are ours / plain, per round.",
        "",
        "| Figure | Ours (Ray Train) | Plain DDP (torchrun) | Ratio | Target | Met |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in labels.items():
        if name not in f:
            continue
        g = f[name]
        lines.append(
            f"| {label} | {_cell(g['ours'], g['unit'])} | {_cell(g['plain'], g['unit'])} | "
            f"{_ratio(g['ratio'])} | {g['target']} | {'yes' if g['met'] else 'NO'} |"
        )
    if s := f.get("scaling"):
        lines += [
            "",
            "| Scaling (ours, in memory) | 1 worker | 2 workers | Efficiency thr2 / (2 x thr1) |",
            "|---|---|---|---|",
            f"| samples/s | {_cell(s['workers_1'], 'x')} | {_cell(s['workers_2'], 'x')} | {_ratio(s['efficiency'])} |",
        ]
    lines += [
        "",
        "Method: steady state = rank 0's step clock over epochs >= 2, steps 10..last of each epoch "
        "(no epoch boundaries: validation, checkpointing and reshuffling are outside it on both sides). "
        "First step = from launching the command (`python -m raytrain_ddp.run` / torchrun) to the end of "
        "rank 0's first optimizer step, both read on this machine's clock. Ingest = steady state over "
        f"{sz['ingest_epochs']} passes over a Parquet train split of {sz['ingest_rows']} rows: "
        "rows delivered to both consumers from "
        "the last consumer's end of pass 1 to the first consumer's end of the second-to-last pass, over "
        "that time. "
        f"Ours' own per-epoch samples/s (metrics.jsonl, epochs >= 2, whole epoch incl. first-batch wait): "
        f"{_cell(result['ours_epoch_samples_per_s'], 'x')}. Ingest wait for a pass's first batch (mean over the "
        f"measured passes, slowest consumer): ours "
        f"{_cell(result['ingest_first_batch_s']['ours'], 's')} s, "
        f"plain {_cell(result['ingest_first_batch_s']['plain'], 's')} s.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sizes_group = parser.add_mutually_exclusive_group()
    sizes_group.add_argument("--quick", action="store_true", help="small data, 1 repeat (about 4 minutes)")
    sizes_group.add_argument(
        "--smoke",
        action="store_true",
        help="the least data, 1 repeat, no Parquet training pair: checks that every part runs (the tests' mode)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the figures as one JSON object to FILE")
    parser.add_argument(
        "--md",
        metavar="FILE",
        help="where the Markdown table goes (default: bench/results/latest.md, or latest-quick.md with --quick)",
    )
    parser.add_argument("--repeats", type=int, help="override the number of rounds")
    args = parser.parse_args(argv)
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    sizes = {"smoke": SMOKE, "quick": QUICK, "full": FULL}[mode]
    if args.repeats:
        sizes = Sizes(**{**sizes.__dict__, "repeats": args.repeats})
    print(f"raytrain-ddp benchmark, {mode} mode: {sizes.repeats} round(s)", file=sys.stderr, flush=True)
    try:
        result = run_suite(sizes, log=lambda text: print(text, file=sys.stderr, flush=True))
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    result["mode"] = mode
    table = markdown(result, mode)
    print(table)
    md = Path(args.md) if args.md else RESULTS / ("latest.md" if mode == "full" else f"latest-{mode}.md")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    measured = [
        k for k in ("throughput_ratio", "first_step_ratio", "ingest_ratio", "scaling_efficiency") if k in result
    ]
    bad = [k for k in measured if not (isinstance(result[k], float) and math.isfinite(result[k]) and result[k] > 0)]
    return 1 if bad else 0
