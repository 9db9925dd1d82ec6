"""Your own step in the built-in loop: a regression task on columns of your own (not x/y).

    cd examples && python task_regression.py
    python -m raytrain_ddp.run --task task_regression:Regression --model task_regression:build_model \\
        --dataset task_regression:build_datasets --checkpoint-metric val_mae --checkpoint-mode min

The task says what one step computes; the project keeps everything else: DDP or FSDP, precision, gradient
accumulation, sharding and reshuffling the data, checkpoints, exact resume, the watchdog. training_step returns
the loss; validation_step returns sums over its batch with the batch's row count under "count", and the project
reports each sum's mean over ALL ranks' rows as val_NAME (identical on every rank).
"""

import sys

import numpy as np
import ray.data
import torch
from torch import nn

FEATURES = 8
WEIGHTS = np.linspace(-1.0, 1.0, FEATURES).astype(np.float32)


class Regression:
    def training_step(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch["features"]).squeeze(1), batch["target"])

    def validation_step(self, model: nn.Module, batch: dict) -> dict:
        error = model(batch["features"]).squeeze(1) - batch["target"]
        return {"loss": (error**2).sum(), "mae": error.abs().sum(), "count": len(error)}


def build_model(config) -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 1))


def _rows(batch: dict, seed: int) -> dict:
    rng = np.random.default_rng([seed, int(batch["id"][0])])
    features = rng.standard_normal((len(batch["id"]), FEATURES)).astype(np.float32)
    target = features @ WEIGHTS + 0.05 * rng.standard_normal(len(batch["id"])).astype(np.float32)
    return {"id": batch["id"], "features": features, "target": target}


def build_datasets(config) -> dict:
    def split(first_id: int, rows: int) -> ray.data.Dataset:
        ids = ray.data.range(rows, override_num_blocks=4).map_batches(lambda b: {"id": b["id"] + first_id})
        return ids.map_batches(_rows, fn_kwargs={"seed": config.seed}, batch_format="numpy")

    return {"train": split(0, config.train_size), "val": split(config.train_size, config.val_size)}


if __name__ == "__main__":
    from raytrain_ddp.run import main

    task = ["--task", "task_regression:Regression", "--model", "task_regression:build_model"]
    data = ["--dataset", "task_regression:build_datasets", "--train-size", "4096", "--val-size", "1024"]
    ranking = ["--checkpoint-metric", "val_mae", "--checkpoint-mode", "min", "--optimizer", "adamw", "--lr", "0.01"]
    sys.exit(main([*task, *data, *ranking, "--epochs", "3", *sys.argv[1:]]))
