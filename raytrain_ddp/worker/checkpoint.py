"""Checkpoints: written by rank zero, one `checkpoint.pt` per Ray Train checkpoint.

The file holds only tensors and plain Python values, so it loads with
``torch.load(path, weights_only=True)``: model and optimizer state, the epoch
it completed (counting from 1), the metrics it was scored by, and the config
and data spec that produced it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from ray.train import Checkpoint
from torch import nn

CHECKPOINT_FILE = "checkpoint.pt"


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (checkpoints never carry `module.`)."""
    return getattr(model, "module", model)


def save(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer,
         epoch: int, metrics: dict, run_info: dict) -> Checkpoint:
    """Write the state to `directory` and wrap it as a Ray Train checkpoint.

    `run_info` holds the plain-data facts needed to use the checkpoint alone:
    the config and the data spec (input shape, classes, normalisation).
    """
    state = {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "metrics": metrics,
        **run_info,
    }
    tmp_path = os.path.join(directory, CHECKPOINT_FILE + ".tmp")
    torch.save(state, tmp_path)
    os.replace(tmp_path, os.path.join(directory, CHECKPOINT_FILE))  # never a half-written file
    return Checkpoint.from_directory(directory)


def load_file(path: str | Path) -> dict:
    """Read a checkpoint file or a checkpoint directory."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_FILE
    return torch.load(path, map_location="cpu", weights_only=True)


def restore(checkpoint: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load model and optimizer from a Ray Train checkpoint; return the epochs it had done."""
    with checkpoint.as_directory() as directory:
        state = load_file(directory)
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"]


def scratch_dir() -> tempfile.TemporaryDirectory:
    """Where rank zero stages a checkpoint before Ray Train persists it."""
    return tempfile.TemporaryDirectory(prefix="raytrain-ckpt-")
