"""Bring your own model, dataset and loss without forking the project: plug-ins by import path.

    cd examples && python custom_plugins.py                 # trains with the three plug-ins below
    python -m raytrain_ddp.run --model custom_plugins:build_model \\
        --dataset custom_plugins:build_datasets --loss custom_plugins:smoothed_cross_entropy

Each plug-in is a plain callable in an importable module (here: this file,
run from its own directory). `--model` gets the TrainConfig and returns an
nn.Module; `--dataset` gets the TrainConfig and returns Ray Datasets whose rows
hold `x` (the model's input) and `y` (the target); `--loss` is called as
loss(outputs, targets). The project still shards the data per rank, reshuffles
it every epoch, validates over all ranks, checkpoints and reports.
"""

import sys

import numpy as np
import ray.data
import torch
import torch.nn.functional as F
from torch import nn

NUM_FEATURES, NUM_CLASSES = 16, 4


class TwoTowerNet(nn.Module):
    """Something the built-ins do not have: two towers over halves of the features, then a head."""

    def __init__(self, hidden: int):
        super().__init__()
        half = NUM_FEATURES // 2
        self.left = nn.Sequential(nn.Linear(half, hidden), nn.ReLU())
        self.right = nn.Sequential(nn.Linear(half, hidden), nn.ReLU())
        self.head = nn.Linear(2 * hidden, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        left, right = x.chunk(2, dim=1)
        return self.head(torch.cat([self.left(left), self.right(right)], dim=1))


def build_model(config) -> nn.Module:
    return TwoTowerNet(hidden=64)


def _rows(batch: dict, seed: int) -> dict:
    """The label is which quadrant the sum of each half falls in: learnable, deterministic per id."""
    rng = np.random.default_rng([seed, int(batch["id"][0])])
    x = rng.standard_normal((len(batch["id"]), NUM_FEATURES)).astype(np.float32)
    half = NUM_FEATURES // 2
    y = (x[:, :half].sum(1) > 0).astype(np.int64) * 2 + (x[:, half:].sum(1) > 0)
    return {"id": batch["id"], "x": x, "y": y}


def build_datasets(config) -> dict:
    """Any Ray Data pipeline works here: read_parquet, read_images, from_huggingface, ..."""

    def split(first_id: int, rows: int) -> ray.data.Dataset:
        ids = ray.data.range(rows, override_num_blocks=4).map_batches(lambda b: {"id": b["id"] + first_id})
        return ids.map_batches(_rows, fn_kwargs={"seed": config.seed}, batch_format="numpy")

    return {"train": split(0, config.train_size), "val": split(config.train_size, config.val_size)}


def smoothed_cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets, label_smoothing=0.1)


if __name__ == "__main__":
    from raytrain_ddp.run import main

    sys.exit(
        main(
            [
                "--model",
                "custom_plugins:build_model",
                "--dataset",
                "custom_plugins:build_datasets",
                "--loss",
                "custom_plugins:smoothed_cross_entropy",
                "--lr",
                "0.05",
                "--epochs",
                "3",
                "--train-size",
                "4096",
                "--val-size",
                "1024",
                *sys.argv[1:],
            ]
        )
    )
