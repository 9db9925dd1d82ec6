"""--quick-start's driver side: the built-in loop on N local processes, torchrun-style, no Ray cluster.

The run is the full path's (driver/fit.py: the lock, the run directory, the console and driver.log, the recorder
and its table, metrics.jsonl, steps.jsonl, summary.json, the report, the exit codes); what differs is how the
ranks start and how their news comes back. Here the ranks are processes of this machine
(``python -m raytrain_ddp.worker.quick``, with torchrun's environment: driver/rank_processes.py, which the command
line starts before the driver imports torch), the driver hosts the run's mailbox itself
(:class:`QuickMonitor`: the RunMonitor's logic, served to the ranks over a loopback connection with an authkey),
records the checkpoints rank zero writes with Ray Train's own checkpoint manager (the same snapshot: either path
resumes the other's run), and waits for the processes. Never ``ray.init``: that alone costs seconds.

Not here, by design: restarts on failure (a rank that dies ends the run, in one line naming it), the hang
watchdog, the Ray dashboard, more than one machine.
"""

from __future__ import annotations

import logging
import pickle
import secrets
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

from raytrain_ddp import _ray_compat
from raytrain_ddp.checkpoint import ranking
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver import rank_processes
from raytrain_ddp.driver.monitor import RunMailbox, RunRecorder
from raytrain_ddp.driver.rank_processes import RankProcess
from raytrain_ddp.driver.watchdog import POLL_INTERVAL_S, log_progress
from raytrain_ddp.errors import plural
from raytrain_ddp.storage import RunPath
from raytrain_ddp.worker.channel import CALL_TIMEOUT_S, LocalAddress, serve_calls
from raytrain_ddp.worker.launched import exception_of, rank_log
from raytrain_ddp.worker.quick import QuickRank

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
        # re-entrant: a stop signal's handler posts request_stop on the main thread, which may hold it (result())
        self.lock = threading.RLock()
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
            return _ray_compat.local_result(self.checkpoints, run_dir)

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


def local_run_dir(config: TrainConfig) -> Path:
    run_dir = config.run_dir
    assert isinstance(run_dir, Path), "--quick-start takes a local --storage-path only (config._check_quick_start)"
    return run_dir


def start_ranks(config: TrainConfig, args, resume_from: str | None) -> list[RankProcess]:
    """The ranks (those the command line started early, else new ones), each given its arguments and its log."""
    payload = pickle.dumps(QuickRank(args, resume_from))
    (local_run_dir(config) / "logs").mkdir(exist_ok=True)
    ranks = rank_processes.take(config)
    for rank in ranks:
        rank.begin(payload, rank_log(str(config.run_dir), rank.rank))
    return ranks


def wait_for(ranks: list[RankProcess], lock) -> str | None:
    """Until every rank has exited: None when all succeeded, else the first failure's line (the others are ended:
    a group that lost a rank cannot go on). Another driver that took the run directory over ends them too."""
    while True:
        codes = {rank.rank: rank.process.poll() for rank in ranks}
        failed = [rank for rank in ranks if codes[rank.rank] not in (None, 0)]
        if failed:
            # a killed rank first: the others' errors are usually the lost peer's echo
            first = min(failed, key=lambda rank: (codes[rank.rank] >= 0, rank.rank))
            first.output_done()
            return rank_processes.failure_of(first, codes[first.rank], exception_of(first.tail))
        if all(code == 0 for code in codes.values()) or lock.taken_over.is_set():
            return None
        time.sleep(RANK_POLL_S)


def end_ranks(ranks: list[RankProcess]) -> None:
    """SIGKILL the ranks still running (a failed run's, or after a Ctrl-C: their last checkpoint is the resume
    point, as the full path's are ended with their controller), reaped, their output all in their logs."""
    for rank in ranks:
        rank.end()
    for rank in ranks:
        rank.output_done()


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
