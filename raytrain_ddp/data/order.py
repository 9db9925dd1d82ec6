"""The order arithmetic of the project's own pipeline: which rows of which unit each rank trains in an epoch,
and in what order its micro-batches take them. A function of (seed, epoch, rank, world size) and, for an epoch
resumed at another world size, of its earlier parts: pure numpy, nothing read (raytrain_ddp.data.pipeline's
docstring says why the order is so)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from raytrain_ddp.config import TrainConfig

SHUFFLE_BUFFER_ROWS = 1024  # a rank's local shuffle window: rows of neighbouring units mixed together


def seed_of(*entropy: int) -> int:
    """One 32-bit seed from several integers (Ray Data's local shuffle takes an int)."""
    return int(np.random.SeedSequence(list(entropy)).generate_state(1)[0])


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
    return seed_of(seed, epoch, rank) if part == 0 else seed_of(seed, epoch, rank, part)


def _trained_order(rows: int, batch_size: int, seed: int, in_memory: bool, trained_rows: int) -> np.ndarray:
    """The first `trained_rows` of positions 0..rows-1 of a rank's epoch rows, in the order its micro-batches
    take them (TrainShard.host_batches' order); only those micro-batches are replayed."""
    if in_memory:
        return np.random.default_rng(seed).permutation(rows)[:trained_rows]
    positions, at = np.arange(rows), 0

    def read(count: int) -> dict[str, np.ndarray]:
        nonlocal at
        part, at = positions[at : at + count], min(rows, at + count)
        return {"y": part}

    shuffled = window_shuffled(read, batch_size, SHUFFLE_BUFFER_ROWS, seed)
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


def val_rows_per_rank(unit_rows: Sequence[int], world_size: int) -> tuple[int, ...]:
    """The rows `val_pieces` gives each rank."""
    rows = sum(unit_rows)
    return tuple((r + 1) * rows // world_size - r * rows // world_size for r in range(world_size))


def window_shuffled(read, batch_size: int, window: int, seed: int) -> Iterator[dict[str, np.ndarray]]:
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
