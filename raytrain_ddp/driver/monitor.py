"""How worker news reaches the driver, and what the driver makes of it.

Workers post to :class:`RunMonitor`, a zero-CPU actor pinned to the driver's
node: their progress every second and their message at the end of each epoch
through their node's aggregator (:mod:`raytrain_ddp.worker.aggregator`: one
message a second per node), the rest (a rank's start and end) directly.
Ray Train's own ``report`` only keeps metrics that come with a checkpoint;
this mailbox keeps every rank's numbers, so the driver can show the
cross-rank picture rather than rank zero's alone.

:class:`RunRecorder` drains the mailbox on the driver and follows each
attempt. When every rank has finished an epoch, :mod:`.epochs` aggregates
the messages into one record, :mod:`.run_files` rewrites ``metrics.jsonl``
and :mod:`.console` prints a table row; the heartbeats feed the watchdog's
:mod:`.liveness` and bring each rank's records of every ``--log-every-steps``-th
optimizer step, aggregated as each step is in from every rank into ``steps.jsonl``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.console import Console
from raytrain_ddp.driver.epochs import (
    aggregate_epoch,
    aggregate_report,
    aggregate_step,
    split_per_rank,
    stragglers_to_warn,
    validation_results,
)
from raytrain_ddp.driver.liveness import Liveness
from raytrain_ddp.driver.run_files import MetricsFile, StepsFile, write_rank_lists
from raytrain_ddp.errors import StorageFull, one_line, plural, storage_full_as
from raytrain_ddp.storage import RunPath
from raytrain_ddp.worker.aggregator import NodeAggregator

log = logging.getLogger("raytrain_ddp")


@dataclass(frozen=True)
class Verdict:
    """Why the driver's watchdog ended the run (capacity did not come back, another driver took the run directory
    over, the cluster went away): the run's error."""

    reason: str
    cluster_gone: bool = False  # the Ray cluster itself went away (its GCS stopped answering): nothing left to stop


class RunMailbox:
    """A mailbox: workers post events, the driver drains them. The Ray actor :class:`RunMonitor` on the full
    path; --quick-start's driver holds one itself (driver/quick.py), its ranks' calls one at a time."""

    def __init__(self) -> None:
        self._events: list[tuple] = []
        self._stop_reason: str | None = None
        self._running: set[int] = set()  # ranks of the current attempt still at work (started, not ended)

    def node_news(self, message: dict) -> str | None:
        """A node's message (`NodeNews.message`), stamped with this node's monotonic clock (the driver's, which
        the watchdog reads); answers whether the driver wants the run stopped."""
        self._events.append(("node", -1, {**message, "time": time.monotonic()}))
        return self._stop_reason

    def request_stop(self, reason: str) -> None:
        """The driver asks every rank to checkpoint at the next step boundary and return (preemption)."""
        self._stop_reason = self._stop_reason or reason

    def stop_requested(self) -> str | None:
        return self._stop_reason

    def worker_started(self, rank: int, info: dict) -> None:
        # a rank of a new attempt: the ranks past its world size belonged to a larger one, now gone
        self._running = {r for r in self._running if r < info["world_size"]} | {rank}
        self._events.append(("started", rank, info))

    def worker_ended(self, rank: int) -> None:
        """A launched rank's script (or function) returned, and its output and reports are in."""
        self._running.discard(rank)

    def ranks_running(self) -> int:
        """Ranks started and not yet ended: what a Ctrl-C waits for after a launched script (driver.fit; the
        built-in loop's ranks never say they ended, and a Ctrl-C does not wait for them)."""
        return len(self._running)

    def progress(
        self,
        rank: int,
        epoch: int,
        micro_batches: int,
        samples: int,
        loss: float,
        phase: str,
        phase_done: int,
        step_records: list[dict],
    ) -> str | None:
        """Record where a rank is, and its steps.jsonl records since the last beat; answer whether the driver
        wants the run stopped.

        `phase_done`: the progress inside the phase (see `Heartbeat.advance`). Stamped with this node's
        monotonic clock, which the driver (on the same node) reads for the watchdog's deadline.
        """
        where = {"epoch": epoch, "micro_batches": micro_batches, "samples": samples, "loss": loss, "phase": phase}
        self._events.append(("progress", rank, {**where, "phase_done": phase_done, "time": time.monotonic()}))
        self._add_steps(rank, step_records)
        return self._stop_reason

    def epoch_finished(self, rank: int, metrics: dict, step_records: list[dict]) -> None:
        self._add_steps(rank, step_records)
        self._events.append(("epoch", rank, metrics))

    def add_step_records(self, rank: int, step_records: list[dict]) -> None:
        """Records sent outside a beat: a launched rank's last reports, before it returns."""
        self._add_steps(rank, step_records)

    def output(self, rank: int, lines: list[str]) -> None:
        """A launched script's output lines, for the console (every line is in its rank's log already)."""
        self._events.append(("output", rank, lines))

    def warning(self, rank: int, line: str) -> None:
        """A rank's warning for the console (an object-store write it retries): Ray's worker output is off it."""
        self._events.append(("warning", rank, line))

    def _add_steps(self, rank: int, step_records: list[dict]) -> None:
        if step_records:
            self._events.append(("steps", rank, step_records))

    def worker_finished(self, rank: int, checksum: str) -> None:
        self._events.append(("finished", rank, checksum))

    def drain(self) -> list[tuple]:
        events, self._events = self._events, []
        return events


@ray.remote(num_cpus=0, max_restarts=-1)
class RunMonitor(RunMailbox):
    """The run's mailbox as a Ray actor, and the node aggregators its ranks post through."""

    def __init__(self) -> None:
        super().__init__()
        self._aggregators: dict[str, ray.actor.ActorHandle] = {}  # node id -> its ranks' NodeAggregator

    def aggregator_for(self, node_id: str, hostname: str) -> tuple[ray.actor.ActorHandle, str | None]:
        """The node's aggregator, started (pinned to the node) when its first rank asks, and the driver's stop
        request if there is one already (a USR1 during start-up: the rank learns it before its first step, not a
        beat and a node message later). The aggregator is owned by this actor: it ends with the run."""
        if node_id not in self._aggregators:
            on_the_node = NodeAffinitySchedulingStrategy(node_id, soft=False)
            self._aggregators[node_id] = NodeAggregator.options(  # type: ignore[attr-defined]  # @ray.remote's
                scheduling_strategy=on_the_node
            ).remote(ray.get_runtime_context().current_actor, node_id, hostname)
        return self._aggregators[node_id], self._stop_reason


def start_monitor() -> ray.actor.ActorHandle:
    here = ray.get_runtime_context().get_node_id()
    strategy = NodeAffinitySchedulingStrategy(here, soft=False)
    return RunMonitor.options(scheduling_strategy=strategy).remote()  # type: ignore[attr-defined]  # @ray.remote's


class RunRecorder:
    """Takes in the workers' news: follows each attempt (workers, world size, restarts, checksums, lost nodes),
    gathers each epoch's messages from every rank into one record (metrics.jsonl, the sinks, a table row),
    and keeps the watchdog's view up to date (`liveness`). What the summary reports comes from here."""

    def __init__(
        self, run_dir: RunPath, config: TrainConfig, train_rows: int, world_size: int, sinks: list, launched=False
    ) -> None:
        """launched: the ranks run a user's script or function (raytrain-ddp launch): their steps.jsonl records are
        what they report (raytrain_ddp.session), and what the built-in loop's would hold means nothing."""
        self.run_dir = run_dir
        self.launched = launched
        self.config = config
        self.train_rows = train_rows
        self.world_size = world_size  # of the current attempt: elastic runs (--min-workers) change it
        self.sinks = (
            sinks  # TensorBoardLog, MlflowLog, WandbLog: write_epoch(record), write_step(record), close(summary), label
        )
        self.workers: dict[int, dict] = {}
        self.starts_of_rank0 = 0
        self.checksums: dict[int, str] = {}
        self.metrics_file = MetricsFile(run_dir)
        self.epochs: dict[int, dict] = self.metrics_file.read()  # epoch -> aggregated record
        self.trained_here: set[int] = set()  # epochs this driver recorded (a resumed run's others came before)
        self._pending: dict[int, dict[int, dict]] = {}  # epoch -> rank -> metrics
        self.steps_file = StepsFile(run_dir) if config.log_every_steps or launched else None
        self._pending_steps: dict[int, dict[int, dict]] = {}  # global step -> rank -> its record
        self.liveness = Liveness()
        self.console = Console(config.epochs)
        self.lost_nodes: list[dict] = []
        self.interrupted_at: float | None = None  # (monotonic) when a lost node took ranks; None while a group runs
        self.verdict: Verdict | None = None  # the watchdog's, when it ended the run
        self.storage_full: StorageFull | None = None  # the first write the run directory's storage refused
        self._unwritten: dict[str, Callable[[], None]] = {}  # file -> the write a full disk refused, to try again

    @property
    def cluster_gone(self) -> bool:
        """The watchdog's verdict: the Ray cluster went away, nothing of it is left to stop or ask."""
        return self.verdict is not None and self.verdict.cluster_gone

    @property
    def micro_batches_per_epoch(self) -> int:
        """Micro-batches per rank per epoch, at the current world size."""
        return self.config.batches_for(self.train_rows // self.world_size)

    @property
    def restarts(self) -> int:
        """Worker-group restarts: rank zero starts once per attempt."""
        return max(self.starts_of_rank0 - 1, 0)

    @property
    def hangs(self) -> list[str]:
        """The watchdog's verdicts."""
        return self.liveness.hangs

    def consume(self, events: list[tuple]) -> None:
        for kind, rank, payload in events:
            if kind == "node":
                self._take_node_news(payload)
            else:
                self._take(kind, rank, payload)
        if self.liveness.positions:
            self.console.show_progress(self.liveness.positions, self.micro_batches_per_epoch)

    def _take_node_news(self, message: dict) -> None:
        """A node aggregator's message: each rank's beat (its time on the driver's clock), then the news its
        ranks handed over, in their order."""
        self.liveness.node_heard(message)
        for rank, (epoch, micro_batches, samples, loss, phase, phase_done, age_s) in message["beats"].items():
            where = {"epoch": epoch, "micro_batches": micro_batches, "samples": samples, "loss": loss, "phase": phase}
            self._take("progress", rank, {**where, "phase_done": phase_done, "time": message["time"] - age_s})
        for kind, rank, payload in message["events"]:
            self._take(kind, rank, payload)

    def _take(self, kind: str, rank: int, payload) -> None:
        if kind != "progress":
            self.liveness.heard()
        if kind == "started":
            self.workers[rank] = payload
            self.liveness.forget([rank])
            if rank == 0:
                self._new_attempt(payload["world_size"])
        elif kind == "progress":
            self.liveness.track(rank, payload)
        elif kind == "epoch":
            self._pending.setdefault(payload["epoch"], {})[rank] = payload
            if len(self._pending[payload["epoch"]]) == self.world_size:
                self._record_epoch(self._pending.pop(payload["epoch"]))
        elif kind == "steps":
            for record in payload:
                self._pending_steps.setdefault(record["step"], {})[rank] = record
                if len(self._pending_steps[record["step"]]) == self.world_size:
                    self._record_step(self._pending_steps.pop(record["step"]))
        elif kind == "finished":
            self.checksums[rank] = payload
        elif kind == "output":
            for line in payload:
                log.info("[rank %d] %s", rank, line)
        elif kind == "warning":
            log.warning("rank %d: %s", rank, payload)

    def progress_line(self) -> str | None:
        return self.console.progress_line(self.liveness.positions, self.micro_batches_per_epoch)

    def _new_attempt(self, world_size: int) -> None:
        """Ray Train started a worker group (the first, or a restart): follow its world size."""
        self.starts_of_rank0 += 1
        self.interrupted_at = None
        self._pending.clear()  # half-reported epochs (and steps) of a lost group are trained again
        self._pending_steps.clear()
        self.checksums.clear()
        if self.starts_of_rank0 > 1:
            resumes = ": every rank's script runs again" if self.launched else " from the latest checkpoint"
            log.warning("Ray Train restarted the workers%s (restart %d)", resumes, self.restarts)
        if world_size != self.world_size:
            log.warning(
                "Training goes on with %s (was %d): global batch now %d per worker x %d = %d%s",
                plural(world_size, "worker"),
                self.world_size,
                self.config.global_batch_for(1),
                world_size,
                self.config.global_batch_for(world_size),
                f", learning rate {self.config.lr_for(world_size):g} (--scale-lr)" if self.config.scale_lr else "",
            )
            self.world_size = world_size
            self.workers = {rank: info for rank, info in self.workers.items() if rank < world_size}
            self.liveness.forget([rank for rank in self.liveness.positions if rank >= world_size])

    def node_lost(self, node: dict) -> list[int]:
        """A node left the Ray cluster: note it; the ranks of the running group that were on it."""
        ranks = sorted(rank for rank, info in self.workers.items() if info.get("node_id") == node["node_id"])
        self.lost_nodes.append({**node, "lost_at": time.time(), "ranks": ranks})
        if ranks:
            self.interrupted_at = self.interrupted_at or time.monotonic()
            self.liveness.forget(ranks)
        self.liveness.nodes.pop(node["hostname"], None)  # its aggregator went with it: no silence to tell
        return ranks

    def _record_epoch(self, by_rank: dict[int, dict]) -> None:
        whole = aggregate_epoch(by_rank, self.config)
        record, lists = split_per_rank(whole)
        if not record["val_identical_across_ranks"]:
            log.warning("validation metrics differ across ranks: %s", validation_results(list(by_rank.values())))
        for straggler in stragglers_to_warn(whole, self.epochs.get(record["epoch"] - 1)):  # the lists tell lateness
            log.warning(
                "Epoch %d: rank %d is a straggler, as in epoch %d: %s",
                record["epoch"],
                straggler["rank"],
                record["epoch"] - 1,
                straggler["why"],
            )
        if lists:  # a large world: its lists once, in a file of their own (metrics.jsonl is rewritten every epoch)
            record["rank_lists_file"] = f"ranks/epoch-{record['epoch']}.json"
            write_lists = functools.partial(write_rank_lists, self.run_dir, record["rank_lists_file"], lists)
            self._write(record["rank_lists_file"], write_lists, again=write_lists)
        self.epochs[record["epoch"]] = record  # an epoch re-run after a restart replaces its record
        self.trained_here.add(record["epoch"])
        write_metrics = functools.partial(self.metrics_file.write, self.epochs)  # rewritten whole: also the retry
        self._write("metrics.jsonl", write_metrics, again=write_metrics)
        self.flush_files()
        for sink in self.sinks:
            self._write(f"the {sink.label} records", functools.partial(sink.write_epoch, record))
        self.console.show_row(record, progress_shown=bool(self.liveness.positions))

    def flush_files(self) -> None:
        """What the run directory's files do not hold yet written there: steps.jsonl on object storage, and
        what a full disk refused (kept in memory till then). Another storage error is a warning (the next flush
        tries again), never the end of the run."""
        for name, write in list(self._unwritten.items()):
            self._write(name, write, again=write)
        if self.steps_file is None:
            return
        try:
            self._write("steps.jsonl", self.steps_file.flush, again=self.steps_file.flush)  # written whole
        except OSError as err:
            log.warning("%s not written yet: %s", self.steps_file.path, one_line(err))

    def _write(self, name: str, write: Callable[[], None], again: Callable[[], None] | None = None) -> None:
        """One write into the run directory (`name`: what it writes). Storage full (or read-only) is said once;
        `again`, the write that brings the file up to date, is tried at each flush until one finds room (the
        records stay in memory). The run goes on: the workers' next checkpoint, into the same storage, ends it
        as Ray Train's controller takes in what they reported before (stopping it now could lose that)."""
        try:
            with storage_full_as(name, self.run_dir):
                write()
        except StorageFull as full:
            if again is not None:
                self._unwritten[name] = again
            if self.storage_full is None:
                self.storage_full = full
                log.warning("%s not written: %s; kept in memory until there is room", name, full.reason)
        else:
            self._unwritten.pop(name, None)

    @property
    def unwritten(self) -> StorageFull | None:
        """Why files of the run directory lack records (still kept in memory), or None when they hold them all."""
        return self.storage_full if self._unwritten else None

    def _record_step(self, by_rank: dict[int, dict]) -> None:
        steps_file = self.steps_file
        assert steps_file is not None  # steps are recorded only with --log-every-steps, or a launched run's reports
        # a large world's per-rank lists are left out of steps.jsonl: their summaries name the ranks at each end
        record, _ = split_per_rank(aggregate_report(by_rank) if self.launched else aggregate_step(by_rank))
        self._write("steps.jsonl", functools.partial(steps_file.add, record), again=steps_file.flush)
        if self.launched:
            self.console.show_report(record)
        for sink in self.sinks:
            self._write(f"the {sink.label} records", functools.partial(sink.write_step, record))
