"""The watchdog's view of the workers: where each rank was last seen, and when any rank last moved.

A rank's position is what its heartbeat says: epoch, micro-batches started,
phase, and the progress inside the phase (validation batches done, the
checkpoint stage reached), so a long validation pass or checkpoint that keeps
moving is never taken for a hang, and one that stops is named with where it
stopped. Deadlines run on the monotonic clock: a wall-clock step (NTP, a
suspended VM) neither fires nor postpones them.
"""

from __future__ import annotations

import time

from raytrain_ddp.errors import bounded, plural
from raytrain_ddp.worker.aggregator import SILENT_AFTER_S
from raytrain_ddp.worker.phases import CHECKPOINT_STAGES

# A stall's description names this many ranks, the furthest behind first (and as many silent ones): listing
# every rank made one line of 245,000 characters at 4,096 ranks (docs/scale.md).
STALL_RANKS_SHOWN = 16

# Within an epoch: the earlier phase is behind (compiling happens inside training, or validation's first batch).
PHASE_ORDER = {
    "starting": 0,
    "training": 1,
    "compiling": 1,
    "validating": 2,
    "checkpointing": 3,
    "writing checkpoint": 3,
}


def describe_phase(progress: dict) -> str:
    """A heartbeat's phase in words, with its progress: 'validating (3 batches done)', 'checkpointing (saving)'."""
    phase, done = progress["phase"], progress["phase_done"]
    if phase == "validating":
        return f"validating ({done} batch{'es' if done != 1 else ''} done)"
    if phase == "checkpointing":
        return f"checkpointing ({CHECKPOINT_STAGES[done]})"
    if phase == "writing checkpoint":
        return f"writing checkpoint ({done / 2**20:.1f} MiB of shards written)"
    return phase


class Liveness:
    """Per-rank positions from the heartbeats, the time of the last news, and the watchdog's verdicts."""

    def __init__(self) -> None:
        self.positions: dict[int, dict] = {}  # rank -> its latest heartbeat, with "position" and "moved_at"
        self.last_news = time.monotonic()  # when any rank last said it was moving
        self.hangs: list[str] = []  # the watchdog's verdicts
        self.stuck_nodes: list[str] = []  # host names of the ranks it ended (the Slurm launcher excludes them)
        self.ended_attempt: int | None = None  # the attempt (its restart count) whose stuck rank the watchdog ended
        self.nodes: dict[str, dict] = {}  # host -> its aggregator's latest message: "time", "ranks", "silent"
        self._said_silent: set[str] = set()  # the hosts `newly_silent_nodes` named

    def node_heard(self, message: dict) -> None:
        """A node aggregator's message came (`NodeNews.message`, stamped with the driver's clock)."""
        known = self.nodes.get(message["hostname"], {}).get("ranks", set())
        self.nodes[message["hostname"]] = {
            "time": message["time"],
            "ranks": known | set(message["beats"]),
            "silent": message["silent"],
        }

    def newly_silent_nodes(self, after_s: float) -> dict[str, float]:
        """`silent_nodes` not said before (a node that posts again may be said again)."""
        silent = self.silent_nodes(after_s)
        new = {host: silent_s for host, silent_s in silent.items() if host not in self._said_silent}
        self._said_silent = set(silent)
        return new

    def silent_nodes(self, after_s: float) -> dict[str, float]:
        """Host -> seconds since its aggregator's last message, for the nodes silent longer than `after_s`."""
        now = time.monotonic()
        return {host: now - node["time"] for host, node in self.nodes.items() if now - node["time"] > after_s}

    def heard(self) -> None:
        """News that is not a heartbeat (a rank started, finished an epoch): the run is moving."""
        self.last_news = time.monotonic()

    def silent_for(self) -> float:
        return time.monotonic() - self.last_news

    def track(self, rank: int, progress: dict) -> None:
        """Heartbeats come every second, moving or not: news is a rank whose position changed.

        `progress["time"]` is when the monitor received it, on the monotonic clock of the driver's node.
        """
        position = (progress["epoch"], progress["micro_batches"], progress["phase"], progress["phase_done"])
        previous = self.positions.get(rank)
        if previous is None or previous["position"] != position:
            progress["moved_at"] = progress["time"]
            self.heard()
        else:
            progress["moved_at"] = previous["moved_at"]
        progress["position"] = position
        self.positions[rank] = progress

    def forget(self, ranks) -> None:
        """Ranks that are gone (restarted, on a lost node) have no position until they report again."""
        for rank in ranks:
            self.positions.pop(rank, None)

    @property
    def any_rank_reported(self) -> bool:
        return bool(self.positions)

    @property
    def any_rank_compiling(self) -> bool:
        return any(p["phase"] == "compiling" for p in self.positions.values())

    def _behind_first(self, rank: int) -> tuple:
        p = self.positions[rank]
        return p["epoch"], p["micro_batches"], PHASE_ORDER.get(p["phase"], 0), p["phase_done"]

    def stuck_rank(self) -> int | None:
        """The rank furthest behind (epoch, micro-batches started, phase, progress in it): the likeliest culprit
        of a stall."""
        return min(self.positions, key=self._behind_first) if self.positions else None

    def describe_stall(self, workers: dict[int, dict]) -> str:
        """Where each rank was last seen, behind-most first: the stuck rank leads. `workers`: rank -> its facts."""
        seen = sorted(self.positions, key=lambda rank: (self._behind_first(rank), self.positions[rank]["time"]))
        now = time.monotonic()
        parts = []
        for rank in seen[:STALL_RANKS_SHOWN]:
            p = self.positions[rank]
            host = workers.get(rank, {}).get("hostname", "?")
            unheard = f", no heartbeat for {now - p['time']:.0f}s" if now - p["time"] > SILENT_AFTER_S else ""
            parts.append(
                f"rank {rank} on {host}: {describe_phase(p)}, epoch {p['epoch']} micro-batch {p['micro_batches']}, "
                f"unchanged for {now - p['moved_at']:.0f}s{unheard}"
            )
        if len(seen) > STALL_RANKS_SHOWN:
            parts.append(f"{plural(len(seen) - STALL_RANKS_SHOWN, 'more rank')} as far along or further")
        silent = [r for r in sorted(workers) if r not in self.positions]
        parts += [
            f"rank {r} on {workers[r].get('hostname', '?')}: no news since it started"
            for r in silent[:STALL_RANKS_SHOWN]
        ]
        if len(silent) > STALL_RANKS_SHOWN:
            parts.append(f"{plural(len(silent) - STALL_RANKS_SHOWN, 'more rank')} with no news since they started")
        return "; ".join(parts + self._describe_silent_nodes())

    def _describe_silent_nodes(self) -> list[str]:
        """The nodes whose aggregator stopped posting (the node or its aggregator lost), longest silent first."""
        silent = sorted(self.silent_nodes(SILENT_AFTER_S).items(), key=lambda item: -item[1])
        parts = []
        for host, silent_s in silent[:STALL_RANKS_SHOWN]:
            ranks = sorted(self.nodes[host]["ranks"])
            parts.append(
                f"node {host}: no message from its aggregator for {silent_s:.0f}s "
                f"(its {plural(len(ranks), 'rank')}: {bounded(ranks, STALL_RANKS_SHOWN)})"
            )
        if len(silent) > STALL_RANKS_SHOWN:
            parts.append(f"{plural(len(silent) - STALL_RANKS_SHOWN, 'more node')} silent as long or less")
        return parts
