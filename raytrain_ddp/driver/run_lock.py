"""One driver per run directory: `RUN_DIR/driver.lock`, made to work on a shared filesystem.

The lock file is created with O_EXCL (atomic on local disks, NFS v3+ and
Lustre) and holds the holder's host, pid, process start time and start time;
while the driver runs, a thread touches it every HEARTBEAT_S. A second driver
finds it and stops with one line naming the holder. A lock left behind by a
driver that died (SIGKILL, a lost node) is taken over only when it is stale:

* on the same host, when its pid is gone (or is now another process);
* from another host, where the pid cannot be checked, when its heartbeat is
  older than STALE_AFTER_S;
* when it is this Slurm job's own, from before the job was requeued (same job
  id, lower SLURM_RESTART_COUNT): Slurm ended that incarnation before this one.

On object storage (a RemotePath, raytrain_ddp.storage) there is no exclusive
create through pyarrow.fs: the lock object is looked for, then written, so two
drivers started within the same moment may both pass (logged as a warning).
Its heartbeat is the time written inside it (`beat`), rewritten every HEARTBEAT_S.

A driver that finds on a heartbeat that its lock was taken over (it hung past
STALE_AFTER_S, and a driver on another host went on) stops beating and sets
`taken_over`: the driver stops its run and writes nothing more there.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator

from raytrain_ddp.errors import ConfigError, RunTakenOver, StorageFull
from raytrain_ddp.storage import RemotePath, RunPath

log = logging.getLogger("raytrain_ddp")

LOCK_FILE = "driver.lock"
HEARTBEAT_S = 30
STALE_AFTER_S = 600  # 20 missed heartbeats: a driver on another host is surely gone (clocks may differ a little)


def _process_start(pid: int) -> str | None:
    """When `pid` started (clock ticks since boot, from /proc): tells a reused pid from the holder."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _slurm_job() -> list[int] | None:
    """[job id, restart count] of the Slurm job this driver runs in, if any."""
    job, restarts = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("SLURM_RESTART_COUNT", "0")
    return [int(job), int(restarts)] if job.isdigit() and restarts.isdigit() else None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    return start is None or _process_start(pid) in (None, start)


def _read(path: RunPath) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # empty (being written right now, or its writer died mid-write) or garbage
    return holder if isinstance(holder, dict) else {}


def _heartbeat_age(path: RunPath, holder: dict) -> float:
    if isinstance(path, RemotePath):  # the object's own time is the server's: the beat inside it is ours
        beat = holder.get("beat")
        return time.time() - beat if isinstance(beat, int | float) else math.inf
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def why_stale(path: RunPath, holder: dict) -> str | None:
    """Why the lock `holder` read from `path` may be taken over, or None while its driver may still run."""
    age = _heartbeat_age(path, holder)
    job, theirs = _slurm_job(), holder.get("slurm_job")
    if job and isinstance(theirs, list) and len(theirs) == 2 and theirs[0] == job[0] and theirs[1] < job[1]:
        return f"it is this Slurm job's (job {job[0]}) from before it was requeued"
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        if not _alive(holder["pid"], holder.get("pid_start")):
            return f"its process {holder['pid']} on this host is gone"
        return None
    if age > STALE_AFTER_S:
        return f"its heartbeat is {age:.0f}s old (more than {STALE_AFTER_S}s)"
    return None


def describe(holder: dict) -> str:
    if not holder:
        return "a driver whose lock file is empty or unreadable (one starting right now, or one that died)"
    return f"process {holder.get('pid', '?')} on host {holder.get('host', '?')} (since {holder.get('started', '?')})"


class RunLock:
    """The lock of one run directory, held by this process."""

    def __init__(self, run_dir: RunPath) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self.created_dir = False
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.holder: dict = {}  # what a remote lock holds, rewritten by each beat
        self.taken_over = threading.Event()  # another driver holds the run directory now: stop, write nothing
        self.taken_by = ""

    def acquire(self) -> None:
        """Take the lock, or raise ConfigError naming who holds it."""
        if not self.run_dir.exists():
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.created_dir = True  # removed again on release if nothing else was written
        for _ in range(3):  # a stale lock taken over by another driver at the same moment: look again
            if self._create():
                self._heartbeat = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
                self._heartbeat.start()
                return
            holder = _read(self.path)
            if holder is None:
                continue  # released just now
            why = why_stale(self.path, holder)
            if why is None:
                self._drop_created_dir()
                raise ConfigError(
                    f"run directory {self.run_dir} is in use by {describe(holder)}: wait for that run to end, "
                    f"or choose another --name (a driver that died leaves {LOCK_FILE}, taken over once stale)"
                )
            self._take_over(holder, why)
        self._drop_created_dir()
        raise ConfigError(f"run directory {self.run_dir}: could not take {self.path} (other drivers race for it)")

    def _holder(self) -> dict:
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "slurm_job": _slurm_job(),
            "token": self.token,
        }

    def _create(self) -> bool:
        if isinstance(self.path, RemotePath):
            if self.path.exists():
                return False
            log.warning(
                "%s is on object storage: the lock is looked for, then written (no exclusive create there), "
                "so two drivers started at the same moment may both pass",
                self.path,
            )
            self.holder = {**self._holder(), "beat": time.time()}
            self.path.write_bytes(json.dumps(self.holder).encode() + b"\n")
            return True
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        holder = self._holder()
        with os.fdopen(fd, "w") as file:
            file.write(json.dumps(holder) + "\n")
            file.flush()
            os.fsync(file.fileno())
        return True

    def _take_over(self, holder: dict, why: str) -> None:
        """Move the stale lock aside; if what was moved is not the lock just judged stale, put it back."""
        if isinstance(self.path, RemotePath):
            if _read(self.path) == holder:
                log.warning("Taking over %s left by %s: %s", self.path, describe(holder), why)
                self.path.unlink(missing_ok=True)
            return
        aside = self.path.with_name(f"{LOCK_FILE}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another driver took it over first
        if _read(aside) != holder:  # a fresh lock another driver took a moment ago
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
        else:
            log.warning("Taking over %s left by %s: %s", self.path, describe(holder), why)
        aside.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            # a filesystem hiccup, or an object store down past the retry budget: the next beat tries again
            with contextlib.suppress(OSError, StorageFull):
                holder = _read(self.path)
                if holder and holder.get("token") != self.token:  # taken over (this driver hung past STALE_AFTER_S)
                    self.taken_by = describe(holder)
                    self.taken_over.set()
                    log.error("%s", self.takeover_message())
                    return  # a beat would keep the other driver's lock looking like ours, or overwrite it
                if isinstance(self.path, RemotePath):
                    self.holder["beat"] = time.time()
                    self.path.write_bytes(json.dumps(self.holder).encode() + b"\n")
                else:
                    os.utime(self.path)

    def takeover_message(self) -> str:
        return (
            f"{self.path} was taken over by {self.taken_by}: this driver no longer holds run directory "
            f"{self.run_dir}, so it stops its run and writes nothing more there"
        )

    def check_held(self) -> None:
        """Raise RunTakenOver once another driver took the lock over."""
        if self.taken_over.is_set():
            raise RunTakenOver(self.takeover_message())

    def release(self) -> None:
        self._stop.set()
        if self._heartbeat:
            self._heartbeat.join()
        if (_read(self.path) or {}).get("token") == self.token:  # never remove a lock taken over from us
            self.path.unlink(missing_ok=True)
        self._drop_created_dir()

    def _drop_created_dir(self) -> None:
        if self.created_dir:
            with contextlib.suppress(OSError):  # not empty: the run wrote into it
                self.run_dir.rmdir()


@contextlib.contextmanager
def hold(run_dir: RunPath) -> Iterator[RunLock]:
    """Hold the run directory's lock for the `with` block; ConfigError when another driver has it."""
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()
