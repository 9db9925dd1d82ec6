"""The raytrain_ddp dataset format (version 1): the contract between converter and trainer.

Layout of a dataset directory OUT (local path or URI)::

    OUT/dataset.json
    OUT/train/part-00000.parquet, part-00001.parquet, ...
    OUT/val/part-00000.parquet, ...

A split with zero rows has an empty (or missing) directory. Files hold at most
5000 rows or ~256 MiB, row groups at most 1000 rows or ~16 MiB (defaults of
`write_split`), so Ray Data can parallelise reads over files and stream row
groups with bounded memory.

Columns, in this order:

* ``id``: int64, unique across train and val (the row's index in the source).
* ``label``: int64, 0 .. num_classes-1.
* kind "image": ``image`` is either ``binary`` holding one encoded PNG or JPEG
  file per row (encoding "png"/"jpeg"; decode with PIL, PNG is lossless), or
  ``fixed_size_list<uint8>[C*H*W]`` holding raw pixels in C,H,W order
  (encoding "raw"; reshape to ``image_shape``).
* kind "tabular": one numeric column per name in ``feature_columns``.

Metadata: the same JSON object is stored in ``dataset.json`` and in every
Parquet file's schema metadata under the key ``b"raytrain_ddp"``::

    {"format_version": 1,
     "kind": "image" | "tabular",
     "classes": [class names, index = label],
     "num_classes": int,
     "image_shape": [C, H, W],                 # image only
     "encoding": "png" | "jpeg" | "raw",       # image only
     "feature_columns": [names],               # tabular only
     "mean": [...], "std": [...],              # over the train split; per channel on a
                                               # 0..1 pixel scale (image), per feature (tabular)
     "rows": {"train": n, "val": n}}

Readers must reject a format_version they do not know.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from raytrain_ddp.data.paths import Location, list_files, one_line, resolve
from raytrain_ddp.errors import ConfigError

FORMAT_VERSION = 1
METADATA_KEY = b"raytrain_ddp"
INFO_FILENAME = "dataset.json"
SPLITS = ("train", "val")
KINDS = ("image", "tabular")
ENCODINGS = ("png", "jpeg", "raw")
ID_COLUMN = "id"
LABEL_COLUMN = "label"
IMAGE_COLUMN = "image"

DEFAULT_ROWS_PER_FILE = 5_000
DEFAULT_FILE_BYTES = 256 * 2**20
DEFAULT_ROW_GROUP_SIZE = 1_000
DEFAULT_ROW_GROUP_BYTES = 16 * 2**20


@dataclass
class DatasetInfo:
    """Dataset metadata plus where its files are (paths are local paths or URIs)."""

    path: str
    kind: str
    classes: list[str]
    num_classes: int
    rows: dict[str, int]
    image_shape: tuple[int, ...] | None = None
    encoding: str | None = None
    feature_columns: list[str] | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    train_paths: list[str] = field(default_factory=list)
    val_paths: list[str] = field(default_factory=list)
    format_version: int = FORMAT_VERSION

    def constant_inputs(self) -> list[str]:
        """The features (or image channels) whose std over the train split is 0: training scales them by 1
        (dividing by their std would make every input NaN)."""
        names = self.feature_columns if self.kind == "tabular" else [f"channel {i}" for i in range(len(self.std or []))]
        return [name for name, std in zip(names or [], self.std or []) if not std > 0]

    def metadata(self) -> dict[str, Any]:
        """The JSON object stored in dataset.json and in each file's schema metadata."""
        meta: dict[str, Any] = {
            "format_version": self.format_version,
            "kind": self.kind,
            "classes": list(self.classes),
            "num_classes": self.num_classes,
        }
        if self.kind == "image":
            meta["image_shape"] = list(self.image_shape) if self.image_shape else None
            meta["encoding"] = self.encoding
        else:
            meta["feature_columns"] = list(self.feature_columns or [])
        meta["mean"] = self.mean
        meta["std"] = self.std
        meta["rows"] = dict(self.rows)
        return meta

    @classmethod
    def from_metadata(
        cls,
        meta: dict[str, Any],
        *,
        source: str,
        path: str,
        train_paths: Sequence[str] = (),
        val_paths: Sequence[str] = (),
    ) -> DatasetInfo:
        """Parse metadata read from `source` (named in errors); raises ConfigError."""
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise ConfigError(
                f"{source} has dataset format_version {version!r}; this code reads version {FORMAT_VERSION}"
            )
        kind = meta.get("kind")
        if kind not in KINDS:
            raise ConfigError(f"{source} has dataset kind {kind!r}; allowed: {', '.join(KINDS)}")
        try:
            image_shape = meta.get("image_shape")
            return cls(
                path=path,
                kind=kind,
                classes=[str(name) for name in meta["classes"]],
                num_classes=int(meta["num_classes"]),
                rows={split: int(meta["rows"].get(split, 0)) for split in SPLITS},
                image_shape=tuple(int(d) for d in image_shape) if image_shape else None,
                encoding=meta.get("encoding"),
                feature_columns=meta.get("feature_columns"),
                mean=meta.get("mean"),
                std=meta.get("std"),
                train_paths=list(train_paths),
                val_paths=list(val_paths),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ConfigError(f"{source} has malformed dataset metadata: {one_line(exc)}") from exc


def schema_metadata(info: DatasetInfo) -> dict[bytes, bytes]:
    return {METADATA_KEY: json.dumps(info.metadata()).encode()}


def metadata_from_schema(schema: pa.Schema) -> dict[str, Any] | None:
    """The raytrain_ddp metadata embedded in a Parquet/Arrow schema, if any."""
    raw = (schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {}  # present but unreadable: from_metadata reports the bad version


def image_schema(encoding: str, image_shape: Sequence[int]) -> pa.Schema:
    if encoding == "raw":
        image_type = pa.list_(pa.uint8(), int(image_shape[0] * image_shape[1] * image_shape[2]))
    else:
        image_type = pa.binary()
    return pa.schema([(ID_COLUMN, pa.int64()), (LABEL_COLUMN, pa.int64()), (IMAGE_COLUMN, image_type)])


def decode_images(values: Sequence[Any] | np.ndarray, encoding: str, image_shape: Sequence[int]) -> np.ndarray:
    """A batch of stored `image` values -> uint8 array N,C,H,W.

    Takes what Ray Data's numpy batches hold: an object array of PNG/JPEG bytes,
    or raw pixels as a 2-D uint8 array or an object array of 1-D arrays.
    """
    shape = tuple(int(d) for d in image_shape)
    if encoding == "raw":
        array = np.asarray(values)
        if array.dtype == object:
            array = np.stack([np.asarray(value, np.uint8) for value in values]) if len(values) else array
        return array.astype(np.uint8, copy=False).reshape(len(values), *shape)
    mode = "L" if shape[0] == 1 else "RGB"
    images = np.empty((len(values), *shape), np.uint8)
    for index, data in enumerate(values):
        with Image.open(io.BytesIO(data)) as image:
            pixels = np.asarray(image if image.mode == mode else image.convert(mode))
        pixels = pixels[np.newaxis] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        if pixels.shape != shape:
            raise ValueError(f"image {index} of the batch is {pixels.shape}, expected {shape} (C,H,W)")
        images[index] = pixels
    return images


def read_info(path: str) -> DatasetInfo:
    """Read OUT/dataset.json and list OUT/train and OUT/val; opens no Parquet file.

    `path` is a dataset directory, local or a URI. Use `validate.check_dataset`
    to also check the files themselves.
    """
    root = resolve(path)
    info_location = root.join(INFO_FILENAME)
    try:
        with root.filesystem.open_input_stream(info_location.path) as stream:
            meta = json.loads(stream.read())
    except FileNotFoundError as exc:
        if not root.exists():
            raise ConfigError(f"dataset path does not exist: {path}") from exc
        raise ConfigError(
            f"{info_location.uri} not found; is {path} a dataset written by `python -m raytrain_ddp.data prepare`?"
        ) from exc
    except ValueError as exc:
        raise ConfigError(f"{info_location.uri} is not valid JSON: {one_line(exc)}") from exc
    if not isinstance(meta, dict):
        raise ConfigError(f"{info_location.uri} must hold a JSON object")
    split_paths = {split: split_files(root, split) for split in SPLITS}
    return DatasetInfo.from_metadata(
        meta,
        source=info_location.uri,
        path=root.uri,
        train_paths=split_paths["train"],
        val_paths=split_paths["val"],
    )


def split_files(root: Location, split: str) -> list[str]:
    """The .parquet files of one split of a dataset directory, sorted; [] if it has none."""
    directory = root.join(split)
    if not directory.is_dir():
        return []
    return [location.uri for location in list_files(directory, ".parquet")]


def write_info(out_dir: str, info: DatasetInfo) -> None:
    with open(os.path.join(out_dir, INFO_FILENAME), "w") as file:
        json.dump(info.metadata(), file, indent=2)
        file.write("\n")


class _SplitWriter:
    """Record batches into split_dir/part-NNNNN.parquet files, one row group buffered at a time (write_split's
    limits)."""

    def __init__(
        self,
        split_dir: str,
        schema: pa.Schema,
        rows_per_file: int,
        row_group_size: int,
        row_group_bytes: int,
        file_bytes: int,
    ) -> None:
        self.split_dir, self.schema = split_dir, schema
        self.rows_per_file, self.row_group_size = rows_per_file, row_group_size
        self.row_group_bytes, self.file_bytes = row_group_bytes, file_bytes
        self.paths: list[str] = []
        self.writer: pq.ParquetWriter | None = None
        self.file_rows = self.file_size = 0
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = self.pending_bytes = 0

    def add(self, batch: pa.RecordBatch) -> None:
        """The batch's rows into the pending row group, which is written whenever a limit is reached."""
        while batch.num_rows:
            bytes_per_row = max(1, batch.nbytes // batch.num_rows)
            room_by_bytes = max(1, -(-(self.row_group_bytes - self.pending_bytes) // bytes_per_row))
            take = min(
                batch.num_rows,
                self.row_group_size - self.pending_rows,
                self.rows_per_file - self.file_rows - self.pending_rows,
                room_by_bytes,
            )
            piece, batch = batch.slice(0, take), batch.slice(take)
            self.pending.append(piece)
            self.pending_rows += take
            self.pending_bytes += take * bytes_per_row
            full = (
                self.pending_rows >= self.row_group_size
                or self.pending_bytes >= self.row_group_bytes
                or self.file_rows + self.pending_rows >= self.rows_per_file
            )
            if full:
                self.flush()

    def flush(self) -> None:
        """The pending rows as one row group; the file ends after it when it reached its rows or bytes."""
        if not self.pending_rows:
            return
        if self.writer is None:
            self.paths.append(os.path.join(self.split_dir, f"part-{len(self.paths):05d}.parquet"))
            self.writer = pq.ParquetWriter(self.paths[-1], self.schema)
        table = pa.Table.from_batches(self.pending, self.schema)
        self.writer.write_table(table, row_group_size=table.num_rows)
        self.file_rows += table.num_rows
        self.file_size += self.pending_bytes
        self.pending, self.pending_rows, self.pending_bytes = [], 0, 0
        if self.file_rows >= self.rows_per_file or self.file_size >= self.file_bytes:
            self.close()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.writer, self.file_rows, self.file_size = None, 0, 0


def write_split(
    split_dir: str,
    batches: Iterable[pa.RecordBatch],
    schema: pa.Schema,
    *,
    rows_per_file: int = DEFAULT_ROWS_PER_FILE,
    row_group_size: int = DEFAULT_ROW_GROUP_SIZE,
    row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES,
    file_bytes: int = DEFAULT_FILE_BYTES,
) -> list[str]:
    """Stream record batches into split_dir/part-NNNNN.parquet files; return their paths.

    A row group ends at `row_group_size` rows or `row_group_bytes` bytes
    (uncompressed), a file at `rows_per_file` rows or after the row group that
    reaches `file_bytes`. Only one row group is buffered at a time.
    """
    if rows_per_file < 1 or row_group_size < 1:
        raise ConfigError(f"rows_per_file and row_group_size must be >= 1, got {rows_per_file} and {row_group_size}")
    os.makedirs(split_dir, exist_ok=True)
    out = _SplitWriter(split_dir, schema, rows_per_file, row_group_size, row_group_bytes, file_bytes)
    try:
        for batch in batches:
            out.add(batch)
        out.flush()
    finally:
        out.close()
    return out.paths


def set_file_metadata(paths: Sequence[str], info: DatasetInfo) -> None:
    """Rewrite local Parquet files with `info` as schema metadata, keeping row groups.

    Converters learn train mean/std only after writing the train split; copying
    the encoded bytes once is far cheaper than decoding every image twice.
    """
    for path in paths:
        source = pq.ParquetFile(path)
        schema = source.schema_arrow.with_metadata(schema_metadata(info))
        rewritten = path + ".rewrite"
        with pq.ParquetWriter(rewritten, schema) as writer:
            for index in range(source.num_row_groups):
                group = source.read_row_group(index)
                writer.write_table(group.replace_schema_metadata(schema.metadata), row_group_size=group.num_rows)
        source.close()
        os.replace(rewritten, path)
