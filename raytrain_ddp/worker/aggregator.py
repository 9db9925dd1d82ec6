"""One message a second per node, not per rank: the node's ranks post their heartbeats to its aggregator.

A :class:`NodeAggregator` is a zero-CPU actor pinned to its node (the run monitor starts one per node, when
the node's first rank asks: `RunMonitor.aggregator_for`). It outlives the death of any rank: a rank that
stops is seen as a rank whose beats stopped (its age grows in the node's messages), never as a silent
node. Once a second it posts to the monitor one compact message (:meth:`NodeNews.message`): each rank's
latest position and how long ago it beat, the slowest and the silent ranks, and the step records and epoch
messages the ranks handed over, in their order. An epoch's message (and a launched rank's last reports) is
posted at once, with whatever the node had queued, and the rank's call returns only when the monitor has
it: the rank's last news reaches the driver before the rank returns. A rank whose aggregator is gone posts
to the monitor itself (`metrics.DriverLink`): a lost aggregator costs the driver calls, never news.

No torch here: the aggregator's process imports this alone.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from raytrain_ddp.worker.channel import RayChannel

log = logging.getLogger("raytrain_ddp")

POST_INTERVAL_S = 1.0  # as often as a rank beats (Heartbeat.INTERVAL_S)
SILENT_AFTER_S = 3.0  # a rank that has not beaten for this long is named silent in its node's messages
FORGET_AFTER_S = 600.0  # a rank silent this long is gone (a restarted group's): its node stops naming it
POST_TIMEOUT_S = 30.0


class NodeNews:
    """What a node's ranks said since the node's last message (no Ray: the simulator runs it in-process)."""

    def __init__(self, node_id: str, hostname: str) -> None:
        self.node_id, self.hostname = node_id, hostname
        self.beats: dict[int, tuple] = {}  # rank -> its latest position, since the last message
        self.heard: dict[int, float] = {}  # rank -> when it last beat (this node's monotonic clock)
        self.events: list[tuple] = []  # (kind, rank, payload) for the recorder, in the order the ranks sent them
        self.queued = self.delivered = 0  # events ever queued; of them, how many the monitor took (in order)
        self.stop_reason: str | None = None  # the driver's, as the last message's answer said

    def beat(self, rank, epoch, micro_batches, samples, loss, phase, phase_done, step_records) -> str | None:
        """A rank's heartbeat (`RunMonitor.progress`'s arguments); answers the driver's stop request, if any."""
        self.beats[rank] = (epoch, micro_batches, samples, loss, phase, phase_done)
        self.heard[rank] = time.monotonic()
        if step_records:
            self.add("steps", rank, step_records)
        return self.stop_reason

    def add(self, kind: str, rank: int, payload) -> int:
        """News to pass on as it is: "epoch" (a rank's epoch message), "steps" (its step records); returns its
        number: once `delivered` reaches it, the monitor has it."""
        self.events.append((kind, rank, payload))
        self.queued += 1
        return self.queued

    def message(self) -> dict:
        """The node's message, and a clean slate: per rank that beat, its position and the seconds since the
        beat (`RunMonitor.node_news` turns them into times on the driver's clock)."""
        now = time.monotonic()
        for rank in [rank for rank, at in self.heard.items() if now - at > FORGET_AFTER_S]:
            del self.heard[rank]
        silent = {rank: round(now - at, 1) for rank, at in self.heard.items() if now - at > SILENT_AFTER_S}
        message = {
            "node_id": self.node_id,
            "hostname": self.hostname,
            "beats": {rank: (*where, now - self.heard[rank]) for rank, where in self.beats.items()},
            "slowest": min(self.beats, key=lambda rank: self.beats[rank][:2]) if self.beats else None,
            "silent": silent,
            "events": self.events,
        }
        self.beats, self.events = {}, []
        return message

    def unsent(self, message: dict) -> None:
        """A message the monitor did not take: its news goes out with the next one (newer beats win)."""
        now = time.monotonic()
        self.events[:0] = message["events"]
        for rank, (*where, _age) in message["beats"].items():
            self.beats.setdefault(rank, tuple(where))
            self.heard.setdefault(rank, now)

    def answered(self, message: dict, stop_reason: str | None) -> None:
        """The monitor took `message`; `stop_reason`: its answer."""
        self.delivered += len(message["events"])
        self.stop_reason = self.stop_reason or stop_reason


@ray.remote(num_cpus=0, max_restarts=-1, max_concurrency=64)  # ranks' calls answer while the poster waits
class NodeAggregator:
    """A node's :class:`NodeNews`, posted to the run monitor once a second from a thread of its own."""

    def __init__(self, monitor, node_id: str, hostname: str) -> None:
        self.monitor, self.news = RayChannel(monitor), NodeNews(node_id, hostname)
        self.state = threading.Lock()  # the news, between the ranks' calls and the poster
        self.posting = threading.Lock()  # one message at a time: a rank's news reaches the monitor in order
        threading.Thread(target=self._post_forever, daemon=True, name="node-news").start()

    def progress(self, *beat) -> str | None:
        with self.state:
            return self.news.beat(*beat)

    def epoch_finished(self, rank: int, metrics: dict, step_records: list[dict]) -> str | None:
        """A rank's epoch message: posted now with what the node had queued; returns once the monitor has it."""
        return self._deliver([("steps", rank, step_records)] if step_records else [], ("epoch", rank, metrics))

    def add_step_records(self, rank: int, step_records: list[dict]) -> str | None:
        """A launched rank's last reports, before it returns: posted now."""
        return self._deliver([], ("steps", rank, step_records))

    def _deliver(self, events: list[tuple], last: tuple) -> str | None:
        """Queue the events and post them, unless a post that took them (the node's ranks end an epoch together:
        one post carries most of their messages) has delivered them meanwhile."""
        with self.state:
            for event in events:
                self.news.add(*event)
            number = self.news.add(*last)
        return self._post(unless_delivered=number)

    def _post(self, unless_delivered: int | None = None) -> str | None:
        """Post what the node has (a message a previous post took is in the monitor, or back in the news, once
        this one holds `posting`); a refused post puts its news back and raises."""
        with self.posting:
            with self.state:
                if unless_delivered is not None and self.news.delivered >= unless_delivered:
                    return self.news.stop_reason
                message = self.news.message()
            try:
                reply = self.monitor.call("node_news", message, timeout=POST_TIMEOUT_S)
            except Exception:
                with self.state:
                    self.news.unsent(message)
                raise
            with self.state:
                self.news.answered(message, reply)
            return reply

    def _post_forever(self) -> None:
        while True:
            time.sleep(POST_INTERVAL_S)
            if not self.news.heard and not self.news.events:
                continue  # no rank here yet (or any more)
            try:
                self._post()
            except Exception as err:  # the monitor restarting or busy: the news waits for the next post
                log.warning("node %s: the run monitor did not take its news (%s)", self.news.hostname, err)
