"""How the driver copes with thousands of ranks, by simulation: `python -m bench.scale --ranks 64 256 1024 4096`.

Fake ranks send what real ranks send, through the real path: grouped 8 to a simulated node, they beat into
their node's real :class:`NodeNews` (what each node's aggregator actor holds), and each node posts its real
message once a second to a real :class:`RunMonitor` actor on a local Ray, drained by the real watcher thread
(:func:`raytrain_ddp.driver.watchdog.watch`) into the real :class:`RunRecorder` (liveness, epoch and step
records in a run directory, the watchdog's verdict). Each fake rank beats once a second with a heartbeat's
arguments and one steps.jsonl record as ``EpochMeter`` makes it, and hands over ``WorkerLoop.report_epoch``'s
message at the end of each epoch, which its node posts at once. A few sender actors each loop over their
nodes, so thousands of ranks fit on a small machine (the aggregators' cost is on the nodes, not the driver's).

After the warm-up epochs one rank stops sending while the others, waiting for it in the all-reduce, keep
beating from one micro-batch ahead: the figure is how long past ``--hang-timeout-s`` the watchdog takes to
name it. Measured per size: the CPU and memory of the driver's side (this process and the monitor actor),
heartbeat lag (from a rank's beat to the recorder taking it in, the second its aggregator held it included),
and one record of metrics.jsonl and of steps.jsonl.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from pathlib import Path

import psutil
import ray

from bench.common import ROOT, markdown_table, publish  # noqa: F401  (ROOT: the repository on sys.path)
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver import preflight, watchdog
from raytrain_ddp.driver.monitor import RunRecorder, start_monitor
from raytrain_ddp.worker.aggregator import NodeNews
from raytrain_ddp.worker.metrics import Heartbeat

log = logging.getLogger("bench.scale")

BEAT_S = Heartbeat.INTERVAL_S
BEATS_PER_EPOCH = 5  # one micro-batch (and one recorded step) per beat
WARMUP_EPOCHS = 2
RANKS_PER_NODE = 8
SENDERS = 2  # sender actors: one per core of the machine the figures in docs/scale.md come from
OBJECT_STORE_BYTES = 80 * 2**20
KEYS = (
    "ranks",
    "driver_cpu_cores",
    "driver_rss_mib",
    "heartbeat_lag_p99_s",
    "stopped_rank_named_s",
    "epoch_record_bytes",
    "step_record_bytes",
)


def position(beat: int) -> tuple[int, int]:
    """(epoch, micro-batches started) of a rank at its beat number `beat` (from 1)."""
    return (beat - 1) // BEATS_PER_EPOCH + 1, (beat - 1) % BEATS_PER_EPOCH + 1


def figure(rank: int, base: float) -> float:
    """A rank's measured figure near `base`, with a real measurement's 17 significant digits (record sizes)."""
    return base * (1 + math.sin(rank) / 100)


def step_record(rank: int, beat: int) -> dict:
    """The steps.jsonl record a rank's EpochMeter.refresh_loss makes (with --log-every-steps 1)."""
    epoch, _ = position(beat)
    return {
        "step": beat,
        "epoch": epoch,
        "lr": 0.1,
        "loss": figure(rank, 1.0),
        "samples": 64,
        "seconds": figure(rank, BEAT_S),
    }


def epoch_message(rank: int, epoch: int) -> dict:
    """What WorkerLoop.report_epoch sends for one rank (the DDP loop on CPU, the built-in validation)."""
    return {
        "epoch": epoch,
        "rank": rank,
        "train_loss": figure(rank, 1.0),
        "samples": 64 * BEATS_PER_EPOCH,
        "micro_batches": BEATS_PER_EPOCH,
        "optimizer_steps": BEATS_PER_EPOCH,
        "skipped_steps": 0,
        "grad_allreduces": BEATS_PER_EPOCH,
        "lr": 0.1,
        "train_seconds": figure(rank, BEATS_PER_EPOCH * BEAT_S),
        "data_wait_seconds": figure(rank, 0.01),
        "micro_batch_seconds": figure(rank, 0.9),
        "val_loss": 0.5,
        "val_accuracy": 0.9,
        "val_rows": 640,
        "allreduce_wait_seconds": figure(rank, 0.1),
    }


@ray.remote(num_cpus=0, max_concurrency=2)  # `behind_s` answers while `run` loops
class FakeNodes:
    """Some nodes of the simulated job, RANKS_PER_NODE ranks each: each node's ranks beat into its real
    :class:`NodeNews` (what the node's aggregator actor holds), and the node posts its message once a second,
    the nodes spread evenly over the second; at an epoch's end its ranks' epoch messages go in one more post,
    as the aggregator delivers them at once."""

    def __init__(self, monitor, nodes: list[int], ranks: int, stuck_rank: int, stop_beat: int) -> None:
        self.monitor, self.stuck_rank, self.stop_beat = monitor, stuck_rank, stop_beat
        self.nodes = {
            node: (list(range(node * RANKS_PER_NODE, min((node + 1) * RANKS_PER_NODE, ranks))), node_news(node))
            for node in nodes
        }
        self.behind = 0.0

    def behind_s(self) -> float:
        """How far behind its schedule this sender has been at worst: that much of the lag is the simulator's."""
        return self.behind

    def run(self, start: float, beats: int) -> None:
        """Beat `beats` times from `start` (monotonic: one clock for every process on this machine)."""
        for beat in range(1, beats + 1):
            posts = []
            for node, (node_ranks, news) in self.nodes.items():
                ahead = scheduled(start, beat, node) - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
                self.behind = max(self.behind, -ahead)
                posts += self._beat(node_ranks, news, beat)
            replies = ray.get([ref for *_, ref in posts])  # each node waits for its reply before its next post
            for (news, message, _), reply in zip(posts, replies):
                news.answered(message, reply)

    def _beat(self, node_ranks: list[int], news: NodeNews, beat: int) -> list[tuple]:
        """The node's ranks' beats (the hang: from `stop_beat` the stuck rank is silent, the others wait one
        micro-batch ahead), and the node's posts: (news, message, reply)."""
        epoch, steps = position(min(beat, self.stop_beat))
        for rank in node_ranks:
            if beat < self.stop_beat:
                news.beat(rank, epoch, steps, 64 * steps, 1.0, "training", 0, [step_record(rank, beat)])
            elif rank != self.stuck_rank:
                news.beat(rank, epoch, steps, 64 * steps, 1.0, "training", 0, [])
        messages = [news.message()]
        if beat < self.stop_beat and steps == BEATS_PER_EPOCH:
            for rank in node_ranks:
                news.add("epoch", rank, epoch_message(rank, epoch))
            messages.append(news.message())
        return [(news, message, self.monitor.node_news.remote(message)) for message in messages]


def node_news(node: int) -> NodeNews:
    return NodeNews(f"node-id-{node}", f"node-{node}")


def scheduled(start: float, beat: int, node: int) -> float:
    """When a node posts its beat-th message: nodes are spread over the second."""
    return start + beat * BEAT_S + (node % 1000) / 1000 * BEAT_S


def held_s(rank: int) -> float:
    """How long before its node's post a rank beat: ranks beat at their own moments, spread over the second the
    aggregator holds their beats."""
    return (rank % RANKS_PER_NODE + 0.5) / RANKS_PER_NODE * BEAT_S


class TimedRecorder(RunRecorder):
    """The real recorder, noting each heartbeat's lag (from the rank's beat) as it takes it in."""

    def __init__(self, start: float, stop_beat: int, *args) -> None:
        super().__init__(*args)
        self.start, self.stop_beat, self.lags = start, stop_beat, []

    def consume(self, events: list[tuple]) -> None:
        now = time.monotonic()
        for kind, _, payload in events:
            if kind != "node":
                continue
            node = int(payload["hostname"].removeprefix("node-"))
            for rank, (epoch, steps, *_) in payload["beats"].items():
                beat = (epoch - 1) * BEATS_PER_EPOCH + steps
                if beat < self.stop_beat:  # from the hang on, the beats repeat one position: no beat number
                    self.lags.append(now - (scheduled(self.start, beat, node) - held_s(rank)))
        super().consume(events)


class NoTakeover:
    """The watcher's run lock: no other driver takes this run directory over."""

    taken_over = threading.Event()


def measure(ranks: int, hang_timeout_s: int, run_root: Path) -> dict:
    """One simulated job of `ranks` ranks, to the watchdog's verdict: its figures (see KEYS)."""
    config = TrainConfig(
        num_workers=ranks,
        epochs=100,
        log_every_steps=1,
        hang_timeout_s=hang_timeout_s,
        storage_path=str(run_root),
        name=f"ranks-{ranks}",
    )
    Path(config.run_dir).mkdir(parents=True)
    monitor = start_monitor()
    monitor_process = psutil.Process(ray.get(monitor.__ray_call__.remote(lambda _self: os.getpid())))
    start = time.monotonic() + 2.0
    stop_beat = WARMUP_EPOCHS * BEATS_PER_EPOCH + 2  # mid-epoch
    stuck_rank = ranks // 2 + 1
    nodes = math.ceil(ranks / RANKS_PER_NODE)
    senders = [
        FakeNodes.remote(monitor, list(range(i, nodes, SENDERS)), ranks, stuck_rank, stop_beat) for i in range(SENDERS)
    ]
    recorder = TimedRecorder(start, stop_beat, config.run_dir, config, 64 * BEATS_PER_EPOCH * ranks, ranks, [])
    stop = threading.Event()
    node_watch = watchdog.NodeWatch(preflight.node_table(), ray.get_runtime_context().gcs_address)
    watcher = threading.Thread(target=watchdog.watch, args=(monitor, recorder, stop, config, node_watch, NoTakeover()))
    for sender in senders:
        sender.run.remote(start, stop_beat + hang_timeout_s + VERDICT_WAIT_S)
    watcher.start()
    driver = psutil.Process()
    time.sleep(max(start + BEATS_PER_EPOCH * BEAT_S - time.monotonic(), 0))  # past the first epoch: steady state
    window_start, cpu_start = time.monotonic(), _cpu_seconds(driver, monitor_process)
    named_s = _wait_for_verdict(recorder, start + stop_beat * BEAT_S + hang_timeout_s)
    cpu_cores = (_cpu_seconds(driver, monitor_process) - cpu_start) / (time.monotonic() - window_start)
    rss_mib = sum(p.memory_info().rss for p in (driver, monitor_process)) / 2**20
    stop.set()
    watcher.join()
    sender_behind_s = max(ray.get([sender.behind_s.remote() for sender in senders]))
    for actor in (*senders, monitor):
        ray.kill(actor)
    lags = sorted(recorder.lags)
    return {
        "ranks": ranks,
        "driver_cpu_cores": round(cpu_cores, 3),
        "driver_rss_mib": round(rss_mib, 1),
        "heartbeat_lag_p99_s": round(lags[int(0.99 * (len(lags) - 1))], 3) if lags else None,
        "stopped_rank_named_s": named_s,
        "epoch_record_bytes": _last_line_bytes(Path(config.run_dir) / "metrics.jsonl"),
        "step_record_bytes": _last_line_bytes(Path(config.run_dir) / "steps.jsonl"),
        "named_rank": _named_rank(recorder.hangs),
        "stuck_rank": stuck_rank,
        "heartbeats_seen": len(lags),
        "sender_behind_s": round(sender_behind_s, 2),
        "verdict_chars": len(recorder.hangs[0]) if recorder.hangs else None,
    }


VERDICT_WAIT_S = 40  # past the hang timeout, after which the watchdog is called too late


def _cpu_seconds(*processes: psutil.Process) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def _wait_for_verdict(recorder: RunRecorder, due: float) -> float | None:
    """Seconds past `due` (the stall's start plus the hang timeout) the watchdog named a rank; None: not in time."""
    while time.monotonic() < due + VERDICT_WAIT_S:
        if recorder.hangs:
            return round(time.monotonic() - due, 2)
        time.sleep(0.05)
    return None


def _named_rank(verdicts: list[str]) -> int | None:
    """The rank a verdict names first (the one furthest behind)."""
    match = re.search(r"last seen: rank (\d+)", verdicts[0]) if verdicts else None
    return int(match.group(1)) if match else None


def _last_line_bytes(path: Path) -> int | None:
    lines = path.read_bytes().splitlines() if path.exists() else []
    return len(lines[-1]) if lines else None


def _or_never(seconds: float | None) -> str:
    return f"not within {VERDICT_WAIT_S} s" if seconds is None else str(seconds)


def _bytes(size: int | None) -> str:
    return "none written" if size is None else f"{size:,}"


def table(results: list[dict]) -> str:
    header = (
        "| Ranks | Driver CPU (cores) | Driver RSS (MiB) | Heartbeat lag p99 (s) | Stuck rank named (s past "
        "timeout) | Rank named (stuck) | metrics.jsonl record (bytes) | steps.jsonl record (bytes) | Senders "
        "behind (s) |"
    )
    rows = [
        f"| {r['ranks']:,} | {r['driver_cpu_cores']:.2f} | {r['driver_rss_mib']:,.0f} | {r['heartbeat_lag_p99_s']} "
        f"| {_or_never(r['stopped_rank_named_s'])} | {r['named_rank']} ({r['stuck_rank']}) "
        f"| {_bytes(r['epoch_record_bytes'])} | {_bytes(r['step_record_bytes'])} | {r['sender_behind_s']} |"
        for r in results
    ]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096])
    parser.add_argument("--hang-timeout-s", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the figures per size here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("raytrain_ddp").setLevel(logging.CRITICAL)  # a verdict at 4,096 ranks is one huge line
    ray.init(
        address="local",
        num_cpus=SENDERS,
        object_store_memory=OBJECT_STORE_BYTES,
        include_dashboard=False,
        logging_level="ERROR",
    )
    results = []
    with tempfile.TemporaryDirectory() as run_root:
        for ranks in args.ranks:
            results.append(measure(ranks, args.hang_timeout_s, Path(run_root)))
            log.info("%s", json.dumps(results[-1]))
    ray.shutdown()
    publish(results, table(results), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
