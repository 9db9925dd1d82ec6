"""Points in the worker loop where a test, a benchmark or a profiler may step in.

From Python a run's hooks are an object: ``fit(config, hooks=SlowData(rank=1, seconds=0.2))``; from the
command line, ``RAYTRAIN_WORKER_HOOKS=pkg.module:factory`` names a factory the driver calls once, with the
keyword arguments of ``RAYTRAIN_WORKER_HOOKS_ARGS`` (a JSON object) if set. Either way the object is shipped,
pickled, to every rank, and unpickled in the worker once its module's directory is on the path. The default
does nothing; a subclass overrides what it needs. Hooks run on the training
thread: whatever they do (sleep, count), the step loop itself has no branch
for it.
"""

from __future__ import annotations

import json
import os

from raytrain_ddp.plugins import import_root, load_object

HOOKS_ENV = "RAYTRAIN_WORKER_HOOKS"
HOOKS_ARGS_ENV = "RAYTRAIN_WORKER_HOOKS_ARGS"  # the factory's keyword arguments, a JSON object


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


def chosen_hooks(hooks: WorkerHooks | None) -> tuple[WorkerHooks | None, list[str]]:
    """The run's hooks (`hooks`, else those RAYTRAIN_WORKER_HOOKS names; None: the defaults), and the import
    root workers need to unpickle them."""
    path = os.environ.get(HOOKS_ENV)
    if hooks is None and path:
        hooks = load_object(path, HOOKS_ENV)(**json.loads(os.environ.get(HOOKS_ARGS_ENV) or "{}"))
    if hooks is None:
        return None, []
    root = import_root(f"{type(hooks).__module__}:")
    return hooks, [root] if root else []
