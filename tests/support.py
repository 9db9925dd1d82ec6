"""Helpers the tests share (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path, PurePosixPath

from raytrain_ddp.driver.dashboard import TRAIN_RUNS_API

REPO = Path(__file__).resolve().parents[1]


def run_cli(module: str, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` the way a user would, capturing its output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env
    )


def run_python_file(
    path: Path, cwd: Path, env: dict | None = None, args: list[str] = (), timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run a script as a user would (`python path ARGS`), with the repo importable."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env
    )


def one_failure_line(result: subprocess.CompletedProcess, exit_code: int) -> str:
    """The run's one `Training failed: ` line, once its exit code is `exit_code` (else the test fails, with the
    output's end to read)."""
    output = result.stderr
    assert result.returncode == exit_code, output[-3000:]
    said = [line for line in output.splitlines() if line.startswith("Training failed: ")]
    assert len(said) == 1, output[-3000:]
    return said[0]


LANE_ENV = "RAYTRAIN_TEST_LANE"  # the xdist worker that started a process (conftest.pytest_configure)


def processes_with(needle: bytes) -> list[int]:
    """Pids of the processes whose command line holds `needle`, found in the process table as an operator would;
    not those the other lane started (its mark in their environment: the bench's runs, say) nor the Slurm
    testbed's jobs (SLURM_JOB_ID in their environment)."""
    found, ours = [], f"{LANE_ENV}={os.environ.get(LANE_ENV, '')}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                environ = (entry / "environ").read_bytes().split(b"\0")
                lane = next((item for item in environ if item.startswith(LANE_ENV.encode() + b"=")), ours)
                elsewhere = lane != ours or any(item.startswith(b"SLURM_JOB_ID=") for item in environ)
                if needle in (entry / "cmdline").read_bytes() and not elsewhere:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def processes_left(needle: bytes, timeout: float = 30) -> list[int]:
    """Processes whose command line holds `needle` still there after `timeout` (none: [])."""
    deadline = time.monotonic() + timeout
    while (left := processes_with(needle)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def dashboard_get(url: str, token: str, timeout: float = 30) -> tuple[int, str]:
    """GET a dashboard URL with the cluster's token: (HTTP status, body); status 0 while nothing listens."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as err:  # not listening yet
        return 0, str(err)


def train_api_run(dashboard: str, token: str, name: str) -> dict | None:
    """The run named NAME as the dashboard's Train API lists it; None while the dashboard is not up or
    Ray Train's state actor does not exist yet (a 500), or before the run is listed."""
    status, body = dashboard_get(dashboard + TRAIN_RUNS_API, token, timeout=10)
    if status in (0, 500):
        return None
    assert status == 200, f"{TRAIN_RUNS_API} answered {status}: {body[:300]}"
    return next((run for run in json.loads(body)["train_runs"] if run["name"] == name), None)


def corrupt_row_group(path: Path, row_group: int) -> None:
    """Overwrite the first page header of a row group's first column: the footer stays valid (the checks
    before a run pass), reading that row group fails as a damaged disk or an interrupted copy makes it fail."""
    import pyarrow.parquet as pq

    column = pq.ParquetFile(path).metadata.row_group(row_group).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))


def descendants(root: int) -> list[int]:
    """The pids of every live descendant of process `root` (read from /proc), children before theirs."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) if entry.name.isdigit() else None
        except OSError:
            continue
        if parent is not None:
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo += children.get(pid, [])
    return found


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a process and every process under it at once (a Ray started by `ray start --block` stops its
    processes one by one, each given seconds to exit: half a minute, for a test's throwaway cluster)."""
    for pid in [process.pid, *descendants(process.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=60)


def listening_addresses(root: int) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket listening in process `root` or its descendants, read from
    /proc/net/tcp and tcp6 as `ss -ltnp` reads them."""
    import ipaddress

    owner = {}
    for pid in [root, *descendants(root)]:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue  # gone meanwhile
        owner.update({link[len("socket:[") : -1]: pid for link in links if link.startswith("socket:[")})
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in owner:  # 0A: LISTEN
                hex_address, hex_port = fields[1].split(":")
                raw = bytes.fromhex(hex_address)
                # the kernel prints each 32-bit word in host (little-endian) order
                address = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
                found.append((str(address), int(hex_port, 16), owner[fields[9]]))
    return found


# conftest.shared_run: the built-in defaults but the sizes (8192/2048 rows, 5 epochs: ~45 s more here;
# test_train.test_cli_defaults pins those), 32 optimizer steps per epoch
SHARED_EPOCHS, SHARED_TRAIN_ROWS, SHARED_VAL_ROWS = 2, 4096, 1024


def shared_run_args(storage: Path) -> list[str]:
    """conftest.shared_run's command line, after `python -m raytrain_ddp.run`."""
    return [
        *("--storage-path", str(storage), "--name", "shared", "--epochs", str(SHARED_EPOCHS)),
        *("--train-size", str(SHARED_TRAIN_ROWS), "--val-size", str(SHARED_VAL_ROWS)),
        *("--mlflow-uri", f"file://{storage}/mlruns", "--wandb-project", "raytrain-tests"),
        *("--log-every-steps", "4", "--profile-steps", "3:4"),  # a torch.profiler trace of two steps on each rank
    ]


WANDB_OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}  # no network here: W&B writes its files only


def wandb_offline_runs(run_dir: Path) -> list[dict]:
    """What each offline W&B run under RUN_DIR/wandb/ holds, oldest first, as wandb's own reader of the run's
    .wandb transaction log prints it (`wandb leet inspect --json`): one dict per run, its records by type."""
    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*")):
        out = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout
        records: dict[str, list] = {}
        for line in out.splitlines():
            record = json.loads(line)
            records.setdefault(record["type"], []).append(record[record["type"]])
        runs.append(records)
    return runs


@contextlib.contextmanager
def one_process_group():
    """A real one-process gloo group in this process (what a worker's RankTrainer or ShardedSaver needs), torn down
    after the block."""
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# `make test` runs the suite in two lanes (pytest-xdist, `-n 2`; one process each, tests in file order):
# the Slurm testbed's jobs, which mostly wait on the testbed's nodes, with the tests that start no Ray of this
# process, beside the tests on this process's local Ray, which run one at a time. The split evens out the lanes'
# wall time (measured: bench/suite_cpu.py). Each lane sees only its own processes (processes_with).
TESTBED_LANE_FILES = {
    "test_checkpoint_sharded.py",
    "test_cli_errors.py",
    "test_cluster_health.py",
    "test_cluster_paths.py",
    "test_data_prepare.py",
    "test_data_validate.py",
    "test_docs.py",
    "test_gpu_check.py",
    "test_dashboard.py",  # a Ray head of its own, with its dashboard
    "test_interrupt.py",  # a Ray of its own per test, started by the command (Ctrl-C reaches all of it; its GCS dies)
    "test_launch_parts.py",
    "test_messages.py",
    "test_observe.py",  # conftest.shared_run (a Ray its command starts) and the quick path's local processes
    "test_quick_start.py",  # the quick path's local processes; the full path's resume on a Ray the command starts
    "test_recorder.py",
    "test_report.py",  # conftest.shared_run's files
    "test_run_directory.py",
    "test_slurm_plan.py",
    "test_start_cost.py",
    "test_strategies.py",  # the loop's rules on the quick path's local processes
    "test_summary.py",
    "test_train.py",  # conftest.shared_run's output and files
}


# files for either lane: they need nothing of one (no Ray, or Rays of their own, never $RAY_ADDRESS's); the lane
# that ends first takes them (conftest's scheduler) instead of waiting idle for the other
EITHER_LANE_FILES = {
    "test_bench.py",  # its own Ray per side of each figure, for its figures only
}


def lane_of(nodeid: str) -> str:
    """The lane of a test: "testbed", "local-ray" or "either" (its file decides)."""
    path = PurePosixPath(nodeid.split("::", 1)[0])
    if path.parent.name == "slurm" or path.name in TESTBED_LANE_FILES:
        return "testbed"
    return "either" if path.name in EITHER_LANE_FILES else "local-ray"


def rank_epoch_message(rank: int, **overrides) -> dict:
    """What `WorkerLoop.report_epoch` sends for one rank."""
    message = {
        "epoch": 1,
        "rank": rank,
        "train_loss": 1.0 + rank,
        "samples": 100 * (rank + 1),
        "micro_batches": 4,
        "optimizer_steps": 4,
        "skipped_steps": 0,
        "grad_allreduces": 4,
        "lr": 0.1,
        "train_seconds": 2.0 + rank,
        "data_wait_seconds": 0.01,
        "micro_batch_seconds": 0.1,
        "val_loss": 0.5,
        "val_accuracy": 0.9,
        "val_rows": 64,
        "allreduce_wait_seconds": 0.2,
    }
    return {**message, **overrides}


def script_rank_pid(script: Path, rank: int, job_id: int | None = None, timeout: float = 240) -> int:
    """The pid of a launched `script`'s process for RANK=`rank`, found in the process table as an operator would:
    the one Slurm job `job_id` runs (the testbed's nodes share this host's process table), else one this lane
    started outside Slurm. Both lanes run the tutorial script; neither may kill the other's rank."""
    ours = f"{LANE_ENV}={os.environ.get(LANE_ENV, '')}".encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and str(script).encode() in (entry / "cmdline").read_bytes():
                    environ = (entry / "environ").read_bytes().split(b"\0")
                    job = next((item for item in environ if item.startswith(b"SLURM_JOB_ID=")), None)
                    mine = job == f"SLURM_JOB_ID={job_id}".encode() if job_id else job is None and ours in environ
                    if mine and f"RANK={rank}".encode() in environ:
                        return int(entry.name)
            except OSError:
                continue
        time.sleep(0.2)
    raise TimeoutError(f"no process of {script} with RANK={rank}")
