"""How a run's checkpoints rank: by the run's checkpoint metric (--checkpoint-metric and --checkpoint-mode, else
the data kind's), for Ray Train's retention (--num-to-keep keeps the best) and the summary's best checkpoint.

A checkpoint taken mid-epoch (a stop request, --checkpoint-every-steps/-minutes) has no validation score: it
records the worst score there is (:func:`unscored`, on the workers), so it ranks below every epoch's, never evicts
a best one, is kept only while it is the latest, and is never the run's best (:func:`best`, on the driver). This
module is the one place that says so.
"""

from __future__ import annotations

import math

from ray.train import CheckpointConfig

from raytrain_ddp.config import TrainConfig


def retention(config: TrainConfig, data_kind: str) -> CheckpointConfig:
    """Ray Train's checkpoint retention for the run: --num-to-keep of them, the best by the run's metric."""
    metric, mode = config.checkpoint_ranking(data_kind)
    return CheckpointConfig(
        num_to_keep=config.num_to_keep, checkpoint_score_attribute=metric, checkpoint_score_order=mode
    )


def unscored(metric: str, mode: str) -> dict:
    """The score a mid-epoch checkpoint records: the worst there is for `mode` ("max" or "min")."""
    return {metric: -math.inf if mode == "max" else math.inf}


def best(pairs: list[tuple], metric: str, mode: str) -> tuple | None:
    """The best scoring of Ray Train's (checkpoint, metrics) `pairs`, or None. One without a finite score never is:
    taken mid-epoch (:func:`unscored`), or its score lost (Ray's snapshot keeps no inf or NaN)."""
    scored = [pair for pair in pairs if math.isfinite(pair[1].get(metric, math.inf))]
    return (max if mode == "max" else min)(scored, key=lambda pair: pair[1][metric]) if scored else None
