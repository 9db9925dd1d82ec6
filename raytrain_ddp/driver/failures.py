"""Which failures Ray Train retries: not the ones that would fail again the same way.

Ray Train's default policy restarts the worker group after any worker error, up
to ``--max-failures``. A NaN loss, a corrupt row group, a bad hyper-parameter,
a model that does not fit the data or a full (or read-only) disk fails
identically on every attempt, so the run ends at the first one; a killed or
OOM-killed process, a lost node or a collective broken by either are still
restarted.
"""

from __future__ import annotations

import re

import pyarrow as pa
import ray.exceptions
from ray.train import WorkerGroupError

from raytrain_ddp import _ray_compat
from raytrain_ddp.errors import (
    DataReadError,
    ScriptFailed,
    ScriptKilled,
    StorageFull,
    causes,
    failure_line,
    full_storage_error,
    named,
)
from raytrain_ddp.storage import RemotePath

# Python errors of the code and its input, not of the machine: the same weights and rows raise them again.
DETERMINISTIC_TYPES = (
    FloatingPointError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AttributeError,
    ImportError,
    NotImplementedError,
    ZeroDivisionError,
    AssertionError,
    pa.ArrowException,
)
# torch raises a model/data mismatch as a bare RuntimeError (as it does collective and CUDA errors): by its words.
SHAPE_MISMATCH = re.compile(
    r"shapes cannot be multiplied|size mismatch|must match the size|Expected input batch_size"
    r"|expected input\[.*\] to have|Given groups=|Target .* is out of bounds"
)
# The process, its node or its memory went away: a new attempt may well succeed.
PROCESS_LOST_TYPES = (
    ray.exceptions.RayActorError,
    ray.exceptions.WorkerCrashedError,
    ray.exceptions.NodeDiedError,
    ray.exceptions.OutOfMemoryError,
    ray.exceptions.ObjectLostError,
    ScriptKilled,
)


def is_deterministic(error: BaseException) -> bool:
    chain = list(causes(error))
    if any(isinstance(c, PROCESS_LOST_TYPES) for c in chain):
        return False
    return any(
        isinstance(c, DETERMINISTIC_TYPES)
        or (isinstance(c, RuntimeError) and SHAPE_MISMATCH.search(str(c)))
        or (isinstance(c, DataReadError) and c.corrupt)
        or isinstance(c, StorageFull)
        or full_storage_error(c) is not None
        for c in chain
    )


def may_retry(error: BaseException) -> bool:
    """False for a worker-group failure that every attempt would repeat (no process of it was lost)."""
    if isinstance(error, WorkerGroupError):
        failures = list(error.worker_failures.values())
        lost = any(isinstance(c, PROCESS_LOST_TYPES) for f in failures for c in causes(f))
        return lost or not any(is_deterministic(f) for f in failures)
    return True


def describe_failure(error: BaseException) -> str:
    """The console's and summary's line for a failed run: per failed rank, the error its code raised (a data
    error says which file and row group), as `Type: first line`, not the last line of Ray's traceback."""
    failures = error.worker_failures if isinstance(error, WorkerGroupError) else {}
    if not failures:
        return failure_line(_unwrapped(error))
    failures = {rank: _unwrapped(exc) for rank, exc in failures.items()}
    lines = {failure_line(exc) for exc in failures.values()}
    if len(lines) > 1 and all(isinstance(exc, ScriptFailed) for exc in failures.values()):
        return _first_script_failure(failures)
    ranks_by_line: dict[str, list[int]] = {}  # ranks that failed alike are named once, together
    for rank, exc in sorted(failures.items()):
        ranks_by_line.setdefault(failure_line(exc), []).append(rank)
    return "; ".join(f"{named('rank', ranks)}: {line}" for line, ranks in ranks_by_line.items())


def _first_script_failure(failures: dict[int, ScriptFailed]) -> str:
    """Launched ranks: the first to fail is the cause (the others most often failed in a collective with it),
    as torchrun names its "root cause"."""
    first = min(failures, key=lambda rank: (failures[rank].exited_at, rank))
    others = sorted(set(failures) - {first})
    then = f"; then {named('rank', others)} too" if others else ""
    return f"rank {first}: {failure_line(failures[first])}{then}"


RAY_TRAIN_RECORDS = "Ray Train's checkpoint records"  # what its controller writes: the snapshot, deletes past --keep


def storage_full_in(error: BaseException, run_dir: object) -> StorageFull | None:
    """The full (or read-only) storage that ended the run (a rank's StorageFull, or a write of Ray Train's own
    into `run_dir`), else None: storage, not a rank, failed, so it is told alone. Ray Train's controller writes
    to an object store unretried: any OSError of its own there is the store's (a rank's is the rank's)."""
    ranks_failed = list(error.worker_failures.values()) if isinstance(error, WorkerGroupError) else []
    for failure in ranks_failed or [error]:
        for cause in causes(_unwrapped(failure)):
            if isinstance(cause, StorageFull):
                return cause
            if (full := full_storage_error(cause)) is not None:
                return StorageFull.of(full, "the run's files", full.filename or run_dir)
            if not ranks_failed and isinstance(run_dir, RemotePath) and isinstance(cause, OSError):
                return StorageFull.store_failed(cause, RAY_TRAIN_RECORDS, run_dir)
    return None


def _unwrapped(error: BaseException) -> BaseException:
    """The error inside Ray's wrappers (a task's ray:: error, the Train controller's), however deep."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = _ray_compat.wrapped_error(error)
        if inner is None:
            break
        error = inner
    return error
