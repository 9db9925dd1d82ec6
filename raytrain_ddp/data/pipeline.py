"""Ray Data pipelines that feed the training workers (runs on the driver).

Train and val datasets flow through the same steps: a source of rows (Parquet
files read with ``ray.data.read_parquet``, or the built-in generated data), a
per-epoch global shuffle (train only), and a CPU transform in ``map_batches``
(decode, augment for train, normalise) to ``{"id", "x", "y"}``. All of it runs
in Ray Data tasks, outside the training step, and Ray Train prefetches
batches, so a GPU worker does not wait on decode.

:class:`ShardingDataConfig` then splits each epoch, DistributedSampler-style:

* train: ``streaming_split(equal=True)``: each rank gets a disjoint, equally
  sized shard, so every rank runs the same number of steps and DDP never waits
  on an all-reduce one rank does not join. Up to ``world_size - 1`` rows of an
  epoch are left out to make the shards equal (which ones changes per epoch).
* val: ``equal=False``: every row is evaluated exactly once, on some rank;
  the worker then all-reduces the sums so every rank holds the same numbers.

The shuffle is seeded with ``RandomSeedConfig(seed, reseed_after_execution=True)``
and order is preserved, so each epoch has a new order, and a second run with
the same seed repeats the first, epoch by epoch.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import ray
import ray.data
from ray.data import RandomSeedConfig
from ray.train import DataConfig

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data import synthetic
from raytrain_ddp.data.format import decode_images
from raytrain_ddp.data.validate import check_dataset
from raytrain_ddp.errors import ConfigError
from raytrain_ddp.plugins import call_plugin

log = logging.getLogger("raytrain_ddp")

ROWS_PER_BLOCK = 1024
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


# ------------------------------------------------------------------ transform
def augment_images(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random crop (after reflection padding) and horizontal flip, per image."""
    _, _, height, width = images.shape
    padded = np.pad(images, ((0, 0), (0, 0), (CROP_PADDING,) * 2, (CROP_PADDING,) * 2), mode="reflect")
    out = np.empty_like(images)
    for i, (top, left, flip) in enumerate(zip(rng.integers(0, 2 * CROP_PADDING + 1, len(images)),
                                              rng.integers(0, 2 * CROP_PADDING + 1, len(images)),
                                              rng.random(len(images)) < 0.5)):
        crop = padded[i, :, top:top + height, left:left + width]
        out[i] = crop[:, :, ::-1] if flip else crop
    return out


def to_model_inputs(rows: dict[str, np.ndarray], spec: DataSpec, augment_seed: int | None = None) -> dict[str, np.ndarray]:
    """Rows as stored -> ``{"id", "x", "y"}`` as the model takes them.

    `augment_seed` (train only) turns on random crop and flip, drawn from the
    seed and the batch's first id, so an epoch's augmentation is reproducible.
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
        scale = np.asarray(spec.std, dtype=np.float32).reshape(1, -1, 1, 1)
        shift = np.asarray(spec.mean, dtype=np.float32).reshape(1, -1, 1, 1)
        x = (images.astype(np.float32) / 255.0 - shift) / scale
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
        return DataSpec("image", synthetic.IMAGE_SHAPE, synthetic.NUM_CLASSES, config.train_size,
                        config.val_size, mean=(0.5,) * 3, std=(0.25,) * 3)
    if config.dataset == "synthetic-tokens":
        return DataSpec("tokens", (synthetic.SEQUENCE_LENGTH,), synthetic.VOCAB_SIZE, config.train_size, config.val_size)
    return DataSpec("tabular", (len(synthetic.FEATURE_NAMES),), synthetic.NUM_CLASSES, config.train_size,
                    config.val_size, feature_columns=synthetic.FEATURE_NAMES)


@dataclass(frozen=True)
class DataPlan:
    """The data a run will read: its spec, and the Parquet files or a plug-in's datasets (neither for built-in data)."""

    spec: DataSpec
    train_paths: tuple[str, ...] = ()
    val_paths: tuple[str, ...] = ()
    plugin_datasets: dict | None = None  # {"train", "val"}: Ray Datasets of model-ready rows {x, y[, id]}


def plugin_plan(config: TrainConfig, dataset_fn, label: str) -> DataPlan:
    """Call a dataset plug-in (Ray is up) and check what it returned; raises ConfigError."""
    flag = f"--dataset {label}"
    datasets = call_plugin(dataset_fn, "--dataset", label, config)
    if not (isinstance(datasets, dict) and set(datasets) >= {"train", "val"}
            and all(isinstance(datasets[name], ray.data.Dataset) for name in ("train", "val"))):
        raise ConfigError(f"{flag} returned {type(datasets).__name__}, expected "
                          "{'train': ray.data.Dataset, 'val': ray.data.Dataset}")
    sample = call_plugin(lambda: datasets["train"].take_batch(256, batch_format="numpy"), "--dataset", label)
    missing = {"x", "y"} - set(sample)
    if missing:
        raise ConfigError(f"{flag}: training rows lack column(s) {', '.join(sorted(missing))}; "
                          f"they hold {', '.join(sorted(sample))}")
    labels = sample["y"]
    num_classes = int(datasets["train"].max("y")) + 1 if labels.ndim == 1 else int(labels.max()) + 1
    spec = DataSpec("custom", tuple(sample["x"].shape[1:]), num_classes, datasets["train"].count(),
                    datasets["val"].count())
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
    info = check_dataset(config.data or config.train_data.split(","),
                         None if config.data else config.val_data.split(","),
                         image_column=config.image_column, label_column=config.label_column,
                         feature_columns=feature_columns)
    if not info.val_paths:
        raise ConfigError(f"no validation data found for {info.path}: give --val-data or a val/ split")
    if info.kind == "image":
        mean, std = info.mean, info.std
        if not mean:
            log.warning("No normalisation statistics in %s: using mean 0.5, std 0.25 per channel "
                        "(`python -m raytrain_ddp.data prepare` records them)", info.path)
            mean, std = [0.5] * info.image_shape[0], [0.25] * info.image_shape[0]
        spec = DataSpec("image", tuple(info.image_shape), info.num_classes, info.rows["train"], info.rows["val"],
                        mean=tuple(mean), std=tuple(std), image_column=config.image_column,
                        label_column=config.label_column, encoding=info.encoding)
    else:
        spec = DataSpec("tabular", (len(info.feature_columns),), info.num_classes, info.rows["train"],
                        info.rows["val"], mean=tuple(info.mean or ()), std=tuple(info.std or ()),
                        label_column=config.label_column, feature_columns=tuple(info.feature_columns))
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
def _synthetic_source(config: TrainConfig, ids: np.ndarray) -> ray.data.Dataset:
    generate = synthetic.GENERATORS[config.dataset]
    seed, first_id = config.seed, int(ids[0])  # ids are contiguous: train 0..n-1, val after them
    return ray.data.range(len(ids), override_num_blocks=max(1, len(ids) // ROWS_PER_BLOCK)).map_batches(
        lambda batch: generate(batch["id"] + first_id, seed), batch_size=None
    ).materialize()  # generated once, shuffled and transformed every epoch


def shuffled_each_epoch(dataset: ray.data.Dataset, config: TrainConfig) -> ray.data.Dataset:
    """A new order every epoch (each execution), the same sequence of orders for the same seed."""
    return dataset.random_shuffle(seed=RandomSeedConfig(seed=config.seed, reseed_after_execution=True))


def build_datasets(config: TrainConfig, plan: DataPlan) -> dict[str, ray.data.Dataset]:
    """The train and val Ray Datasets that `plan` describes."""
    spec = plan.spec
    if plan.plugin_datasets:  # already model-ready: only the per-epoch shuffle is ours
        return {"train": shuffled_each_epoch(plan.plugin_datasets["train"], config),
                "val": plan.plugin_datasets["val"]}
    if plan.train_paths:
        with_id = _columns(spec) + (["id"] if "id" in pq.read_schema(plan.train_paths[0]).names else [])
        sources = {"train": ray.data.read_parquet(list(plan.train_paths), columns=with_id),
                   "val": ray.data.read_parquet(list(plan.val_paths), columns=with_id)}
    else:
        train_ids, val_ids = synthetic.split_ids(config.train_size, config.val_size)
        sources = {"train": _synthetic_source(config, train_ids), "val": _synthetic_source(config, val_ids)}
    augment_seed = config.seed if spec.kind == "image" and spec.encoding != "array" else None
    datasets = {
        "train": shuffled_each_epoch(sources["train"], config).map_batches(
            to_model_inputs, fn_kwargs={"spec": spec, "augment_seed": augment_seed}, batch_format="numpy"),
        "val": sources["val"].map_batches(to_model_inputs, fn_kwargs={"spec": spec}, batch_format="numpy"),
    }
    return datasets


class ShardingDataConfig(DataConfig):
    """Equal train shards (no DDP hang), exact val shards (no row lost or repeated)."""

    def __init__(self) -> None:
        options = DataConfig.default_ingest_options()
        options.preserve_order = True  # deterministic shard assignment from the seed
        super().__init__(datasets_to_split=["train", "val"], execution_options=options)

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        # Ray Train calls this once per dataset name.
        shards = [{} for _ in range(world_size)]
        for name, dataset in datasets.items():
            dataset = dataset.copy(dataset)
            dataset.context.execution_options = self._resolve_execution_options(name)
            for rank, split in enumerate(dataset.streaming_split(world_size, equal=name == "train")):
                shards[rank][name] = split
        return shards
