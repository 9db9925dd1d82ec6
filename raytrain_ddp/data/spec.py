"""What a run's data is, decided on the driver before Ray starts (the Parquet footers and a sample, the built-in
datasets' shapes, a plug-in's columns), and the per-row transform from stored rows to model inputs. Plain values
only: the spec travels to every Ray Data task and training worker."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pyarrow.parquet as pq
import ray.data

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data import synthetic
from raytrain_ddp.data.format import decode_images
from raytrain_ddp.data.validate import check_dataset
from raytrain_ddp.errors import ConfigError, named
from raytrain_ddp.plugins import call_plugin

log = logging.getLogger("raytrain_ddp")

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


def stored_columns(spec: DataSpec) -> list[str]:
    """The columns a row is read with: its inputs and its label."""
    inputs = [spec.image_column] if spec.kind == "image" else list(spec.feature_columns)
    return inputs + [spec.label_column]


def read_split_rows(config: TrainConfig, split: str) -> dict[str, np.ndarray]:
    """All rows of a split, in this process, without Ray (the evaluator uses this)."""
    if not config.uses_parquet:
        train_ids, val_ids = synthetic.split_ids(config.train_size, config.val_size)
        return synthetic.GENERATORS[config.dataset](train_ids if split == "train" else val_ids, config.seed)
    plan = plan_data(config)
    paths = plan.train_paths if split == "train" else plan.val_paths
    table = pq.ParquetDataset(list(paths)).read(columns=stored_columns(plan.spec))
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
