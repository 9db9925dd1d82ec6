"""Checkpoints, in one of two formats (``--checkpoint-format``), one directory per Ray Train checkpoint.

**full** (DDP's default): rank zero gathers and writes one ``checkpoint.pt``.
**sharded** (FSDP's default): ``shards/`` holds a ``torch.distributed.checkpoint`` (DCP) checkpoint of the
model and optimizer, every rank writing its own shards in parallel (``__RANK_0.distcp``; ``.metadata``,
written last, indexes them), and ``training_state.pt``, written by rank zero, everything else. It loads at
any world size (DCP reshards on load); :func:`consolidate` turns it into the full format.

``checkpoint.pt`` holds only tensors and plain Python values, so it loads with
``torch.load(path, weights_only=True)``:

* ``model``, ``optimizer``: full (unsharded) state dicts, keyed by parameter
  name, for DDP and FSDP alike: a plain model loads ``model`` directly;
* ``scheduler``, ``scaler``: learning-rate schedule and fp16 loss-scale state;
  ``world_size``: how many ranks trained it (elastic runs change it);
* ``epoch``: epochs completed (counting from 1); ``step_in_epoch``: optimizer
  steps already taken in the next epoch when the run was stopped mid-epoch
  (0 at an epoch boundary); ``global_step``: optimizer steps so far;
  ``earlier_parts``: [world size, optimizer steps] of that epoch's parts trained
  at other world sizes before a resize (empty but after one; absent in old files);
* ``rng``: torch's random state (the same on every rank: all were seeded alike);
* ``metrics``, ``config``, ``data_spec``: what it scored and what produced it.

``training_state.pt`` holds the same keys but ``model`` and ``optimizer`` (which are ``shards/``'s
``model`` and ``optimizer``, keyed alike), and ``format: "sharded"``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import shutil
import tempfile
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import pyarrow.fs as pafs
import ray.train
import torch
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointUploadMode

from raytrain_ddp import _ray_compat
from raytrain_ddp.errors import ConfigError, plural, storage_full_as
from raytrain_ddp.redact import redact_values
from raytrain_ddp.storage import RemotePath, RunPath, local_copy, location

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

CHECKPOINT_FILE = "checkpoint.pt"
SHARDS_DIR = "shards"  # a sharded checkpoint's DCP directory
TRAINING_STATE_FILE = "training_state.pt"  # a sharded checkpoint's non-sharded state
CONSOLIDATED_SUFFIXES = (".pt", ".pth")  # a consolidate OUT named so is the file, else a directory to hold it


@dataclass
class Position:
    """Where training stands: what a checkpoint records and a resume starts from."""

    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # optimizer steps done in epoch `epoch + 1`
    global_step: int = 0
    # (world size, optimizer steps) of epoch `epoch + 1`'s parts trained before the world size changed
    earlier_parts: tuple[tuple[int, int], ...] = ()

    def resumes(self) -> str:
        """Where training goes on from here, in words: the epoch it resumes in, not the last one done."""
        return resume_point(self.epoch, self.step_in_epoch)


def resume_point(epochs_done: int, steps_in_next: int) -> str:
    """'at the start of epoch 3', or 'in epoch 3, 24 optimizer steps into it'."""
    if not steps_in_next:
        return f"at the start of epoch {epochs_done + 1}"
    return f"in epoch {epochs_done + 1}, {plural(steps_in_next, 'optimizer step')} into it"


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
        **plain_state(training_state, position, metrics, run_info),
    }
    _save_atomic(state, Path(directory) / CHECKPOINT_FILE)
    return Checkpoint.from_directory(directory)


def plain_state(training_state: dict, position: Position, metrics: dict, run_info: dict) -> dict:
    """Everything a checkpoint holds but the model and optimizer state; credentials in the config's URIs masked,
    as in config.toml (checkpoints travel: to a bucket, to a colleague)."""
    return {
        **training_state,
        "epoch": position.epoch,
        "step_in_epoch": position.step_in_epoch,
        "global_step": position.global_step,
        "earlier_parts": [list(part) for part in position.earlier_parts],
        "rng": {"torch": torch.get_rng_state()},
        "metrics": metrics,
        **run_info,
        "config": redact_values(run_info["config"]),
    }


def described(position: Position) -> str:
    """How a message names the checkpoint taken at `position`."""
    if position.step_in_epoch:
        return f"the checkpoint of epoch {position.epoch + 1} at step {position.step_in_epoch}"
    return f"the checkpoint of epoch {position.epoch}"


def _save_atomic(state: dict, path: Path) -> None:
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
    """A directory name for a sharded checkpoint, in Ray Train's own pattern (rank zero's clock)."""
    return "checkpoint_" + datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")


def load_file(path: str | Path | BinaryIO) -> dict:
    """Read a checkpoint file or a checkpoint directory (a sharded one's state without the model and
    optimizer), or a checkpoint's bytes read from object storage."""
    if isinstance(path, str | Path):
        path = Path(path)
        if path.is_dir():
            path = path / (TRAINING_STATE_FILE if is_sharded(path) else CHECKPOINT_FILE)
    return torch.load(path, map_location="cpu", weights_only=True)


def _shard_index(directory: str | RunPath) -> Metadata:
    """DCP's index of a sharded checkpoint, local or on object storage (only the index is fetched). Raises what
    reading it raises."""
    shards = location(directory) / SHARDS_DIR
    if isinstance(shards, Path):
        return _dcp().FileSystemReader(str(shards)).read_metadata()
    with tempfile.TemporaryDirectory(prefix="raytrain-index-") as scratch:
        (Path(scratch) / ".metadata").write_bytes((shards / ".metadata").read_bytes())
        return _dcp().FileSystemReader(scratch).read_metadata()


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
    tensor_entry = _dcp().metadata.TensorStorageMetadata
    return {
        key.removeprefix("model."): tuple(item.size)
        for key, item in _shard_index(directory).state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, tensor_entry)
    }


@contextlib.contextmanager
def loaded(checkpoint: Checkpoint) -> Iterator[dict]:
    """The state in a Ray Train checkpoint, read on this worker, for the `with` block. A sharded one's model and
    optimizer stay in its shards: ``state["shards"]`` says where (in the run directory, or a copy Ray Train
    downloads for the block, shared by the node's ranks, when that is on object storage)."""
    with checkpoint.as_directory() as directory:
        state = load_file(directory)
        if is_sharded(directory):
            state["shards"] = os.path.join(directory, SHARDS_DIR)
        torch.set_rng_state(state["rng"]["torch"])
        yield state


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
        _dcp().format_utils.dcp_to_torch_save(str(checkpoint / SHARDS_DIR), str(shards))
        tensors = torch.load(shards, map_location="cpu", weights_only=True)
        shards.unlink()
        written = Path(scratch) / "out"
        file = written / consolidated_file(out).relative_to(out)  # `written` itself for a file
        file.parent.mkdir(exist_ok=True)
        _save_atomic({"model": tensors["model"], "optimizer": tensors["optimizer"], **state}, file)
        written.rename(out)  # within one directory: atomic
    return consolidated_file(out)


def position_of(state: dict) -> Position:
    earlier = tuple((int(world_size), int(steps)) for world_size, steps in state.get("earlier_parts", ()))
    return Position(state["epoch"], state["step_in_epoch"], state["global_step"], earlier)


def scratch_dir() -> tempfile.TemporaryDirectory:
    """Where rank zero stages a checkpoint before Ray Train persists it."""
    return tempfile.TemporaryDirectory(prefix="raytrain-ckpt-")


def report_written(metrics: dict, directory: Path, rank: int) -> None:
    """Ray Train's report of a checkpoint every rank wrote into `directory`, in the run directory: rank zero
    names it (one checkpoint), nothing is copied (NO_UPLOAD). Every rank calls it: it is a barrier."""
    ray.train.report(
        metrics,
        checkpoint=Checkpoint.from_directory(str(directory)) if rank == 0 else None,
        checkpoint_dir_name=directory.name,
        checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD,
    )


@dataclass
class _Pending:
    future: Future
    directory: Path
    metrics: dict
    what: str  # the checkpoint, as a message names it


def report_uploaded(metrics: dict, directory: Path, rank: int, run_dir: RunPath) -> None:
    """Ray Train's report of the checkpoint this rank staged in `directory` (a local one of its own) for a run
    directory on object storage: every rank's files are uploaded into one checkpoint directory of that name
    there (Ray Train merges them; a store that fails is retried, then StorageFull), then deleted here. Every
    rank calls it: it is a barrier."""
    _ray_compat.report_checkpoint(
        metrics,
        Checkpoint.from_directory(str(directory)),
        f"the shards of {directory.name}",  # the console's warning names the rank
        run_dir,
        checkpoint_dir_name=directory.name,
        delete_local_checkpoint_after_upload=True,
    )


class ShardedSaver:
    """Sharded checkpoints written in the background, straight into the run directory.

    ``save`` stages this rank's shards in host memory (the one pause training takes), starts
    ``dcp.async_save`` into RUN_DIR/checkpoint_DATE/shards/ and returns. The checkpoint is reported to Ray
    Train (one checkpoint: rank zero reports the directory every rank wrote into, with NO_UPLOAD, as it
    already lies in the run directory) once every rank's write is done: :meth:`flush`, called by the
    training loop at the first stop check that finds every rank's :meth:`done_here`, else before the next
    save or when the run ends. Until then Ray Train does not know it: a crash resumes from the one before.
    A run directory on object storage cannot be written into by DCP: each rank writes into a local
    directory of its own, and its report uploads it (:func:`report_uploaded`), which the flush waits for.
    DCP's collectives run on their own gloo group (in the writing thread; the next one waits for it), so
    they never interleave with training's collectives, and async_save gets the CPU group it needs on GPUs.
    """

    FLUSH_POLL_S = 0.5  # while a flush waits, how often the bytes written are told to `progress`

    def __init__(self, run_dir: str | RunPath, rank: int, report: Callable[[dict, Path], None] | None = None) -> None:
        """`report(metrics, directory)`: how a written checkpoint is counted (default: :func:`report_written`,
        or :func:`report_uploaded` for a run directory on object storage)."""
        run_dir = location(run_dir)
        self.rank = rank
        if isinstance(run_dir, Path):
            self.write_dir, default_report = run_dir, report_written
        else:
            self.write_dir = Path(tempfile.mkdtemp(prefix="raytrain-shards-"))
            default_report = functools.partial(report_uploaded, run_dir=run_dir)
            weakref.finalize(self, shutil.rmtree, self.write_dir, True)  # this rank's own staging directory
        self.report = report or functools.partial(default_report, rank=rank)
        self.group = dist.new_group(backend="gloo")  # every rank, at the same point: a collective
        self.pending: _Pending | None = None
        # told the bytes the shards hold while a flush waits: the watchdog sees a long write move, a stalled one not
        self.progress: Callable[[int], None] | None = None

    def save(self, model_state: dict, optimizer_state: dict, plain: dict, metrics: dict) -> None:
        self.flush()  # one save in flight at a time
        what = described(position_of(plain))
        with storage_full_as(what, self.write_dir, probe=True):  # DCP's writer loses the errno
            self._start_save(model_state, optimizer_state, plain, metrics, what)

    def _start_save(self, model_state: dict, optimizer_state: dict, plain: dict, metrics: dict, what: str) -> None:
        names: list[str | None] = [None]
        if self.rank == 0:  # made before the others learn its name: their DCP writers create it too
            names = [new_checkpoint_name()]
            (self.write_dir / names[0]).mkdir()  # a new name: an existing directory is never written into
        dist.broadcast_object_list(names, src=0, group=self.group)
        directory = self.write_dir / names[0]
        if self.rank == 0:
            _save_atomic({**plain, "format": "sharded"}, directory / TRAINING_STATE_FILE)
        future = _dcp().async_save(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=str(directory / SHARDS_DIR),
            process_group=self.group,
        )
        self.pending = _Pending(future, directory, metrics, what)

    def done_here(self) -> bool:
        """This rank's write has finished (or nothing is pending)."""
        return self.pending is None or self.pending.future.done()

    def flush(self) -> None:
        """Wait for the pending save, then report it (every rank: a Ray Train report is a barrier)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        with storage_full_as(pending.what, self.write_dir, probe=True):
            while True:
                try:
                    pending.future.result(timeout=self.FLUSH_POLL_S)
                    break
                except TimeoutError:
                    if self.progress is not None:
                        self.progress(_bytes_under(pending.directory / SHARDS_DIR))
            self.report(pending.metrics, pending.directory)

    @property
    def in_flight(self) -> bool:
        return self.pending is not None


def _bytes_under(directory: Path) -> int:
    """What the files directly in `directory` hold (0 before it exists)."""
    try:
        return sum(entry.stat().st_size for entry in os.scandir(directory) if entry.is_file())
    except FileNotFoundError:
        return 0


def load_model_weights(checkpoint_dir: str | RunPath, model: torch.nn.Module) -> None:
    """A sharded checkpoint's model weights into a plain model, on one process (DCP assembles the shards)."""
    state = {"model": model.state_dict()}
    with local_copy(location(checkpoint_dir) / SHARDS_DIR) as shards, warnings.catch_warnings():
        # DCP warns that it assumes a single process even when asked for one (no_dist): news to no one here
        warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized")
        _dcp().load(state, checkpoint_id=str(shards), no_dist=True)
    model.load_state_dict(state["model"])


def _dcp():
    """torch.distributed.checkpoint, imported on first use (sharded checkpoints only): about a second of CPU
    that Ray Train's controller (it unpickles the worker loop) and every worker of a DDP run would otherwise
    pay before the first step."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.format_utils  # noqa: F401  (dcp.format_utils, for consolidate)

    return dcp
