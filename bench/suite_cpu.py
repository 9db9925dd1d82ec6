"""Where the test suite's time goes: CPU seconds per test, per lane, as a pytest plugin (Linux, root).

    PYTHONPATH=bench .venv/bin/python -m pytest -n 2 -p suite_cpu     # writes suite-cpu.tsv
    .venv/bin/python bench/suite_cpu.py suite-cpu.tsv                  # per file, per lane

Each xdist worker (a lane: tests/support.py's lane_of) moves itself into a cgroup v1 `cpuacct` group of
its own, which every process it starts joins: its local Ray and the Ray workers, the CLI runs, the Slurm
testbed's daemons and their jobs. A test's CPU is what its lane's group used from its setup to its
teardown, so the other lane's work is not counted in it (wall time is: the lanes share two cores).
"""

from __future__ import annotations

import collections
import os
import sys
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
OUT = Path(os.environ.get("SUITE_CPU_OUT", "suite-cpu.tsv"))
_group: Path | None = None


def pytest_configure(config) -> None:
    global _group
    lane = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if not CPUACCT.is_dir() or (lane == "main" and getattr(config.option, "numprocesses", None)):
        return  # no cgroup v1 cpuacct here, or xdist's controller (it runs no test)
    _group = CPUACCT / f"raytrain-suite-{lane}"
    _group.mkdir(exist_ok=True)
    (_group / "cgroup.procs").write_text(str(os.getpid()))


def _cpu_s() -> float:
    return int((_group / "cpuacct.usage").read_text()) / 1e9 if _group else 0.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ARG001 (pytest's signature)
    cpu, wall = _cpu_s(), time.monotonic()
    yield
    with OUT.open("a") as out:
        lane = os.environ.get("PYTEST_XDIST_WORKER", "main")
        out.write(f"{lane}\t{time.monotonic() - wall:.1f}\t{_cpu_s() - cpu:.1f}\t{item.nodeid}\n")


def summary(path: Path) -> str:
    """Per file: its lane, tests, wall and CPU seconds; then each lane's total. Largest CPU first."""
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    lanes: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    lane_of: dict[str, str] = {}
    for line in path.read_text().splitlines():
        lane, wall, cpu, nodeid = line.split("\t")
        name = nodeid.split("::")[0]
        lane_of[name] = lane
        files[name][0] += 1
        files[name][1] += float(wall)
        files[name][2] += float(cpu)
        lanes[lane][0] += float(wall)
        lanes[lane][1] += float(cpu)
    rows = ["| file | lane | tests | wall (s) | CPU (s) |", "|---|---|---|---|---|"]
    for name, (count, wall, cpu) in sorted(files.items(), key=lambda item: -item[1][2]):
        rows.append(f"| {name} | {lane_of[name]} | {count:.0f} | {wall:.0f} | {cpu:.0f} |")
    for lane, (wall, cpu) in sorted(lanes.items()):
        rows.append(f"| all of lane {lane} | | | {wall:.0f} | {cpu:.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else OUT)))
