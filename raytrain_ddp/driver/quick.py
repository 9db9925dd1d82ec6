"""--quick-start's driver side: the built-in loop on N local processes, torchrun-style, no Ray cluster.

The run is the full path's (driver/fit.py: the lock, the run directory, the console and driver.log, the recorder
and its table, metrics.jsonl, steps.jsonl, summary.json, the report, the exit codes); what differs is how the
ranks start and how their news comes back. Here the driver starts one process per rank
(``python -m raytrain_ddp.worker.quick``, with torchrun's environment), hosts the run's mailbox itself
(:class:`QuickMonitor`: the RunMonitor's logic, served to the ranks over a loopback connection with an authkey),
records the checkpoints rank zero writes with Ray Train's own checkpoint manager (the same snapshot: either path
resumes the other's run), and waits for the processes. Never ``ray.init``: that alone costs seconds.

Not here, by design: restarts on failure (a rank that dies ends the run, in one line naming it), the hang
watchdog, the Ray dashboard, more than one machine.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from raytrain_ddp import _ray_compat
from raytrain_ddp.checkpoint import ranking
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.monitor import RunMailbox, RunRecorder
from raytrain_ddp.driver.watchdog import POLL_INTERVAL_S, log_progress
from raytrain_ddp.errors import plural
from raytrain_ddp.storage import RunPath
from raytrain_ddp.worker.channel import CALL_TIMEOUT_S, LocalAddress, serve_calls
from raytrain_ddp.worker.launched import TAIL_LINES, exception_of, rank_log
from raytrain_ddp.worker.quick import QuickRank
from raytrain_ddp.worker.script_runner import PARENT_PID_ENV

log = logging.getLogger("raytrain_ddp")

WHAT_IT_LEAVES_OUT = (
    "Quick start: %s, each a process of this machine under Ray Train's local mode, no Ray cluster; not here: "
    "restarts on failure (a rank that fails ends the run), the hang watchdog, the Ray dashboard, other machines"
)
RANK_POLL_S = 0.2  # how often the driver looks for a rank that exited


class QuickMonitor:
    """The run's mailbox (RunMailbox) in the driver process, served to the ranks over loopback, one call at a time;
    and the run's checkpoints, kept by Ray Train's own manager as the controller keeps them. It is the driver's
    channel to itself too (worker.channel.MonitorChannel: `call`, `post`)."""

    aggregates = False

    def __init__(self, config: TrainConfig, data_kind: str) -> None:
        self.mailbox = RunMailbox()
        self.lock = threading.Lock()
        run_dir = local_run_dir(config)
        retention = ranking.retention(config, data_kind)
        self.checkpoints = _ray_compat.local_checkpoint_manager(str(run_dir.parent), run_dir.name, retention)
        authkey = secrets.token_bytes(32)  # the ranks get it on stdin: no other local user can call in
        self.listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self.listener.address
        self.address = LocalAddress(host, port, authkey)
        self.closed = threading.Event()
        threading.Thread(target=serve_calls, args=(self.listener, self.call, self.closed), daemon=True).start()

    def call(self, method: str, *args: Any, timeout: float | None = CALL_TIMEOUT_S) -> Any:
        """A rank's call (or the driver's own): the mailbox's method, or `checkpoint_written`."""
        if method.startswith("_"):
            raise AttributeError(f"no monitor method {method!r}")
        with self.lock:
            if method == "checkpoint_written":  # (checkpoint_dir_name, metrics), from rank zero
                return _ray_compat.register_local_checkpoint(self.checkpoints, *args)
            return getattr(self.mailbox, method)(*args)

    def post(self, method: str, *args: Any) -> None:
        self.call(method, *args)

    def result(self, run_dir: RunPath) -> Any:
        """The run's checkpoints as the ray.train.Result a full run's fit() returns."""
        with self.lock:
            return _ray_compat.local_result(self.checkpoints, run_dir, None)

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


@dataclass
class QuickRankProcess:
    rank: int
    process: subprocess.Popen
    log_path: Path

    def failure(self, code: int) -> str:
        """The rank's exit, in one line: its error from its log's last traceback, or the signal that killed it."""
        where = f"rank {self.rank} (pid {self.process.pid}; {self.log_path})"
        if code < 0:
            return f"{where} was killed by {signal.Signals(-code).name}"
        with self.log_path.open(errors="replace") as lines:
            error = exception_of(deque((line.rstrip("\n") for line in lines), maxlen=TAIL_LINES))
        return f"{where} failed: {error or 'no error in its log'} (exit code {code})"


def local_run_dir(config: TrainConfig) -> Path:
    run_dir = config.run_dir
    assert isinstance(run_dir, Path), "--quick-start takes a local --storage-path only (config._check_quick_start)"
    return run_dir


def start_ranks(config: TrainConfig, args, resume_from: str | None) -> list[QuickRankProcess]:
    """One process per rank, torchrun's environment, its arguments on stdin; a session of its own each, so a
    terminal's Ctrl-C reaches the driver alone, which ends them."""
    payload = pickle.dumps(QuickRank(args, resume_from))
    env = _rank_env(config, args.import_roots)
    (local_run_dir(config) / "logs").mkdir(exist_ok=True)
    ranks = []
    for rank in range(config.num_workers):
        log_path = rank_log(str(config.run_dir), rank)
        with log_path.open("ab") as log_file:
            log_file.write(f"--- rank {rank} on {socket.gethostname()}, {time.ctime()} (--quick-start)\n".encode())
            log_file.flush()
            process = subprocess.Popen(
                [sys.executable, "-m", "raytrain_ddp.worker.quick"],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        assert process.stdin is not None
        process.stdin.write(payload)
        process.stdin.close()
        ranks.append(QuickRankProcess(rank, process, log_path))
    return ranks


def _rank_env(config: TrainConfig, import_roots) -> dict[str, str]:
    """torchrun's environment for this machine's ranks (RANK and LOCAL_RANK added per rank)."""
    with socket.socket() as probe:  # a free port for the process group's rendezvous, as torchrun picks one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    paths = [*import_roots, *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])]
    env = {
        **os.environ,
        "WORLD_SIZE": str(config.num_workers),
        "LOCAL_WORLD_SIZE": str(config.num_workers),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        PARENT_PID_ENV: str(os.getpid()),
        "PYTHONPATH": os.pathsep.join(paths),
    }
    env.setdefault("OMP_NUM_THREADS", str(max(1, int(config.cpus_per_worker))))  # as Ray Train sets it per worker
    if not config.use_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # local mode picks NCCL wherever CUDA is visible
    return env


def wait_for(ranks: list[QuickRankProcess], lock) -> str | None:
    """Until every rank has exited: None when all succeeded, else the first failure's line (the others are ended:
    a group that lost a rank cannot go on). Another driver that took the run directory over ends them too."""
    while True:
        codes = {rank.rank: rank.process.poll() for rank in ranks}
        failed = [rank for rank in ranks if codes[rank.rank] not in (None, 0)]
        if failed:
            # a killed rank first: the others' errors are usually the lost peer's echo
            first = min(failed, key=lambda rank: (codes[rank.rank] >= 0, rank.rank))
            return first.failure(codes[first.rank])
        if all(code == 0 for code in codes.values()) or lock.taken_over.is_set():
            return None
        time.sleep(RANK_POLL_S)


def end_ranks(ranks: list[QuickRankProcess]) -> None:
    """SIGKILL the ranks still running (a failed run's, or after a Ctrl-C: their last checkpoint is the resume
    point, as the full path's are ended with their controller), and reap them."""
    for rank in ranks:
        if rank.process.poll() is None:
            rank.process.kill()
    for rank in ranks:
        rank.process.wait()


def drain_until(monitor: QuickMonitor, recorder: RunRecorder, stop: threading.Event) -> None:
    """The watcher thread: the mailbox into the recorder (the table, metrics.jsonl, steps.jsonl) until `stop`,
    then once more; a progress line to driver.log every few seconds."""
    last_logged = time.monotonic()
    while not stop.wait(POLL_INTERVAL_S):
        try:
            recorder.consume(monitor.call("drain"))
        except Exception:  # the watcher must outlive a bad message: training goes on regardless
            log.exception("Error while reading worker news (training continues)")
        last_logged = log_progress(recorder, last_logged)
    recorder.consume(monitor.call("drain"))


def announce(config: TrainConfig) -> None:
    log.info(WHAT_IT_LEAVES_OUT, plural(config.num_workers, "rank"))
