"""What a run shows on the console: one table row per epoch and, on a terminal, a live progress line."""

from __future__ import annotations

import logging
import statistics
import sys
import time

from raytrain_ddp.driver.epochs import validation_names
from raytrain_ddp.errors import plural

log = logging.getLogger("raytrain_ddp")

BUILTIN_VALIDATION = ("val_loss", "val_accuracy")  # the built-in loop's columns; a --task's are its own names


def _header(validation: list[str]) -> str:
    columns = "  ".join(f"{_column_name(name):>{_width(name)}}" for name in validation)
    return f"{'epoch':>5}  {'train loss (min..max over ranks)':<32} {columns}  {'samples/s':>9}  {'time':>6}"


def _column_name(name: str) -> str:
    return "val acc" if name == "val_accuracy" else name.replace("_", " ")


def _width(name: str) -> int:
    return max(7, len(_column_name(name)))


TABLE_HEADER = _header(list(BUILTIN_VALIDATION))
RATE_MIN_SPAN_S = 1.0  # no samples over a shorter stretch is not news of a stall


def finished_text(epochs_completed: int, trained_here: int, seconds: float) -> str:
    """'5 epochs in 51s'; a resumed run's seconds are this driver's only, so it says how many epochs they hold."""
    if trained_here == epochs_completed:
        return f"{plural(epochs_completed, 'epoch')} in {seconds:.0f}s"
    return f"{plural(epochs_completed, 'epoch')} ({plural(trained_here, 'epoch')} trained in this run's {seconds:.0f}s)"


class Console:
    """The epoch table (through `logging`) and the progress line of the epoch in flight (stderr, a terminal only)."""

    def __init__(self, total_epochs: int) -> None:
        self.total_epochs = total_epochs
        self.interactive = sys.stderr.isatty()
        self._table_started = False
        self._rate_epoch, self._rate_start = 0, (0.0, 0)

    def show_row(self, r: dict, progress_shown: bool) -> None:
        """One epoch's row, the header before the first; a progress line on screen is cleared first."""
        if self.interactive and progress_shown:
            sys.stderr.write("\r\033[K")
        validation = validation_names(r) or list(BUILTIN_VALIDATION)
        if not self._table_started:
            log.info(_header(validation))
            self._table_started = True
        spread = f"{r['train_loss']:.4f} ({r['train_loss_min']:.4f}..{r['train_loss_max']:.4f})"
        figures = "  ".join(f"{r[name]:>{_width(name)}.4f}" for name in validation)
        log.info(f"{r['epoch']:>5}  {spread:<32} {figures}  {r['samples_per_second']:>9,.0f}  {r['seconds']:>5.1f}s")

    def show_report(self, record: dict) -> None:
        """A step a launched script reported on every rank: its figures (mean over ranks, and their range)."""
        # the ranks differ: NAME_per_rank, or above epochs.PER_RANK_LIMIT ranks its summary NAME_rank_summary
        spread = {k.removesuffix(s) for k in record for s in ("_per_rank", "_rank_summary") if k.endswith(s)}
        derived = {f"{k}{suffix}" for k in spread for suffix in ("_min", "_max", "_per_rank", "_rank_summary")}
        figures = [
            f"{key} {value:.6g}"
            + (f" ({record[key + '_min']:.6g}..{record[key + '_max']:.6g})" if key in spread else "")
            for key, value in record.items()
            if key not in ("step", "world_size") and key not in derived
        ]
        log.info("step %d: %s", record["step"], ", ".join(figures))

    def progress_line(self, positions: dict[int, dict], micro_batches_per_epoch: int) -> str | None:
        """Micro-batch (micro-batches started by the rank furthest behind), samples/s, ETA and mean loss of the epoch in
        flight, over all ranks (`positions`: each rank's latest heartbeat; `micro_batches_per_epoch`: a rank's)."""
        if not positions:
            return None
        epoch = max(p["epoch"] for p in positions.values())
        current = [p for p in positions.values() if p["epoch"] == epoch and p["phase"] == "training"]
        if not current:
            return None
        samples = sum(p["samples"] for p in current)
        rate = self._rate(epoch, samples)
        micro_batches = min(p["micro_batches"] for p in current)
        speed = f", {rate:,.0f} samples/s" if rate is not None else ""
        left = micro_batches_per_epoch - micro_batches
        eta = f", epoch ETA {left * (samples / max(micro_batches, 1)) / rate:.0f}s" if rate else ""
        losses = [p["loss"] for p in current if p["loss"] == p["loss"]]  # NaN before a rank's first step
        loss = f", loss {statistics.fmean(losses):.4f}" if losses else ""
        where = f"micro-batch {micro_batches}/{micro_batches_per_epoch}"
        return f"epoch {epoch}/{self.total_epochs}: {where}{speed}{eta}{loss}"

    def _rate(self, epoch: int, samples: int) -> float | None:
        """Samples/s since the epoch was first seen; None until there is a stretch to measure (a rate over no
        time would read 0)."""
        if epoch != self._rate_epoch:  # a new epoch: measure its rate from here
            self._rate_epoch, self._rate_start = epoch, (time.monotonic(), samples)
        elapsed = time.monotonic() - self._rate_start[0]
        if samples == self._rate_start[1] and elapsed < RATE_MIN_SPAN_S:
            return None
        return (samples - self._rate_start[1]) / elapsed

    def show_progress(self, positions: dict[int, dict], micro_batches_per_epoch: int) -> None:
        """Called on every heartbeat: the rate's start is set then, not when a line is first logged."""
        line = self.progress_line(positions, micro_batches_per_epoch)
        if self.interactive and line:
            sys.stderr.write(f"\r\033[K  {line}")
            sys.stderr.flush()
