"""Driver-side checks of Parquet training data, run before any Ray worker starts.

`check_dataset` reads only Parquet footers plus the first image of each file,
so it stays fast on large datasets and on remote storage, and turns every
problem it finds into a one-line ConfigError naming the path or column.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from PIL import Image, UnidentifiedImageError

from raytrain_ddp.data.format import (
    IMAGE_COLUMN,
    INFO_FILENAME,
    LABEL_COLUMN,
    DatasetInfo,
    metadata_from_schema,
    read_info,
)
from raytrain_ddp.data.paths import Location, expand_glob, has_glob, list_files, one_line, resolve
from raytrain_ddp.errors import ConfigError, plural

logger = logging.getLogger(__name__)

PathSpec = str | Sequence[str]
MAX_PARALLEL_FILES = 16  # footers are latency-bound on object stores


@dataclass(frozen=True)
class _Columns:
    """Which columns hold what, decided from the first file's schema."""

    kind: str  # "image" or "tabular"
    label: str
    image: str | None = None
    raw_image_shape: tuple[int, ...] | None = None  # set when images are raw pixel lists
    features: tuple[str, ...] | None = None


@dataclass(frozen=True)
class _FileReport:
    uri: str
    rows: int
    label_min: int | None
    label_max: int | None
    image_shape: tuple[int, ...] | None
    image_encoding: str | None


def check_dataset(
    train: PathSpec,
    val: PathSpec | None = None,
    *,
    image_column: str = IMAGE_COLUMN,
    label_column: str = LABEL_COLUMN,
    feature_columns: Sequence[str] | None = None,
    num_classes: int | None = None,
) -> DatasetInfo:
    """Check training (and validation) Parquet data; return what the trainer needs.

    `train` and `val` are each a dataset directory (with train/ and val/
    subdirectories; then `val` defaults to its val/), a directory of .parquet
    files, a file, a glob such as /x/train-*.parquet, a URI (s3://...), or a
    list of these. Pass `feature_columns` for tabular data; otherwise images are
    expected in `image_column`. `num_classes` is the model's output size:
    labels must lie in 0..num_classes-1 (default: from the dataset metadata,
    else max label + 1).

    Returns a DatasetInfo whose train_paths/val_paths are every file found
    (local paths or URIs), rows counted from the footers, image_shape taken
    from decoded samples, and classes/mean/std from the metadata when the data
    was written by `prepare` (mean/std are None otherwise). Raises ConfigError.
    """
    root_info, train_files, val_files = _resolve_inputs(train, val)
    first = train_files[0]
    reference_schema, file_info = _reference(first, root_info)
    columns = _plan_columns(reference_schema, first.uri, file_info, image_column, label_column, feature_columns)
    reports = _check_files(train_files + val_files, columns, reference_schema, first.uri)
    train_reports, val_reports = reports[: len(train_files)], reports[len(train_files) :]

    rows = {"train": sum(r.rows for r in train_reports), "val": sum(r.rows for r in val_reports)}
    if not rows["train"]:
        raise ConfigError(f"the training data has no rows: {_describe(train)}")
    if root_info:
        _check_rows_match(root_info, rows)
    num_classes = _resolve_num_classes(num_classes, file_info, reports)
    _check_label_range(reports, num_classes)
    image_shape, encoding = _check_image_shapes(reports, file_info) if columns.kind == "image" else (None, None)

    classes = file_info.classes if file_info and len(file_info.classes) == num_classes else None
    return DatasetInfo(
        path=root_info.path if root_info else _describe(train),
        kind=columns.kind,
        classes=classes or [str(label) for label in range(num_classes)],
        num_classes=num_classes,
        rows=rows,
        image_shape=image_shape,
        encoding=encoding,
        feature_columns=list(columns.features) if columns.features is not None else None,
        mean=_stats_of(file_info, columns, "mean"),
        std=_stats_of(file_info, columns, "std"),
        train_paths=[location.uri for location in train_files],
        val_paths=[location.uri for location in val_files],
    )


def _reference(first: Location, root_info: DatasetInfo | None) -> tuple[pa.Schema, DatasetInfo | None]:
    """The first training file's schema, which every file must share, and the dataset's metadata: the root's
    dataset.json, else what `prepare` embedded in that file's schema (None: neither)."""
    with open_parquet(first) as parquet:
        reference_schema = parquet.schema_arrow
    if root_info is not None:
        return reference_schema, root_info
    embedded = metadata_from_schema(reference_schema)
    info = None if embedded is None else DatasetInfo.from_metadata(embedded, source=first.uri, path=first.uri)
    return reference_schema, info


def _check_files(files: list[Location], columns: _Columns, reference_schema: pa.Schema, first_uri: str) -> list:
    """Every file's footer and sample checked, several at a time (remote files wait on the network)."""
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_FILES, len(files))) as pool:
        return list(pool.map(lambda location: _check_file(location, columns, reference_schema, first_uri), files))


def _stats_of(file_info: DatasetInfo | None, columns: _Columns, which: str) -> list[float] | None:
    """The dataset's recorded mean or std, per feature of this run, in its order (--feature-columns may pick
    some of the recorded features, in another order); None where a feature has none recorded."""
    stats = getattr(file_info, which) if file_info else None
    if not stats or columns.kind != "tabular":
        return stats
    position = {name: i for i, name in enumerate(file_info.feature_columns or [])}
    if len(stats) != len(position) or not all(name in position for name in columns.features):
        return None
    return [stats[position[name]] for name in columns.features]


# ---------------------------------------------------------------- finding files


def _describe(spec: PathSpec) -> str:
    return spec if isinstance(spec, str) else ", ".join(spec)


def _resolve_inputs(train: PathSpec, val: PathSpec | None) -> tuple[DatasetInfo | None, list[Location], list[Location]]:
    """(dataset.json info if `train` is a dataset root, train files, val files)."""
    if isinstance(train, str) and not has_glob(train):
        root = resolve(train)
        if root.is_dir() and root.join("train").is_dir():
            train_files = _files_in_directory(root.join("train"))
            if val is not None:
                val_files = _expand(val)
            elif root.join("val").is_dir():
                val_files = list_files(root.join("val"), ".parquet")
            else:
                val_files = []
            root_info = read_info(train) if root.join(INFO_FILENAME).exists() else None
            return root_info, train_files, val_files
    return None, _expand(train), _expand(val) if val is not None else []


def _expand(spec: PathSpec) -> list[Location]:
    """Every file a path spec names, in order, without duplicates."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs:
        raise ConfigError("an empty list of dataset paths was given")
    found: dict[str, Location] = {}
    for item in specs:
        if has_glob(item):
            matches = expand_glob(item)
            if not matches:
                raise ConfigError(f"no files match {item}")
        else:
            location = resolve(item)
            file_type = location.file_type()
            if file_type == pafs.FileType.NotFound:
                raise ConfigError(f"dataset path does not exist: {item}")
            matches = _files_in_directory(location) if file_type == pafs.FileType.Directory else [location]
        found.update((location.uri, location) for location in matches)
    return list(found.values())


def _files_in_directory(directory: Location) -> list[Location]:
    files = list_files(directory, ".parquet")
    if files:
        return files
    others = [location.name for location in list_files(directory)]
    holds = f"it holds {', '.join(others[:5])}{' ...' if len(others) > 5 else ''}" if others else "it is empty"
    raise ConfigError(f"no .parquet files in {directory.uri} ({holds})")


# ---------------------------------------------------------------- one file


@contextmanager
def open_parquet(location: Location) -> Iterator[pq.ParquetFile]:
    """Open a file and parse its footer, telling 'not Parquet' from 'truncated'."""
    try:
        source = location.filesystem.open_input_file(location.path)
    except OSError as exc:
        raise ConfigError(f"cannot open {location.uri}: {one_line(exc)}") from exc
    with source:
        try:
            parquet = pq.ParquetFile(source)
        except (pa.ArrowException, OSError) as exc:
            size = source.size()
            head = source.read_at(4, 0) if size >= 4 else b""
            if size == 0:
                raise ConfigError(f"{location.uri} is an empty file, not Parquet") from exc
            if head != b"PAR1":
                raise ConfigError(f"{location.uri} is not a Parquet file (it does not start with PAR1)") from exc
            raise ConfigError(f"{location.uri} is a truncated or corrupt Parquet file: {one_line(exc)}") from exc
        yield parquet


def _check_file(location: Location, columns: _Columns, reference: pa.Schema, reference_uri: str) -> _FileReport:
    with open_parquet(location) as parquet:
        schema = parquet.schema_arrow
        if not schema.equals(reference, check_metadata=False):
            raise ConfigError(f"{location.uri} and {reference_uri} differ: {_schema_difference(schema, reference)}")
        label_min, label_max = _label_range(parquet, location.uri, columns.label)
        image_shape = encoding = None
        if columns.kind == "image" and parquet.metadata.num_rows:
            image_shape, encoding = _first_image_shape(parquet, location.uri, columns)
        return _FileReport(location.uri, parquet.metadata.num_rows, label_min, label_max, image_shape, encoding)


def _schema_difference(schema: pa.Schema, reference: pa.Schema) -> str:
    for field in reference:
        if field.name not in schema.names:
            return f"the first lacks column {field.name!r}"
        if schema.field(field.name).type != field.type:
            return f"column {field.name!r} is {schema.field(field.name).type} in the first, {field.type} in the second"
    extra = [name for name in schema.names if name not in reference.names]
    if extra:
        return f"the first has extra {'column' if len(extra) == 1 else 'columns'} {', '.join(extra)}"
    return f"columns {', '.join(schema.names)} vs {', '.join(reference.names)}"


def _label_range(parquet: pq.ParquetFile, uri: str, label_column: str) -> tuple[int | None, int | None]:
    """Min and max label from row-group statistics; reads the label column only if they are missing."""
    metadata = parquet.metadata
    lows: list[int] = []
    highs: list[int] = []
    nulls = 0
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        if not group.num_rows:
            continue
        chunk = next(
            group.column(j) for j in range(group.num_columns) if group.column(j).path_in_schema == label_column
        )
        statistics = chunk.statistics
        if statistics is None or not statistics.has_min_max or not statistics.has_null_count:
            break
        lows.append(statistics.min)
        highs.append(statistics.max)
        nulls += statistics.null_count
    else:
        _check_no_nulls(nulls, uri, label_column)
        return (min(lows), max(highs)) if lows else (None, None)
    labels = parquet.read(columns=[label_column]).column(0)
    _check_no_nulls(labels.null_count, uri, label_column)
    extremes = pc.min_max(labels)
    return extremes["min"].as_py(), extremes["max"].as_py()


def _check_no_nulls(nulls: int, uri: str, label_column: str) -> None:
    if nulls:
        raise ConfigError(f"column {label_column!r} in {uri} has {nulls} null values; every row needs a label")


def _first_image_shape(parquet: pq.ParquetFile, uri: str, columns: _Columns) -> tuple[tuple[int, ...], str]:
    """(C, H, W) and encoding of the file's first image: a sample, not the whole column."""
    batch = next(parquet.iter_batches(batch_size=1, columns=[columns.image]))
    value = batch.column(0)[0].as_py()
    if value is None:
        raise ConfigError(f"the first image in {uri} (column {columns.image!r}) is null")
    if columns.raw_image_shape is not None:
        expected = columns.raw_image_shape
        if len(value) != expected[0] * expected[1] * expected[2]:
            raise ConfigError(
                f"the first image in {uri} has {len(value)} values; image_shape {_shape_text(expected)} needs "
                f"{expected[0] * expected[1] * expected[2]}"
            )
        return expected, "raw"
    try:
        with Image.open(io.BytesIO(value)) as image:
            image.load()
            return (len(image.getbands()), image.height, image.width), (image.format or "unknown").lower()
    except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as exc:
        raise ConfigError(
            f"cannot decode the first image in {uri} (column {columns.image!r}): {one_line(exc)}"
        ) from exc


# ---------------------------------------------------------------- whole dataset


def _plan_columns(
    schema: pa.Schema,
    uri: str,
    info: DatasetInfo | None,
    image_column: str,
    label_column: str,
    feature_columns: Sequence[str] | None,
) -> _Columns:
    names = schema.names

    def missing(column: str, hint: str = "") -> ConfigError:
        return ConfigError(f"no column {column!r} in {uri}; columns: {', '.join(names)}{hint}")

    if label_column not in names:
        raise missing(label_column)
    label_type = schema.field(label_column).type
    if not pa.types.is_integer(label_type):
        raise ConfigError(
            f"column {label_column!r} in {uri} has type {label_type}; labels must be integers 0..num_classes-1"
        )
    if feature_columns is None and info is not None and info.kind == "tabular":
        feature_columns = info.feature_columns or []
    if feature_columns is not None:
        for column in feature_columns:
            if column not in names:
                raise missing(column)
            column_type = schema.field(column).type
            if not (pa.types.is_integer(column_type) or pa.types.is_floating(column_type)):
                raise ConfigError(
                    f"feature column {column!r} in {uri} has type {column_type}; features must be numeric"
                )
        return _Columns(kind="tabular", label=label_column, features=tuple(feature_columns))
    if image_column not in names:
        raise missing(image_column, " (for tabular data pass feature_columns)")
    image_type = schema.field(image_column).type
    if pa.types.is_binary(image_type) or pa.types.is_large_binary(image_type):
        return _Columns(kind="image", label=label_column, image=image_column)
    is_pixel_list = (
        pa.types.is_list(image_type) or pa.types.is_large_list(image_type) or pa.types.is_fixed_size_list(image_type)
    ) and image_type.value_type == pa.uint8()
    if not is_pixel_list:
        raise ConfigError(
            f"column {image_column!r} in {uri} has type {image_type}; images must be binary (PNG/JPEG bytes) "
            "or lists of uint8 with image_shape metadata"
        )
    if info is None or info.image_shape is None:
        raise ConfigError(
            f"column {image_column!r} in {uri} holds raw pixels but no image_shape metadata says their shape"
        )
    return _Columns(kind="image", label=label_column, image=image_column, raw_image_shape=info.image_shape)


def _check_rows_match(root_info: DatasetInfo, rows: dict[str, int]) -> None:
    """A partial copy to shared storage shows up as fewer rows than dataset.json records."""
    for split, count in rows.items():
        if count != root_info.rows[split]:
            raise ConfigError(
                f"{root_info.path}/{split} holds {plural(count, 'row')} but {INFO_FILENAME} says "
                f"{root_info.rows[split]}; files are missing or extra"
            )


def _resolve_num_classes(num_classes: int | None, info: DatasetInfo | None, reports: Sequence[_FileReport]) -> int:
    if num_classes is not None:
        if num_classes < 1:
            raise ConfigError(f"num_classes must be >= 1, got {num_classes}")
        if info is not None and info.num_classes != num_classes:
            logger.warning("the model has %d classes but the dataset metadata lists %d", num_classes, info.num_classes)
        return num_classes
    if info is not None:
        return info.num_classes
    highest = max((r.label_max for r in reports if r.label_max is not None), default=0)
    logger.info("no num_classes given and no dataset metadata: using max label + 1 = %d", highest + 1)
    return highest + 1


def _check_label_range(reports: Sequence[_FileReport], num_classes: int) -> None:
    allowed = f"allowed 0..{num_classes - 1}"
    for report in reports:
        if report.label_min is not None and report.label_min < 0:
            raise ConfigError(f"labels in {report.uri} go down to {report.label_min} ({allowed})")
        if report.label_max is not None and report.label_max >= num_classes:
            raise ConfigError(
                f"labels in {report.uri} go up to {report.label_max} but num_classes is {num_classes} ({allowed})"
            )


def _shape_text(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape)


def _check_image_shapes(reports: Sequence[_FileReport], info: DatasetInfo | None) -> tuple[tuple[int, ...], str | None]:
    """One fixed image shape across files (sampled), matching the metadata if any."""
    sampled = [r for r in reports if r.image_shape is not None]
    first = sampled[0]
    for report in sampled[1:]:
        if report.image_shape != first.image_shape:
            raise ConfigError(
                f"images differ in shape: the first image in {first.uri} is {_shape_text(first.image_shape)}, "
                f"in {report.uri} it is {_shape_text(report.image_shape)}; training needs one fixed shape "
                "(re-convert with --image-size)"
            )
    if info is not None and info.image_shape is not None and tuple(info.image_shape) != first.image_shape:
        raise ConfigError(
            f"the first image in {first.uri} is {_shape_text(first.image_shape)} but the dataset metadata says "
            f"{_shape_text(info.image_shape)}"
        )
    encoding = info.encoding if info is not None and info.encoding else first.image_encoding
    return first.image_shape, encoding
