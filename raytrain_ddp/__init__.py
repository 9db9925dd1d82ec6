"""raytrain-ddp: one-command data-parallel PyTorch training on Ray and Slurm.

from raytrain_ddp import TrainConfig, fit
result = fit(TrainConfig(num_workers=2, epochs=3))

from raytrain_ddp import launch
result = launch(train_fn, num_workers=2, args={"lr": 0.1})   # your own training function on every worker

Names load on first use: `from raytrain_ddp import session` in a user's script (and the script runner under
`raytrain-ddp launch`) imports nothing the script did not ask for (numpy, pyarrow, torch, Ray).
"""

from __future__ import annotations

import importlib

__all__ = ["TrainConfig", "ConfigError", "RunTakenOver", "fit", "launch", "session"]

_LAZY = {
    "TrainConfig": "raytrain_ddp.config",
    "ConfigError": "raytrain_ddp.errors",
    "RunTakenOver": "raytrain_ddp.errors",
}


def fit(config, model_fn=None, dataset_fn=None, loss_fn=None, task=None, hooks=None):
    """Train as `config` says and return a FitResult (see raytrain_ddp.driver.fit).

    model_fn(config) -> nn.Module, dataset_fn(config) -> {"train", "val"} Ray
    Datasets, loss_fn(outputs, targets), task (an object with training_step and
    validation_step, see docs/launch.md): your own, in place of the built-ins
    (the CLI takes them as --model/--dataset/--loss/--task import paths); hooks, a
    raytrain_ddp.worker.hooks.WorkerHooks that steps into the loop on every rank.
    """
    from raytrain_ddp.driver.fit import fit as _fit  # Ray and torch load only when training

    return _fit(config, model_fn=model_fn, dataset_fn=dataset_fn, loss_fn=loss_fn, task=task, hooks=hooks)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "launch":  # the module is callable: raytrain_ddp.launch(train_fn, ...) and python -m raytrain_ddp.launch
        return importlib.import_module("raytrain_ddp.launch")
    raise AttributeError(f"module 'raytrain_ddp' has no attribute {name!r}")
