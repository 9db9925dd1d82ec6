"""The driver's parts that turn worker news into records and verdicts, in-process and without Ray."""

from __future__ import annotations

import json
import threading

import pytest
from support import rank_epoch_message

from raytrain_ddp import TrainConfig
from raytrain_ddp.driver.epochs import (
    PER_RANK_LIMIT,
    aggregate_epoch,
    aggregate_step,
    find_stragglers,
    split_per_rank,
    summarize_ranks,
)
from raytrain_ddp.driver.liveness import Liveness
from raytrain_ddp.driver.monitor import RunRecorder
from raytrain_ddp.driver.run_files import MetricsFile

METRICS_FIELDS = [
    "epoch",
    "train_loss",
    "train_loss_min",
    "train_loss_max",
    "train_loss_per_rank",
    "val_loss",
    "val_accuracy",
    "val_rows",
    "val_loss_per_rank",
    "val_accuracy_per_rank",
    "val_identical_across_ranks",
    "world_size",
    "global_batch_size",
    "samples_per_second",
    "samples_per_rank",
    "micro_batches_per_rank",
    "optimizer_steps_per_rank",
    "skipped_steps_per_rank",
    "grad_allreduces_per_rank",
    "lr",
    "data_wait_seconds_per_rank",
    "micro_batch_seconds_per_rank",
    "allreduce_wait_seconds_per_rank",
    "seconds",
    "stragglers",
]


def test_an_epoch_record_weighs_ranks_by_samples_and_keeps_every_field():
    by_rank = {1: rank_epoch_message(1), 0: rank_epoch_message(0)}
    record = aggregate_epoch(by_rank, TrainConfig(batch_size=8, grad_accum=2))
    assert list(record) == METRICS_FIELDS
    assert record["train_loss"] == pytest.approx((1.0 * 100 + 2.0 * 200) / 300)
    assert (record["train_loss_min"], record["train_loss_max"]) == (1.0, 2.0)
    assert record["train_loss_per_rank"] == [1.0, 2.0]  # in rank order, whatever order they came in
    assert record["world_size"] == 2 and record["global_batch_size"] == 8 * 2 * 2
    assert record["seconds"] == 3.0 and record["samples_per_second"] == 100.0  # the slowest rank's time
    assert record["val_identical_across_ranks"] and record["stragglers"] == []


def test_an_epoch_record_says_when_validation_differs_and_keeps_gpu_memory():
    by_rank = {
        0: rank_epoch_message(0, gpu_memory_peak_gib=1.5),
        1: rank_epoch_message(1, val_accuracy=0.8, gpu_memory_peak_gib=2),
    }
    record = aggregate_epoch(by_rank, TrainConfig())
    assert not record["val_identical_across_ranks"]
    assert record["gpu_memory_peak_gib_per_rank"] == [1.5, 2]


def test_stragglers_name_the_slow_input_pipeline_and_the_slow_compute():
    slow_data = {"data_wait_seconds_per_rank": [0.1, 3.0, 0.1], "allreduce_wait_seconds_per_rank": [1.0, 1.0, 1.0]}
    assert [s["rank"] for s in find_stragglers(slow_data)] == [1]
    slow_compute = {"data_wait_seconds_per_rank": [0.1, 0.1], "allreduce_wait_seconds_per_rank": [2.0, 0.1]}
    (straggler,) = find_stragglers(slow_compute)
    assert straggler["rank"] == 1 and "its compute is the bottleneck" in straggler["why"]
    no_wait_measured = {"data_wait_seconds_per_rank": [0.1, 0.1], "allreduce_wait_seconds_per_rank": [None, None]}
    assert find_stragglers(no_wait_measured) == []


def _step(step: int, rank: int, loss: float, samples: int = 64, seconds: float = 1.0) -> dict:
    """A rank's record of a recorded step, as `EpochMeter.refresh_loss` makes it."""
    return {"step": step, "epoch": 1, "lr": 0.1, "loss": loss, "samples": samples, "seconds": seconds}


def test_a_step_record_weighs_ranks_by_samples_over_the_slowest_ranks_time():
    record = aggregate_step({1: _step(10, 1, 3.0, samples=192, seconds=2.0), 0: _step(10, 0, 1.0)})
    assert record == {
        "step": 10,
        "epoch": 1,
        "train_loss": (1.0 * 64 + 3.0 * 192) / 256,
        "train_loss_min": 1.0,
        "train_loss_max": 3.0,
        "train_loss_per_rank": [1.0, 3.0],
        "lr": 0.1,
        "samples_per_second": 128.0,
        "seconds": 2.0,
        "world_size": 2,
    }


def test_the_recorder_writes_each_step_once_every_rank_has_it_and_a_step_trained_again_replaces(tmp_path):
    config = TrainConfig(num_workers=2, log_every_steps=10, storage_path=str(tmp_path), name="unit")
    config.run_dir.mkdir(parents=True)
    recorder = RunRecorder(config.run_dir, config, train_rows=512, world_size=2, sinks=[])
    steps_file = config.run_dir / "steps.jsonl"

    def written() -> list[tuple[int, float]]:
        return [(r["step"], r["train_loss"]) for r in map(json.loads, steps_file.read_text().splitlines())]

    recorder.consume([("steps", 0, [_step(10, 0, 2.0), _step(20, 0, 1.0)])])
    assert not steps_file.exists()  # rank 1 has not sent them
    recorder.consume([("steps", 1, [_step(10, 1, 4.0)]), ("steps", 1, [_step(20, 1, 3.0)])])
    assert written() == [(10, 3.0), (20, 2.0)]
    recorder.consume([("steps", 0, [_step(30, 0, 1.0)])])  # the group restarts from a checkpoint at step 10:
    recorder.consume([("started", 0, {"rank": 0, "world_size": 2, "hostname": "h", "node_id": "n"})])
    recorder.consume([("steps", rank, [_step(20, rank, 5.0)]) for rank in (0, 1)])
    assert written() == [(10, 3.0), (20, 5.0)]  # step 20 trained again; step 30's half record is gone
    resumed = RunRecorder(config.run_dir, config, 512, 2, [])  # the same command again: appends after them
    resumed.consume([("steps", rank, [_step(30, rank, 0.5)]) for rank in (0, 1)])
    assert written() == [(10, 3.0), (20, 5.0), (30, 0.5)]
    off = TrainConfig(num_workers=2, log_every_steps=0, storage_path=str(tmp_path), name="off")
    off.run_dir.mkdir(parents=True)
    assert RunRecorder(off.run_dir, off, 512, 2, []).steps_file is None


def test_the_meter_reads_the_marked_steps_with_the_loss_each_over_its_own_micro_batches():
    import torch

    from raytrain_ddp.worker.metrics import EpochMeter

    meter = EpochMeter()
    for loss, mark in ((1.0, None), (3.0, {"step": 2}), (5.0, None), (6.0, None), (7.0, {"step": 5})):
        meter.add(torch.tensor(loss), 4)
        if mark:
            meter.mark_step(mark)
    meter.add(torch.tensor(100.0), 4)  # after the last marked step: in no step record
    assert meter.step_records == []  # nothing read before the refresh
    assert meter.refresh_loss() == pytest.approx(122 / 6)
    assert [(r["step"], r["loss"], r["samples"]) for r in meter.step_records] == [(2, 2.0, 8), (5, 6.0, 12)]
    assert all(r["seconds"] >= 0 for r in meter.step_records)


def _beat(epoch: int, steps: int, phase: str, phase_done: int = 0) -> dict:
    """A heartbeat as the monitor hands it over."""
    return {"epoch": epoch, "micro_batches": steps, "samples": 0, "loss": 1.0, "phase": phase, "phase_done": phase_done}


def _quiet_for_a_while(liveness: Liveness) -> None:
    liveness.last_news -= 1000  # as if nothing had moved for 1000 s


def test_a_long_phase_that_reports_progress_is_not_a_stall_and_one_that_stops_is():
    liveness = Liveness()
    liveness.track(0, {**_beat(1, 8, "validating", 1), "time": 1.0})
    _quiet_for_a_while(liveness)
    liveness.track(0, {**_beat(1, 8, "validating", 2), "time": 2.0})  # same phase, one batch more: it moves
    assert liveness.silent_for() < 1000
    _quiet_for_a_while(liveness)
    liveness.track(0, {**_beat(1, 8, "validating", 2), "time": 3.0})  # the same place again: no news
    assert liveness.silent_for() >= 1000
    assert liveness.positions[0]["moved_at"] == 2.0
    for stage in (1, 2):  # checkpoint stages move too
        _quiet_for_a_while(liveness)
        liveness.track(0, {**_beat(1, 8, "checkpointing", stage), "time": 3.0 + stage})
        assert liveness.silent_for() < 1000


def test_a_stall_inside_validation_names_the_rank_behind_and_its_progress():
    liveness = Liveness()
    liveness.track(0, {**_beat(2, 8, "validating", 5), "time": 1.0})  # done, waiting in the all-reduce
    liveness.track(1, {**_beat(2, 8, "validating", 2), "time": 1.0})
    liveness.track(2, {**_beat(2, 8, "checkpointing", 1), "time": 1.0})
    workers = {rank: {"hostname": f"node-{rank}"} for rank in range(4)}
    assert liveness.stuck_rank() == 1
    verdict = liveness.describe_stall(workers)
    assert verdict.startswith("rank 1 on node-1: validating (2 batches done), epoch 2 micro-batch 8, unchanged for ")
    assert "rank 0 on node-0: validating (5 batches done)" in verdict
    assert "rank 2 on node-2: checkpointing (saving), epoch 2 micro-batch 8" in verdict
    assert verdict.endswith("rank 3 on node-3: no news since it started")


def test_in_training_the_rank_that_started_fewer_micro_batches_is_the_stuck_one():
    liveness = Liveness()
    liveness.track(0, {**_beat(1, 4, "training"), "time": 1.0})  # waits in the all-reduce of micro-batch 4
    liveness.track(1, {**_beat(1, 3, "training"), "time": 1.0})
    assert liveness.stuck_rank() == 1
    assert not liveness.any_rank_compiling
    liveness.track(0, {**_beat(1, 4, "compiling"), "time": 2.0})
    assert liveness.any_rank_compiling


def test_a_start_slower_than_the_grace_is_said_as_a_start_and_a_silent_started_rank_is_a_hang(tmp_path, caplog):
    from raytrain_ddp.driver.watchdog import _end_stalled_attempt

    config = TrainConfig(num_workers=2, storage_path=str(tmp_path), name="unit")
    recorder = RunRecorder(config.run_dir, config, train_rows=512, world_size=2, sinks=[])
    _quiet_for_a_while(recorder.liveness)
    with caplog.at_level("WARNING", logger="raytrain_ddp"):
        _end_stalled_attempt(recorder, 120)  # no worker has started: nothing to name, nothing is a hang
    assert recorder.liveness.hangs == [] and recorder.liveness.silent_for() < 1000
    [record] = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage() == (
        "Watchdog: no worker has started in 120s; Ray Train is still starting them (new processes importing torch, "
        "slow on a busy node); waiting on"
    )
    # a worker that started and never reported is named; with no position to compare, none is ended
    recorder.consume([("started", 1, {"rank": 1, "world_size": 2, "hostname": "h1", "node_id": "n"})])
    _end_stalled_attempt(recorder, 120)
    [verdict] = recorder.liveness.hangs
    assert verdict == "no rank made progress for 120s; last seen: rank 1 on h1: no news since it started"
    assert recorder.liveness.stuck_nodes == []


def test_the_recorder_turns_a_whole_epoch_into_metrics_jsonl_and_counts_restarts(tmp_path, caplog):
    config = TrainConfig(num_workers=2, epochs=2, storage_path=str(tmp_path), name="unit")
    config.run_dir.mkdir(parents=True)
    recorder = RunRecorder(config.run_dir, config, train_rows=512, world_size=2, sinks=[])
    started = [("started", rank, {"rank": rank, "world_size": 2, "hostname": "h", "node_id": "n"}) for rank in (0, 1)]
    with caplog.at_level("INFO", logger="raytrain_ddp"):
        recorder.consume(started + [("progress", 0, {**_beat(1, 1, "training"), "time": 1.0})])
        recorder.consume([("epoch", 0, rank_epoch_message(0))])
        assert recorder.epochs == {}  # half an epoch: nothing written
        recorder.consume([("epoch", 1, rank_epoch_message(1)), ("finished", 0, "abc")])
    lines = (config.run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["epoch"] for line in lines] == [1]
    assert recorder.checksums == {0: "abc"} and recorder.restarts == 0
    assert "epoch  train loss (min..max over ranks)" in caplog.text
    assert MetricsFile(config.run_dir).read() == recorder.epochs  # what a resumed run reads back
    assert not (config.run_dir / "metrics.jsonl.tmp").exists()
    recorder.consume([("started", 0, {"rank": 0, "world_size": 1, "hostname": "h", "node_id": "n"})])
    assert recorder.restarts == 1 and recorder.world_size == 1 and list(recorder.workers) == [0]
    assert RunRecorder(config.run_dir, config, 512, 2, []).epochs == recorder.epochs


def test_the_heartbeat_posts_validation_progress_and_compilation_as_a_phase(monkeypatch):
    import torch
    from torch._dynamo.callback import callback_handler

    from raytrain_ddp.worker.metrics import EpochMeter, Heartbeat

    posted: list[tuple] = []
    seen = {phase: threading.Event() for phase in ("validating", "compiling", "training")}

    def post(rank, epoch, micro_batches_started, samples, loss, phase, phase_done, step_records):
        posted.append((phase, phase_done))
        steps_posted.extend(step_records)
        if phase in seen:
            seen[phase].set()

    steps_posted: list[dict] = []
    monkeypatch.setattr(Heartbeat, "INTERVAL_S", 0.02)
    heartbeat = Heartbeat(post, rank=0)
    heartbeat.step_records.extend([{"step": 10}, {"step": 20}])  # what the loop's loss check hands over
    heartbeat.at("validating", 1, EpochMeter())
    heartbeat.advance(3)
    assert seen["validating"].wait(30)
    assert ("validating", 3) in posted
    heartbeat.step_records.append({"step": 30})
    sent: list[dict] = []
    heartbeat.send_step_records(sent.extend)  # the epoch's message takes what no beat has posted yet
    assert steps_posted + sent == [{"step": 10}, {"step": 20}, {"step": 30}]
    heartbeat.at("training", 1, EpochMeter())
    heartbeat.follow_compiles()

    def hold_compilation_until_posted(_args) -> None:  # runs after the heartbeat's own start callback
        assert seen["compiling"].wait(30)

    callback_handler.register_start_callback(hold_compilation_until_posted)
    try:
        torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
    finally:
        for callback in (hold_compilation_until_posted, heartbeat._compile_started):
            callback_handler.remove_start_callback(callback)
        callback_handler.remove_end_callback(heartbeat._compile_ended)
    assert seen["compiling"].is_set()
    seen["training"].clear()
    assert seen["training"].wait(30)  # compiled: back to the phase it interrupted


def _training_beat(epoch: int, steps: int, samples: int) -> dict:
    """A training heartbeat as `Liveness.positions` holds it."""
    return {"epoch": epoch, "micro_batches": steps, "samples": samples, "loss": 0.5, "phase": "training"}


def test_the_progress_line_rates_the_epoch_from_its_first_heartbeat_not_from_its_first_logged_line(monkeypatch):
    """Heartbeats come every second; a line is logged every PROGRESS_LOG_INTERVAL_S: the first logged line of
    an epoch, at step 36, says the rate since step 2, never 0 samples/s."""
    from raytrain_ddp.driver import console as console_module

    clock = iter([100.0, 100.0, 130.0, 130.0])
    monkeypatch.setattr(console_module.time, "monotonic", lambda: next(clock))
    console = console_module.Console(total_epochs=3)
    console.show_progress({0: _training_beat(2, 2, 64), 1: _training_beat(2, 2, 64)}, micro_batches_per_epoch=64)
    line = console.progress_line(
        {0: _training_beat(2, 36, 1152), 1: _training_beat(2, 36, 1152)}, micro_batches_per_epoch=64
    )
    assert line.startswith("epoch 2/3: micro-batch 36/64, 73 samples/s, epoch ETA 25s"), line


def test_the_progress_line_says_no_rate_before_there_is_a_stretch_to_measure(monkeypatch):
    from raytrain_ddp.driver import console as console_module

    monkeypatch.setattr(console_module.time, "monotonic", lambda: 100.0)
    line = console_module.Console(total_epochs=3).progress_line(
        {0: _training_beat(1, 36, 1152)}, micro_batches_per_epoch=64
    )
    assert line == "epoch 1/3: micro-batch 36/64, loss 0.5000", line


def test_a_straggler_is_warned_of_only_when_the_same_rank_lags_two_epochs_running_by_a_share_that_matters(
    tmp_path, caplog
):
    """A busy 2-core machine flags rank 0 one epoch, rank 1 the next: noise, kept in metrics.jsonl, not
    warned of. Rank 1 lagging again is; a lag under STRAGGLER_WARN_SHARE of the epoch is not."""
    config = TrainConfig(num_workers=2, epochs=4, storage_path=str(tmp_path), name="unit")
    config.run_dir.mkdir(parents=True)
    recorder = RunRecorder(config.run_dir, config, train_rows=512, world_size=2, sinks=[])
    slow = {1: (0, 2.0), 2: (1, 2.0), 3: (1, 2.0), 4: (1, 0.6)}  # epoch -> (rank, its data wait); 3 s epochs
    with caplog.at_level("WARNING", logger="raytrain_ddp"):
        for epoch, (slow_rank, wait) in slow.items():
            recorder.consume(
                [
                    (
                        "epoch",
                        rank,
                        rank_epoch_message(rank, epoch=epoch, data_wait_seconds=wait if rank == slow_rank else 0.01),
                    )
                    for rank in (0, 1)
                ]
            )
    assert [[s["rank"] for s in recorder.epochs[e]["stragglers"]] for e in slow] == [[0], [1], [1], [1]]
    warned = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("Epoch 3: rank 1 is a straggler, as in epoch 2: data wait 2s"), (
        warned
    )


def test_a_per_rank_summary_gives_the_spread_and_names_the_ranks_at_each_end():
    summary = summarize_ranks([0.5, None, 3.0, 1.0, 2.0, 0.1])
    assert summary == {
        "ranks_measured": 5,
        "min": 0.1,
        "median": 1.0,
        "p90": 2.0,
        "max": 3.0,
        "lowest_ranks": [5, 0, 3],
        "highest_ranks": [2, 4, 3],
    }
    assert summarize_ranks([None, None]) == {"ranks_measured": 0}


def test_a_small_world_keeps_its_per_rank_lists_and_a_large_one_keeps_summaries():
    config = TrainConfig(num_workers=2)
    small = aggregate_epoch({rank: rank_epoch_message(rank) for rank in range(PER_RANK_LIMIT)}, config)
    assert split_per_rank(small) == (small, {})
    world = 4096
    large = aggregate_epoch({rank: rank_epoch_message(rank) for rank in range(world)}, config)
    record, lists = split_per_rank(large)
    assert not [key for key in record if key.endswith("_per_rank")]
    assert lists["train_loss_per_rank"] == large["train_loss_per_rank"] and len(lists["samples_per_rank"]) == world
    assert record["train_loss_rank_summary"]["highest_ranks"] == [world - 1, world - 2, world - 3]  # loss 1 + rank
    assert record["train_loss"] == large["train_loss"] and record["world_size"] == world
    assert len(json.dumps(record)) < 10_000  # the lists made ~1 MB


def test_a_large_world_writes_its_lists_once_per_epoch_beside_small_records(tmp_path):
    world = PER_RANK_LIMIT + 1
    config = TrainConfig(num_workers=world, log_every_steps=1, storage_path=str(tmp_path), name="large")
    config.run_dir.mkdir(parents=True)
    recorder = RunRecorder(config.run_dir, config, train_rows=512 * world, world_size=world, sinks=[])
    recorder.consume([("steps", rank, [_step(1, rank, 1.0 + rank)]) for rank in range(world)])
    recorder.consume([("epoch", rank, rank_epoch_message(rank)) for rank in range(world)])
    (record,) = MetricsFile(config.run_dir).read().values()
    assert record["rank_lists_file"] == "ranks/epoch-1.json" and "train_loss_per_rank" not in record
    lists = json.loads((config.run_dir / record["rank_lists_file"]).read_text())
    assert lists["train_loss_per_rank"] == [1.0 + rank for rank in range(world)]
    (step,) = [json.loads(line) for line in (config.run_dir / "steps.jsonl").read_text().splitlines()]
    assert "train_loss_per_rank" not in step and step["train_loss_rank_summary"]["max"] == 1.0 + world - 1


def test_a_large_worlds_epoch_gives_the_sinks_each_figures_spread_not_a_scalar_per_rank():
    from raytrain_ddp.driver.tensorboard_log import epoch_scalars

    world = PER_RANK_LIMIT + 1
    record, _ = split_per_rank(aggregate_epoch({r: rank_epoch_message(r) for r in range(world)}, TrainConfig()))
    scalars = epoch_scalars(record)
    assert scalars["train_loss/max"] == 1.0 + world - 1 and scalars["data_wait/median"] == 0.01
    assert not [tag for tag in scalars if "/rank_" in tag] and "val_loss/max" not in scalars  # identical on all


def test_the_sinks_count_each_ranks_micro_batches_under_that_name_alone():
    """A rank's micro-batches go to TensorBoard, MLflow and W&B once, as micro_batches/rank_R (not also as steps)."""
    from raytrain_ddp.driver.tensorboard_log import epoch_scalars

    scalars = epoch_scalars(aggregate_epoch({r: rank_epoch_message(r) for r in range(2)}, TrainConfig()))
    assert scalars["micro_batches/rank_0"] == scalars["micro_batches/rank_1"] == 4
    assert not [tag for tag in scalars if tag.startswith("steps/")]


def test_a_large_worlds_stall_names_the_ranks_furthest_behind_and_counts_the_rest():
    from raytrain_ddp.driver.liveness import STALL_RANKS_SHOWN

    liveness = Liveness()
    world = 4096
    for rank in range(world - 8):  # rank 7 is behind; the last 8 ranks never reported
        liveness.track(rank, {**_beat(1, 3 if rank == 7 else 4, "training"), "time": 1.0})
    workers = {rank: {"hostname": f"node{rank // 8}"} for rank in range(world)}
    verdict = liveness.describe_stall(workers)
    assert verdict.startswith("rank 7 on node0: training, epoch 1 micro-batch 3")
    assert f"; {world - 8 - STALL_RANKS_SHOWN} more ranks as far along or further; rank {world - 8} on " in verdict
    assert verdict.count("no news since it started") == 8 and len(verdict) < 3000


def test_a_nodes_message_brings_its_ranks_beats_and_their_news_in_order_and_the_stop_request_back(tmp_path):
    import time

    from raytrain_ddp.worker.aggregator import NodeNews

    config = TrainConfig(num_workers=2, epochs=2, log_every_steps=1, storage_path=str(tmp_path), name="unit")
    config.run_dir.mkdir(parents=True)
    recorder = RunRecorder(config.run_dir, config, train_rows=512, world_size=2, sinks=[])
    recorder.consume([("started", r, {"rank": r, "world_size": 2, "hostname": "h", "node_id": "n"}) for r in (0, 1)])
    news = NodeNews("n", "h")
    assert news.beat(0, 1, 4, 400, 1.0, "training", 0, [_step(1, 0, 2.0)]) is None
    news.beat(1, 1, 3, 300, 1.0, "training", 0, [_step(1, 1, 4.0)])
    for rank in (0, 1):
        news.add("epoch", rank, rank_epoch_message(rank))
    message = news.message()
    assert (message["hostname"], message["slowest"], message["silent"]) == ("h", 1, {})
    recorder.consume([("node", -1, {**message, "time": time.monotonic()})])
    assert recorder.liveness.stuck_rank() == 1 and recorder.liveness.positions[0]["micro_batches"] == 4
    steps = [json.loads(line) for line in (config.run_dir / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["train_loss"]) for s in steps] == [(1, 3.0)]
    assert list(recorder.epochs) == [1]  # the epoch messages came after the beats' step records, as sent
    assert news.delivered == 0 and news.queued == 4
    news.answered(message, "preempted")  # the monitor took the message; its answer
    assert news.delivered == 4
    assert news.beat(0, 2, 1, 100, 1.0, "training", 0, []) == "preempted"
    news.heard[1] -= 10  # rank 1 has not beaten for 10 s: named silent, its last position not sent again
    later = news.message()
    assert list(later["beats"]) == [0] and list(later["silent"]) == [1] and later["events"] == []
    news.unsent(later)  # the monitor did not take it: its beats go with the next message
    assert list(news.message()["beats"]) == [0]


def test_a_rank_that_stopped_beating_and_a_node_whose_aggregator_stopped_posting_are_named(tmp_path, caplog):
    import time

    from raytrain_ddp.driver.watchdog import _note_silent_nodes

    config = TrainConfig(num_workers=4, storage_path=str(tmp_path), name="unit")
    recorder = RunRecorder(config.run_dir, config, train_rows=512, world_size=4, sinks=[])
    liveness, now = recorder.liveness, time.monotonic()
    for host, ranks, age_s in (("node0", (0, 1), 0), ("node1", (2, 3), 30)):
        beats = {rank: (1, 4, 0, 1.0, "training", 0, 0.0) for rank in ranks}
        liveness.node_heard({"hostname": host, "beats": beats, "silent": {}, "time": now - age_s})
    for rank in range(4):  # rank 1 stopped at step 3 20 s ago; node1's last message came 30 s ago
        liveness.track(rank, {**_beat(1, 3 if rank == 1 else 4, "training"), "time": now - (20 if rank == 1 else 0)})
    workers = {rank: {"hostname": f"node{rank // 2}"} for rank in range(4)}
    verdict = liveness.describe_stall(workers)
    stuck = "rank 1 on node0: training, epoch 1 micro-batch 3, unchanged for 20s, no heartbeat for 20s; "
    assert verdict.startswith(stuck)
    assert "rank 0 on node0: training, epoch 1 micro-batch 4, unchanged for 0s; " in verdict
    assert verdict.endswith("; node node1: no message from its aggregator for 30s (its 2 ranks: 2, 3)")
    with caplog.at_level("WARNING", logger="raytrain_ddp"):
        _note_silent_nodes(recorder)
        _note_silent_nodes(recorder)  # said once
    assert [r.getMessage() for r in caplog.records] == [
        "Node node1: no message from its aggregator for 30s (the aggregator lost or stuck); its 2 ranks: 2, 3"
    ]
    recorder.node_lost({"node_id": "n1", "hostname": "node1", "node_ip": "10.0.0.2"})  # the node itself left
    assert "node node1" not in liveness.describe_stall(workers)
