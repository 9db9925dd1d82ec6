"""Errors that end a run with a one-line message instead of a traceback: the one way every CLI prints them."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from raytrain_ddp.redact import redact

EXIT_BAD_INPUT = 2  # bad input or a request the cluster cannot hold: nothing was started
EXIT_STORAGE_FULL = 74  # EX_IOERR: the run's storage is full, over quota, read-only or failed (StorageFull)
# OS errors that every attempt to write the same bytes to the same file system would repeat: full, over quota, or
# no room at all (a mount turned read-only, as a file system with errors turns itself)
READ_ONLY = "read-only file system"
# the start of StorageFull's reason for an object store that failed past its retry budget (raytrain_ddp.storage)
STORE_FAILED = "the object store failed"
# the start of StorageFull's reason for a write that added nothing for the retry budget (a sharded checkpoint's)
STALLED = "nothing written"
STORAGE_FULL_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: READ_ONLY,
}


class ConfigError(ValueError):
    """Bad user input: a flag, a config file, a dataset, a cluster request.

    Raised on the driver before any Ray worker starts; the CLI prints the
    message as one line and exits with code 2.
    """


class RunTakenOver(Exception):
    """Another driver took this run directory's lock over (this one hung past the stale limit): this driver
    stopped its run and writes nothing more there. The CLI prints the message as one line and exits with 1."""


def plural(count: int, noun: str) -> str:
    """'1 worker', '2 workers', '0 epochs': a count with the noun agreeing (every message says counts this way)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def named(noun: str, items: Iterable) -> str:
    """'rank 1', 'ranks 0, 3', 'no ranks': the items a message names, the noun agreeing with how many."""
    items = list(items)
    if not items:
        return f"no {noun}s"
    return f"{noun}{'s' if len(items) > 1 else ''} {', '.join(map(str, items))}"


def bounded(items: Iterable, shown: int, sep: str = ", ") -> str:
    """'a, b, c' or, past `shown` items, 'a, b and 502 more': a list that stays one readable line however long."""
    items = [str(item) for item in items]
    listed = sep.join(items[:shown])
    return listed if len(items) <= shown else f"{listed} and {len(items) - shown} more"


def one_line(exc: BaseException) -> str:
    """An exception's message squeezed onto one line (pyarrow messages span several), credentials masked."""
    return redact(" ".join(str(exc).split())) or type(exc).__name__


def first_line(exc: BaseException) -> str:
    """An exception's first line (and the next, where the first only introduces it with a colon), control
    characters escaped: what it says, without what others appended (Ray Data adds its retry advice below)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = " ".join(lines[:2]) if len(lines) > 1 and lines[0].endswith(":") else (lines[0] if lines else "")
    return redact("".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text))


def headline(exc: BaseException) -> str:
    """`Type: first line`, the one way a failure from inside a run (a worker, a data task) is shown."""
    line = first_line(exc)
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__


class DataReadError(Exception):
    """Part of the data could not be read: `where` names it (a file's row group), `cause` is the reader's error.

    `cause` is kept through pickling (unlike __cause__, which Ray drops between processes), so the driver
    still sees the reader's error and its type. `corrupt`: the bytes themselves are bad (a read of them fails
    the same way again), not the storage that serves them.
    """

    def __init__(self, where: str, cause: BaseException, corrupt: bool):
        super().__init__(f"{where}: {headline(cause)}")
        self.where, self.cause, self.corrupt = where, cause, corrupt

    def __reduce__(self):
        return type(self), (self.where, self.cause, self.corrupt)


def causes(error: BaseException | None) -> Iterator[BaseException]:
    """The error and what it wraps (Ray's task errors, exception chains, a script's error raised from ours)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = getattr(error, "cause", None) or error.__cause__ or error.__context__


def full_storage_error(error: BaseException) -> OSError | None:
    """The full-disk, over-quota or read-only OSError in `error` or what it chains to (torch.save raises a RuntimeError
    whose context is the file's OSError; DCP's CheckpointException holds each rank's (error, traceback) in
    `failures`), else None."""
    todo, seen = [error], set()
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in STORAGE_FULL_ERRNOS:
            return error
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict):
            todo += [failure[0] if isinstance(failure, tuple) else failure for failure in failures.values()]
        todo += [error.__cause__, error.__context__]
    return None


class StorageFull(Exception):
    """Writing `what` to `path` failed for lack of space (ENOSPC) or quota (EDQUOT), or on a mount that turned
    read-only (EROFS): a retry writes the same bytes to the same file system and fails again, so the run ends at
    once (exit code 74). `free`/`total`: the file system's bytes when it failed (None on object storage).
    Pickles whole (a worker's reaches the driver)."""

    def __init__(self, what: str, path: str, reason: str, free: int | None = None, total: int | None = None):
        known = free is not None and total is not None and reason != READ_ONLY
        space = f" ({_bytes(free or 0)} free of {_bytes(total or 0)})" if known else ""
        state, remedy = _state_and_remedy(reason)
        super().__init__(
            f"{state}: {reason} writing {what} to {path}{space}; {remedy} and run the same command again to resume"
        )
        self.what, self.path, self.reason, self.free, self.total = what, path, reason, free, total

    def __reduce__(self):
        return type(self), (self.what, self.path, self.reason, self.free, self.total)

    @classmethod
    def store_failed(cls, error: OSError, what: str, path: object) -> StorageFull:
        """An object store that kept failing past the retry budget, or refused outright (access denied, no
        bucket), writing `what` to `path`: the same write would fail again until someone fixes the store."""
        return cls(what, str(path), f"{STORE_FAILED} ({one_line(error)})")

    @classmethod
    def stalled(cls, what: str, path: object, waited_s: float) -> StorageFull:
        """A write of `what` to `path` that added no byte for `waited_s` seconds (the storage retry budget): a hung
        mount or a store that stopped answering, reported rather than waited on for ever."""
        return cls(what, str(path), f"{STALLED} for {waited_s:g} s")

    @classmethod
    def of(cls, error: OSError, what: str, path: str | os.PathLike | object) -> StorageFull:
        """`error` (a full-storage OSError) as met writing `what` into `path` (a local path or a RemotePath)."""
        usage = _disk_usage(path)
        return cls(what, str(path), STORAGE_FULL_ERRNOS[error.errno], *(usage or (None, None)))

    def record(self) -> dict:
        """What summary.json says of it."""
        return {
            "reason": self.reason,
            "writing": self.what,
            "path": self.path,
            "free_bytes": self.free,
            "total_bytes": self.total,
        }


def _state_and_remedy(reason: str) -> tuple[str, str]:
    """What StorageFull's line says the storage is, and what to do about it, for `reason`."""
    if reason == READ_ONLY:
        return "storage read-only", "make it writable"
    if reason.startswith(STORE_FAILED):
        return "storage failed", "bring the store back (or fix its access)"
    if reason.startswith(STALLED):
        return "storage stalled", "bring the storage back (RAYTRAIN_STORAGE_RETRY_S: how long a write may stall)"
    return "storage full", "free space"


@contextlib.contextmanager
def storage_full_as(what: str, path: str | os.PathLike | object, probe: bool = False) -> Iterator[None]:
    """A full disk or quota (or a read-only mount) met in the block, writing `what` into `path`, raised as
    StorageFull. `probe`: for a failure that lost its errno, ask `path`'s file system whether it is full now."""
    try:
        yield
    except StorageFull:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # DCP's CheckpointException is one
        if (full := full_storage_error(err) or (refused_now(path) if probe else None)) is None:
            raise
        raise StorageFull.of(full, what, path) from err


PROBE_BYTES = 2**20


def refused_now(path: str | os.PathLike | object) -> OSError | None:
    """The full-storage OSError the file system of `path` raises now for a MiB, else None: for writers that lose
    the errno (torch.save into DCP's stream sees a short write and says only `unexpected pos`)."""
    if (where := _existing(path)) is None:
        return None
    try:
        with tempfile.TemporaryFile(dir=where if where.is_dir() else where.parent) as probe:
            os.posix_fallocate(probe.fileno(), 0, PROBE_BYTES)
    except OSError as err:
        return err if err.errno in STORAGE_FULL_ERRNOS else None
    return None


def _existing(path: str | os.PathLike | object) -> Path | None:
    """`path` or its nearest existing parent; None on object storage (not a local path)."""
    if not isinstance(path, str | os.PathLike):
        return None
    where = Path(path).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    return where


def _disk_usage(path: str | os.PathLike | object) -> tuple[int, int] | None:
    """(free, total) bytes of the file system that holds `path` (its nearest existing parent); None on
    object storage."""
    if (where := _existing(path)) is None:
        return None
    try:
        usage = shutil.disk_usage(where)
    except OSError:
        return None
    return usage.free, usage.total


def _bytes(n: int) -> str:
    """1536 -> '1.5 KiB'; whole bytes below a KiB."""
    size, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}".replace(".0 ", " ")


def bad_input(err: BaseException) -> int:
    """Print a bad-input error as the one line every CLI prints, `error: ...`; return the exit code for it."""
    print(f"error: {one_line(err)}", file=sys.stderr)
    return EXIT_BAD_INPUT


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr and exit code 2."""

    def error(self, message: str):  # type: ignore[override]  # exits, as argparse's does
        self.exit(EXIT_BAD_INPUT, f"error: {message} (see --help)\n")


class ScriptFailed(Exception):
    """A launched script's rank exited with an error: the message is its own `Type: message` (read from its
    traceback), the exit code and its log, as the run's one line shows them. `exited_at`: when (time.time()),
    which tells the first failure (the cause) from the ranks that failed because of it."""

    def __init__(self, message: str, exited_at: float = 0.0) -> None:
        super().__init__(message)
        self.exited_at = exited_at

    def __reduce__(self):
        return type(self), (str(self), self.exited_at)


class ScriptKilled(ScriptFailed):
    """A launched script's rank was ended by a signal it did not ask for (SIGKILL, the OOM killer, a crash): a
    lost process, which --max-restarts restarts."""


def failure_line(exc: BaseException) -> str:
    """A failure from inside a run as one line: a launched script's says what its rank raised, anything else
    `Type: first line`."""
    return first_line(exc) if isinstance(exc, ScriptFailed) else headline(exc)
