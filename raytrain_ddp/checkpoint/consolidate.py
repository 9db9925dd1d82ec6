"""A sharded checkpoint read on one process, without a process group: consolidated into the full format, or
its model weights loaded into a plain model."""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import torch

from raytrain_ddp.checkpoint.layout import CHECKPOINT_FILE, SHARDS_DIR, dcp, load_file, save_atomic
from raytrain_ddp.errors import ConfigError
from raytrain_ddp.storage import RunPath, local_copy, location

CONSOLIDATED_SUFFIXES = (".pt", ".pth")  # a consolidate OUT named so is the file, else a directory to hold it


def consolidated_file(out: str | Path) -> Path:
    """Where consolidate writes: `out` itself when it names a file (.pt, .pth), else `out`/checkpoint.pt."""
    out = Path(out)
    return out if out.suffix in CONSOLIDATED_SUFFIXES else out / CHECKPOINT_FILE


def consolidate(checkpoint_dir: str | RunPath, out: str | Path) -> Path:
    """Write a sharded checkpoint (local or on object storage) as one full-format checkpoint: the new local
    file `out` when it ends in .pt or .pth, else the new local directory `out`, holding checkpoint.pt.

    On one process, without a process group; the whole state is in memory once. Raises ConfigError when
    `out` exists (nothing is overwritten). Written beside `out` and renamed: a failed one leaves no `out`.
    Returns the file written."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} already exists; consolidate writes a new file and overwrites nothing")
    out.parent.mkdir(parents=True, exist_ok=True)
    with (
        local_copy(location(checkpoint_dir)) as checkpoint,
        tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as scratch,
    ):
        state = load_file(checkpoint)
        state.pop("format", None)
        shards = Path(scratch) / "shards.pt"
        dcp().format_utils.dcp_to_torch_save(str(checkpoint / SHARDS_DIR), str(shards))
        tensors = torch.load(shards, map_location="cpu", weights_only=True)
        shards.unlink()
        written = Path(scratch) / "out"
        file = written / consolidated_file(out).relative_to(out)  # `written` itself for a file
        file.parent.mkdir(exist_ok=True)
        save_atomic({"model": tensors["model"], "optimizer": tensors["optimizer"], **state}, file)
        written.rename(out)  # within one directory: atomic
    return consolidated_file(out)


def load_model_weights(checkpoint_dir: str | RunPath, model: torch.nn.Module) -> None:
    """A sharded checkpoint's model weights into a plain model, on one process (DCP assembles the shards)."""
    state = {"model": model.state_dict()}
    with local_copy(location(checkpoint_dir) / SHARDS_DIR) as shards, warnings.catch_warnings():
        # DCP warns that it assumes a single process even when asked for one (no_dist): news to no one here
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        dcp().load(state, checkpoint_id=str(shards), no_dist=True)
    model.load_state_dict(state["model"])
