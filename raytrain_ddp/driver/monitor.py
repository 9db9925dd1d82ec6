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

from raytrain_ddp.config import TrainConfig

log = logging.getLogger("raytrain_ddp")


@ray.remote(num_cpus=0, max_restarts=-1)
class RunMonitor:
    """A mailbox: workers post events, the driver drains them."""

    def __init__(self) -> None:
        self._events: list[tuple] = []
        self._stop_reason: str | None = None

    def request_stop(self, reason: str) -> None:
        """The driver asks every rank to checkpoint at the next step boundary and return (preemption)."""
        self._stop_reason = self._stop_reason or reason

    def stop_requested(self) -> str | None:
        return self._stop_reason

    def worker_started(self, rank: int, info: dict) -> None:
        self._events.append(("started", rank, info))

    def progress(self, rank: int, epoch: int, steps: int, samples: int, loss: float, phase: str) -> str | None:
        """Record where a rank is; answer whether the driver wants the run stopped."""
        self._events.append(
            (
                "progress",
                rank,
                {"epoch": epoch, "steps": steps, "samples": samples, "loss": loss, "phase": phase, "time": time.time()},
            )
        )
        return self._stop_reason

    def epoch_finished(self, rank: int, metrics: dict) -> None:
        self._events.append(("epoch", rank, metrics))

    def worker_finished(self, rank: int, checksum: str) -> None:
        self._events.append(("finished", rank, checksum))

    def drain(self) -> list[tuple]:
        events, self._events = self._events, []
        return events


def start_monitor() -> ray.actor.ActorHandle:
    here = ray.get_runtime_context().get_node_id()
    strategy = NodeAffinitySchedulingStrategy(here, soft=False)
    return RunMonitor.options(scheduling_strategy=strategy).remote()  # type: ignore[attr-defined]  # @ray.remote's


STRAGGLER_MIN_EXCESS_S = 0.25  # below this, waiting is noise, not a bottleneck


def find_stragglers(record: dict) -> list[dict]:
    """Ranks whose data wait stands far above the others' median, and the rank slow in compute.

    In DDP a rank slow for any reason makes every rank slow: the others wait
    for it inside the all-reduce, so their step time grows as much as its own.
    Step time cannot name the culprit; time spent waiting for the next batch
    can, and it says "this rank's input pipeline is the bottleneck"; so can the
    time each rank waits inside the gradient all-reduce (the slow rank waits least).
    """
    waits = record.get("data_wait_seconds_per_rank") or []
    if len(waits) < 2:
        return []
    median = statistics.median(waits)
    slow_data_ranks = {
        rank for rank, wait in enumerate(waits) if wait - median > max(0.5 * median, STRAGGLER_MIN_EXCESS_S)
    }
    stragglers = [
        {
            "rank": rank,
            "why": f"data wait {waits[rank]:.3g}s vs median {median:.3g}s over the epoch: "
            "its input pipeline is the bottleneck",
        }
        for rank in sorted(slow_data_ranks)
    ]
    return stragglers + _slow_in_compute(record, slow_data_ranks)


def _slow_in_compute(record: dict, slow_in_data: set[int]) -> list[dict]:
    """The rank the others wait for inside the gradient all-reduce: it waits least there (it arrives last),
    unless its lateness is its data wait, flagged already."""
    waits = record.get("allreduce_wait_seconds_per_rank") or []
    if len(waits) < 2 or None in waits:
        return []
    rank = min(range(len(waits)), key=waits.__getitem__)
    others = min(wait for other, wait in enumerate(waits) if other != rank)
    if rank in slow_in_data or others - waits[rank] <= max(0.5 * others, STRAGGLER_MIN_EXCESS_S):
        return []
    return [
        {
            "rank": rank,
            "why": f"all-reduce wait {waits[rank]:.3g}s while every other rank waits "
            f">= {others:.3g}s for it over the epoch: its compute is the bottleneck",
        }
    ]


TABLE_HEADER = (
    f"{'epoch':>5}  {'train loss (min..max over ranks)':<32} {'val loss':>8}  {'val acc':>7}  "
    f"{'samples/s':>9}  {'time':>6}"
)


class RunRecorder:
    """Turns worker events into metrics.jsonl, table rows and the summary's facts."""

    def __init__(self, run_dir: Path, config: TrainConfig, train_rows: int, world_size: int, sinks: list) -> None:
        self.run_dir = run_dir
        self.config = config
        self.total_epochs = config.epochs
        self.train_rows = train_rows
        self.world_size = world_size  # of the current attempt: elastic runs (--min-workers) change it
        self._rate_epoch, self._rate_start = 0, (0.0, 0)
        self.sinks = sinks  # TensorBoardLog, MlflowLog: anything with write_epoch(record)
        self.workers: dict[int, dict] = {}
        self.starts_of_rank0 = 0
        self.checksums: dict[int, str] = {}
        self.epochs: dict[int, dict] = self._read_earlier_epochs()  # epoch -> aggregated record
        self._pending: dict[int, dict[int, dict]] = {}  # epoch -> rank -> metrics
        self._progress: dict[int, dict] = {}
        self.last_news = time.time()  # when any rank last said it was moving
        self.hangs: list[str] = []  # the watchdog's verdicts
        self.lost_nodes: list[dict] = []
        self.interrupted_at: float | None = None  # when a lost node took ranks with it; None while a group runs
        self.abort_reason: str | None = None  # why the driver ended the run (capacity did not come back)
        self._interactive = sys.stderr.isatty()
        self._table_started = False

    @property
    def steps_per_epoch(self) -> int:
        """Micro-batches per rank per epoch, at the current world size."""
        return self.config.batches_for(self.train_rows // self.world_size)

    def _read_earlier_epochs(self) -> dict[int, dict]:
        """A resumed run keeps the epochs it already recorded."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return {}
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return {r["epoch"]: r for r in records}

    @property
    def restarts(self) -> int:
        """Worker-group restarts: rank zero starts once per attempt."""
        return max(self.starts_of_rank0 - 1, 0)

    def consume(self, events: list[tuple]) -> None:
        for kind, rank, payload in events:
            if kind != "progress":
                self.last_news = time.time()
            if kind == "started":
                self.workers[rank] = payload
                self._progress.pop(rank, None)
                if rank == 0:
                    self._new_attempt(payload["world_size"])
            elif kind == "progress":
                self._track_position(rank, payload)
            elif kind == "epoch":
                self._pending.setdefault(payload["epoch"], {})[rank] = payload
                if len(self._pending[payload["epoch"]]) == self.world_size:
                    self._write_epoch(self._pending.pop(payload["epoch"]))
            elif kind == "finished":
                self.checksums[rank] = payload
        if self._interactive and self._progress:
            self._show_progress()

    def _new_attempt(self, world_size: int) -> None:
        """Ray Train started a worker group (the first, or a restart): follow its world size."""
        self.starts_of_rank0 += 1
        self.interrupted_at = None
        self._pending.clear()  # half-reported epochs of a lost group are trained again
        self.checksums.clear()
        if self.starts_of_rank0 > 1:
            log.warning("Ray Train restarted the workers from the latest checkpoint (restart %d)", self.restarts)
        if world_size != self.world_size:
            log.warning(
                "Training goes on with %d workers (was %d): global batch now %d per worker x %d = %d%s",
                world_size,
                self.world_size,
                self.config.global_batch_for(1),
                world_size,
                self.config.global_batch_for(world_size),
                f", learning rate {self.config.lr_for(world_size):g} (--scale-lr)" if self.config.scale_lr else "",
            )
            self.world_size = world_size
            self.workers = {rank: info for rank, info in self.workers.items() if rank < world_size}
            self._progress = {rank: p for rank, p in self._progress.items() if rank < world_size}

    def node_lost(self, node: dict) -> list[int]:
        """A node left the Ray cluster: note it; the ranks of the running group that were on it."""
        ranks = sorted(rank for rank, info in self.workers.items() if info.get("node_id") == node["node_id"])
        self.lost_nodes.append({**node, "lost_at": time.time(), "ranks": ranks})
        if ranks:
            self.interrupted_at = self.interrupted_at or time.time()
            for rank in ranks:
                self._progress.pop(rank, None)
        return ranks

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
            "world_size": len(ranks),
            "global_batch_size": self.config.global_batch_for(len(ranks)),
            "samples_per_second": sum(samples) / seconds,
            "samples_per_rank": samples,
            "micro_batches_per_rank": [m["micro_batches"] for m in ranks],
            "steps_per_rank": [m["micro_batches"] for m in ranks],  # the old name of micro_batches_per_rank
            "optimizer_steps_per_rank": [m["optimizer_steps"] for m in ranks],
            "skipped_steps_per_rank": [m["skipped_steps"] for m in ranks],
            "grad_allreduces_per_rank": [m["grad_allreduces"] for m in ranks],
            "lr": first["lr"],
            "data_wait_seconds_per_rank": [round(m["data_wait_seconds"], 4) for m in ranks],
            "step_seconds_per_rank": [round(m["step_seconds"], 5) for m in ranks],
            "allreduce_wait_seconds_per_rank": [
                None if m.get("allreduce_wait_seconds") is None else round(m["allreduce_wait_seconds"], 4)
                for m in ranks
            ],
            "seconds": seconds,
        }
        if "gpu_memory_peak_gib" in first:
            record["gpu_memory_peak_gib_per_rank"] = [m["gpu_memory_peak_gib"] for m in ranks]
        record["stragglers"] = find_stragglers(record)
        for straggler in record["stragglers"]:
            log.warning("Epoch %d: rank %d is a straggler: %s", record["epoch"], straggler["rank"], straggler["why"])
        self.epochs[record["epoch"]] = record  # an epoch re-run after a restart replaces its record
        lines = "".join(json.dumps(self.epochs[e]) + "\n" for e in sorted(self.epochs))
        tmp = self.run_dir / "metrics.jsonl.tmp"
        tmp.write_text(lines)
        tmp.replace(self.run_dir / "metrics.jsonl")
        for sink in self.sinks:
            sink.write_epoch(record)
        self._show_row(record)

    def _track_position(self, rank: int, progress: dict) -> None:
        """Heartbeats come every second, moving or not: news is a rank whose position changed."""
        position = (progress["epoch"], progress["steps"], progress["phase"])
        previous = self._progress.get(rank)
        if previous is None or previous["position"] != position:
            progress["moved_at"] = progress["time"]
            self.last_news = time.time()
        else:
            progress["moved_at"] = previous["moved_at"]
        progress["position"] = position
        self._progress[rank] = progress

    def describe_stall(self) -> str:
        """Where each rank was last seen, behind-most first: the stuck rank leads."""
        seen = sorted(self._progress.items(), key=lambda item: (item[1]["epoch"], item[1]["steps"], item[1]["time"]))
        parts = []
        for rank, p in seen:
            host = self.workers.get(rank, {}).get("hostname", "?")
            parts.append(
                f"rank {rank} on {host}: {p['phase']}, epoch {p['epoch']} step {p['steps']}, "
                f"unchanged for {time.time() - p['moved_at']:.0f}s"
            )
        silent = [r for r in sorted(self.workers) if r not in self._progress]
        parts += [f"rank {r} on {self.workers[r].get('hostname', '?')}: no news since it started" for r in silent]
        return "; ".join(parts) or "no worker has reported yet"

    @property
    def any_rank_training(self) -> bool:
        return bool(self._progress)

    def stuck_rank(self) -> int | None:
        """The rank furthest behind (lowest epoch and step), the likeliest culprit of a stall."""
        if not self._progress:
            return None
        return min(self._progress, key=lambda r: (self._progress[r]["epoch"], self._progress[r]["steps"]))

    def _show_row(self, r: dict) -> None:
        if self._interactive and self._progress:
            sys.stderr.write("\r\033[K")
        if not self._table_started:
            log.info(TABLE_HEADER)
            self._table_started = True
        spread = f"{r['train_loss']:.4f} ({r['train_loss_min']:.4f}..{r['train_loss_max']:.4f})"
        log.info(
            f"{r['epoch']:>5}  {spread:<32} {r['val_loss']:>8.4f}  {r['val_accuracy']:>7.4f}  "
            f"{r['samples_per_second']:>9,.0f}  {r['seconds']:>5.1f}s"
        )

    def progress_line(self) -> str | None:
        """Step, samples/s, ETA and mean loss of the epoch in flight, over all ranks."""
        if not self._progress:
            return None
        epoch = max(p["epoch"] for p in self._progress.values())
        current = [p for p in self._progress.values() if p["epoch"] == epoch and p["phase"] == "training"]
        if not current:
            return None
        if epoch != self._rate_epoch:  # a new epoch: measure its rate from here
            self._rate_epoch, self._rate_start = epoch, (time.time(), sum(p["samples"] for p in current))
        samples = sum(p["samples"] for p in current)
        elapsed = time.time() - self._rate_start[0]
        rate = (samples - self._rate_start[1]) / elapsed if elapsed > 0 else 0.0
        step = min(p["steps"] for p in current)
        eta = f", epoch ETA {(self.steps_per_epoch - step) * (samples / max(step, 1)) / rate:.0f}s" if rate > 0 else ""
        losses = [p["loss"] for p in current if p["loss"] == p["loss"]]  # NaN before a rank's first step
        loss = f", loss {statistics.fmean(losses):.4f}" if losses else ""
        return (
            f"epoch {epoch}/{self.total_epochs}: step {step}/{self.steps_per_epoch}, {rate:,.0f} samples/s{eta}{loss}"
        )

    def _show_progress(self) -> None:
        line = self.progress_line()
        if line:
            sys.stderr.write(f"\r\033[K  {line}")
            sys.stderr.flush()
