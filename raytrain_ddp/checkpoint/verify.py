"""Whether a checkpoint can be used: it loads, has the keys a resume reads, its shards are whole, and it holds
the model this run builds. Read by the driver before any worker loads one, and by the one-process commands."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.fs as pafs
import torch

from raytrain_ddp.checkpoint.layout import CHECKPOINT_FILE, SHARDS_DIR, TRAINING_STATE_FILE, dcp, is_sharded, load_file
from raytrain_ddp.checkpoint.state import required_keys
from raytrain_ddp.errors import ConfigError, bounded, headline
from raytrain_ddp.storage import RemotePath, RunPath, location, open_for_read

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

MISMATCHES_NAMED = 3  # a model that does not fit a checkpoint: the first few tensors that differ


def read_verified(checkpoint_dir: RunPath) -> tuple[dict | None, str | None]:
    """(state, None) when the checkpoint loads and has what a resume needs, else (None, why not).

    A sharded checkpoint's state comes without the model and optimizer, once its shards are all there
    and whole (read from DCP's index, not loaded; sharded checkpoints are local: see config's check)."""
    sharded = is_sharded(checkpoint_dir)
    path = checkpoint_dir / (TRAINING_STATE_FILE if sharded else CHECKPOINT_FILE)
    if not path.is_file():
        return None, f"{path.name} is missing"
    if sharded and (problem := shard_problem(checkpoint_dir)):
        return None, problem
    try:
        state = load_file(open_for_read(path))
    except Exception as err:  # truncated, garbage, not a torch file: all mean "unusable"
        return None, f"it does not load ({headline(err)})"
    if not isinstance(state, dict):
        return None, f"it holds a {type(state).__name__}, not a checkpoint"
    missing = [key for key in required_keys(sharded) if key not in state]
    return (None, f"keys missing: {', '.join(missing)}") if missing else (state, None)


def _shard_index(directory: str | RunPath) -> Metadata:
    """DCP's index of a sharded checkpoint, local or on object storage (only the index is fetched). Raises what
    reading it raises."""
    shards = location(directory) / SHARDS_DIR
    if isinstance(shards, Path):
        return dcp().FileSystemReader(str(shards)).read_metadata()
    with tempfile.TemporaryDirectory(prefix="raytrain-index-") as scratch:
        (Path(scratch) / ".metadata").write_bytes((shards / ".metadata").read_bytes())
        return dcp().FileSystemReader(scratch).read_metadata()


def _size(path: RunPath) -> int | None:
    """A file's size (None: missing)."""
    if isinstance(path, RemotePath):
        info = path.fs.get_file_info(path.path)
        return info.size if info.type == pafs.FileType.File else None
    return path.stat().st_size if path.is_file() else None


def shard_problem(directory: str | RunPath) -> str | None:
    """Why a sharded checkpoint's shards cannot be read (index unreadable, a shard missing or short), else None."""
    try:
        metadata = _shard_index(directory)
    except Exception as err:  # missing, truncated, not DCP's: all mean "unusable"
        return f"{SHARDS_DIR}/.metadata does not load ({type(err).__name__})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    shards = location(directory) / SHARDS_DIR
    for name, size in sorted(needed.items()):
        found = _size(shards / name)
        if found is None:
            return f"shard {SHARDS_DIR}/{name} is missing"
        if found < size:
            return f"shard {SHARDS_DIR}/{name} is truncated ({found} of {size} bytes)"
    return None


def model_shapes(directory: str | RunPath, state: dict) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of the checkpoint's model, by name: `state`'s (read by :func:`load_file`), or a
    sharded one's from DCP's index (nothing loaded)."""
    if not is_sharded(directory):
        return {name: tuple(value.shape) for name, value in state["model"].items() if isinstance(value, torch.Tensor)}
    tensor_entry = dcp().metadata.TensorStorageMetadata
    return {
        key.removeprefix("model."): tuple(item.size)
        for key, item in _shard_index(directory).state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, tensor_entry)
    }


def model_mismatch(saved: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> str | None:
    """How a checkpoint's model tensors (`saved`, name -> shape) differ from the model's (`wanted`), or None."""

    def named(names: list[str], say) -> str:
        return bounded(map(say, names), MISMATCHES_NAMED)

    differ = [name for name in wanted if name in saved and saved[name] != wanted[name]]
    missing = [name for name in wanted if name not in saved]
    extra = [name for name in saved if name not in wanted]
    found = [
        *([named(differ, lambda n: f"{n} is {list(saved[n])} there, {list(wanted[n])} here")] if differ else []),
        *([f"it lacks {named(missing, str)}"] if missing else []),
        *([f"this model has no {named(extra, str)}"] if extra else []),
    ]
    return "; ".join(found) or None


def check_fits_model(
    checkpoint_dir: RunPath, state: dict, wanted: dict[str, tuple[int, ...]], what: str, remedy: str
) -> None:
    """ConfigError when the checkpoint's model is not the model this run builds (`wanted`: name -> shape): one
    line before any worker starts, not each rank's load_state_dict traceback."""
    if mismatch := model_mismatch(model_shapes(checkpoint_dir, state), wanted):
        raise ConfigError(f"{what} holds another model than this run's ({mismatch}); {remedy}")
