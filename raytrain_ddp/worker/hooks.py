"""Points in the worker loop where a test, a benchmark or a profiler may step in.

A run's hooks are named by ``RAYTRAIN_WORKER_HOOKS=pkg.module:factory`` (read by
the driver, which calls the factory once and ships the object, pickled, to
every rank, so parameters read from the driver's environment travel with it;
it is unpickled in the worker, once the module's directory is on its path). The default
does nothing; a subclass overrides what it needs. Hooks run on the training
thread: whatever they do (sleep, count), the step loop itself has no branch
for it.
"""

from __future__ import annotations

import os
import pickle

from raytrain_ddp.plugins import import_root, load_object

HOOKS_ENV = "RAYTRAIN_WORKER_HOOKS"


class WorkerHooks:
    """No-ops. Ranks and epochs count as the loop counts them: ranks from 0, epochs and micro-batches from 1."""

    def on_fetch(self, rank: int) -> None:
        """Each time the loop takes the next batch from the input pipeline (inside the data-wait timer)."""

    def on_micro_batch(self, rank: int, epoch: int, micro_batch: int) -> None:
        """After micro-batch `micro_batch` of `epoch` was launched (forward and backward; its optimizer step,
        if it ends a group, comes next)."""

    def on_optimizer_step(self, rank: int, epoch: int, step: int) -> None:
        """After optimizer step `step` of `epoch` was launched (counting from 1, steps before a resume too)."""

    def on_validation_batch(self, rank: int, epoch: int, batch: int) -> None:
        """After validation batch `batch` (from 1) of `epoch` was launched and counted in the heartbeat."""


def hooks_from_environment() -> tuple[bytes | None, list[str]]:
    """The pickled hooks RAYTRAIN_WORKER_HOOKS names (None: the defaults), and the import root workers need.

    Pickled here, unpickled by `worker_hooks`: Ray's controller unpickles the loop's config before any
    worker has the hooks' module on its path.
    """
    path = os.environ.get(HOOKS_ENV)
    if not path:
        return None, []
    hooks = pickle.dumps(load_object(path, HOOKS_ENV)())
    root = import_root(path)
    return hooks, [root] if root else []


def worker_hooks(pickled: bytes | None) -> WorkerHooks:
    return pickle.loads(pickled) if pickled else WorkerHooks()
