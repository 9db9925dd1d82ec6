"""The training step never makes the host wait for the device outside the documented cadences, and the
heartbeat never touches the device."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from pathlib import Path

import pytest
from worker_hooks import CountSyncs

FIRST, LAST = 5, 125  # the steady micro-batches counted: after the first few, before the epoch's end


def test_steady_steps_synchronise_only_at_the_cadences(tmp_path):
    from raytrain_ddp import TrainConfig, fit
    from raytrain_ddp.worker.loop import NAN_CHECK_EVERY, STOP_CHECK_EVERY

    counts = tmp_path / "counts"
    counts.mkdir()
    # 130 micro-batches per rank; ids recorded, so their path is counted too
    result = fit(
        TrainConfig(
            num_workers=2,
            epochs=1,
            dataset="synthetic-tabular",
            model="mlp",
            train_size=2080,
            val_size=64,
            batch_size=8,
            record_sample_ids=True,
            storage_path=str(tmp_path),
            name="syncs",
            quick_start=True,  # the loop's rule: its local processes
        ),
        hooks=CountSyncs(str(counts), first=FIRST, last=LAST),
    )
    assert result.ok, result.summary["error"]
    # in the window: the loss check of micro-batches FIRST+1..LAST, the stop checks after optimizer steps
    # FIRST..LAST-1 (one micro-batch per step); each of them reads one value from the device
    loss_checks = sum(m % NAN_CHECK_EVERY == 0 for m in range(FIRST + 1, LAST + 1))
    stop_checks = sum(s % STOP_CHECK_EVERY == 0 for s in range(FIRST, LAST))
    assert loss_checks == 1 and stop_checks == 12
    for rank in (0, 1):
        seen = json.loads((counts / f"rank-{rank}.json").read_text())
        assert seen["count"] == loss_checks + stop_checks, seen["calls"]


def _blocked_rank(rank: int, store_dir: str, result_file: str) -> None:
    """Rank 0 sits in an all-reduce, heartbeat running, until rank 1 has seen it post three times."""
    import torch
    import torch.distributed as dist
    import worker_hooks

    from raytrain_ddp.worker.metrics import EpochMeter, Heartbeat

    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=2)
    posts = Path(store_dir) / "posts"
    if rank == 1:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and (not posts.exists() or int(posts.read_text() or 0) < 3):
            time.sleep(0.05)
        dist.all_reduce(torch.ones(1))
        return
    heartbeat_calls = []
    worker_hooks.count_synchronising_calls(
        lambda name: heartbeat_calls.append(name) if threading.current_thread().name == "heartbeat" else None
    )
    meter = EpochMeter()
    meter.add(torch.tensor(2.0), 4)
    meter.refresh_loss()  # what the loop does at its loss-check cadence
    meter.add(torch.tensor(10.0), 4)  # on the device, not yet read back
    in_collective = threading.Event()
    posted = []

    def post(rank, epoch, micro_batches_started, samples, loss, phase, phase_done, step_records):
        posted.append((epoch, micro_batches_started, samples, loss, phase))
        if in_collective.is_set():
            during = sum(1 for p in posted if p[4] == "training")
            posts.write_text(str(during))

    Heartbeat.INTERVAL_S = 0.1
    heartbeat = Heartbeat(post, rank)
    meter.micro_batches_started = 2
    heartbeat.at("training", 1, meter)
    posted.clear()
    in_collective.set()
    dist.all_reduce(torch.ones(1))  # waits for rank 1, which waits for our heartbeats
    during = [p for p in posted if p[4] == "training"]
    Path(result_file).write_text(
        json.dumps({"posts": len(during), "last": during[-1] if during else None, "heartbeat_calls": heartbeat_calls})
    )
    dist.destroy_process_group()


def test_heartbeat_posts_host_values_while_the_training_thread_waits_in_a_collective(tmp_path):
    context = multiprocessing.get_context("spawn")
    result_file = tmp_path / "result.json"
    ranks = [context.Process(target=_blocked_rank, args=(rank, str(tmp_path), str(result_file))) for rank in (0, 1)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=180)
        assert process.exitcode == 0
    result = json.loads(result_file.read_text())
    assert result["posts"] >= 3  # rank 1 released the collective only after seeing them
    assert result["heartbeat_calls"] == []  # the thread never read a tensor
    assert result["last"] == [1, 2, 8, 2.0, "training"]  # the loss as of the last refresh


def test_fsdp_validation_reads_its_batches_as_it_runs_them():
    """Lockstep validation (FSDP) pads to the most batches any rank holds without first reading all of its own:
    never more than one batch ahead of the forwards (each on the device, so a whole val split held at once could
    not fit), and a rank that runs out runs the padding batch, uncounted."""
    import torch

    from raytrain_ddp.worker.metrics import default_loss, evaluate

    pulled, ahead = 0, []

    def batches():
        nonlocal pulled
        for label in (0, 1, 2):
            pulled += 1
            yield {"x": torch.full((2, 3), float(label)), "y": torch.tensor([label, label])}

    class Probe(torch.nn.Module):
        def forward(self, x):
            ahead.append(pulled - len(ahead) - 1)  # batches read beyond the one this forward runs
            return torch.nn.functional.one_hot(x[:, 0].long(), 3).float() * 10

    padding = {"x": torch.zeros(1, 3)}
    scored = evaluate(Probe(), batches(), default_loss, torch.device("cpu"), lockstep=(padding, 5))
    assert len(ahead) == 5 and max(ahead[:3]) == 0  # 3 batches read one at a time, then 2 paddings
    assert scored["val_rows"] == 6 and scored["val_accuracy"] == 1.0


def test_device_feed_ahead_keeps_order_and_the_last_batch():
    import torch

    from raytrain_ddp.worker.device_feed import DeviceFeed

    feed = DeviceFeed(None, "cpu")
    batches = [{"x": torch.full((2,), float(i)), "y": torch.tensor([i])} for i in range(3)]
    assert [(int(b["y"]), last) for b, last in feed.ahead(iter(batches))] == [(0, False), (1, False), (2, True)]
    assert list(feed.ahead(iter([]))) == []


def test_a_nodes_ranks_beat_through_one_aggregator_and_past_it_once_it_is_gone(ray_address):
    """Two ranks of one node: one message for both, an epoch message delivered before the call returns with the
    beats queued before it, the stop request back through the aggregator; its process killed, the ranks post
    to the monitor themselves."""
    import ray

    from raytrain_ddp.driver.monitor import start_monitor
    from raytrain_ddp.worker.channel import RayChannel
    from raytrain_ddp.worker.metrics import DriverLink

    monitor = start_monitor()
    try:
        links = [DriverLink(RayChannel(monitor), rank) for rank in (0, 1)]
        for link in links:
            assert link.post(link.rank, 1, 3 + link.rank, 96, 0.5, "training", 0, []) is None
        links[0].epoch_finished({"epoch": 1, "rank": 0}, [{"step": 4}])  # the monitor has it when this returns
        [(kind, _, message)] = ray.get(monitor.drain.remote())
        assert kind == "node" and sorted(message["beats"]) == [0, 1] and message["slowest"] == 0
        assert message["events"] == [("steps", 0, [{"step": 4}]), ("epoch", 0, {"epoch": 1, "rank": 0})]
        ray.get(monitor.request_stop.remote("preempted"))
        links[1].epoch_finished({"epoch": 1, "rank": 1}, [])  # the node's post brings the answer back
        assert links[0].post(0, 2, 1, 32, 0.5, "training", 0, []) == "preempted"
        aggregator = links[0].aggregator.handle  # the actor behind the rank's channel to it
        ray.kill(aggregator, no_restart=True)
        with pytest.raises(ray.exceptions.RayActorError):  # waits for it to be gone
            for _ in range(300):
                ray.get(aggregator.__ray_call__.remote(lambda _self: None))
                time.sleep(0.1)
        assert links[1].post(1, 2, 1, 32, 0.5, "training", 0, []) == "preempted"
        events = ray.get(monitor.drain.remote())
        assert ("progress", 1) in [(kind, rank) for kind, rank, _ in events]  # straight to the monitor
    finally:
        ray.kill(monitor)
