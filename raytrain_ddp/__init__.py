"""raytrain-ddp: one-command data-parallel PyTorch training on Ray and Slurm.

    from raytrain_ddp import TrainConfig, fit
    result = fit(TrainConfig(num_workers=2, epochs=3))
"""

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.errors import ConfigError

__all__ = ["TrainConfig", "ConfigError", "fit"]


def fit(config: TrainConfig):
    """Train as `config` says and return a FitResult (see raytrain_ddp.driver.fit)."""
    from raytrain_ddp.driver.fit import fit as _fit  # Ray and torch load only when training

    return _fit(config)
