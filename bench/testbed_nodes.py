"""Whether this machine holds an N-node job on the Slurm testbed: `python -m bench.testbed_nodes --nodes 3` (root).

Brings the testbed up with N nodes (cluster/testbed/up.sh; a testbed of another size is torn down first), runs
one small job through cluster/start_ray_slurm.sh (N CPU workers, one epoch of 512 rows), takes it down again
(unless it was up with N nodes before), and samples the machine's used memory and load every second. Run it
under the shared Ray lock: it stands in for other lanes' testbed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from bench.common import ROOT, publish

sys.path.insert(0, str(ROOT / "tests" / "slurm"))
from slurm_testbed import TESTBED, TESTBED_DIR, Testbed  # noqa: E402  (tests/slurm: the tests' own helpers)

log = logging.getLogger("bench.testbed_nodes")

SMALL_RUN = ["--epochs", "1", "--train-size", "512", "--val-size", "256", "--no-report", "--no-tensorboard"]


class Sampler:
    """The machine's used memory (GiB) and 1-minute load, every second."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while not self.stop.wait(1):
            self.samples.append((psutil.virtual_memory().used / 2**30, os.getloadavg()[0]))


def run_job(nodes: int) -> dict:
    shared = TESTBED_DIR / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    job = Testbed(shared=shared).sbatch(
        [f"--nodes={nodes}", "--ntasks-per-node=1", "--cpus-per-task=3", "--gpus-per-node=0", "--time=30"],
        ["--num-workers", str(nodes), *SMALL_RUN],
        name=f"{nodes}-nodes",
        timeout=700,
    )
    joined = [line for line in job.log.splitlines() if "node(s) joined" in line]
    return {"job_rc": job.returncode, "job_s": round(job.elapsed, 1), "joined": joined[-1] if joined else None}


def measure(nodes: int) -> dict:
    sampler = Sampler()
    was_up = (TESTBED_DIR / "nodes.count").exists() and (TESTBED_DIR / "nodes.count").read_text().strip() == str(nodes)
    started = time.monotonic()
    up = subprocess.run([str(TESTBED / "up.sh"), str(nodes)], capture_output=True, text=True, timeout=300)
    result: dict = {"nodes": nodes, "up_rc": up.returncode, "up_s": round(time.monotonic() - started, 1)}
    try:
        if up.returncode == 0:
            result.update(run_job(nodes))
        else:
            log.error("cluster/testbed/up.sh failed: %s", up.stderr.strip()[-500:])
    finally:
        if not was_up:
            subprocess.run([str(TESTBED / "down.sh")], capture_output=True, text=True, timeout=300)
        sampler.stop.set()
    used, load = zip(*sampler.samples) if sampler.samples else ((0.0,), (0.0,))
    return {**result, "memory_used_gib_max": round(max(used), 2), "memory_used_gib_min": round(min(used), 2),
            "load1_max": round(max(load), 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)
    if args.nodes < 1:
        parser.error("--nodes must be 1 or more")
    if os.geteuid() != 0:
        parser.error("the Slurm testbed needs root (network namespaces, slurmd)")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = measure(args.nodes)
    publish([result], json.dumps(result), args.json)
    return 0 if result.get("job_rc") == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
