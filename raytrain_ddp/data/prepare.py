"""Converters from common sources into the raytrain_ddp dataset format (see `format`).

Every converter writes into a staging directory next to `out` and renames it
into place at the end, so a crash or Ctrl-C never leaves a half-written
dataset at `out`.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from PIL import Image, ImageOps, UnidentifiedImageError

from raytrain_ddp.data.format import (
    DEFAULT_ROW_GROUP_SIZE,
    DEFAULT_ROWS_PER_FILE,
    ID_COLUMN,
    INFO_FILENAME,
    LABEL_COLUMN,
    DatasetInfo,
    image_schema,
    read_info,
    schema_metadata,
    set_file_metadata,
    write_info,
    write_split,
)
from raytrain_ddp.data.paths import one_line
from raytrain_ddp.data.progress import Progress
from raytrain_ddp.errors import ConfigError

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg")
GRAYSCALE_MODES = frozenset({"1", "L", "LA"})
CIFAR10_TRAIN_BATCHES = tuple(f"data_batch_{index}" for index in range(1, 6))
CIFAR10_FILES = (*CIFAR10_TRAIN_BATCHES, "test_batch", "batches.meta")
ENCODE_BATCH_ROWS = 256  # rows encoded per record batch: bounds memory for large images
JPEG_QUALITY = 95
STATS_BLOCK_PIXELS = 2**20  # bounds the int64 copy PixelStats makes


# ---------------------------------------------------------------- shared pieces


class PixelStats:
    """Exact per-channel mean/std of uint8 pixels, accumulated batch by batch."""

    def __init__(self, channels: int) -> None:
        self._sum = [0] * channels
        self._sum_of_squares = [0] * channels
        self._count = 0

    def add(self, pixels: np.ndarray) -> None:
        """Add images shaped (..., H, W, C); integer sums keep the result exact."""
        flat = pixels.reshape(-1, pixels.shape[-1])
        for start in range(0, len(flat), STATS_BLOCK_PIXELS):
            block = flat[start : start + STATS_BLOCK_PIXELS].astype(np.int64)
            for channel, (total, squares) in enumerate(
                zip(block.sum(axis=0), (block * block).sum(axis=0), strict=True)
            ):
                self._sum[channel] += int(total)
                self._sum_of_squares[channel] += int(squares)
        self._count += len(flat)

    def mean_std(self) -> tuple[list[float], list[float]]:
        """Mean and std per channel on the 0..1 scale."""
        if not self._count:
            return [0.0] * len(self._sum), [0.0] * len(self._sum)
        means = [total / self._count for total in self._sum]
        variances = [
            squares / self._count - mean * mean for squares, mean in zip(self._sum_of_squares, means, strict=True)
        ]
        return [mean / 255 for mean in means], [max(var, 0.0) ** 0.5 / 255 for var in variances]


def split_by_class(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) row indices: per class, round(n * val_fraction) rows go to val.

    Each class is shuffled by its own generator seeded with (seed, label), so the
    split is reproducible and one class's size does not move another's split.
    Val is sorted; train comes in a seeded random order, so that rows sorted by
    class on input are mixed in every row group (training shuffles whole row
    groups per epoch and mixes rows only within a small window).
    """
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"val fraction must be in [0, 1), got {val_fraction}")
    if seed < 0:
        raise ConfigError(f"seed must be >= 0, got {seed}")
    val_parts = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        val_count = min(len(members) - 1, round(len(members) * val_fraction))
        shuffled = np.random.default_rng([seed, int(label)]).permutation(members)
        val_parts.append(shuffled[:val_count])
    val = np.sort(np.concatenate(val_parts)) if val_parts else np.array([], np.int64)
    # a spawn key no per-class generator has: the train order is a stream of its own
    train_order = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,)))
    train = train_order.permutation(np.setdiff1d(np.arange(len(labels)), val))
    return train, val


def _check_output(out: str, overwrite: bool) -> None:
    """Refuse an existing non-empty `out` unless overwrite is set and it is a dataset."""
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out):
        raise ConfigError(f"output path {out} exists and is not a directory; choose another --out")
    if not os.listdir(out):
        return
    if not overwrite:
        raise ConfigError(f"output directory {out} is not empty; pass --overwrite to replace it")
    if not os.path.isfile(os.path.join(out, INFO_FILENAME)):
        raise ConfigError(f"refusing to overwrite {out}: it is not empty and holds no {INFO_FILENAME}")


@contextmanager
def _staging_directory(out: str, overwrite: bool) -> Iterator[str]:
    """Yield a fresh directory next to `out` (same filesystem, so renames are cheap).

    On success it is renamed to `out` (a previous dataset there is moved aside
    first, then deleted); on failure it is deleted and `out` is left untouched.
    """
    out = os.path.abspath(os.path.expanduser(out))
    _check_output(out, overwrite)
    parent, name = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    staging = os.path.join(parent, f".{name}.tmp-{token}")
    os.mkdir(staging)  # not mkdtemp: its 0700 mode would hide the dataset from other users/nodes
    try:
        yield staging
        _check_output(out, overwrite)  # again: something may have appeared meanwhile
        previous = None
        if os.path.isdir(out):
            previous = os.path.join(parent, f".{name}.old-{token}")
            os.rename(out, previous)
        os.rename(staging, out)
        if previous:
            shutil.rmtree(previous)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _write_dataset(
    out: str,
    info: DatasetInfo,
    schema: pa.Schema,
    train_batches: Iterator[pa.RecordBatch],
    val_batches: Callable[[], Iterator[pa.RecordBatch]],
    *,
    train_stats: PixelStats | None,
    overwrite: bool,
    rows_per_file: int,
    row_group_size: int,
) -> DatasetInfo:
    """Write both splits and dataset.json atomically; returns the written dataset's info.

    With `train_stats`, the train batches fill it while being written and
    info.mean/std are set from it afterwards; otherwise info must carry them.
    """
    layout = {"rows_per_file": rows_per_file, "row_group_size": row_group_size}
    with _staging_directory(out, overwrite) as staging:
        train_paths = write_split(
            os.path.join(staging, "train"), train_batches, schema.with_metadata(schema_metadata(info)), **layout
        )
        if train_stats is not None:
            info.mean, info.std = train_stats.mean_std()
            set_file_metadata(train_paths, info)
        write_split(os.path.join(staging, "val"), val_batches(), schema.with_metadata(schema_metadata(info)), **layout)
        write_info(staging, info)
    written = read_info(out)
    logger.info("wrote %s: %s train rows, %s val rows", written.path, info.rows["train"], info.rows["val"])
    return written


def _encode(image: Image.Image, encoding: str) -> bytes:
    buffer = io.BytesIO()
    if encoding == "jpeg":
        image.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    else:
        image.save(buffer, format="PNG")
    return buffer.getvalue()


# ---------------------------------------------------------------- in-memory arrays


def _to_nhwc(images: np.ndarray, layout: str | None) -> np.ndarray:
    """View images as N,H,W,C; 3-D input is grayscale N,H,W; layout None means auto-detect."""
    if images.dtype != np.uint8:
        raise ConfigError(f"images must be uint8, got {images.dtype}")
    if images.ndim == 3:
        return images[..., np.newaxis]
    if images.ndim != 4:
        raise ConfigError(f"images must have shape N,C,H,W or N,H,W,C, got {images.shape}")
    if layout is None:
        channels_first = images.shape[1] in (1, 3)
        channels_last = images.shape[3] in (1, 3)
        if channels_first == channels_last:
            raise ConfigError(f"cannot tell the layout of images shaped {images.shape}; pass layout='NCHW' or 'NHWC'")
        layout = "NCHW" if channels_first else "NHWC"
    if layout == "NCHW":
        return images.transpose(0, 2, 3, 1)
    if layout == "NHWC":
        return images
    raise ConfigError(f"layout must be 'NCHW' or 'NHWC', got {layout!r}")


def _check_labels(labels: np.ndarray, count: int, num_classes: int) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.shape != (count,):
        raise ConfigError(f"labels must have shape ({count},), got {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(f"labels must be integers, got {labels.dtype}")
    if count and (labels.min() < 0 or labels.max() >= num_classes):
        raise ConfigError(
            f"labels range {labels.min()}..{labels.max()} but there are {num_classes} classes "
            f"(allowed 0..{num_classes - 1})"
        )
    return labels.astype(np.int64)


def _array_batches(
    images: np.ndarray,
    labels: np.ndarray,
    indices: np.ndarray,
    schema: pa.Schema,
    encoding: str,
    stats: PixelStats | None,
    progress: Progress,
) -> Iterator[pa.RecordBatch]:
    for start in range(0, len(indices), ENCODE_BATCH_ROWS):
        chunk_indices = indices[start : start + ENCODE_BATCH_ROWS]
        chunk = images[chunk_indices]
        if stats is not None:
            stats.add(chunk)
        if encoding == "raw":
            flat = np.ascontiguousarray(chunk.transpose(0, 3, 1, 2)).reshape(-1)
            column = pa.FixedSizeListArray.from_arrays(pa.array(flat), schema.field("image").type.list_size)
        else:
            squeeze = chunk.shape[-1] == 1  # PIL wants H,W for grayscale
            column = pa.array(
                [_encode(Image.fromarray(image[..., 0] if squeeze else image), encoding) for image in chunk],
                pa.binary(),
            )
        progress.update(len(chunk_indices))
        yield pa.record_batch(
            [pa.array(chunk_indices, pa.int64()), pa.array(labels[chunk_indices]), column], schema=schema
        )


def _write_image_arrays(
    images_nhwc: np.ndarray,
    labels: np.ndarray,
    train_indices: np.ndarray,
    val_indices: np.ndarray,
    classes: Sequence[str],
    out: str,
    *,
    encoding: str,
    overwrite: bool,
    rows_per_file: int,
    row_group_size: int,
) -> DatasetInfo:
    if encoding not in ("png", "raw"):
        raise ConfigError(f"encoding for arrays must be 'png' or 'raw', got {encoding!r}")
    _, height, width, channels = images_nhwc.shape
    if channels not in (1, 3):
        raise ConfigError(f"images must have 1 or 3 channels, got {channels}")
    image_shape = (channels, height, width)
    info = DatasetInfo(
        path=out,
        kind="image",
        classes=list(classes),
        num_classes=len(classes),
        rows={"train": len(train_indices), "val": len(val_indices)},
        image_shape=image_shape,
        encoding=encoding,
    )
    schema = image_schema(encoding, image_shape)
    stats = PixelStats(channels)
    with Progress(len(labels), f"encoding {out}") as progress:
        return _write_dataset(
            out,
            info,
            schema,
            _array_batches(images_nhwc, labels, train_indices, schema, encoding, stats, progress),
            lambda: _array_batches(images_nhwc, labels, val_indices, schema, encoding, None, progress),
            train_stats=stats,
            overwrite=overwrite,
            rows_per_file=rows_per_file,
            row_group_size=row_group_size,
        )


def from_arrays(
    images: np.ndarray,
    labels: np.ndarray,
    classes: Sequence[str],
    out: str,
    *,
    val_fraction: float = 0.1,
    seed: int = 0,
    layout: str | None = None,
    encoding: str = "png",
    overwrite: bool = False,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
) -> DatasetInfo:
    """Write uint8 images (N,C,H,W, N,H,W,C or grayscale N,H,W) as an image dataset.

    ids are the row indices into `images`; the split is `split_by_class`.
    encoding "png" stores PNG bytes, "raw" stores C,H,W pixels (no decode cost).
    """
    images_nhwc = _to_nhwc(np.asarray(images), layout)
    labels = _check_labels(labels, len(images_nhwc), len(classes))
    train_indices, val_indices = split_by_class(labels, val_fraction, seed)
    return _write_image_arrays(
        images_nhwc,
        labels,
        train_indices,
        val_indices,
        classes,
        out,
        encoding=encoding,
        overwrite=overwrite,
        rows_per_file=rows_per_file,
        row_group_size=row_group_size,
    )


# ---------------------------------------------------------------- CIFAR-10


def _load_pickle(path: str) -> dict:
    try:
        with open(path, "rb") as file:
            return pickle.load(file, encoding="bytes")
    except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        raise ConfigError(f"cannot read CIFAR-10 batch {path}: {one_line(exc)}") from exc


def _cifar10_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    batch = _load_pickle(path)
    try:
        data = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path} is not a CIFAR-10 python batch (needs b'data' N x 3072 and b'labels')") from exc
    return data, labels


def from_cifar10(
    directory: str,
    out: str,
    overwrite: bool = False,
    *,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
) -> DatasetInfo:
    """Convert the CIFAR-10 python batches (cifar-10-batches-py) to PNG rows.

    train = data_batch_1..5 (ids 0..49999), val = test_batch (ids 50000..).
    The batches are pickles: only convert files from a source you trust.
    """
    directory = os.path.expanduser(directory)
    missing = [name for name in CIFAR10_FILES if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise ConfigError(
            f"{directory} is not a CIFAR-10 python directory: missing {', '.join(missing)} "
            "(expected data_batch_1..5, test_batch, batches.meta from cifar-10-python.tar.gz)"
        )
    meta_path = os.path.join(directory, "batches.meta")
    try:
        classes = [name.decode() for name in _load_pickle(meta_path)[b"label_names"]]
    except (KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{meta_path} lacks b'label_names'") from exc
    batches = [_cifar10_batch(os.path.join(directory, name)) for name in (*CIFAR10_TRAIN_BATCHES, "test_batch")]
    images = _to_nhwc(np.concatenate([data for data, _ in batches]), "NCHW")
    labels = _check_labels(np.concatenate([labels for _, labels in batches]), len(images), len(classes))
    train_count = sum(len(labels) for _, labels in batches[:-1])
    return _write_image_arrays(
        images,
        labels,
        np.arange(train_count),
        np.arange(train_count, len(images)),
        classes,
        out,
        encoding="png",
        overwrite=overwrite,
        rows_per_file=rows_per_file,
        row_group_size=row_group_size,
    )


# ---------------------------------------------------------------- ImageFolder


@dataclass(frozen=True)
class _ImagePlan:
    """What every stored image looks like: decisions made from the header scan."""

    mode: str  # PIL mode: "L" or "RGB"
    size: tuple[int, int]  # PIL (width, height)
    encoding: str  # "png" or "jpeg"
    resize: bool

    @property
    def shape(self) -> tuple[int, int, int]:
        return (1 if self.mode == "L" else 3, self.size[1], self.size[0])


def _list_imagefolder(root: str) -> tuple[list[str], np.ndarray, list[str]]:
    """Image files in sorted (class, file name) order, their labels, and the sorted class names."""
    if not os.path.isdir(root):
        raise ConfigError(f"image folder does not exist or is not a directory: {root}")
    classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
    if not classes:
        raise ConfigError(f"{root} has no class subdirectories; expected ROOT/CLASS_NAME/*.png|*.jpg")
    files: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        class_dir = os.path.join(root, name)
        class_files = sorted(
            entry.path
            for entry in os.scandir(class_dir)
            if entry.is_file() and entry.name.lower().endswith(IMAGE_EXTENSIONS) and not entry.name.startswith(".")
        )
        if not class_files:
            raise ConfigError(f"class folder {class_dir} has no images ({', '.join(IMAGE_EXTENSIONS)})")
        files += class_files
        labels += [label] * len(class_files)
    return files, np.array(labels, np.int64), classes


def _plan_images(files: Sequence[str], image_size: int | None) -> _ImagePlan:
    """Read every image header (no decoding) to choose mode, size and encoding."""
    formats, modes = set(), set()
    first_size: tuple[str, tuple[int, int]] | None = None
    with Progress(len(files), "scanning image headers") as progress:
        for path in files:
            try:
                with Image.open(path) as image:
                    formats.add(image.format)
                    modes.add(image.mode)
                    size = image.size
            except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
                raise ConfigError(f"cannot read image {path}: {one_line(exc)}") from exc
            if first_size is None:
                first_size = (path, size)
            elif image_size is None and size != first_size[1]:
                raise ConfigError(
                    f"images differ in size ({first_size[0]} is {first_size[1][0]}x{first_size[1][1]}, "
                    f"{path} is {size[0]}x{size[1]}); pass --image-size to resize them all"
                )
            progress.update()
    assert first_size is not None  # _list_imagefolder guarantees at least one file
    mode = "L" if modes <= GRAYSCALE_MODES else "RGB"
    # Keep JPEG sources as JPEG: re-encoding photos as PNG would multiply their size.
    encoding = "jpeg" if image_size is None and formats == {"JPEG"} else "png"
    size = (image_size, image_size) if image_size else first_size[1]
    return _ImagePlan(mode=mode, size=size, encoding=encoding, resize=image_size is not None)


def _load_image(path: str, plan: _ImagePlan, stats: PixelStats | None) -> bytes:
    """The bytes to store for one image file: the file itself unless it must change."""
    with open(path, "rb") as file:
        data = file.read()
    try:
        original = Image.open(io.BytesIO(data))
        original.load()
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise ConfigError(f"cannot decode image {path}: {one_line(exc)}") from exc
    image = original if original.mode == plan.mode else original.convert(plan.mode)
    if plan.resize and image.size != plan.size:
        # Scale the shorter side and centre-crop, so aspect ratio is preserved.
        image = ImageOps.fit(image, plan.size, Image.Resampling.BICUBIC)
    if stats is not None:
        pixels = np.asarray(image)
        stats.add(pixels[..., np.newaxis] if pixels.ndim == 2 else pixels)
    if image is original and original.format.lower() == plan.encoding:
        return data
    return _encode(image, plan.encoding)


def _imagefolder_batches(
    files: Sequence[str],
    labels: np.ndarray,
    indices: np.ndarray,
    schema: pa.Schema,
    plan: _ImagePlan,
    stats: PixelStats | None,
    progress: Progress,
) -> Iterator[pa.RecordBatch]:
    for start in range(0, len(indices), ENCODE_BATCH_ROWS):
        chunk_indices = indices[start : start + ENCODE_BATCH_ROWS]
        encoded = [_load_image(files[index], plan, stats) for index in chunk_indices]
        progress.update(len(chunk_indices))
        yield pa.record_batch(
            [pa.array(chunk_indices, pa.int64()), pa.array(labels[chunk_indices]), pa.array(encoded, pa.binary())],
            schema=schema,
        )


def from_imagefolder(
    root: str,
    out: str,
    val_fraction: float = 0.1,
    seed: int = 0,
    image_size: int | None = None,
    overwrite: bool = False,
    *,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
) -> DatasetInfo:
    """Convert ROOT/CLASS_NAME/*.png|*.jpg|*.jpeg into a dataset at `out`.

    Classes are the sorted subdirectory names; ids number the files in sorted
    (class, file name) order. Without `image_size` all images must share one
    size; with it each is scaled and centre-cropped to image_size x image_size.
    Files are stored byte-for-byte when already in the dataset's mode, size and
    encoding (PNG, or JPEG when every source is JPEG), otherwise re-encoded.
    Channels: 1 if every image is grayscale, else 3 (alpha is dropped).
    """
    if image_size is not None and image_size < 1:
        raise ConfigError(f"image size must be >= 1, got {image_size}")
    root = os.path.expanduser(root)
    files, labels, classes = _list_imagefolder(root)
    train_indices, val_indices = split_by_class(labels, val_fraction, seed)
    _check_output(os.path.abspath(os.path.expanduser(out)), overwrite)  # fail before the long scan
    plan = _plan_images(files, image_size)
    info = DatasetInfo(
        path=out,
        kind="image",
        classes=classes,
        num_classes=len(classes),
        rows={"train": len(train_indices), "val": len(val_indices)},
        image_shape=plan.shape,
        encoding=plan.encoding,
    )
    schema = image_schema(plan.encoding, plan.shape)
    stats = PixelStats(plan.shape[0])
    with Progress(len(files), f"converting {root}") as progress:
        return _write_dataset(
            out,
            info,
            schema,
            _imagefolder_batches(files, labels, train_indices, schema, plan, stats, progress),
            lambda: _imagefolder_batches(files, labels, val_indices, schema, plan, None, progress),
            train_stats=stats,
            overwrite=overwrite,
            rows_per_file=rows_per_file,
            row_group_size=row_group_size,
        )


# ---------------------------------------------------------------- tabular


def write_tabular(
    features: Mapping[str, np.ndarray],
    labels: np.ndarray,
    out: str,
    *,
    classes: Sequence[str] | None = None,
    val_fraction: float = 0.1,
    seed: int = 0,
    overwrite: bool = False,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
) -> DatasetInfo:
    """Write 1-D numeric feature columns and integer labels as a tabular dataset.

    Column order follows `features`; mean/std are per feature over the train
    split. `classes` defaults to "0".."max label".
    """
    if not features:
        raise ConfigError("tabular data needs at least one feature column")
    reserved = {ID_COLUMN, LABEL_COLUMN} & set(features)
    if reserved:
        raise ConfigError(f"feature columns may not be named {', '.join(sorted(reserved))}")
    columns = {name: np.asarray(values) for name, values in features.items()}
    count = len(np.asarray(labels))
    for name, values in columns.items():
        if values.shape != (count,) or not (np.issubdtype(values.dtype, np.number) or values.dtype == bool):
            raise ConfigError(
                f"feature {name!r} must be a numeric array of shape ({count},), got {values.dtype} {values.shape}"
            )
    if classes is None:
        classes = [str(label) for label in range(int(np.max(labels)) + 1 if count else 0)]
    labels = _check_labels(labels, count, len(classes))
    train_indices, val_indices = split_by_class(labels, val_fraction, seed)
    train_features = np.stack([values[train_indices].astype(np.float64) for values in columns.values()], axis=1)
    info = DatasetInfo(
        path=out,
        kind="tabular",
        classes=list(classes),
        num_classes=len(classes),
        rows={"train": len(train_indices), "val": len(val_indices)},
        feature_columns=list(columns),
        mean=train_features.mean(axis=0).tolist() if len(train_indices) else [0.0] * len(columns),
        std=train_features.std(axis=0).tolist() if len(train_indices) else [0.0] * len(columns),
    )
    table = pa.table({ID_COLUMN: pa.array(np.arange(count), pa.int64()), LABEL_COLUMN: pa.array(labels), **columns})

    def batches(indices: np.ndarray) -> Iterator[pa.RecordBatch]:
        yield from table.take(pa.array(indices, pa.int64())).to_batches(max_chunksize=ENCODE_BATCH_ROWS)

    return _write_dataset(
        out,
        info,
        table.schema,
        batches(train_indices),
        lambda: batches(val_indices),
        train_stats=None,
        overwrite=overwrite,
        rows_per_file=rows_per_file,
        row_group_size=row_group_size,
    )


def from_csv(
    path: str,
    out: str,
    label_column: str,
    val_fraction: float = 0.1,
    seed: int = 0,
    overwrite: bool = False,
    *,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
) -> DatasetInfo:
    """Convert a CSV file (read into memory) with a header row into a tabular dataset.

    Every column except `label_column` must be numeric. Integer labels are used
    as they are; string labels become classes in sorted order.
    """
    try:
        table = pacsv.read_csv(os.path.expanduser(path))
    except (OSError, pa.ArrowInvalid) as exc:
        raise ConfigError(f"cannot read CSV {path}: {one_line(exc)}") from exc
    if label_column not in table.column_names:
        raise ConfigError(f"no column {label_column!r} in {path}; columns: {', '.join(table.column_names)}")
    label_values = table.column(label_column)
    if label_values.null_count:
        raise ConfigError(f"column {label_column!r} in {path} has {label_values.null_count} empty values")
    classes = None
    if pa.types.is_integer(label_values.type):
        labels = label_values.to_numpy()
    else:
        as_text = pc.cast(label_values, pa.string())
        classes = sorted(set(as_text.to_pylist()))
        labels = pc.index_in(as_text, pa.array(classes)).to_numpy().astype(np.int64)
    features = {}
    for name in table.column_names:
        if name == label_column:
            continue
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
            raise ConfigError(f"column {name!r} in {path} has type {column.type}; feature columns must be numeric")
        if column.null_count:
            raise ConfigError(f"column {name!r} in {path} has {column.null_count} empty values")
        features[name] = column.to_numpy()
    return write_tabular(
        features,
        labels,
        out,
        classes=classes,
        val_fraction=val_fraction,
        seed=seed,
        overwrite=overwrite,
        rows_per_file=rows_per_file,
        row_group_size=row_group_size,
    )
