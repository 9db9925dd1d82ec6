"""The driver's watcher thread: worker news, the hang watchdog, lost nodes.

While ``TorchTrainer.fit()`` blocks the main thread, :func:`watch` drains
the run monitor into the :class:`RunRecorder` and keeps two deadlines: no
rank moving for ``--hang-timeout-s`` (name the stuck rank, end it so Ray Train
restarts from the checkpoint) and, after a node took ranks with it, no room
for the workers within ``--capacity-wait-s`` (name the node, end the run).
Both run on the monotonic clock; what a rank's position is lives in
:mod:`.liveness`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ddp import _ray_compat
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver import preflight, stacks
from raytrain_ddp.driver.monitor import RunRecorder, Verdict
from raytrain_ddp.driver.run_lock import RunLock
from raytrain_ddp.driver.signals import interrupt_main_thread
from raytrain_ddp.errors import named, one_line, plural

log = logging.getLogger("raytrain_ddp")
progress_log = logging.getLogger("raytrain_ddp.progress")  # driver.log only

POLL_INTERVAL_S = 0.5
# Before any rank has reported, the wait is start-up (processes, imports, the process group),
# slow on a busy node; while a rank compiles (torch.compile: no progress to report until it is
# done) the wait is alike: the watchdog allows this long, or --hang-timeout-s if longer.
STARTUP_GRACE_S = 120
NODE_CHECK_INTERVAL_S = 2.0
PROGRESS_LOG_INTERVAL_S = 5.0
# Ray's core worker ends this process 60 s after it lost the GCS (the head node's Ray), with no summary and no
# word of why: the watcher calls the cluster gone well before, and the run ends with both.
CLUSTER_GONE_S = 15.0
# A node aggregator posts every second: one silent this long is said (a node's ranks number 8 or so: listed).
NODE_SILENT_S = 10.0
DRAIN_TIMEOUT_S = 5.0  # a drain that waits longer is retried; the GCS check decides whether the cluster is gone


@ray.remote(num_cpus=0)
def _kill_process(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone already: what the kill was for
        os.kill(pid, signal.SIGKILL)


def _end_stalled_attempt(recorder: RunRecorder, hang_timeout_s: int) -> None:
    """The watchdog's verdict: name the stuck rank, then end it so Ray Train restarts from the checkpoint; before
    any worker has started, only say that the start is slow."""
    liveness = recorder.liveness
    liveness.heard()  # the restarted attempt (or the start still under way) gets a full timeout of its own
    if liveness.ended_attempt == recorder.restarts:
        return  # its stuck rank is ended: Ray Train ends the attempt (slower than a timeout on a busy node)
    # Nothing to name or end while Ray Train starts the workers: a placement that never comes ends in Ray Train
    # (fit.WORKER_GROUP_PLACEMENT_WAIT_S, then its retries), a node that left in the capacity verdict.
    if not recorder.workers and not liveness.any_rank_reported:
        log.warning(
            "Watchdog: no worker has started in %ds; Ray Train is still starting them (new processes importing "
            "torch, slow on a busy node); waiting on",
            hang_timeout_s,
        )
        return
    verdict = f"no rank made progress for {hang_timeout_s}s; last seen: {liveness.describe_stall(recorder.workers)}"
    stuck = liveness.stuck_rank()
    if recorder.launched:  # a script's ranks: no phase to tell them apart, but their stacks can
        stuck, verdict = _named_by_stacks(recorder, hang_timeout_s) or (stuck, verdict)
    log.error("Watchdog: %s", verdict)
    liveness.hangs.append(verdict)
    worker = recorder.workers.get(stuck)
    if worker is None:
        return
    log.error(
        "Watchdog: ending rank %d (pid %d on %s); %s",
        worker["rank"],
        worker["pid"],
        worker["hostname"],
        _next(recorder),
    )
    liveness.stuck_nodes.append(worker["hostname"])
    liveness.ended_attempt = recorder.restarts
    on_its_node = NodeAffinitySchedulingStrategy(worker["node_id"], soft=False)
    ray.get(_kill_process.options(scheduling_strategy=on_its_node).remote(worker["pid"]), timeout=30)


def _next(recorder: RunRecorder) -> str:
    """What follows the end of a stuck rank: a restart while the run has restarts left, else the end."""
    if recorder.restarts >= recorder.config.max_failures:
        flag = "--max-restarts" if recorder.launched else "--max-failures"
        return f"the run ends: no restarts are left ({flag} {recorder.config.max_failures})"
    if recorder.launched:
        return "Ray Train restarts every rank's script"
    return "Ray Train restarts the workers from the last checkpoint"


def _named_by_stacks(recorder: RunRecorder, hang_timeout_s: int) -> tuple[int, str] | None:
    """(the rank, the verdict) when exactly one rank's stack is outside a collective: the one the others wait
    for. Every rank's stack goes to driver.log."""
    taken = stacks.take(recorder.workers)
    for rank, stack in sorted(taken.items()):
        progress_log.info("Watchdog: rank %d's stack (py-spy dump):\n%s", rank, stack)
        if stack.startswith("no stack"):
            log.warning("Watchdog: rank %d: %s", rank, stack)
    outside = stacks.outside_collectives(taken, recorder.workers)
    if len(outside) != 1:
        return None
    rank, frames = next(iter(outside.items()))
    where = " <- ".join(frames[: stacks.TOP_FRAMES])
    others = "; the others wait in one" if len(taken) > 1 else ""
    return rank, (
        f"no rank made progress for {hang_timeout_s}s; rank {rank} on {recorder.workers[rank]['hostname']} is not "
        f"inside a collective{others}: {where} (every rank's stack: driver.log)"
    )


class NodeWatch:
    """The Ray cluster's nodes as the run goes on: which left, which joined; whether its GCS still answers."""

    def __init__(self, nodes: list[dict], gcs_address: str) -> None:
        self.alive = {node["node_id"]: node for node in nodes}
        self.checked = time.monotonic()
        self.gcs_address = gcs_address
        self.gcs_host, self.gcs_port = preflight.split_address(gcs_address)
        self.gcs_silent_since: float | None = None
        self.own_gcs = _ray_compat.own_gcs_process()  # a Ray this command started: its GCS cannot come back

    def own_gcs_ended(self) -> bool:
        """The GCS of the Ray this command started has exited (None while it runs, or when it joined a cluster)."""
        return self.own_gcs is not None and self.own_gcs.poll() is not None

    def gcs_silent_for(self) -> float:
        """Seconds the GCS has refused connections or let them time out; 0 while it accepts them. A plain TCP
        connect: Ray's own calls wait (up to the 60 s above) instead of failing."""
        self.checked = time.monotonic()
        try:
            preflight.connect(self.gcs_host, self.gcs_port, timeout=2)
        except OSError:
            self.gcs_silent_since = self.gcs_silent_since or time.monotonic()
            return time.monotonic() - self.gcs_silent_since
        self.gcs_silent_since = None
        return 0.0

    def changes(self) -> tuple[list[dict], list[dict]]:
        """(lost, joined) since the last look."""
        self.checked = time.monotonic()
        now = {node["node_id"]: node for node in preflight.node_table()}
        lost = [node for node_id, node in self.alive.items() if node_id not in now]
        joined = [node for node_id, node in now.items() if node_id not in self.alive]
        self.alive = now
        return lost, joined


def _note_node_changes(config: TrainConfig, recorder: RunRecorder, node_watch: NodeWatch) -> None:
    lost, joined = node_watch.changes()
    for node in lost:
        ranks = recorder.node_lost(node)
        on_it = f": {named('rank', ranks)} ran there" if ranks else ""
        log.error("Lost node %s (%s) from the Ray cluster%s", node["hostname"], node["node_ip"], on_it)
        if ranks:
            log.warning(
                "Ray Train restarts the workers from the latest checkpoint once there is room for %d; "
                "waiting up to %ds (--capacity-wait-s)",
                config.fewest_workers,
                config.capacity_wait_s,
            )
    for node in joined:
        log.info("Node %s (%s) joined the Ray cluster", node["hostname"], node["node_ip"])


def _note_silent_nodes(recorder: RunRecorder) -> None:
    """A node whose aggregator stopped posting while the node is still in the cluster: said once (its ranks post
    to the monitor themselves meanwhile, `DriverLink`; the node itself lost is `_note_node_changes`'s)."""
    for host, silent_s in recorder.liveness.newly_silent_nodes(NODE_SILENT_S).items():
        ranks = sorted(recorder.liveness.nodes[host]["ranks"])
        log.warning(
            "Node %s: no message from its aggregator for %.0fs (the aggregator lost or stuck); its %s: %s",
            host,
            silent_s,
            plural(len(ranks), "rank"),
            ", ".join(map(str, ranks)),
        )


def _capacity_verdict(config: TrainConfig, recorder: RunRecorder) -> str:
    """Why the run gives up after a node loss, and what to do: one line."""
    lost = "; ".join(
        f"{n['hostname']} ({n['node_ip']}, {named('rank', n['ranks'])})" for n in recorder.lost_nodes if n["ranks"]
    )
    fits = preflight.most_workers(config, preflight.node_table())
    hint = "" if config.min_workers or not fits else f", or let it go on with fewer: --min-workers {fits}"
    return (
        f"lost node {lost} after {plural(len(recorder.epochs), 'epoch')}; "
        f"room for {plural(config.fewest_workers, 'worker')} did not come "
        f"back within {config.capacity_wait_s}s (the cluster now holds {fits}); the checkpoints are kept: "
        f"run the same command again when the nodes are back{hint}"
    )


def _end_lost_cluster(recorder: RunRecorder, node_watch: NodeWatch, silent_s: float) -> None:
    """The head node's Ray is gone, and with it the cluster: say so, and end fit() in the main thread as Ctrl-C
    would (nothing of the cluster is left to stop)."""
    if node_watch.own_gcs_ended():
        why = f"ended (the Ray this command started; exit code {node_watch.own_gcs.returncode})"
    else:
        why = (
            f"has not answered for {silent_s:.0f}s (Ray ended on its head node: the node, its Slurm step or `ray stop`)"
        )
    recorder.verdict = Verdict(
        f"the Ray cluster went away: its GCS at {node_watch.gcs_address} {why}; the checkpoints are kept: run the "
        f"same command again to resume",
        cluster_gone=True,
    )
    log.error("Giving up: %s", recorder.verdict.reason)
    interrupt_main_thread()


def log_progress(recorder: RunRecorder, last_logged: float) -> float:
    """Every PROGRESS_LOG_INTERVAL_S, where the ranks stand, to driver.log; returns when it was last logged."""
    if time.monotonic() - last_logged >= PROGRESS_LOG_INTERVAL_S and (line := recorder.progress_line()):
        progress_log.info(line)
        return time.monotonic()
    return last_logged


def watch(
    monitor, recorder: RunRecorder, stop: threading.Event, config: TrainConfig, node_watch: NodeWatch, lock: RunLock
) -> None:
    """Drain the monitor until training ends (then once more), watching for a stall and for lost nodes, and
    ending the run when another driver took its directory over (then nothing more is recorded there).

    Every few seconds a progress line goes to driver.log (not the console,
    which gets one row per epoch), so a log shows where a long epoch stands.
    """
    last_logged, liveness = time.monotonic(), recorder.liveness
    drained = None  # a drain not yet answered: waited for again, never asked anew (its events would be lost)
    monitor_silent = False  # said once, while the monitor does not answer
    while not stop.wait(POLL_INTERVAL_S):
        try:
            if lock.taken_over.is_set():  # every poll until fit() returns: a controller that starts late goes too
                recorder.verdict = recorder.verdict or Verdict(lock.takeover_message())
                _ray_compat.kill_train_controller()  # TorchTrainer.fit() raises: the run ends
                continue
            if time.monotonic() - node_watch.checked >= NODE_CHECK_INTERVAL_S:
                silent_s = node_watch.gcs_silent_for()
                if silent_s > CLUSTER_GONE_S or node_watch.own_gcs_ended():
                    _end_lost_cluster(recorder, node_watch, silent_s)
                    break
                if silent_s:
                    continue  # Ray's calls would wait for it
                _note_node_changes(config, recorder, node_watch)
                _note_silent_nodes(recorder)
            drained = drained or monitor.drain.remote()
            recorder.consume(ray.get(drained, timeout=DRAIN_TIMEOUT_S))
            drained, monitor_silent = None, False
            if recorder.interrupted_at is not None:  # no group to watch: waiting for capacity
                if time.monotonic() - recorder.interrupted_at > config.capacity_wait_s and not recorder.verdict:
                    recorder.verdict = Verdict(_capacity_verdict(config, recorder))
                    log.error("Giving up: %s", recorder.verdict.reason)
                    _ray_compat.kill_train_controller()  # TorchTrainer.fit() raises: the run ends
                continue
            quiet_start = not liveness.any_rank_reported or liveness.any_rank_compiling
            allowed_s = max(config.hang_timeout_s, STARTUP_GRACE_S) if quiet_start else config.hang_timeout_s
            if liveness.silent_for() > allowed_s:
                _end_stalled_attempt(recorder, allowed_s)
            last_logged = log_progress(recorder, last_logged)
        except ray.exceptions.GetTimeoutError:
            continue  # the GCS check above tells a slow monitor from a cluster gone
        except ray.exceptions.RayActorError as err:  # the monitor's process or node gone (it restarts, if Ray lives)
            drained = None
            if not monitor_silent:
                log.warning("The run monitor does not answer (%s); watching the cluster", one_line(err))
            monitor_silent = True
        except Exception:  # the watcher must outlive a bad message: training goes on regardless
            drained = None
            log.exception("Error while reading worker news (training continues)")
    if not lock.taken_over.is_set() and not recorder.cluster_gone:
        for events in ray.get([*([drained] if drained else []), monitor.drain.remote()]):  # in the order asked
            recorder.consume(events)
