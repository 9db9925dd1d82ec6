"""The worker side of `raytrain-ddp launch`: a user's own script or function on every Ray Train worker.

A script runs as torchrun runs it: a child process of the worker (``python SCRIPT ARGS`` through
:mod:`.script_runner`), with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and
MASTER_PORT set, the caller's environment and working directory. Its MASTER_PORT is a port of its own, so the
process group the script creates never meets the one Ray Train set up in the worker. The worker stays its
supervisor: the script's output goes to ``RUN_DIR/logs/rank-N.log`` (and to the console for the ranks teed),
its reports (:mod:`raytrain_ddp.session`) and its liveness to the driver with each heartbeat, a stop request
becomes the signal the driver got, and its exit becomes this worker's outcome. A function runs in the worker
itself, in the process group Ray Train set up, with the same session.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import ray
import ray.train
import ray.train.collective

from raytrain_ddp import session
from raytrain_ddp.errors import ScriptFailed, ScriptKilled, StorageFull
from raytrain_ddp.storage import RemotePath, Spool, copy_tree, file_states, location
from raytrain_ddp.worker.args import LaunchArgs
from raytrain_ddp.worker.channel import RayChannel
from raytrain_ddp.worker.metrics import DriverLink, Heartbeat
from raytrain_ddp.worker.script_runner import PARENT_PID_ENV, PROCESS_GROUP_MARK, STORAGE_FULL_NOTE

log = logging.getLogger("raytrain_ddp.worker")

PHASE = "running"  # the heartbeat's phase: what the script does is its own business
BEAT_S = Heartbeat.INTERVAL_S / 2  # how often the supervisor looks at its rank
BUSY_TICKS = 0.1 * os.sysconf("SC_CLK_TCK") * BEAT_S  # CPU time that counts as computing: a tenth of a core
TAIL_LINES = 200  # of a failed rank's output, read for its traceback
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")  # torch's, on each line of a rank's traceback once its group is up


def rank_log(run_dir: str, rank: int | str) -> Path:
    return Path(run_dir) / "logs" / f"rank-{rank}.log"


class Channel:
    """This rank's session folder (see raytrain_ddp.session): the reports it appends, the stop flag we set."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="raytrain-session-"))
        self.reports = self.path / session.REPORTS_FILE
        self.reports.touch()
        self._read_to = 0
        self.made = 0  # reports read so far: part of the rank's progress

    def new_reports(self) -> list[dict]:
        """The whole lines appended since the last call."""
        with self.reports.open("rb") as file:
            file.seek(self._read_to)
            data = file.read()
        whole = data[: data.rfind(b"\n") + 1]
        self._read_to += len(whole)
        records = [json.loads(line) for line in whole.splitlines() if line.strip()]
        self.made += len(records)
        return records

    def request_stop(self) -> None:
        (self.path / session.STOP_FILE).touch()

    def note_restored(self, files: dict[str, tuple[int, int]]) -> None:
        (self.path / session.RESTORED_FILE).write_text(json.dumps(files))

    def joined_process_group(self) -> bool:
        return (self.path / PROCESS_GROUP_MARK).exists()

    def storage_full(self) -> StorageFull | None:
        """The full disk or quota the script died of, as its runner noted it."""
        note = self.path / STORAGE_FULL_NOTE
        return pickle.loads(note.read_bytes()) if note.exists() else None


class Supervisor:
    """One rank's beat: its progress (reports, output, CPU time) and its reports to the driver; a stop request
    passed on."""

    def __init__(self, args: LaunchArgs, on_stop: Callable[[str], None]) -> None:
        context = ray.train.get_context()
        self.rank, self.world_size = context.get_world_rank(), context.get_world_size()
        self.local_rank, self.node_rank = context.get_local_rank(), context.get_node_rank()
        self.local_world_size = context.get_local_world_size()
        self.run_dir = location(args.run_dir)
        self.logs = Spool(self.run_dir / "logs", fetch=(rank_log("", self.rank).name,))
        self.channel, self.on_stop, self.lines = Channel(), on_stop, 0
        self.checkpoint = self._local_checkpoint()
        self.busy_beats = 0  # beats in which the rank printed, reported or computed: its liveness
        self.output: list[str] = []  # teed lines not yet sent to the driver
        self.output_lock = threading.Lock()
        self.cpu_of: Callable[[], int] = lambda: _cpu_ticks(os.getpid())
        self.link = DriverLink(RayChannel(args.monitor), self.rank)
        self.heartbeat = Heartbeat(self.link.post, self.rank, self.link.stop_reason)
        self.heartbeat.at(PHASE, 0, self.heartbeat.meter)
        self.closed = threading.Event()
        threading.Thread(target=self._beat_forever, daemon=True, name="supervisor").start()

    def announce(self, stack_pid: int | None) -> None:
        """This rank to the driver; `stack_pid`: the process whose stack the watchdog takes (a script's)."""
        self.link.channel.post("worker_started", self.rank, {**self.describe(), "stack_pid": stack_pid})

    def describe(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "hostname": socket.gethostname(),
            "node_ip": ray.util.get_node_ip_address(),
            "device": os.environ.get("CUDA_VISIBLE_DEVICES", "cpu"),
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def _local_checkpoint(self) -> Path:
        """The script's checkpoint folder: the run directory's, or with object storage a local folder holding
        the store's copy (every rank reads it; rank zero's changes are uploaded, see session.upload_checkpoint)."""
        stored = self.run_dir / "checkpoint"
        if not isinstance(stored, RemotePath):
            return stored
        local = Path(tempfile.mkdtemp(prefix="raytrain-checkpoint-")) / "checkpoint"
        if stored.is_dir() and stored.iterdir():
            copy_tree(stored, local)
            if self.rank == 0:  # the rank that uploads (session_env): what it restored is not uploaded again
                self.channel.note_restored(file_states(local))
        return local

    def session_env(self) -> dict[str, str]:
        env = {session.SESSION_ENV: str(self.channel.path), session.CHECKPOINT_DIR_ENV: str(self.checkpoint)}
        stored = self.run_dir / "checkpoint"
        if isinstance(stored, RemotePath) and self.rank == 0:
            env[session.CHECKPOINT_STORE_ENV] = stored.uri
        return env

    def _beat_forever(self) -> None:
        stop_passed, seen = False, (0, 0, self.cpu_of())
        while not self.closed.wait(BEAT_S):
            try:
                self.heartbeat.step_records.extend(self.channel.new_reports())
            except (OSError, ValueError):  # a line cut short is read whole next time; a bad one is the script's
                pass
            # Liveness: output, a report or real computing since the last beat. A rank blocked in a collective
            # does none of it (gloo's waiting thread still takes a tick now and then: below BUSY_TICKS).
            now = (self.channel.made, self.lines, self.cpu_of())
            if now[:2] != seen[:2] or now[2] - seen[2] >= BUSY_TICKS:
                self.busy_beats += 1
                self.heartbeat.advance(self.busy_beats)
            seen = now
            self.send_output()
            if self.heartbeat.stop_reason and not stop_passed:
                stop_passed = True
                self.channel.request_stop()
                self.on_stop(self.heartbeat.stop_reason)

    def take_line(self, line: str, teed: bool) -> None:
        """One line of the rank's output: progress, and for the console if teed."""
        self.lines += 1
        if teed:
            with self.output_lock:
                self.output.append(line)

    def send_output(self, wait: bool = False) -> None:
        with self.output_lock:
            lines, self.output = self.output, []
        if lines:
            if wait:
                self.link.call("output", self.rank, lines, timeout=None)
            else:
                self.link.channel.post("output", self.rank, lines)

    def finish(self) -> None:
        """The rank's last output and reports reach the driver before the worker returns."""
        self.send_output(wait=True)
        self.heartbeat.step_records.extend(self.channel.new_reports())
        self.heartbeat.send_step_records(self.link.add_step_records)
        self.logs.upload()
        self.link.channel.post("worker_ended", self.rank)  # a Ctrl-C's grace waits no longer for this rank

    def close(self) -> None:
        """However the rank ended: no more beats, and its temporary folders go (the session's channel; with object
        storage the local copy of the checkpoint folder, whose store copy holds what rank zero saved)."""
        self.closed.set()
        shutil.rmtree(self.channel.path, ignore_errors=True)
        if isinstance(self.run_dir, RemotePath):
            shutil.rmtree(self.checkpoint.parent, ignore_errors=True)


def _cpu_ticks(pid: int) -> int:
    """User + system CPU ticks of a process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def _stop_signal(reason: str) -> signal.Signals:
    """The signal the driver got (its reason starts with its name: SIGUSR1, SIGTERM, SIGINT for a Ctrl-C), passed
    on as torchrun passes signals to its workers."""
    return getattr(signal.Signals, reason.split(" ", 1)[0], signal.SIGTERM)


def _master_address() -> tuple[str, int]:
    """Rank zero's node and a free port there, for the script's own process group: the same on every rank."""
    if ray.train.get_context().get_world_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            chosen = (ray.util.get_node_ip_address(), probe.getsockname()[1])
    else:
        chosen = None
    return tuple(ray.train.collective.broadcast_from_rank_zero(chosen))


def _script_env(args: LaunchArgs, supervisor: Supervisor, master_addr: str, master_port: int) -> dict[str, str]:
    """The script's environment: the caller's, torchrun's variables, the session's."""
    torchrun_env = {
        "RANK": supervisor.rank,
        "LOCAL_RANK": supervisor.local_rank,
        "WORLD_SIZE": supervisor.world_size,
        "LOCAL_WORLD_SIZE": supervisor.local_world_size,
        "NODE_RANK": supervisor.node_rank,
        "GROUP_RANK": supervisor.node_rank,  # torchrun's name for it (Lightning reads it)
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": master_port,
        "TORCHELASTIC_RUN_ID": args.run_name,  # how Lightning and others tell a torchrun launch
    }
    env = {
        **args.environment,  # the caller's, as torchrun's children inherit it
        **{key: str(value) for key, value in torchrun_env.items()},
        **supervisor.session_env(),
        PARENT_PID_ENV: str(os.getpid()),
    }
    for key in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):  # Ray's choice for this worker, unless the caller's
        if key in os.environ and (key == "CUDA_VISIBLE_DEVICES" or key not in env):
            env[key] = os.environ[key]
    env.setdefault("PYTHONUNBUFFERED", "1")  # lines reach the log as they are printed
    return env


def run_script_per_worker(loop_config: dict) -> None:
    """Ray Train's training function for a script: run it on this rank, return when it exits well."""
    args = LaunchArgs.from_loop_config(loop_config)
    assert args.script is not None
    master_addr, master_port = _master_address()
    child: subprocess.Popen | None = None

    def pass_stop(reason: str) -> None:
        if child is not None and child.poll() is None:
            child.send_signal(_stop_signal(reason))

    supervisor = Supervisor(args, pass_stop)
    try:
        env = _script_env(args, supervisor, master_addr, master_port)
        cwd = args.cwd if os.path.isdir(args.cwd) else os.path.dirname(args.script)
        log_path = supervisor.logs.local / rank_log("", supervisor.rank).name  # uploaded at the end if remote
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "raytrain_ddp.worker.script_runner", args.script, *args.script_args]
        # a session of its own, as torchrun starts its workers: a terminal's Ctrl-C reaches it once, passed on by
        # the driver (which then gives it a grace period), not also straight from the terminal
        child = subprocess.Popen(
            command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        supervisor.cpu_of = lambda: _cpu_ticks(child.pid)
        supervisor.announce(stack_pid=child.pid)
        teed = args.tee == "all" or supervisor.rank == 0
        tail = _pump_output(child, log_path, supervisor, teed)
        returncode, exited_at = child.wait(), time.time()
        supervisor.finish()
        if supervisor.heartbeat.stop_reason:  # asked to stop: whatever the script did with the signal, it stopped
            return
        if returncode < 0:
            raise ScriptKilled(f"killed by {signal.Signals(-returncode).name} ({log_path})", exited_at)
        if returncode > 0 and (full := supervisor.channel.storage_full()) is not None:
            raise full  # not a rank's failure: the run ends at once in the storage line, exit 74, no restart
        if returncode > 0:
            error = exception_of(tail) or "the script failed"
            raise ScriptFailed(f"{error} (exit code {returncode}; {log_path})", exited_at)
        if supervisor.world_size > 1 and not supervisor.channel.joined_process_group():
            raise ScriptFailed(
                f"the script never called torch.distributed.init_process_group: the {supervisor.world_size} ranks "
                f"each ran it alone; call it once at the start (docs/launch.md)"
            )
    finally:
        supervisor.close()


def _pump_output(child: subprocess.Popen, log_path: Path, supervisor: Supervisor, teed: bool) -> collections.deque:
    """Copy the script's output to its rank's log, and the teed ranks' to the driver (the beat sends them);
    returns the last lines."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    with log_path.open("ab") as log_file:
        log_file.write(f"--- rank {supervisor.rank} on {socket.gethostname()}, {time.ctime()}\n".encode())
        for raw in child.stdout:
            log_file.write(raw)
            log_file.flush()
            line = raw.decode(errors="replace").rstrip("\n")
            tail.append(line)
            supervisor.take_line(line, teed)
    return tail


class _RankOutput(io.TextIOBase):
    """A launched function's stdout, as a script's output is taken: whole lines to its rank's log and, teed,
    to the driver's console."""

    def __init__(self, supervisor: Supervisor, log_file, teed: bool) -> None:
        self.supervisor, self.log_file, self.teed, self.partial = supervisor, log_file, teed, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.log_file.write(text)
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.supervisor.take_line(line, self.teed)
        return len(text)

    def flush(self) -> None:
        self.log_file.flush()


def exception_of(lines: collections.deque) -> str | None:
    """`Type: message` of the last traceback in a rank's output: its first line that is not a frame."""
    text = [RANK_PREFIX.sub("", line) for line in lines]
    starts = [i for i, line in enumerate(text) if line.startswith("Traceback (most recent call last)")]
    if not starts:
        return None
    raised = next((line for line in text[starts[-1] + 1 :] if line and not line[0].isspace()), None)
    if raised is None:
        return None
    name, _, message = raised.partition(": ")
    name = name.rsplit(".", 1)[-1]  # the type's own name, as the built-in loop's one line gives it
    return f"{name}: {message}" if message else name


def run_function_per_worker(loop_config: dict) -> None:
    """Ray Train's training function for a user's function: call it here, in the process group Ray Train set
    up, with the session of a launched script."""
    args = LaunchArgs.from_loop_config(loop_config)
    supervisor = Supervisor(args, on_stop=lambda reason: None)  # should_stop() reads the channel's flag
    supervisor.announce(stack_pid=None)  # its main thread is Ray's, not the function's: no stack to read
    os.environ.update(supervisor.session_env())
    function, function_args = args.function_and_args()
    log_path = supervisor.logs.local / rank_log("", supervisor.rank).name
    log_path.parent.mkdir(parents=True, exist_ok=True)
    teed = args.tee == "all" or supervisor.rank == 0
    try:
        with log_path.open("a") as log_file, contextlib.redirect_stdout(_RankOutput(supervisor, log_file, teed)):
            function() if function_args is None else function(function_args)
    finally:
        session.upload_checkpoint()
        supervisor.finish()
        supervisor.close()
