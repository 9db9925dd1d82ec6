"""Where the test suite's CPU goes, by kind of process (Linux, root; Debian's `acct` package).

    apt-get install -y acct && accton /tmp/suite.pacct
    .venv/bin/python bench/suite_processes.py poll /tmp/suite.cmds &     # until /tmp/suite.cmds.stop exists
    date +%s > /tmp/suite.start; CI=true make test; touch /tmp/suite.cmds.stop; accton off
    .venv/bin/python bench/suite_processes.py table /tmp/suite.pacct /tmp/suite.cmds $(cat /tmp/suite.start)

Process accounting writes each process's user and system seconds when it exits, under the name of its last
thread; the poll keeps each pid's command line, where Ray's actors name themselves (`ray::RayTrainWorker...`).
The table joins the two (docs/benchmarks.md#the-whole-suite-by-process-process-accounting).
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

KINDS = [  # the first that matches a process's command line names its kind
    ("Ray Train workers (ray::RayTrainWorker)", r"^ray::RayTrainWorker"),
    (
        "Ray Train's other per-run actors (controller, placement-group cleaner, dataset manager, synchronization)",
        r"^ray::(TrainController|PlacementGroupCleaner|DatasetManager|SynchronizationActor)",
    ),
    ("this project's per-run actors (RunMonitor, NodeAggregator)", r"^ray::(RunMonitor|NodeAggregator)"),
    ("Ray Data tasks and actors", r"^ray::(MapBatches|ReadRange|SplitCoordinator|map|Consumer|Read|_Stats)"),
    (
        "Ray's per-cluster actors (Train state, autoscaling coordinator)",
        r"^ray::(TrainStateActor|_AutoscalingCoordinator|train_v2_state)",
    ),
    (
        "Ray's node processes (GCS, raylet, dashboard, agents, log monitor, autoscaler monitor, ray start)",
        r"gcs_server|raylet|dashboard|log_monitor|autoscaler|monitor\.py|ray::DashboardAgent|ray::RuntimeEnvAgent"
        r"|ray\.scripts|ray/scripts|ray\.util\.client|--node-ip-address|runtime_env/agent",
    ),
    ("--quick-start ranks", r"raytrain_ddp\.worker\.quick"),
    ("launched scripts (script_runner) and torchrun", r"script_runner|torch\.distributed\.run"),
    ("CLI drivers (run, launch, cluster, evaluate, checkpoint, report, ...)", r"-m raytrain_ddp"),
    ("pytest (the two lanes, in-process fits' drivers)", r"pytest|exec\(eval\(sys\.stdin"),
    ("examples, benchmarks, Jupyter, browser, moto", r"examples/|-m bench|bench\.|ipykernel|jupyter|chrom|moto"),
    (
        "Slurm testbed (slurmctld, slurmd, slurmstepd, munged, clients)",
        r"slurm|munge|sbatch|srun|squeue|scontrol|sacct|scancel|sinfo",
    ),
    ("other Ray workers (idle, other tasks)", r"^ray::"),
]


def poll(out: Path) -> None:
    """pid -> its command line, once a second until OUT.stop exists; an idle Ray worker's later title wins."""
    seen: dict[str, str] = {}
    while not out.with_suffix(out.suffix + ".stop").exists():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            if seen.get(pid, "").startswith("ray::") and not seen[pid].startswith("ray::IDLE"):
                continue  # an actor keeps its name
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if title.strip() and (pid not in seen or not title.startswith("ray::IDLE")):
                seen[pid] = title[:160].strip()
        out.write_text(json.dumps(seen))
        time.sleep(1)


def table(pacct: Path, cmds: Path, since: float) -> str:
    """Per kind: processes, CPU seconds and share, of the processes begun at `since` (epoch seconds) or later."""
    titles = json.loads(cmds.read_text())
    cpu: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    dump = subprocess.run(["dump-acct", str(pacct)], capture_output=True, text=True, check=True).stdout
    for line in dump.splitlines():
        field = [part.strip() for part in line.split("|")]
        begun = datetime.datetime.strptime(field[14], "%a %b %d %H:%M:%S %Y").replace(tzinfo=datetime.UTC)
        if begun.timestamp() < since:
            continue
        title = titles.get(field[9]) or field[0]
        kind = next((name for name, pattern in KINDS if re.search(pattern, title)), "other")
        cpu[kind] += (float(field[2]) + float(field[3])) / 100  # clock ticks
        count[kind] += 1
    total = sum(cpu.values())
    rows = [
        f"| {kind} | {count[kind]} | {seconds:,.0f} | {100 * seconds / total:.0f} % |"
        for kind, seconds in sorted(cpu.items(), key=lambda item: -item[1])
    ]
    return "\n".join(
        [
            "| processes | count | CPU s | share |",
            "|---|---|---|---|",
            *rows,
            f"| all | {sum(count.values())} | {total:,.0f} | |",
        ]
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["poll"] and len(sys.argv) == 3:
        poll(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["table"] and len(sys.argv) == 5:
        print(table(Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4])))
    else:
        sys.exit("usage: suite_processes.py poll CMDS | table PACCT CMDS SINCE")
