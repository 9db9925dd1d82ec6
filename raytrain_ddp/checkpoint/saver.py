"""Checkpoints, in one of two formats (``--checkpoint-format``), one directory per Ray Train checkpoint.

**full** (DDP's default): rank zero gathers and writes one ``checkpoint.pt``.
**sharded** (FSDP's default): ``shards/`` holds a ``torch.distributed.checkpoint`` (DCP) checkpoint of the
model and optimizer, every rank writing its own shards in parallel (``__RANK_0.distcp``; ``.metadata``,
written last, indexes them), and ``training_state.pt``, written by rank zero, everything else. It loads at
any world size (DCP reshards on load); consolidate.py turns it into the full format.

``checkpoint.pt`` and ``training_state.pt`` hold the keys of state.py's :class:`CheckpointState` (a sharded
one's ``model`` and ``optimizer`` are its ``shards/``'s, keyed alike). Both savers are a :class:`Saver`: the
training loop calls one the same way whichever the format.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import ray.train
import torch
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointUploadMode

from raytrain_ddp import _ray_compat
from raytrain_ddp.checkpoint.layout import (
    CHECKPOINT_FILE,
    SHARDS_DIR,
    TRAINING_STATE_FILE,
    dcp,
    is_sharded,
    load_file,
    new_checkpoint_name,
    save_atomic,
)
from raytrain_ddp.checkpoint.state import Position, described, plain_state, position_of
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.errors import StorageFull, storage_full_as
from raytrain_ddp.storage import RunPath, location, retried, retry_budget_s
from raytrain_ddp.worker import strategy


def _nothing() -> None:
    pass


class Saver(abc.ABC):
    """How every rank writes the run's checkpoints (--checkpoint-format: :class:`FullSaver`, :class:`ShardedSaver`)
    and loads the one a resume starts from (of either format). The training loop calls each rank's at the same
    points: :meth:`state_of` (a collective), :meth:`save`; :meth:`flush` and :meth:`done_here` for a save still
    being written when `save` returned (the sharded one's)."""

    group: dist.ProcessGroup | None = None  # where a sharded load's collectives run (None: training's group)
    # told the bytes written while a flush waits (the sharded one's): the watchdog sees a long write move
    progress: Callable[[int], None] | None = None
    # --quick-start (Ray Train's local mode keeps no checkpoints; the full format only): rank zero writes into the
    # run directory and `register(checkpoint_dir_name, metrics)` has the driver record it; None: a Ray Train report
    register: Callable[[str, dict], None] | None = None

    @abc.abstractmethod
    def state_of(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The model's and optimizer's state as this format saves it. Every rank must call it."""

    @abc.abstractmethod
    def save(
        self, model_state: dict, optimizer_state: dict, plain: dict, metrics: dict, reporting: Callable = _nothing
    ) -> None:
        """Save a checkpoint of `state_of`'s state and `plain` (state.plain_state) and report it to Ray Train
        with `metrics`, now or at a later :meth:`flush`. `reporting()`: told when the report begins."""

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """The model and optimizer state of a checkpoint of either format (`state`, read by :func:`loaded`) into
        `model` and `optimizer`, on every rank; a sharded one from any world size."""
        if "shards" in state:
            strategy.load_sharded_state(model, optimizer, state["shards"], self.group)
        else:
            strategy.load_full_state(model, optimizer, state["model"], state["optimizer"])

    def done_here(self) -> bool:
        """This rank's write has finished (or nothing is pending)."""
        return True

    def flush(self) -> None:  # noqa: B027  (a full save is reported as it is written: nothing is pending)
        """Wait for the pending save, then report it."""


class FullSaver(Saver):
    """Full checkpoints: every rank gathers (FSDP shards meet on rank zero); rank zero writes checkpoint.pt into a
    scratch directory, which its report has Ray Train copy into the run directory; every rank reports."""

    def __init__(self, config: TrainConfig, rank: int) -> None:
        """`config`: the run's; its run directory, where Ray Train copies a checkpoint, is read only then (on
        object storage naming it is a lookup)."""
        self.config, self.rank = config, rank

    def state_of(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        return strategy.full_state(model, optimizer)

    def save(
        self, model_state: dict, optimizer_state: dict, plain: dict, metrics: dict, reporting: Callable = _nothing
    ) -> None:
        if self.rank != 0:
            reporting()
            if self.register is None:  # --quick-start's ranks have no controller to report to
                ray.train.report(metrics, checkpoint=None)
            return
        what = described(position_of(plain))
        if self.register is not None:
            directory = self.config.run_dir / new_checkpoint_name()
            with storage_full_as(what, directory):
                directory.mkdir()
                write_full(str(directory), model_state, optimizer_state, plain)
            reporting()
            self.register(directory.name, metrics)
            return
        with scratch_dir() as directory:
            with storage_full_as(what, directory):
                checkpoint = write_full(directory, model_state, optimizer_state, plain)
            reporting()
            with storage_full_as(what, self.config.run_dir):  # Ray Train copies it into the run directory
                _ray_compat.report_checkpoint(metrics, checkpoint, what, self.config.run_dir)


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
    return write_full(directory, model_state, optimizer_state, plain_state(training_state, position, metrics, run_info))


def write_full(directory: str, model_state: dict, optimizer_state: dict, plain: dict) -> Checkpoint:
    """Write a full checkpoint's checkpoint.pt into `directory` (write, then rename); wrap it as Ray Train's."""
    save_atomic({"model": model_state, "optimizer": optimizer_state, **plain}, Path(directory) / CHECKPOINT_FILE)
    return Checkpoint.from_directory(directory)


@contextlib.contextmanager
def loaded(checkpoint: Checkpoint, run_dir: RunPath) -> Iterator[dict]:
    """The state in a Ray Train checkpoint of `run_dir`, read on this worker, for the `with` block. A sharded one's
    model and optimizer stay in its shards: ``state["shards"]`` says where (in the run directory, or a copy Ray
    Train downloads for the block, shared by the node's ranks, when that is on object storage: that download is
    retried within the storage budget, a store still failing then ends the run as StorageFull)."""
    with contextlib.ExitStack() as stack:

        def download() -> str:  # a new context each try: a failed one is spent
            return stack.enter_context(checkpoint.as_directory())

        directory = retried("the checkpoint to resume", run_dir, download, "reading")
        state = load_file(directory)
        if is_sharded(directory):
            state["shards"] = os.path.join(directory, SHARDS_DIR)
        torch.set_rng_state(state["rng"]["torch"])
        yield state


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


def report_uploaded(metrics: dict, directory: Path, run_dir: RunPath) -> None:
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


class ShardedSaver(Saver):
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
            self.write_dir, default_report = run_dir, functools.partial(report_written, rank=rank)
        else:
            self.write_dir = Path(tempfile.mkdtemp(prefix="raytrain-shards-"))
            default_report = functools.partial(report_uploaded, run_dir=run_dir)
            weakref.finalize(self, shutil.rmtree, self.write_dir, True)  # this rank's own staging directory
        self.report = report or default_report
        self.group = dist.new_group(backend="gloo")  # every rank, at the same point: a collective
        self.pending: _Pending | None = None

    def state_of(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        return strategy.sharded_state(model, optimizer)

    def save(
        self, model_state: dict, optimizer_state: dict, plain: dict, metrics: dict, reporting: Callable = _nothing
    ) -> None:
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
            save_atomic({**plain, "format": "sharded"}, directory / TRAINING_STATE_FILE)
        future = dcp().async_save(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=str(directory / SHARDS_DIR),
            process_group=self.group,
        )
        self.pending = _Pending(future, directory, metrics, what)

    def done_here(self) -> bool:
        return self.pending is None or self.pending.future.done()

    def flush(self) -> None:
        """Wait for the pending save, then report it (every rank: a Ray Train report is a barrier)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        with storage_full_as(pending.what, self.write_dir, probe=True):
            self._wait(pending)
            self.report(pending.metrics, pending.directory)

    def _wait(self, pending: _Pending) -> None:
        """Until this rank's write is done. A write that adds no byte for the storage retry budget (a hung mount, a
        store that stopped answering) cannot be told from one that will never finish: StorageFull (the run ends,
        exit 74) rather than a wait for ever. A slow write that keeps adding bytes is waited for."""
        budget = retry_budget_s()
        written, moved_at = -1, time.monotonic()
        while True:
            try:
                pending.future.result(timeout=self.FLUSH_POLL_S)
                return
            except TimeoutError:
                now_written = _bytes_under(pending.directory / SHARDS_DIR)
                if self.progress is not None:
                    self.progress(now_written)
                if now_written != written:
                    written, moved_at = now_written, time.monotonic()
                elif time.monotonic() - moved_at >= budget:
                    raise StorageFull.stalled(pending.what, pending.directory, budget) from None

    @property
    def in_flight(self) -> bool:
        return self.pending is not None


def _bytes_under(directory: Path) -> int:
    """What the files directly in `directory` hold (0 before it exists)."""
    try:
        return sum(entry.stat().st_size for entry in os.scandir(directory) if entry.is_file())
    except FileNotFoundError:
        return 0
