"""raytrain-ddp: one-command data-parallel PyTorch training on Ray and Slurm.

from raytrain_ddp import TrainConfig, fit
result = fit(TrainConfig(num_workers=2, epochs=3))
"""

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.errors import ConfigError, RunTakenOver

__all__ = ["TrainConfig", "ConfigError", "RunTakenOver", "fit"]


def fit(config: TrainConfig, model_fn=None, dataset_fn=None, loss_fn=None):
    """Train as `config` says and return a FitResult (see raytrain_ddp.driver.fit).

    model_fn(config) -> nn.Module, dataset_fn(config) -> {"train", "val"} Ray
    Datasets of rows {x, y}, loss_fn(outputs, targets): your own, in place of
    the built-ins (the CLI takes them as --model/--dataset/--loss import paths).
    """
    from raytrain_ddp.driver.fit import fit as _fit  # Ray and torch load only when training

    return _fit(config, model_fn=model_fn, dataset_fn=dataset_fn, loss_fn=loss_fn)
