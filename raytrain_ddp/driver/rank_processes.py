"""--quick-start's rank processes: started as soon as the command knows it needs them, told what to train later.

A rank's process spends seconds importing torch and Ray Train, then sets up the process group with the others;
none of it needs the run's arguments. So the command line starts the ranks right after its cheap checks
(:func:`start_early`, before the driver imports torch and Ray), and they import and meet while the driver
prepares the run; the driver then takes them (:func:`take`) and writes each its arguments on stdin
(:meth:`RankProcess.begin`). A driver that does not go on (bad input found later, another run's lock) ends
them (:func:`dismiss`); one that dies takes them with it (worker.script_runner.end_with_parent).

Light on purpose: the command imports this before torch and Ray.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.worker.script_runner import PARENT_PID_ENV

RANK_MODULE = "raytrain_ddp.worker.quick"
TAIL_LINES = 200  # of a failed rank's output, read for its traceback


class RankProcess:
    """One rank's process: started, then given its arguments and its log (its output copied there as it comes)."""

    def __init__(self, rank: int, process: subprocess.Popen) -> None:
        self.rank, self.process = rank, process
        self.log_path: Path | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._copier: threading.Thread | None = None

    def begin(self, payload: bytes, log_path: Path) -> None:
        """Its output from now on (and what it wrote before) into `log_path`; its arguments on stdin."""
        self.log_path = log_path
        self._copier = threading.Thread(target=self._copy_output, daemon=True, name=f"rank-{self.rank}-output")
        self._copier.start()
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(payload)
            self.process.stdin.close()
        except BrokenPipeError:  # it died while importing: its exit code says how (wait_for)
            pass

    def _copy_output(self) -> None:
        assert self.log_path is not None and self.process.stdout is not None
        with self.log_path.open("ab") as log_file:
            log_file.write(f"--- rank {self.rank} on {socket.gethostname()}, {time.ctime()} (--quick-start)\n".encode())
            for raw in self.process.stdout:
                log_file.write(raw)
                log_file.flush()
                self.tail.append(raw.decode(errors="replace").rstrip("\n"))

    def output_done(self, timeout: float = 10) -> None:
        """Its output is all in its log (it has exited)."""
        if self._copier is not None:
            self._copier.join(timeout)

    def end(self) -> None:
        """SIGKILL it if it still runs, and reap it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        if self.process.stdin is not None and not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except BrokenPipeError:
                pass


def spawn(config: TrainConfig) -> list[RankProcess]:
    """One process per rank with torchrun's environment; a session of its own each, so a terminal's Ctrl-C reaches
    the driver alone, which ends them."""
    env = _torchrun_env(config)
    return [
        RankProcess(
            rank,
            subprocess.Popen(
                [sys.executable, "-m", RANK_MODULE],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            ),
        )
        for rank in range(config.num_workers)
    ]


def _torchrun_env(config: TrainConfig) -> dict[str, str]:
    """torchrun's environment for this machine's ranks (RANK and LOCAL_RANK added per rank)."""
    with socket.socket() as probe:  # a free port for the process group's rendezvous, as torchrun picks one
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "WORLD_SIZE": str(config.num_workers),
        "LOCAL_WORLD_SIZE": str(config.num_workers),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        PARENT_PID_ENV: str(os.getpid()),
    }
    env.setdefault("OMP_NUM_THREADS", str(max(1, int(config.cpus_per_worker))))  # as Ray Train sets it per worker
    if not config.use_gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # local mode picks NCCL wherever CUDA is visible
    return env


_early: list[RankProcess] = []  # started by start_early, not yet taken
_early_for: tuple[int, bool] | None = None  # (num_workers, use_gpu) they were started for


def start_early(config: TrainConfig) -> None:
    """The command line's: start the ranks now, while the driver imports and prepares (take() hands them over)."""
    global _early_for
    dismiss()
    _early[:] = spawn(config)
    _early_for = (config.num_workers, config.use_gpu)


def take(config: TrainConfig) -> list[RankProcess]:
    """The ranks started early for this run if they are still there, else new ones."""
    early, _early[:] = list(_early), []
    if early and _early_for == (config.num_workers, config.use_gpu) and all(r.process.poll() is None for r in early):
        return early
    for rank in early:
        rank.end()
    return spawn(config)


def dismiss() -> None:
    """End the ranks started early that no run took (the driver did not go on)."""
    early, _early[:] = list(_early), []
    for rank in early:
        rank.end()


def failure_of(rank: RankProcess, code: int, error: str | None) -> str:
    """A rank's exit in one line: `error` (from its log's last traceback), or the signal that killed it."""
    where = f"rank {rank.rank} (pid {rank.process.pid}; {rank.log_path})"
    if code < 0:
        return f"{where} was killed by {signal.Signals(-code).name}"
    return f"{where} failed: {error or 'no error in its output'} (exit code {code})"
