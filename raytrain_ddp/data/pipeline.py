"""Ray Data pipelines that feed the training workers.

Both splits are read in *units*: a Parquet row group, read with pyarrow in a
Ray Data task, or, for the built-in data, a chunk of ``ROWS_PER_CHUNK`` rows
generated and normalised once per run and kept in Ray's object store. A Ray
Data task turns a unit's rows into ``{"id", "x", "y"}`` (decode, augment for
train, normalise), outside the training step, and Ray Data prefetches, so a
GPU worker does not wait on decode.

Train, every epoch (:func:`host_batches`, which each rank calls with the
epoch number), DistributedSampler-style over units:

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
  next rows read take their places (:func:`_window_shuffled`, which depends on
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
its earlier parts did not train (:func:`rest_of_epoch_pieces`), so across a
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
import itertools
import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray
import ray.data
from ray.data import ExecutionOptions, RandomSeedConfig
from ray.train import DataConfig

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data import paths, synthetic
from raytrain_ddp.data.format import decode_images
from raytrain_ddp.data.validate import check_dataset
from raytrain_ddp.errors import ConfigError, DataReadError, named
from raytrain_ddp.plugins import call_plugin

log = logging.getLogger("raytrain_ddp")

ROWS_PER_CHUNK = 1024  # built-in rows per cached chunk (a unit)
TRANSFORM_ROWS = 256  # rows decoded at a time: bounds the decode buffers of a large row group
SHUFFLE_BUFFER_ROWS = 1024  # a rank's local shuffle window: rows of neighbouring units mixed together
# Train pieces are grouped into Ray Data tasks of about this many decoded bytes: each task costs its
# worker 10-20 ms of Ray Data overhead (measured with 1000-row, 3 MB tasks: a third of the worker's time)
TASK_BYTES = 12 * 2**20
MAX_STREAM_PIECES = 10_000  # train pieces one Ray Data execution reads at most (epochs past that: a new one)
CROP_PADDING = 4  # pixels of reflection padding before the random crop


@dataclass(frozen=True)
class DataSpec:
    """What the model and the transform need to know about the data (plain values only)."""

    kind: str  # "image", "tabular", "tokens" (next-token prediction) or "custom" (a dataset plug-in's own x, y)
    input_shape: tuple[int, ...]
    num_classes: int
    train_rows: int
    val_rows: int
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    image_column: str = "image"
    label_column: str = "label"
    encoding: str = "array"  # "png" / "jpeg" bytes, "raw" pixel lists, "array" uint8 NCHW
    feature_columns: tuple[str, ...] = ()
    input_dtype: str = ""  # a plug-in's x dtype; "" = the kind's own (int64 tokens, float32 otherwise)
    constant_inputs: tuple[str, ...] = ()  # features/channels of std 0 over the train split, scaled by 1


# ------------------------------------------------------------------ transform
def augment_images(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random crop (after reflection padding) and horizontal flip, per image."""
    _, _, height, width = images.shape
    padded = np.pad(images, ((0, 0), (0, 0), (CROP_PADDING,) * 2, (CROP_PADDING,) * 2), mode="reflect")
    out = np.empty_like(images)
    for i, (top, left, flip) in enumerate(
        zip(
            rng.integers(0, 2 * CROP_PADDING + 1, len(images)),
            rng.integers(0, 2 * CROP_PADDING + 1, len(images)),
            rng.random(len(images)) < 0.5,
        )
    ):
        crop = padded[i, :, top : top + height, left : left + width]
        out[i] = crop[:, :, ::-1] if flip else crop
    return out


def to_model_inputs(
    rows: dict[str, np.ndarray], spec: DataSpec, augment_seed: int | None = None, normalise: bool = True
) -> dict[str, np.ndarray]:
    """Rows as stored -> ``{"id", "x", "y"}`` as the model takes them.

    `augment_seed` (train only) turns on random crop and flip, drawn from the
    seed and the batch's first id, so an epoch's augmentation is reproducible.
    `normalise=False` leaves images as uint8 pixels (a quarter of the bytes
    to move) for the training worker's device feed to finish where the batch is used.
    """
    if spec.kind == "tokens":  # predict every next token: inputs are the sequence, targets it shifted by one
        tokens = rows["tokens"]
        return {"id": rows["id"].astype(np.int64), "x": tokens[:, :-1], "y": tokens[:, 1:]}
    if spec.kind == "image":
        images = rows[spec.image_column]
        if spec.encoding != "array":
            images = decode_images(images, spec.encoding, spec.input_shape)
        if augment_seed is not None and len(images):
            rng = np.random.default_rng([augment_seed, int(rows["id"][0]) if "id" in rows else 0])
            images = augment_images(images, rng)
        if not normalise:
            return {
                "id": rows["id"].astype(np.int64) if "id" in rows else np.full(len(images), -1),
                "x": images,
                "y": rows[spec.label_column].astype(np.int64),
            }
        scale = np.asarray(spec.std, dtype=np.float32).reshape(1, -1, 1, 1)
        shift = np.asarray(spec.mean, dtype=np.float32).reshape(1, -1, 1, 1)
        x: np.ndarray = (images.astype(np.float32) / 255.0 - shift) / scale
    else:
        x = np.stack([rows[name] for name in spec.feature_columns], axis=1).astype(np.float32)
        if spec.mean:
            x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    labels = rows[spec.label_column]
    ids = rows["id"] if "id" in rows else np.full(len(labels), -1)
    return {"id": ids.astype(np.int64), "x": x, "y": labels.astype(np.int64)}


# ---------------------------------------------------------------- data specs
def synthetic_spec(config: TrainConfig) -> DataSpec:
    if config.dataset == "synthetic":
        return DataSpec(
            "image",
            synthetic.IMAGE_SHAPE,
            synthetic.NUM_CLASSES,
            config.train_size,
            config.val_size,
            mean=(0.5,) * 3,
            std=(0.25,) * 3,
        )
    if config.dataset == "synthetic-tokens":
        return DataSpec(
            "tokens", (synthetic.SEQUENCE_LENGTH,), synthetic.VOCAB_SIZE, config.train_size, config.val_size
        )
    return DataSpec(
        "tabular",
        (len(synthetic.FEATURE_NAMES),),
        synthetic.NUM_CLASSES,
        config.train_size,
        config.val_size,
        feature_columns=synthetic.FEATURE_NAMES,
    )


@dataclass(frozen=True)
class DataPlan:
    """The data a run will read: its spec, and the Parquet files or a plug-in's datasets (neither for built-in data)."""

    spec: DataSpec
    train_paths: tuple[str, ...] = ()
    val_paths: tuple[str, ...] = ()
    plugin_datasets: dict | None = None  # {"train", "val"}: Ray Datasets of model-ready rows {x, y[, id]}


def plugin_plan(config: TrainConfig, dataset_fn, label: str) -> DataPlan:
    """Call a dataset plug-in (Ray is up) and check what it returned; raises ConfigError. Its rows hold x and y,
    unless a --task reads them (then any columns)."""
    flag = f"--dataset {label}"
    datasets = call_plugin(dataset_fn, "--dataset", label, config)
    if not (
        isinstance(datasets, dict)
        and set(datasets) >= {"train", "val"}
        and all(isinstance(datasets[name], ray.data.Dataset) for name in ("train", "val"))
    ):
        raise ConfigError(
            f"{flag} returned {type(datasets).__name__}, expected "
            "{'train': ray.data.Dataset, 'val': ray.data.Dataset}"
        )
    sample = call_plugin(lambda: datasets["train"].take_batch(256, batch_format="numpy"), "--dataset", label)
    if config.task and not {"x", "y"} <= set(sample):
        rows = (datasets["train"].count(), datasets["val"].count())
        return DataPlan(
            DataSpec("custom", (), 0, *rows), plugin_datasets={"train": datasets["train"], "val": datasets["val"]}
        )
    missing = {"x", "y"} - set(sample)
    if missing:
        raise ConfigError(
            f"{flag}: training rows lack {named('column', sorted(missing))}; they hold {', '.join(sorted(sample))}"
        )
    labels = sample["y"]
    num_classes = int(datasets["train"].max("y")) + 1 if labels.ndim == 1 else int(labels.max()) + 1
    spec = DataSpec(
        "custom",
        tuple(sample["x"].shape[1:]),
        num_classes,
        datasets["train"].count(),
        datasets["val"].count(),
        input_dtype=str(sample["x"].dtype),
    )
    return DataPlan(spec, plugin_datasets={"train": datasets["train"], "val": datasets["val"]})


def plan_data(config: TrainConfig) -> DataPlan:
    """Check the data without Ray, before anything starts; raises ConfigError."""
    if not config.uses_parquet:
        return DataPlan(synthetic_spec(config))
    spec, train_paths, val_paths = parquet_spec(config)
    return DataPlan(spec, tuple(train_paths), tuple(val_paths))


def parquet_spec(config: TrainConfig) -> tuple[DataSpec, list[str], list[str]]:
    """Validate the Parquet data on the driver (footers and a sample); raises ConfigError."""
    feature_columns = [c.strip() for c in config.feature_columns.split(",")] if config.feature_columns else None
    info = check_dataset(
        config.data or config.train_data.split(","),
        None if config.data else config.val_data.split(","),
        image_column=config.image_column,
        label_column=config.label_column,
        feature_columns=feature_columns,
    )
    if not info.val_paths:
        raise ConfigError(f"no validation data found for {info.path}: give --val-data or a val/ split")
    constant = tuple(info.constant_inputs())
    std = [s if s > 0 else 1.0 for s in info.std] if info.std else info.std  # see DatasetInfo.constant_inputs
    if info.kind == "image":
        mean = info.mean
        if not mean:
            log.warning(
                "No normalisation statistics in %s: using mean 0.5, std 0.25 per channel "
                "(`python -m raytrain_ddp.data prepare` records them)",
                info.path,
            )
            mean, std = [0.5] * info.image_shape[0], [0.25] * info.image_shape[0]
        spec = DataSpec(
            "image",
            tuple(info.image_shape),
            info.num_classes,
            info.rows["train"],
            info.rows["val"],
            mean=tuple(mean),
            std=tuple(std),
            image_column=config.image_column,
            label_column=config.label_column,
            encoding=info.encoding,
            constant_inputs=constant,
        )
    else:
        spec = DataSpec(
            "tabular",
            (len(info.feature_columns),),
            info.num_classes,
            info.rows["train"],
            info.rows["val"],
            mean=tuple(info.mean or ()),
            std=tuple(std or ()),
            label_column=config.label_column,
            feature_columns=tuple(info.feature_columns),
            constant_inputs=constant,
        )
    return spec, info.train_paths, info.val_paths


def _columns(spec: DataSpec) -> list[str]:
    inputs = [spec.image_column] if spec.kind == "image" else list(spec.feature_columns)
    return inputs + [spec.label_column]


def read_split_rows(config: TrainConfig, split: str) -> dict[str, np.ndarray]:
    """All rows of a split, in this process, without Ray (the evaluator uses this)."""
    if not config.uses_parquet:
        train_ids, val_ids = synthetic.split_ids(config.train_size, config.val_size)
        return synthetic.GENERATORS[config.dataset](train_ids if split == "train" else val_ids, config.seed)
    plan = plan_data(config)
    paths = plan.train_paths if split == "train" else plan.val_paths
    table = pq.ParquetDataset(list(paths)).read(columns=_columns(plan.spec))
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


# ------------------------------------------------------------------ datasets
@dataclass(frozen=True)
class SplitSource:
    """One split as units that a Ray Data task reads whole (plain values and object refs only).

    A unit is a Parquet row group (`row_groups`: file URI and index, read as
    `columns`), or a chunk of built-in rows already turned into model inputs
    (`chunks`).
    """

    spec: DataSpec
    unit_rows: tuple[int, ...]
    row_groups: tuple[tuple[str, int], ...] = ()
    columns: tuple[str, ...] = ()
    chunks: tuple[ray.ObjectRef, ...] = ()

    @property
    def augments(self) -> bool:
        """Random crop and flip for encoded images (the built-in images are not augmented)."""
        return self.spec.kind == "image" and self.spec.encoding != "array"


def _seed_of(*entropy: int) -> int:
    """One 32-bit seed from several integers (Ray Data's local shuffle takes an int)."""
    return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


def _read_piece(source: SplitSource, unit: int, start: int, stop: int) -> dict[str, np.ndarray]:
    """Rows [start, stop) of a unit: as stored (Parquet) or as model inputs (built-in chunks)."""
    if source.chunks:
        chunk = ray.get(source.chunks[unit])
        return {name: values[start:stop] for name, values in chunk.items()}
    uri, row_group = source.row_groups[unit]
    location = paths.resolve(uri)
    try:
        with location.filesystem.open_input_file(location.path) as file:
            table = pq.ParquetFile(file).read_row_group(row_group, columns=list(source.columns))
    except (pa.ArrowException, OSError) as exc:  # checked before the run: the file changed, or a page is corrupt
        # Arrow's decoder raises an OSError without errno for bytes it cannot decode; a remote store's may pass
        corrupt = isinstance(exc, pa.ArrowException) or (
            exc.errno is None and isinstance(location.filesystem, pafs.LocalFileSystem)
        )
        raise DataReadError(f"row group {row_group} of {uri}", exc, corrupt) from exc
    table = table.slice(start, stop - start)
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


def _read_pieces(source: SplitSource, pieces: Iterable[tuple[int, int, int]]) -> Iterator[dict[str, np.ndarray]]:
    """Each piece's rows, in order; a run of pieces of one unit (a resized epoch's rest: rows scattered by the
    earlier parts' shuffles) reads the unit's span once, not a row group per piece."""
    for unit, run in itertools.groupby(pieces, key=lambda piece: piece[0]):
        spans = [(start, stop) for _, start, stop in run]
        first, last = min(start for start, _ in spans), max(stop for _, stop in spans)
        rows = _read_piece(source, unit, first, last)
        for start, stop in spans:
            yield {name: values[start - first : stop - first] for name, values in rows.items()}


# A piece of a task: rows [start, stop) of a unit, and the augmentation seed of its epoch (None: no augmentation).
TaskPiece = tuple[int, int, int, int | None]


def _task_inputs(
    batch: dict[str, np.ndarray], source: SplitSource, tasks: list[list[TaskPiece]], normalise: bool
) -> Iterator[dict[str, np.ndarray]]:
    """map_batches over task numbers: the task's pieces' model inputs, in order, transformed a slice at a time."""
    task = tasks[int(batch["id"][0])]
    pieces_rows = _read_pieces(source, (piece[:3] for piece in task))
    for (_, start, stop, augment_seed), rows in zip(task, pieces_rows):
        if source.chunks:  # model inputs already
            yield rows
            continue
        for at in range(0, stop - start, TRANSFORM_ROWS):
            yield to_model_inputs(
                {name: values[at : at + TRANSFORM_ROWS] for name, values in rows.items()},
                source.spec,
                augment_seed,
                normalise,
            )


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


def _pieces(unit_rows: Sequence[int], order: Iterable[int], first: int, last: int) -> list[tuple[int, int, int]]:
    """(unit, start, stop) pieces that cover rows [first, last) of the units laid end to end in `order`."""
    pieces, offset = [], 0
    for unit in order:
        start, stop = max(first, offset), min(last, offset + unit_rows[unit])
        if start < stop:
            pieces.append((int(unit), start - offset, stop - offset))
        offset += unit_rows[unit]
    return pieces


def _unit_order(unit_rows: Sequence[int], seed: int, epoch: int) -> np.ndarray:
    """The epoch's order of the units, drawn from (seed, epoch): the same on every rank and at every world size."""
    return np.random.default_rng([seed, epoch]).permutation(len(unit_rows))


def epoch_pieces(
    unit_rows: Sequence[int], seed: int, epoch: int, rank: int, world_size: int
) -> list[tuple[int, int, int]]:
    """Rank's train pieces of an epoch, in order: rows [rank * n, (rank + 1) * n) of the units in the
    epoch's order, n = all rows // world_size."""
    per_rank = sum(unit_rows) // world_size
    return _pieces(unit_rows, _unit_order(unit_rows, seed, epoch), rank * per_rank, (rank + 1) * per_rank)


def rest_of_epoch_pieces(
    unit_rows: Sequence[int],
    config: TrainConfig,
    epoch: int,
    rank: int,
    world_size: int,
    earlier_parts,
    in_memory: bool,
) -> list[tuple[int, int, int]]:
    """Rank's train pieces of what is left of an epoch whose `earlier_parts` ((world size, optimizer steps), in
    order) were trained at other world sizes (an elastic restart, a resumed run with more or fewer workers).

    Each earlier part's ranks are replayed on row positions only (no data is read): what each trained is the
    start of its shard in its micro-batch order. The rows none of them trained (an earlier split's remainder
    included), in the epoch's order, are split as a whole epoch is: `rows // world_size` per rank, so over all
    parts no row of the epoch is trained twice and fewer than `world_size` rows are left out, as in any epoch.
    """
    order = _unit_order(unit_rows, config.seed, epoch)
    units = np.repeat(order, [unit_rows[unit] for unit in order])  # the epoch's rows as (unit, row in unit)
    rows = np.concatenate([np.arange(unit_rows[unit]) for unit in order]) if len(order) else np.empty(0, int)
    for part, (part_world_size, steps) in enumerate(earlier_parts):
        per_rank = len(units) // part_world_size
        trained_rows = steps * config.grad_accum * config.batch_size
        left = []
        for part_rank in range(part_world_size):
            seed = shuffle_seed(config.seed, epoch, part_rank, part)
            trained = _trained_order(per_rank, config.batch_size, seed, in_memory, trained_rows)
            untrained = np.ones(per_rank, dtype=bool)
            untrained[trained] = False
            left.append(part_rank * per_rank + np.flatnonzero(untrained))
        left.append(np.arange(part_world_size * per_rank, len(units)))  # the part's remainder: no rank had it
        picked = np.concatenate(left)
        units, rows = units[picked], rows[picked]
    per_rank = len(units) // world_size
    return _runs(units[rank * per_rank : (rank + 1) * per_rank], rows[rank * per_rank : (rank + 1) * per_rank])


def shuffle_seed(seed: int, epoch: int, rank: int, part: int = 0) -> int:
    """The seed of a rank's micro-batch order in an epoch; `part` counts the world-size changes within it."""
    return _seed_of(seed, epoch, rank) if part == 0 else _seed_of(seed, epoch, rank, part)


def _trained_order(rows: int, batch_size: int, seed: int, in_memory: bool, trained_rows: int) -> np.ndarray:
    """The first `trained_rows` of positions 0..rows-1 of a rank's epoch rows, in the order its micro-batches
    take them (host_batches' order); only those micro-batches are replayed."""
    if in_memory:
        return np.random.default_rng(seed).permutation(rows)[:trained_rows]
    positions, at = np.arange(rows), 0

    def read(count: int) -> dict[str, np.ndarray]:
        nonlocal at
        part, at = positions[at : at + count], min(rows, at + count)
        return {"y": part}

    shuffled = _window_shuffled(read, batch_size, SHUFFLE_BUFFER_ROWS, seed)
    batches = [batch["y"] for batch in itertools.islice(shuffled, math.ceil(trained_rows / batch_size))]
    return np.concatenate(batches)[:trained_rows] if batches else positions[:0]


def _runs(units: np.ndarray, rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(unit, start, stop) pieces of consecutive rows of one unit, covering the given rows in their order."""
    if not len(units):
        return []
    breaks = np.flatnonzero((np.diff(units) != 0) | (np.diff(rows) != 1)) + 1
    starts, stops = np.concatenate([[0], breaks]), np.concatenate([breaks, [len(units)]])
    return [(int(units[a]), int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(starts, stops)]


def val_pieces(unit_rows: Sequence[int], rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """Rank's val pieces, in storage order: rows [rank * N // W, (rank + 1) * N // W), none dropped."""
    rows = sum(unit_rows)
    return _pieces(unit_rows, range(len(unit_rows)), rank * rows // world_size, (rank + 1) * rows // world_size)


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
            augment_seed = _seed_of(config.seed, epoch) if source.augments else None
            epoch_part = train_pieces(shard, config, epoch, earlier_parts if epoch == first else ())
            pieces += [(*piece, augment_seed) for piece in epoch_part]
            self.rows_of_epoch[epoch] = sum(stop - start for _, start, stop in epoch_part)
            self.last = epoch
        # images cross the object store as uint8 and are normalised by the consumer (DeviceFeed)
        dataset = _tasks_dataset(source, _group_pieces(pieces, _task_rows(source.spec)), normalise=False)
        dataset.context.execution_options = shard.execution_options
        self._blocks = iter(dataset.iter_batches(batch_size=None, batch_format="numpy"))
        self._block: dict[str, np.ndarray] = {}
        self._offset = 0
        self.next_epoch: int | None = first  # None while an epoch is being read (or was left half read)

    def read(self, rows: int) -> dict[str, np.ndarray]:
        """The next `rows` rows of the stream (fewer only where it ends), cut from its blocks."""
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

    def epoch(self, epoch: int, batch_size: int, shuffle_seed: int) -> Iterator[dict[str, np.ndarray]]:
        """Epoch `epoch`'s rows (the next rows_of_epoch[epoch] of the stream), shuffled in a window; marks the
        stream ready for epoch + 1 once all of them were read."""
        left = self.rows_of_epoch[epoch]

        def read(rows: int) -> dict[str, np.ndarray]:
            nonlocal left
            part = self.read(min(rows, left))
            left -= len(part.get("y", ()))
            return part

        yield from _window_shuffled(read, batch_size, SHUFFLE_BUFFER_ROWS, shuffle_seed)
        if epoch < self.last:
            self.next_epoch = epoch + 1
        else:
            self.close()

    def close(self) -> None:
        close = getattr(self._blocks, "close", None)
        if close:
            close()  # stops the execution behind it


def _window_shuffled(read, batch_size: int, window: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
    """The rows that `read(n)` hands out (n at a time, fewer at the end) in batches drawn from a window of
    `window` rows: each batch takes random rows of the window, and the next rows read take their places.
    A function of the rows' order and the seed only, not of how the stream cuts them into blocks."""
    rng = np.random.default_rng(seed)
    buffer = {name: np.array(values) for name, values in read(window).items()}  # writable: slots are refilled
    size = len(buffer.get("y", ()))
    while size:
        incoming = read(batch_size)
        arrived = len(incoming.get("y", ()))
        if not arrived:
            break
        slots = rng.choice(size, min(batch_size, size), replace=False)
        yield {name: values[slots] for name, values in buffer.items()}
        for name, values in buffer.items():
            values[slots[:arrived]] = incoming[name]
        if arrived < len(slots):  # the stream ended: drop the slots nothing refilled
            keep = np.ones(size, dtype=bool)
            keep[slots[arrived:]] = False
            buffer, size = {name: values[keep] for name, values in buffer.items()}, int(keep.sum())
            break
    order = rng.permutation(size)
    for at in range(0, size, batch_size):
        yield {name: values[order[at : at + batch_size]] for name, values in buffer.items()}


@dataclass
class TrainShard:
    """What Ray Train hands each rank for "train": the split's layout and the rank; the rows come per epoch.

    `stream` is the rank's reader of the coming epochs, made on first use in the worker (never pickled).
    """

    source: SplitSource
    rank: int
    world_size: int
    execution_options: ExecutionOptions
    stream: _TrainStream | None = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "stream": None}


def host_batches(shard: TrainShard, config: TrainConfig, epoch: int, earlier_parts=()) -> Iterable[dict]:
    """This rank's batches of `epoch` as host tensors, images still uint8 (the worker's DeviceFeed finishes them).

    `earlier_parts`: the (world size, optimizer steps) of the epoch trained before a world-size change; the
    rank then reads its share of the rows they did not train (:func:`rest_of_epoch_pieces`)."""
    if not isinstance(shard, TrainShard):  # a plug-in's dataset, already split (and reshuffled) by Ray Data
        return shard.iter_torch_batches(batch_size=config.batch_size)
    seed = shuffle_seed(config.seed, epoch, shard.rank, len(earlier_parts))
    if shard.source.chunks:
        pieces = train_pieces(shard, config, epoch, earlier_parts)
        return _to_torch(_in_memory_batches(shard.source, pieces, config.batch_size, seed))
    # A new stream for the first epoch, a jump, one left half read, or the rest of a resized epoch
    if shard.stream is None or shard.stream.next_epoch != epoch or earlier_parts:
        if shard.stream is not None:
            shard.stream.close()
        shard.stream = _TrainStream(shard, config, epoch, earlier_parts)
    shard.stream.next_epoch = None
    return _to_torch(shard.stream.epoch(epoch, config.batch_size, seed))


def train_pieces(shard: TrainShard, config: TrainConfig, epoch: int, earlier_parts=()) -> list[tuple[int, int, int]]:
    """The rank's pieces of `epoch`, in order: its shard of the epoch, or of its rest after `earlier_parts`."""
    unit_rows = shard.source.unit_rows
    if earlier_parts:
        in_memory = bool(shard.source.chunks)
        return rest_of_epoch_pieces(unit_rows, config, epoch, shard.rank, shard.world_size, earlier_parts, in_memory)
    return epoch_pieces(unit_rows, config.seed, epoch, shard.rank, shard.world_size)


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
    parts = list(_read_pieces(source, pieces))
    rows = {name: np.concatenate([part[name] for part in parts]) for name in ("id", "x", "y")}
    order = np.random.default_rng(shuffle_seed).permutation(len(rows["y"]))
    for at in range(0, len(order), batch_size):
        taken = order[at : at + batch_size]
        yield {name: values[taken] for name, values in rows.items()}


def _built_in_source(config: TrainConfig, spec: DataSpec, ids: np.ndarray) -> SplitSource:
    """Chunks generated and normalised once, here, into the object store (a task per chunk would
    start a process each, on the cores the worker group is starting on)."""
    pieces = [ids[at : at + ROWS_PER_CHUNK] for at in range(0, len(ids), ROWS_PER_CHUNK)]
    generate = synthetic.GENERATORS[config.dataset]
    return SplitSource(
        spec,
        tuple(len(piece) for piece in pieces),
        chunks=tuple(ray.put(to_model_inputs(generate(piece, config.seed), spec)) for piece in pieces),
    )


def _parquet_source(spec: DataSpec, uris: Sequence[str]) -> SplitSource:
    """Every row group of the files, in order, from their footers."""
    row_groups, unit_rows, schemas = [], [], []
    for uri in uris:
        location = paths.resolve(uri)
        with location.filesystem.open_input_file(location.path) as file:
            metadata = pq.ParquetFile(file).metadata
        schemas.append(metadata.schema)
        for index in range(metadata.num_row_groups):
            if metadata.row_group(index).num_rows:
                row_groups.append((uri, index))
                unit_rows.append(metadata.row_group(index).num_rows)
    with_id = ["id"] if "id" in schemas[0].names else []
    return SplitSource(spec, tuple(unit_rows), row_groups=tuple(row_groups), columns=tuple(_columns(spec) + with_id))


def build_datasets(config: TrainConfig, plan: DataPlan) -> dict[str, SplitSource | ray.data.Dataset]:
    """What Ray Train gets as `datasets`: the layout of each split; ShardingDataConfig hands it to every rank.

    A --dataset plug-in's own Ray Datasets are shuffled globally (a new seed each
    execution, i.e. each epoch) and split by Ray Data's streaming_split instead.
    """
    if plan.plugin_datasets:
        shuffle_seed = RandomSeedConfig(seed=config.seed, reseed_after_execution=True)
        return {
            "train": plan.plugin_datasets["train"].random_shuffle(seed=shuffle_seed),
            "val": plan.plugin_datasets["val"],
        }
    if plan.train_paths:
        return {
            "train": _parquet_source(plan.spec, plan.train_paths),
            "val": _parquet_source(plan.spec, plan.val_paths),
        }
    train_ids, val_ids = synthetic.split_ids(config.train_size, config.val_size)
    return {
        "train": _built_in_source(config, plan.spec, train_ids),
        "val": _built_in_source(config, plan.spec, val_ids),
    }


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
        # Ray Train calls this once per dataset name and hands rank r shards[r][name]:
        # for train what host_batches needs, for val an iterator over the rank's own fixed rows.
        shards = [{} for _ in range(world_size)]
        for name, source in datasets.items():
            options = copy.deepcopy(self.options)  # a copy per dataset, as DataConfig.configure makes
            if isinstance(source, ray.data.Dataset):  # a plug-in's pipeline: equal train shards, exact val
                source = source.copy(source)
                source.context.execution_options = options
                for rank, split in enumerate(source.streaming_split(world_size, equal=name == "train")):
                    shards[rank][name] = split
                continue
            for rank in range(world_size):
                if name == "train":
                    shards[rank][name] = TrainShard(source, rank, world_size, options)
                else:
                    pieces = val_pieces(source.unit_rows, rank, world_size)
                    dataset = _tasks_dataset(source, [[(*piece, None)] for piece in pieces], normalise=False)
                    dataset.context.execution_options = options
                    shards[rank][name] = ValShard(dataset.iterator(), val_rows_per_rank(source.unit_rows, world_size))
        return shards


@dataclass
class ValShard:
    """What Ray Train hands each rank for "val": an iterator over the rank's fixed rows (images as uint8, which
    the worker's DeviceFeed finishes as it does training's) and every rank's row count, so that FSDP's lockstep
    knows the most batches any rank holds without reading them first."""

    iterator: ray.data.DataIterator
    rows_per_rank: tuple[int, ...]


def val_rows_per_rank(unit_rows: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The rows `val_pieces` gives each rank."""
    rows = sum(unit_rows)
    return tuple((r + 1) * rows // world_size - r * rows // world_size for r in range(world_size))


def val_batches(shard: ValShard | ray.data.DataIterator, batch_size: int) -> tuple[Iterable[dict], int | None]:
    """This rank's val batches as host tensors, and the most batches any rank has (None for a plug-in's split,
    whose lengths are known only once read)."""
    if isinstance(shard, ValShard):
        most = max(-(-rows // batch_size) for rows in shard.rows_per_rank)
        return shard.iterator.iter_torch_batches(batch_size=batch_size), most
    return shard.iter_torch_batches(batch_size=batch_size), None
