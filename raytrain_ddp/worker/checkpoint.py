"""Checkpoints: written by rank zero, one `checkpoint.pt` per Ray Train checkpoint.

The file holds only tensors and plain Python values, so it loads with
``torch.load(path, weights_only=True)``:

* ``model``, ``optimizer``: full (unsharded) state dicts, keyed by parameter
  name, for DDP and FSDP alike: a plain model loads ``model`` directly;
* ``scheduler``, ``scaler``: learning-rate schedule and fp16 loss-scale state;
  ``world_size``: how many ranks trained it (elastic runs change it);
* ``epoch``: epochs completed (counting from 1); ``step_in_epoch``: optimizer
  steps already taken in the next epoch when the run was stopped mid-epoch
  (0 at an epoch boundary); ``global_step``: optimizer steps so far;
* ``rng``: torch's random state (the same on every rank: all were seeded alike);
* ``metrics``, ``config``, ``data_spec``: what it scored and what produced it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch
from ray.train import Checkpoint

CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class Position:
    """Where training stands: what a checkpoint records and a resume starts from."""

    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # optimizer steps done in epoch `epoch + 1`
    global_step: int = 0


def save(
    directory: str,
    model_state: dict,
    optimizer_state: dict,
    training_state: dict,
    position: Position,
    metrics: dict,
    run_info: dict,
) -> Checkpoint:
    """Write the state to `directory` (write, then rename) and wrap it as a Ray Train checkpoint.

    `training_state` holds the scheduler and scaler state and the world size; `run_info` the
    plain-data facts needed to use the checkpoint alone: config and data spec.
    """
    state = {
        "model": model_state,
        "optimizer": optimizer_state,
        **training_state,
        "epoch": position.epoch,
        "step_in_epoch": position.step_in_epoch,
        "global_step": position.global_step,
        "rng": {"torch": torch.get_rng_state()},
        "metrics": metrics,
        **run_info,
    }
    tmp_path = os.path.join(directory, CHECKPOINT_FILE + ".tmp")
    torch.save(state, tmp_path)
    os.replace(tmp_path, os.path.join(directory, CHECKPOINT_FILE))  # never a half-written file
    return Checkpoint.from_directory(directory)


def load_file(path: str | Path | BinaryIO) -> dict:
    """Read a checkpoint file or a checkpoint directory (or a checkpoint's bytes, read from object storage)."""
    if isinstance(path, str | Path):
        path = Path(path)
        if path.is_dir():
            path = path / CHECKPOINT_FILE
    return torch.load(path, map_location="cpu", weights_only=True)


def load(checkpoint: Checkpoint) -> dict:
    """The state in a Ray Train checkpoint, read on this worker."""
    with checkpoint.as_directory() as directory:
        state = load_file(directory)
    torch.set_rng_state(state["rng"]["torch"])
    return state


def position_of(state: dict) -> Position:
    return Position(state["epoch"], state["step_in_epoch"], state["global_step"])


def scratch_dir() -> tempfile.TemporaryDirectory:
    """Where rank zero stages a checkpoint before Ray Train persists it."""
    return tempfile.TemporaryDirectory(prefix="raytrain-ckpt-")
