"""Where a split's rows come from, as *units* read whole: a chunk of built-in rows already turned into model
inputs and kept in Ray's object store (:class:`ChunkSource`), or a Parquet row group read with pyarrow
(:class:`RowGroupSource`). Both answer the :class:`SplitSource` protocol, which is all the pipeline asks of
them. Plain values and object refs only: a source travels to every Ray Data task and training worker."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import ray

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data import paths, synthetic
from raytrain_ddp.data.spec import DataSpec, stored_columns, to_model_inputs
from raytrain_ddp.errors import DataReadError

ROWS_PER_CHUNK = 1024  # built-in rows per cached chunk (a unit)
TRANSFORM_ROWS = 256  # rows decoded at a time: bounds the decode buffers of a large row group


class SplitSource(Protocol):
    """One split as units; `in_memory`: its rows are model inputs already (a rank takes its pieces itself, in
    its own process, and shuffles all of them: no Ray Data tasks, no window)."""

    @property
    def spec(self) -> DataSpec: ...

    @property
    def unit_rows(self) -> tuple[int, ...]:
        """Rows of each unit, in storage order."""
        ...

    @property
    def in_memory(self) -> bool: ...

    @property
    def augments(self) -> bool: ...

    def read(self, unit: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows [start, stop) of a unit, as stored."""
        ...

    def model_inputs(self, rows: dict[str, np.ndarray], augment_seed: int | None, normalise: bool) -> Iterator[dict]:
        """A piece's rows as `{"id", "x", "y"}`, a slice at a time."""
        ...


@dataclass(frozen=True)
class ChunkSource:
    """Built-in rows, generated and normalised once on the driver, a chunk of ROWS_PER_CHUNK per unit."""

    spec: DataSpec
    unit_rows: tuple[int, ...]
    chunks: tuple[ray.ObjectRef, ...]
    in_memory = True
    augments = False  # the built-in images are not augmented

    def read(self, unit: int, start: int, stop: int) -> dict[str, np.ndarray]:
        chunk = ray.get(self.chunks[unit])
        return {name: values[start:stop] for name, values in chunk.items()}

    def model_inputs(self, rows: dict[str, np.ndarray], augment_seed: int | None, normalise: bool) -> Iterator[dict]:
        yield rows  # model inputs already


@dataclass(frozen=True)
class RowGroupSource:
    """Parquet row groups (`row_groups`: file URI and index), read as `columns`."""

    spec: DataSpec
    unit_rows: tuple[int, ...]
    row_groups: tuple[tuple[str, int], ...]
    columns: tuple[str, ...]
    in_memory = False

    @property
    def augments(self) -> bool:
        """Random crop and flip for encoded images."""
        return self.spec.kind == "image" and self.spec.encoding != "array"

    def read(self, unit: int, start: int, stop: int) -> dict[str, np.ndarray]:
        uri, row_group = self.row_groups[unit]
        location = paths.resolve(uri)
        try:
            with location.filesystem.open_input_file(location.path) as file:
                table = pq.ParquetFile(file).read_row_group(row_group, columns=list(self.columns))
        except (pa.ArrowException, OSError) as exc:  # checked before the run: the file changed, or a page is corrupt
            # Arrow's decoder raises an OSError without errno for bytes it cannot decode; a remote store's may pass
            corrupt = isinstance(exc, pa.ArrowException) or (
                exc.errno is None and isinstance(location.filesystem, pafs.LocalFileSystem)
            )
            raise DataReadError(f"row group {row_group} of {uri}", exc, corrupt) from exc
        table = table.slice(start, stop - start)
        return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}

    def model_inputs(self, rows: dict[str, np.ndarray], augment_seed: int | None, normalise: bool) -> Iterator[dict]:
        for at in range(0, len(next(iter(rows.values()), ())), TRANSFORM_ROWS):
            part = {name: values[at : at + TRANSFORM_ROWS] for name, values in rows.items()}
            yield to_model_inputs(part, self.spec, augment_seed, normalise)


def read_pieces(source: SplitSource, pieces: Iterable[tuple[int, int, int]]) -> Iterator[dict[str, np.ndarray]]:
    """Each piece's rows, in order; a run of pieces of one unit (a resized epoch's rest: rows scattered by the
    earlier parts' shuffles) reads the unit's span once, not a row group per piece."""
    for unit, run in itertools.groupby(pieces, key=lambda piece: piece[0]):
        spans = [(start, stop) for _, start, stop in run]
        first, last = min(start for start, _ in spans), max(stop for _, stop in spans)
        rows = source.read(unit, first, last)
        for start, stop in spans:
            yield {name: values[start - first : stop - first] for name, values in rows.items()}


class GeneratedSource:
    """Built-in rows generated where they are read (--quick-start: no object store), a chunk of ROWS_PER_CHUNK
    per unit, each the very chunk ChunkSource holds; kept once generated (a rank reads most units each epoch)."""

    in_memory = True
    augments = False

    def __init__(self, config: TrainConfig, spec: DataSpec, ids: np.ndarray) -> None:
        self.spec, self.dataset, self.seed = spec, config.dataset, config.seed
        self.unit_ids = _chunk_ids(ids)
        self.unit_rows = tuple(len(unit) for unit in self.unit_ids)
        self._chunks: dict[int, dict[str, np.ndarray]] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_chunks": {}}  # a rank generates its own

    def read(self, unit: int, start: int, stop: int) -> dict[str, np.ndarray]:
        if unit not in self._chunks:
            self._chunks[unit] = _chunk(self.dataset, self.spec, self.unit_ids[unit], self.seed)
        return {name: values[start:stop] for name, values in self._chunks[unit].items()}

    def model_inputs(self, rows: dict[str, np.ndarray], augment_seed: int | None, normalise: bool) -> Iterator[dict]:
        yield rows  # model inputs already


def _chunk_ids(ids: np.ndarray) -> list[np.ndarray]:
    """The built-in split's ids in chunks of ROWS_PER_CHUNK: its units, in the object store or generated in a rank."""
    return [ids[at : at + ROWS_PER_CHUNK] for at in range(0, len(ids), ROWS_PER_CHUNK)]


def _chunk(dataset: str, spec: DataSpec, ids: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """A chunk of built-in rows, generated from the seed and normalised: model inputs."""
    return to_model_inputs(synthetic.GENERATORS[dataset](ids, seed), spec)


def built_in_source(config: TrainConfig, spec: DataSpec, ids: np.ndarray, in_process: bool = False) -> SplitSource:
    """Chunks generated and normalised once, here, into the object store (a task per chunk would
    start a process each, on the cores the worker group is starting on); `in_process` (--quick-start): generated
    by each rank as it reads them."""
    if in_process:
        return GeneratedSource(config, spec, ids)
    pieces = _chunk_ids(ids)
    return ChunkSource(
        spec,
        tuple(len(piece) for piece in pieces),
        tuple(ray.put(_chunk(config.dataset, spec, piece, config.seed)) for piece in pieces),
    )


def parquet_source(spec: DataSpec, uris: Sequence[str]) -> RowGroupSource:
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
    return RowGroupSource(spec, tuple(unit_rows), tuple(row_groups), tuple(stored_columns(spec) + with_id))
