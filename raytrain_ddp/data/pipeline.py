"""Ray Data pipelines that feed the training workers: what Ray Train gets as its datasets (:func:`build_datasets`),
each rank's shards (:class:`ShardingDataConfig`), and how a rank reads them. The data's spec is in
:mod:`.spec`, its units in :mod:`.sources`, the order arithmetic in :mod:`.order`.

Both splits are read in *units*: a Parquet row group, read with pyarrow in a
Ray Data task, or, for the built-in data, a chunk of ``ROWS_PER_CHUNK`` rows
generated and normalised once per run and kept in Ray's object store. A Ray
Data task turns a unit's rows into ``{"id", "x", "y"}`` (decode, augment for
train, normalise), outside the training step, and Ray Data prefetches, so a
GPU worker does not wait on decode.

Train, every epoch (:meth:`TrainShard.host_batches`, which each rank calls with
the epoch number), DistributedSampler-style over units:

* the units are put in an order drawn from ``(seed, epoch)``; rank r takes
  rows ``[r * n, (r + 1) * n)`` of that sequence, ``n = rows // world_size``.
  So the shards are disjoint and equal (every rank runs the same number of
  steps: DDP never waits on an all-reduce one rank does not join), and they
  cover every row but the last ``rows % world_size`` (fewer than world_size;
  which ones changes per epoch), with a new split of rows between ranks;
* each rank reads its units in that order, in parallel Ray Data tasks (of
  about ``TASK_BYTES`` decoded bytes each: consecutive pieces, of this epoch
  or the next ones, share a task), and mixes their rows in
  a shuffle window of ``SHUFFLE_BUFFER_ROWS`` rows seeded from
  ``(seed, epoch, rank)``: each batch takes random rows of the window, and the
  next rows read take their places (:func:`.order.window_shuffled`, which depends on
  the rows' order only, not on how Ray Data cuts them into blocks);
* since every epoch's pieces are known up front, one Ray Data execution per
  rank reads all the epochs still to come (:class:`_TrainStream`, kept on the
  rank's :class:`TrainShard`): Ray Data starts once per run, not once per
  epoch, and decodes the start of epoch E + 1 while epoch E is being trained
  on, within its usual backpressure. Images cross the object store as uint8
  and are normalised where the batch is used (on the GPU when there is one).

The order of epoch E is therefore a function of ``(seed, E, world_size)``
only: a second run with the same seed repeats the first, and a run resumed at
epoch E (driver restarted, or Ray Train restarting the worker group) sees what
the uninterrupted run saw (a rank that asks for another epoch than the
stream's next one, or left an epoch half read, gets a new stream starting
there). An epoch resumed mid-way at another world size goes on with the rows
its earlier parts did not train (:func:`.order.rest_of_epoch_pieces`), so across a
resize too every row of the epoch is trained once. No all-to-all shuffle runs, so the first batch of an epoch waits for
one window of rows, not for the whole training set.

Shuffle quality, against a global row shuffle: a batch draws its rows from the
``SHUFFLE_BUFFER_ROWS``-row window of a few units that are neighbours in the
epoch's order (random units, but whole ones). Rows stored in a meaningful
order, e.g. sorted by label, therefore share batches more than they would
under a global shuffle; such data should be shuffled once when written (as
``prepare`` does), or written with small row groups.

Val: rank r reads rows ``[r * N // W, (r + 1) * N // W)`` in storage order,
so every row is evaluated exactly once, on some rank; the worker then
all-reduces the sums so every rank holds the same numbers.

The built-in data needs no decoding: its chunks are model inputs already, and
a rank takes its train pieces straight from the object store and shuffles all
its rows (no window), in its own process, without Ray Data tasks.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import ray
import ray.data
import ray.train
from ray.data import ExecutionOptions, RandomSeedConfig
from ray.train import DataConfig

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data import synthetic
from raytrain_ddp.data.order import (
    SHUFFLE_BUFFER_ROWS,
    epoch_pieces,
    rest_of_epoch_pieces,
    seed_of,
    shuffle_seed,
    val_pieces,
    val_rows_per_rank,
    window_shuffled,
)
from raytrain_ddp.data.sources import SplitSource, built_in_source, parquet_source, read_pieces
from raytrain_ddp.data.spec import DataPlan, DataSpec

# Train pieces are grouped into Ray Data tasks of about this many decoded bytes: each task costs its
# worker 10-20 ms of Ray Data overhead (measured with 1000-row, 3 MB tasks: a third of the worker's time)
TASK_BYTES = 12 * 2**20
MAX_STREAM_PIECES = 10_000  # train pieces one Ray Data execution reads at most (epochs past that: a new one)

# A piece of a task: rows [start, stop) of a unit, and the augmentation seed of its epoch (None: no augmentation).
TaskPiece = tuple[int, int, int, int | None]


# ------------------------------------------------------ Ray Data tasks
def _task_inputs(
    batch: dict[str, np.ndarray], source: SplitSource, tasks: list[list[TaskPiece]], normalise: bool
) -> Iterator[dict[str, np.ndarray]]:
    """map_batches over task numbers: the task's pieces' model inputs, in order, transformed a slice at a time."""
    yield from _pieces_inputs(source, tasks[int(batch["id"][0])], normalise)


def _pieces_inputs(
    source: SplitSource, pieces: Sequence[TaskPiece], normalise: bool
) -> Iterator[dict[str, np.ndarray]]:
    """The pieces' model inputs, in order, a slice at a time (a Ray Data task's, or --quick-start's in the rank)."""
    pieces_rows = read_pieces(source, (piece[:3] for piece in pieces))
    for (*_, augment_seed), rows in zip(pieces, pieces_rows):
        yield from source.model_inputs(rows, augment_seed, normalise)


def _tasks_dataset(source: SplitSource, tasks: list[list[TaskPiece]], normalise: bool = True) -> ray.data.Dataset:
    """A Dataset of the tasks' model inputs, one Ray Data task per task, in task order (with preserve_order)."""
    # from_items, not range: its blocks are made here, so each task reads and transforms in one go
    numbers = [{"id": number} for number in range(len(tasks))]
    return ray.data.from_items(numbers, override_num_blocks=max(1, len(tasks))).map_batches(
        _task_inputs,
        batch_size=1,
        batch_format="numpy",
        fn_kwargs={"source": source, "tasks": tasks, "normalise": normalise},
    )


def _task_rows(spec: DataSpec) -> int:
    """Rows of a train task: TASK_BYTES of decoded rows (uint8 pixels, or float32 features), at least one."""
    value_bytes = 1 if spec.kind == "image" else 4
    return max(1, TASK_BYTES // (value_bytes * math.prod(spec.input_shape) + 16))  # + id and label


def _group_pieces(pieces: Iterable[TaskPiece], task_rows: int) -> list[list[TaskPiece]]:
    """Consecutive pieces (of one epoch or of the next ones) in tasks of at least `task_rows` rows, the
    last may have fewer: the per-task cost is paid once per TASK_BYTES, not once per row group."""
    tasks: list[list[TaskPiece]] = [[]]
    rows = 0  # in tasks[-1]
    for piece in pieces:
        if rows >= task_rows:
            tasks.append([])
            rows = 0
        tasks[-1].append(piece)
        rows += piece[2] - piece[1]
    return [task for task in tasks if task]


class BlockReader:
    """Rows cut from a sequence of blocks (dicts of equal-length columns), `read(n)` at a time, whatever the
    blocks' sizes: the same rows in the same order however they were cut."""

    def __init__(self, blocks: Iterator[dict[str, np.ndarray]]) -> None:
        self._blocks = blocks
        self._block: dict[str, np.ndarray] = {}
        self._offset = 0

    def read(self, rows: int) -> dict[str, np.ndarray]:
        """The next `rows` rows (fewer only where the blocks end; {} after)."""
        parts = []
        while rows > 0:
            if self._offset == len(self._block.get("y", ())):
                self._block, self._offset = next(self._blocks, None), 0
                if self._block is None:
                    self._block = {}
                    break
                continue
            taken = min(rows, len(self._block["y"]) - self._offset)
            parts.append({name: values[self._offset : self._offset + taken] for name, values in self._block.items()})
            self._offset += taken
            rows -= taken
        if len(parts) == 1:
            return parts[0]
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]} if parts else {}


class _TrainStream:
    """One rank's train rows of epochs [first, last], in order, from one Ray Data execution.

    Every epoch's pieces are known up front (a function of the seed, the
    epoch, the rank and the world size), so one execution reads them all:
    Ray Data starts once, not once per epoch, and decodes the start of epoch
    E + 1 while epoch E is still being consumed (within its usual backpressure).
    """

    def __init__(self, shard: TrainShard, config: TrainConfig, first: int, earlier_parts=()) -> None:
        source = shard.source
        self.rows_of_epoch: dict[int, int] = {}
        pieces: list[TaskPiece] = []
        self.last = first
        for epoch in range(first, max(first, config.epochs) + 1):
            if pieces and len(pieces) + len(source.unit_rows) > MAX_STREAM_PIECES:
                break  # the rest in a later stream: the task list stays small
            epoch_part = shard.task_pieces(config, epoch, earlier_parts if epoch == first else ())
            pieces += epoch_part
            self.rows_of_epoch[epoch] = sum(stop - start for _, start, stop, _ in epoch_part)
            self.last = epoch
        # images cross the object store as uint8 and are normalised by the consumer (DeviceFeed)
        dataset = _tasks_dataset(source, _group_pieces(pieces, _task_rows(source.spec)), normalise=False)
        dataset.context.execution_options = shard.execution_options
        self._blocks = iter(dataset.iter_batches(batch_size=None, batch_format="numpy"))
        self._rows = BlockReader(self._blocks)
        self.next_epoch: int | None = first  # None while an epoch is being read (or was left half read)

    def read(self, rows: int) -> dict[str, np.ndarray]:
        """The next `rows` rows of the stream (fewer only where it ends), cut from its blocks."""
        return self._rows.read(rows)

    def epoch(self, epoch: int, batch_size: int, shuffle_seed: int) -> Iterator[dict[str, np.ndarray]]:
        """Epoch `epoch`'s rows (the next rows_of_epoch[epoch] of the stream), shuffled in a window; marks the
        stream ready for epoch + 1 once all of them were read."""
        left = self.rows_of_epoch[epoch]

        def read(rows: int) -> dict[str, np.ndarray]:
            nonlocal left
            part = self.read(min(rows, left))
            left -= len(part.get("y", ()))
            return part

        yield from window_shuffled(read, batch_size, SHUFFLE_BUFFER_ROWS, shuffle_seed)
        if epoch < self.last:
            self.next_epoch = epoch + 1
        else:
            self.close()

    def close(self) -> None:
        close = getattr(self._blocks, "close", None)
        if close:
            close()  # stops the execution behind it


# ------------------------------------------------------ a rank's shards
class TrainInput(Protocol):
    """What a rank trains from, whatever the data's source."""

    @property
    def resizable(self) -> bool:
        """An epoch checkpointed mid-way at another world size goes on with the rows left (else it starts over)."""
        ...

    def host_batches(self, config: TrainConfig, epoch: int, earlier_parts=()) -> Iterable[dict]:
        """This rank's batches of `epoch` as host tensors, images still uint8 (the worker's DeviceFeed finishes
        them). `earlier_parts`: the (world size, optimizer steps) of the epoch trained before a world-size
        change; the rank then reads its share of the rows they did not train (order.rest_of_epoch_pieces)."""
        ...


class ValInput(Protocol):
    def batches(self, batch_size: int) -> tuple[Iterable[dict], int | None]:
        """This rank's val batches as host tensors, and the most batches any rank has (None where that is known
        only once read)."""
        ...


@dataclass
class TrainShard:
    """The project's own train shard of a rank: the split's layout and the rank; the rows come per epoch.

    `stream` is the rank's reader of the coming epochs, made on first use in the worker (never pickled).
    `execution_options` None: --quick-start's shard, whose rows the rank reads in its own process (no Ray Data),
    in the order a Ray Data stream hands them out (the same batches).
    """

    source: SplitSource
    rank: int
    world_size: int
    execution_options: ExecutionOptions | None = None
    stream: _TrainStream | None = field(default=None, compare=False, repr=False)
    resizable = True

    def __getstate__(self) -> dict:
        return {**self.__dict__, "stream": None}

    def host_batches(self, config: TrainConfig, epoch: int, earlier_parts=()) -> Iterable[dict]:
        seed = shuffle_seed(config.seed, epoch, self.rank, len(earlier_parts))
        if self.source.in_memory:
            pieces = self.train_pieces(config, epoch, earlier_parts)
            return _to_torch(_in_memory_batches(self.source, pieces, config.batch_size, seed))
        if self.execution_options is None:
            epoch_part = self.task_pieces(config, epoch, earlier_parts)
            rows = BlockReader(_pieces_inputs(self.source, epoch_part, normalise=False))
            return _to_torch(window_shuffled(rows.read, config.batch_size, SHUFFLE_BUFFER_ROWS, seed))
        # A new stream for the first epoch, a jump, one left half read, or the rest of a resized epoch
        if self.stream is None or self.stream.next_epoch != epoch or earlier_parts:
            if self.stream is not None:
                self.stream.close()
            self.stream = _TrainStream(self, config, epoch, earlier_parts)
        self.stream.next_epoch = None
        return _to_torch(self.stream.epoch(epoch, config.batch_size, seed))

    def task_pieces(self, config: TrainConfig, epoch: int, earlier_parts=()) -> list[TaskPiece]:
        """train_pieces with the epoch's augmentation seed (None where the source does not augment)."""
        augment_seed = seed_of(config.seed, epoch) if self.source.augments else None
        return [(*piece, augment_seed) for piece in self.train_pieces(config, epoch, earlier_parts)]

    def train_pieces(self, config: TrainConfig, epoch: int, earlier_parts=()) -> list[tuple[int, int, int]]:
        """The rank's pieces of `epoch`, in order: its shard of the epoch, or of its rest after `earlier_parts`."""
        unit_rows, in_memory = self.source.unit_rows, self.source.in_memory
        if earlier_parts:
            return rest_of_epoch_pieces(unit_rows, config, epoch, self.rank, self.world_size, earlier_parts, in_memory)
        return epoch_pieces(unit_rows, config.seed, epoch, self.rank, self.world_size)


@dataclass
class ValShard:
    """The project's own val shard of a rank: an iterator over its fixed rows (images as uint8, which the
    worker's DeviceFeed finishes as it does training's) and every rank's row count, so that FSDP's lockstep
    knows the most batches any rank holds without reading them first."""

    iterator: ray.data.DataIterator
    rows_per_rank: tuple[int, ...]

    def batches(self, batch_size: int) -> tuple[Iterable[dict], int | None]:
        return self.iterator.iter_torch_batches(batch_size=batch_size), _most_batches(self.rows_per_rank, batch_size)


def _most_batches(rows_per_rank: tuple[int, ...], batch_size: int) -> int:
    """The most val batches of `batch_size` any rank holds."""
    return max(-(-rows // batch_size) for rows in rows_per_rank)


@dataclass(frozen=True)
class LocalValShard:
    """--quick-start's val shard of a rank: its fixed rows (ValShard's), read in the rank's own process."""

    source: SplitSource
    rank: int
    world_size: int

    def batches(self, batch_size: int) -> tuple[Iterable[dict], int | None]:
        pieces = [(*piece, None) for piece in val_pieces(self.source.unit_rows, self.rank, self.world_size)]
        rows = BlockReader(_pieces_inputs(self.source, pieces, normalise=False))
        batches = iter(lambda: rows.read(batch_size), {})
        most = _most_batches(val_rows_per_rank(self.source.unit_rows, self.world_size), batch_size)
        return _to_torch(batches), most


@dataclass(frozen=True)
class LocalSources:
    """--quick-start's splits: each rank reads its shards of them in its own process (no Ray Data, no object
    store), the same rows in the same order as the full path's shards."""

    train: SplitSource
    val: SplitSource

    def rank_inputs(self, rank: int, world_size: int) -> tuple[TrainInput, ValInput]:
        return TrainShard(self.train, rank, world_size), LocalValShard(self.val, rank, world_size)


@dataclass
class PluginTrainShard:
    """A --dataset plug-in's train split of a rank: Ray Data split it and reshuffles it every epoch."""

    iterator: ray.data.DataIterator
    resizable = False

    def host_batches(self, config: TrainConfig, epoch: int, earlier_parts=()) -> Iterable[dict]:
        return self.iterator.iter_torch_batches(batch_size=config.batch_size)


@dataclass
class PluginValShard:
    """A --dataset plug-in's val split of a rank: its lengths are known only once read."""

    iterator: ray.data.DataIterator

    def batches(self, batch_size: int) -> tuple[Iterable[dict], int | None]:
        return self.iterator.iter_torch_batches(batch_size=batch_size), None


def rank_inputs(local: LocalSources | None = None) -> tuple[TrainInput, ValInput]:
    """This rank's train and val inputs, from Ray Train (or --quick-start's `local` sources, read here). A
    plug-in's shards arrive as Ray Data's own split iterators (Ray Train keeps those as they are, to shut their
    executors down): wrapped here."""
    if local is not None:
        context = ray.train.get_context()
        return local.rank_inputs(context.get_world_rank(), context.get_world_size())
    train, val = ray.train.get_dataset_shard("train"), ray.train.get_dataset_shard("val")
    if isinstance(train, ray.data.DataIterator):
        return PluginTrainShard(train), PluginValShard(val)
    return train, val


def _to_torch(batches: Iterable[dict[str, np.ndarray]]) -> Iterator[dict]:
    # torch is imported here, on the training workers only: Ray Train's DatasetManager and Ray Data's task
    # workers unpickle this module too, and importing torch would cost each of them seconds of CPU at start
    import torch

    for batch in batches:
        yield {name: torch.from_numpy(values) for name, values in batch.items()}


def _in_memory_batches(
    source: SplitSource, pieces: list[tuple[int, int, int]], batch_size: int, shuffle_seed: int
) -> Iterator[dict[str, np.ndarray]]:
    """Built-in rows are model inputs already: the rank takes its pieces from the object store, in this
    process (no Ray Data tasks, nothing to decode), and shuffles all of them."""
    parts = list(read_pieces(source, pieces))
    rows = {name: np.concatenate([part[name] for part in parts]) for name in ("id", "x", "y")}
    order = np.random.default_rng(shuffle_seed).permutation(len(rows["y"]))
    for at in range(0, len(order), batch_size):
        taken = order[at : at + batch_size]
        yield {name: values[taken] for name, values in rows.items()}


# ------------------------------------------------------ what Ray Train gets
class RayTrainDataset(Protocol):
    """A value of Ray Train's `datasets`: ShardingDataConfig asks it for every rank's shard."""

    def rank_shards(self, name: str, world_size: int, options: ExecutionOptions) -> list: ...


@dataclass(frozen=True)
class OwnPipeline:
    """The project's own pipeline over a source: train shards drawn per epoch, val rows fixed per rank."""

    source: SplitSource

    def rank_shards(self, name: str, world_size: int, options: ExecutionOptions) -> list:
        if name == "train":
            return [TrainShard(self.source, rank, world_size, options) for rank in range(world_size)]
        shards = []
        for rank in range(world_size):
            pieces = val_pieces(self.source.unit_rows, rank, world_size)
            dataset = _tasks_dataset(self.source, [[(*piece, None)] for piece in pieces], normalise=False)
            dataset.context.execution_options = options
            shards.append(ValShard(dataset.iterator(), val_rows_per_rank(self.source.unit_rows, world_size)))
        return shards


@dataclass(frozen=True)
class PluginPipeline:
    """A --dataset plug-in's own Ray Dataset: Ray Data's streaming_split gives equal train shards and exact val."""

    dataset: ray.data.Dataset

    def rank_shards(self, name: str, world_size: int, options: ExecutionOptions) -> list:
        dataset = self.dataset.copy(self.dataset)
        dataset.context.execution_options = options
        return list(dataset.streaming_split(world_size, equal=name == "train"))


def build_datasets(config: TrainConfig, plan: DataPlan) -> dict[str, RayTrainDataset]:
    """What Ray Train gets as `datasets`: each split's pipeline; ShardingDataConfig hands its shards to the ranks.

    A --dataset plug-in's own Ray Datasets are shuffled globally (a new seed each
    execution, i.e. each epoch) and split by Ray Data's streaming_split instead.
    """
    if plan.plugin_datasets:
        shuffle_seed = RandomSeedConfig(seed=config.seed, reseed_after_execution=True)
        return {
            "train": PluginPipeline(plan.plugin_datasets["train"].random_shuffle(seed=shuffle_seed)),
            "val": PluginPipeline(plan.plugin_datasets["val"]),
        }
    train, val = _split_sources(config, plan)
    return {"train": OwnPipeline(train), "val": OwnPipeline(val)}


def local_sources(config: TrainConfig, plan: DataPlan) -> LocalSources:
    """--quick-start's splits, read by each rank in its own process (a --dataset plug-in's Ray Datasets cannot be)."""
    return LocalSources(*_split_sources(config, plan, in_process=True))


def _split_sources(config: TrainConfig, plan: DataPlan, in_process: bool = False) -> tuple[SplitSource, SplitSource]:
    """The train and val splits' sources: the Parquet files' row groups, or the built-in rows."""
    if plan.train_paths:
        return parquet_source(plan.spec, plan.train_paths), parquet_source(plan.spec, plan.val_paths)
    train_ids, val_ids = synthetic.split_ids(config.train_size, config.val_size)
    return (
        built_in_source(config, plan.spec, train_ids, in_process),
        built_in_source(config, plan.spec, val_ids, in_process),
    )


class ShardingDataConfig(DataConfig):
    """Train: equal shards drawn per epoch (no DDP hang). Val: every row on exactly one rank."""

    def __init__(self) -> None:
        # DataConfig.default_ingest_options() less its deprecated exclude_resources (Ray Train V2 excludes none)
        current = ray.data.DataContext.get_current().execution_options
        options = ExecutionOptions(
            resource_limits=current.resource_limits,
            preserve_order=True,  # blocks in piece order: the epoch's order is the seed's
            verbose_progress=current.verbose_progress,
        )
        super().__init__(datasets_to_split=["train", "val"], execution_options=options)
        self.options = options

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        # Ray Train calls this once per dataset name and hands rank r shards[r][name]
        shards: list[dict] = [{} for _ in range(world_size)]
        for name, pipeline in datasets.items():
            # a copy of the options per dataset, as DataConfig.configure makes
            for rank, shard in enumerate(pipeline.rank_shards(name, world_size, copy.deepcopy(self.options))):
                shards[rank][name] = shard
        return shards
