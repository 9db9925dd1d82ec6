"""A checkpoint's files: their names, which of the two formats a directory holds, reading one, writing one
whole (raytrain_ddp/checkpoint/saver.py describes the formats)."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import BinaryIO

import torch

from raytrain_ddp.storage import RunPath, location

CHECKPOINT_FILE = "checkpoint.pt"
SHARDS_DIR = "shards"  # a sharded checkpoint's DCP directory
TRAINING_STATE_FILE = "training_state.pt"  # a sharded checkpoint's non-sharded state


def save_atomic(state: dict, path: Path) -> None:
    tmp_path = path.with_name(path.name + ".tmp")
    try:
        with open(tmp_path, "wb") as file:  # a Python file: a full disk shows as its OSError, not torch's words
            torch.save(state, file)
    except BaseException:
        tmp_path.unlink(missing_ok=True)  # no partial file left to take the space
        raise
    os.replace(tmp_path, path)  # never a half-written file


def is_sharded(directory: str | RunPath) -> bool:
    """A sharded checkpoint's directory (local or on object storage)."""
    where = location(directory)
    return (where / TRAINING_STATE_FILE).exists() or (where / SHARDS_DIR).is_dir()


def entry_point(directory: RunPath) -> RunPath:
    """What a user hands `evaluate` or --resume-from: the full format's checkpoint.pt, a sharded one's directory."""
    return directory if is_sharded(directory) else directory / CHECKPOINT_FILE


def new_checkpoint_name() -> str:
    """A directory name for a checkpoint rank zero writes into the run directory itself (a sharded one, a
    --quick-start one), in Ray Train's own pattern (rank zero's clock)."""
    return "checkpoint_" + datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")


def load_file(path: str | Path | BinaryIO) -> dict:
    """Read a checkpoint file or a checkpoint directory (a sharded one's state without the model and
    optimizer), or a checkpoint's bytes read from object storage."""
    if isinstance(path, str | Path):
        path = Path(path)
        if path.is_dir():
            path = path / (TRAINING_STATE_FILE if is_sharded(path) else CHECKPOINT_FILE)
    return torch.load(path, map_location="cpu", weights_only=True)


def dcp():
    """torch.distributed.checkpoint, imported on first use (sharded checkpoints only): about a second of CPU
    that Ray Train's controller (it unpickles the worker loop) and every worker of a DDP run would otherwise
    pay before the first step."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.format_utils  # noqa: F401  (dcp.format_utils, for consolidate)

    return dcp
