"""Seeing the run: progress during an epoch, and a slowed rank flagged as a straggler with its cause."""

from __future__ import annotations

import json
import os
import re

import pytest
from worker_hooks import SlowDataThenCompute

pytestmark = pytest.mark.ray


def test_a_rank_slow_in_data_then_in_compute_is_named_for_each_and_progress_arrives_mid_epoch(tmp_path):
    """A straggler is named with what holds it up: rank 1 waits for its data in epoch 1 (its data wait is
    long), then computes slower in epoch 2 (rank 0 waits for it inside the gradient all-reduce). The loop's and
    the driver's rules: on the quick path's local processes, no Ray Train start."""
    from raytrain_ddp import TrainConfig, fit

    # per batch of epoch 1, per micro-batch of epoch 2
    slow_rank_1 = SlowDataThenCompute(rank=1, data_seconds=0.4, compute_seconds=0.1)
    result = fit(
        TrainConfig(
            num_workers=2,
            epochs=2,
            dataset="synthetic-tabular",
            model="mlp",
            train_size=2000,
            val_size=200,
            batch_size=50,
            storage_path=str(tmp_path),
            name="slow",
            report=False,
            tensorboard=False,
            profile_steps="39:42",  # the run has 40 optimizer steps: the window is cut by its end
            quick_start=True,
        ),
        hooks=slow_rank_1,
    )
    assert result.ok, result.summary["error"]
    in_data, in_compute = result.epochs
    wait0, wait1 = in_data["data_wait_seconds_per_rank"]
    assert wait1 > 7 and wait0 < wait1 / 2  # 20 batches x 0.4 s on rank 1 only
    assert [s["rank"] for s in in_data["stragglers"]] == [1], in_data["stragglers"]
    assert "input pipeline is the bottleneck" in in_data["stragglers"][0]["why"]
    wait0, wait1 = in_compute["allreduce_wait_seconds_per_rank"]
    assert wait0 > wait1  # rank 0 waits for rank 1 at every step
    assert [s["rank"] for s in in_compute["stragglers"]] == [1], in_compute["stragglers"]
    assert "its compute is the bottleneck" in in_compute["stragglers"][0]["why"]

    # driver.log: progress lines with micro-batch counts below the epoch's 20 come before the epoch's table row
    log_lines = (result.run_dir / "driver.log").read_text().splitlines()
    row = next(i for i, line in enumerate(log_lines) if re.search(r"INFO raytrain_ddp:\s+1\s", line))
    progress = [line for line in log_lines[:row] if "raytrain_ddp.progress: epoch 1/2: micro-batch" in line]
    assert progress, "no progress line during the epoch"
    micro_batches = [int(re.search(r"micro-batch (\d+)/20", line).group(1)) for line in progress]
    # an epoch's first line may come within a second of its first heartbeat: no stretch to rate yet, no rate
    assert min(micro_batches) < 20 and any("samples/s" in line for line in progress), progress
    assert not any(" 0 samples/s" in line for line in progress), progress
    assert "rank 1 is a straggler, as in epoch 1: all-reduce wait" in "\n".join(log_lines)
    cut = [line for line in log_lines if "--profile-steps 39:42" in line]
    assert len(cut) == 1 and "WARNING" in cut[0] and "ended after 40 optimizer steps" in cut[0] and "39-40" in cut[0]
    for rank in (0, 1):  # what the window held was written when the loop ended
        table = json.loads((result.run_dir / "profile" / f"rank-{rank}.top_ops.json").read_text())
        assert table["steps"] == [39, 40] and table["ops"]


def test_ray_logs_are_linked_from_the_run_directory_and_worker_lines_say_who_wrote_them(shared_run):
    """Ray's own logs stay off the console but are linked from the run directory."""
    result, run_dir = shared_run
    ray_logs = run_dir / "ray-logs"
    assert ray_logs.is_dir() and "raylet.out" in os.listdir(ray_logs)
    worker_lines = "".join(
        p.read_text(errors="replace") for p in ray_logs.rglob("*") if p.is_file() and p.stat().st_size < 50_000_000
    )
    assert "[rank 1 on " in worker_lines and "training on cpu from epoch 1" in worker_lines
    assert "[rank 1 on " not in result.stderr


def test_mlflow_file_store_gets_params_and_metrics(trained_run, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked

    uri = f"file://{trained_run.parent}/mlruns"  # the session's shared run logs there (conftest.shared_run)
    client = MlflowClient(tracking_uri=uri)
    run = client.search_runs([client.get_experiment_by_name("raytrain-ddp").experiment_id])[0]
    assert run.info.run_name == "shared" and run.info.status == "FINISHED"
    assert run.data.params["num_workers"] == "2"
    history = client.get_metric_history(run.info.run_id, "val/accuracy")
    assert [m.step for m in history] == [1, 2]
    final = json.loads((trained_run / "summary.json").read_text())["final_metrics"]
    assert history[-1].value == pytest.approx(final["val_accuracy"])
    steps = [json.loads(line) for line in (trained_run / "steps.jsonl").read_text().splitlines()]
    step_history = client.get_metric_history(run.info.run_id, "step/train_loss")  # by optimizer step
    assert [(m.step, m.value) for m in step_history] == [(r["step"], pytest.approx(r["train_loss"])) for r in steps]


def test_wandb_offline_run_holds_the_config_history_by_step_and_epoch_and_the_summary(trained_run):
    from support import wandb_offline_runs

    (run,) = wandb_offline_runs(trained_run)  # conftest.shared_run: WANDB_MODE=offline, in RUN_DIR/wandb/
    (header,) = run["run"]
    assert (header["display_name"], header["project"]) == ("shared", "raytrain-tests")
    assert header["run_id"] == (trained_run / "wandb-run-id").read_text().strip()
    assert header["config"]["update"]["num_workers"] == 2 and header["config"]["update"]["log_every_steps"] == 4
    rows = [h["item"] for h in run["history"]]
    steps = [json.loads(line) for line in (trained_run / "steps.jsonl").read_text().splitlines()]
    assert [(r["global_step"], r["step/train_loss"]) for r in rows if "global_step" in r] == [
        (s["step"], pytest.approx(s["train_loss"])) for s in steps
    ]
    summary = json.loads((trained_run / "summary.json").read_text())
    epochs = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["val/accuracy"], r["train/loss"]) for r in rows if "epoch" in r] == [
        (e["epoch"], pytest.approx(e["val_accuracy"]), pytest.approx(e["train_loss"])) for e in epochs
    ]
    metrics = {m.get("name") or m.get("glob_name"): m.get("step_metric") for m in run["metric"]}
    assert metrics["step/*"] == "global_step" and metrics["val/accuracy"] == "epoch"
    end = {k: v for update in run["summary"] for k, v in update["update"].items()}
    assert end["status"] == "finished" and end["epochs_completed"] == 2
    assert end["best/val_accuracy"] == pytest.approx(summary["best_metrics"]["val_accuracy"])
    assert end["val/accuracy"] == pytest.approx(summary["final_metrics"]["val_accuracy"])  # the last value
    assert run["exit"][0].get("exit_code", 0) == 0


def test_steps_jsonl_records_every_4th_step_and_its_windows_make_up_the_epochs(trained_run):
    steps = [json.loads(line) for line in (trained_run / "steps.jsonl").read_text().splitlines()]
    epochs = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"], r["world_size"]) for r in steps] == [
        (s, (s - 1) // 32 + 1, 2) for s in range(4, 65, 4)
    ]
    for record in steps:
        assert record["train_loss_min"] <= record["train_loss"] <= record["train_loss_max"]
        assert record["lr"] > 0 and record["samples_per_second"] > 0 and record["seconds"] > 0
    for epoch in epochs:  # each epoch's 32 steps are 8 windows of 4, equal in samples: their mean is the epoch's
        windows = [r for r in steps if r["epoch"] == epoch["epoch"]]
        assert epoch["train_loss"] == pytest.approx(sum(r["train_loss"] for r in windows) / 8, rel=1e-5)
        for rank, loss in enumerate(epoch["train_loss_per_rank"]):
            assert loss == pytest.approx(sum(r["train_loss_per_rank"][rank] for r in windows) / 8, rel=1e-5)


def test_profile_steps_leave_a_trace_and_a_top_ops_table_per_rank(trained_run):
    """conftest.shared_run profiles steps 3:4 (of 64): every rank's Chrome trace holds those two steps' markers."""
    for rank in (0, 1):
        trace = json.loads((trained_run / "profile" / f"rank-{rank}.trace.json").read_text())
        names = {event.get("name") for event in trace["traceEvents"]}
        assert {"optimizer step 3", "optimizer step 4"} <= names and "optimizer step 5" not in names
        assert "aten::convolution" in names  # the cnn's forward, recorded
        table = json.loads((trained_run / "profile" / f"rank-{rank}.top_ops.json").read_text())
        assert table["rank"] == rank and table["steps"] == [3, 4] and table["device"] == "cpu"
        ops = table["ops"]
        assert any(op["name"] in ("aten::mkldnn_convolution", "aten::convolution_backward") for op in ops)
        assert [op["self_cpu_us"] for op in ops] == sorted((op["self_cpu_us"] for op in ops), reverse=True)
        assert all(op["calls"] >= 1 and op["cpu_total_us"] >= op["self_cpu_us"] >= 0 for op in ops)
    assert sorted(p.name for p in (trained_run / "profile").iterdir()) == [
        "rank-0.top_ops.json",
        "rank-0.trace.json",
        "rank-1.top_ops.json",
        "rank-1.trace.json",
    ]
