"""Which failures Ray Train retries: not the ones that would fail again the same way.

Ray Train's default policy restarts the worker group after any worker error, up
to ``--max-failures``. A NaN loss, a corrupt row group, a bad hyper-parameter
or a model that does not fit the data fails identically on every attempt, so
the run ends at the first one; a killed or OOM-killed process, a lost node or a
collective broken by either are still restarted.
"""

from __future__ import annotations

import re

import pyarrow as pa
import ray.exceptions
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy
from ray.train.v2.api.exceptions import WorkerGroupError

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
)


def _causes(error: BaseException):
    """The error and what it wraps (Ray's task errors, exception chains)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = getattr(error, "cause", None) or error.__cause__ or error.__context__


def is_deterministic(error: BaseException) -> bool:
    causes = list(_causes(error))
    if any(isinstance(c, PROCESS_LOST_TYPES) for c in causes):
        return False
    return any(
        isinstance(c, DETERMINISTIC_TYPES) or (isinstance(c, RuntimeError) and SHAPE_MISMATCH.search(str(c)))
        for c in causes
    )


class NoRetryOfDeterministicFailures(DefaultFailurePolicy):
    """Ray Train's default policy, less the retries of a worker error that every attempt would repeat."""

    def _is_retryable_error(self, training_failed_error) -> bool:
        if isinstance(training_failed_error, WorkerGroupError):
            failures = list(training_failed_error.worker_failures.values())
            lost = any(isinstance(c, PROCESS_LOST_TYPES) for f in failures for c in _causes(f))
            if not lost and any(is_deterministic(f) for f in failures):
                return False
        return super()._is_retryable_error(training_failed_error)


class Trainer(TorchTrainer):
    """TorchTrainer with that failure policy (V2 builds its policy from FailureConfig alone, without a hook)."""

    def _initialize_and_run_controller(self, **controller_init_kwargs):
        controller_init_kwargs["failure_policy"] = NoRetryOfDeterministicFailures(self.run_config.failure_config)
        return super()._initialize_and_run_controller(**controller_init_kwargs)
