"""How worker news reaches the driver, and what the driver makes of it.

Workers post to :class:`RunMonitor`, a zero-CPU actor pinned to the driver's
node: fire-and-forget progress every second, and one message per rank at the
end of each epoch. Ray Train's own ``report`` only keeps metrics that come
with a checkpoint; this mailbox keeps every rank's numbers, so the driver can
show the cross-rank picture rather than rank zero's alone.

:class:`RunRecorder` drains the mailbox on the driver. When every rank has
finished an epoch it aggregates them into one record, appends it to
``metrics.jsonl`` and prints a table row.
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger("raytrain_ddp")


@ray.remote(num_cpus=0, max_restarts=-1)
class RunMonitor:
    """A mailbox: workers post events, the driver drains them."""

    def __init__(self) -> None:
        self._events: list[tuple] = []

    def worker_started(self, rank: int, info: dict) -> None:
        self._events.append(("started", rank, info))

    def progress(self, rank: int, epoch: int, steps: int, samples: int, loss: float) -> None:
        self._events.append(("progress", rank, {"epoch": epoch, "steps": steps, "samples": samples,
                                                "loss": loss, "time": time.time()}))

    def epoch_finished(self, rank: int, metrics: dict) -> None:
        self._events.append(("epoch", rank, metrics))

    def worker_finished(self, rank: int, checksum: str) -> None:
        self._events.append(("finished", rank, checksum))

    def drain(self) -> list[tuple]:
        events, self._events = self._events, []
        return events


def start_monitor() -> "ray.actor.ActorHandle":
    here = ray.get_runtime_context().get_node_id()
    return RunMonitor.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()


TABLE_HEADER = f"{'epoch':>5}  {'train loss (min..max over ranks)':<32} {'val loss':>8}  {'val acc':>7}  {'samples/s':>9}  {'time':>6}"


class RunRecorder:
    """Turns worker events into metrics.jsonl, table rows and the summary's facts."""

    def __init__(self, run_dir: Path, world_size: int, total_epochs: int) -> None:
        self.run_dir = run_dir
        self.world_size = world_size
        self.total_epochs = total_epochs
        self.workers: dict[int, dict] = {}
        self.starts_of_rank0 = 0
        self.checksums: dict[int, str] = {}
        self.epochs: dict[int, dict] = {}  # epoch -> aggregated record (written)
        self._pending: dict[int, dict[int, dict]] = {}  # epoch -> rank -> metrics
        self._progress: dict[int, dict] = {}
        self._interactive = sys.stderr.isatty()
        self._table_started = False

    @property
    def restarts(self) -> int:
        """Worker-group restarts: rank zero starts once per attempt."""
        return max(self.starts_of_rank0 - 1, 0)

    def consume(self, events: list[tuple]) -> None:
        for kind, rank, payload in events:
            if kind == "started":
                self.workers[rank] = payload
                self.starts_of_rank0 += rank == 0
            elif kind == "progress":
                self._progress[rank] = payload
            elif kind == "epoch":
                self._pending.setdefault(payload["epoch"], {})[rank] = payload
                if len(self._pending[payload["epoch"]]) == self.world_size:
                    self._write_epoch(self._pending.pop(payload["epoch"]))
            elif kind == "finished":
                self.checksums[rank] = payload
        if self._interactive and self._progress:
            self._show_progress()

    def _write_epoch(self, by_rank: dict[int, dict]) -> None:
        ranks = [by_rank[r] for r in sorted(by_rank)]
        samples = [m["samples"] for m in ranks]
        losses = [m["train_loss"] for m in ranks]
        seconds = max(m["train_seconds"] for m in ranks)
        val = {(m["val_loss"], m["val_accuracy"]) for m in ranks}
        if len(val) != 1:
            log.warning("validation metrics differ across ranks: %s", sorted(val))
        first = ranks[0]
        record = {
            "epoch": first["epoch"],
            "train_loss": sum(l * n for l, n in zip(losses, samples)) / sum(samples),
            "train_loss_min": min(losses),
            "train_loss_max": max(losses),
            "train_loss_per_rank": losses,
            "val_loss": first["val_loss"],
            "val_accuracy": first["val_accuracy"],
            "val_rows": first["val_rows"],
            "val_loss_per_rank": [m["val_loss"] for m in ranks],
            "val_accuracy_per_rank": [m["val_accuracy"] for m in ranks],
            "val_identical_across_ranks": len(val) == 1,
            "samples_per_second": sum(samples) / seconds,
            "samples_per_rank": samples,
            "steps_per_rank": [m["steps"] for m in ranks],
            "data_wait_seconds_per_rank": [round(m["data_wait_seconds"], 4) for m in ranks],
            "seconds": seconds,
        }
        self.epochs[record["epoch"]] = record
        with open(self.run_dir / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        self._show_row(record)

    def _show_row(self, r: dict) -> None:
        if self._interactive and self._progress:
            sys.stderr.write("\r\033[K")
        self._progress.clear()
        if not self._table_started:
            log.info(TABLE_HEADER)
            self._table_started = True
        spread = f"{r['train_loss']:.4f} ({r['train_loss_min']:.4f}..{r['train_loss_max']:.4f})"
        log.info(f"{r['epoch']:>5}  {spread:<32} {r['val_loss']:>8.4f}  {r['val_accuracy']:>7.4f}  "
                 f"{r['samples_per_second']:>9,.0f}  {r['seconds']:>5.1f}s")

    def _show_progress(self) -> None:
        latest = max(self._progress.values(), key=lambda p: p["time"])
        samples = sum(p["samples"] for p in self._progress.values() if p["epoch"] == latest["epoch"])
        losses = [p["loss"] for p in self._progress.values() if p["epoch"] == latest["epoch"]]
        sys.stderr.write(f"\r\033[K  epoch {latest['epoch']}/{self.total_epochs}: step {latest['steps']}, "
                         f"{samples:,} samples, loss {statistics.fmean(losses):.4f}")
        sys.stderr.flush()
