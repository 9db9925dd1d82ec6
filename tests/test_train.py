"""The training spine on a real local Ray with 2 CPU workers (gloo DDP): what the session's shared run
(conftest.shared_run, on a Ray its command starts) printed and wrote."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from support import SHARED_EPOCHS, SHARED_TRAIN_ROWS, SHARED_VAL_ROWS, run_cli, shared_run_args

pytestmark = pytest.mark.ray

SUMMARY_KEYS = {
    "status",
    "error",
    "epochs_completed",
    "world_size",
    "global_batch_size",
    "workers",
    "final_metrics",
    "best_checkpoint",
    "samples_per_second",
    "param_checksums",
    "restarts",
}
EPOCH_KEYS = {
    "epoch",
    "train_loss",
    "train_loss_min",
    "train_loss_max",
    "val_loss",
    "val_accuracy",
    "samples_per_second",
    "samples_per_rank",
    "seconds",
    "val_accuracy_per_rank",
}


def test_cli_defaults():
    from raytrain_ddp.run import config_from_args

    config = config_from_args([])
    assert (config.num_workers, config.epochs, config.batch_size) == (2, 5, 64)
    assert (config.dataset, config.train_size, config.val_size) == ("synthetic", 8192, 2048)


@pytest.fixture(scope="module")
def default_run(shared_run):
    """conftest.shared_run: `python -m raytrain_ddp.run` with the built-in defaults but the sizes."""
    result, run_dir = shared_run
    summary = json.loads((run_dir / "summary.json").read_text())
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return result, run_dir, summary, epochs


def test_console_says_dashboard_global_batch_and_table(default_run):
    result, *_ = default_run
    assert "Ray dashboard: http://" in result.stderr
    # a private Ray: its token new, in a directory of its own that went with it; its node (and listeners) loopback
    token = Path(re.search(r"log in with the token: the contents of (\S+)\)", result.stderr).group(1))
    assert token.parent.parent == Path.home() / ".raytrain" and not token.parent.exists(), token
    assert "Ray cluster: 1 node: 127.0.0.1:" in result.stderr, result.stderr[:2000]
    assert "Global batch = 64 per worker x 2 workers = 128" in result.stderr
    assert "train loss (min..max over ranks)" in result.stderr
    assert "WARNING" not in result.stderr and "INFO" not in result.stderr  # none of Ray's own lines


def test_a_run_starts_no_actor_it_does_not_use(default_run):
    """Ray Train's PreemptionWatcher (Ray's node drains, for ray.train.get_preemption_info) stays off: the run's
    own Ray session logs one worker file per actor process, each naming its actor."""
    _, run_dir, *_ = default_run
    actors = {
        line.removeprefix(":actor_name:")
        for path in (run_dir / "ray-logs").glob("worker-*.out")
        for line in path.read_text(errors="replace").splitlines()[:3]
        if line.startswith(":actor_name:")
    }
    assert {"TrainController", "RayTrainWorker", "RunMonitor"} <= actors, actors
    assert "PreemptionWatcher" not in actors, actors


def test_default_run_learns(default_run):
    *_, summary, epochs = default_run
    assert summary["status"] == "finished" and summary["epochs_completed"] == SHARED_EPOCHS
    assert epochs[0]["train_loss"] > epochs[-1]["train_loss"]
    assert summary["final_metrics"]["val_accuracy"] >= 0.8  # chance is 0.1


def test_summary_contract(default_run):
    _, run_dir, summary, _ = default_run
    assert SUMMARY_KEYS <= summary.keys()
    assert summary["world_size"] == 2 and summary["global_batch_size"] == 128
    assert sorted(w["rank"] for w in summary["workers"]) == [0, 1]
    assert all({"hostname", "node_ip", "device"} <= w.keys() for w in summary["workers"])
    assert summary["restarts"] == 0
    assert summary["best_checkpoint"].startswith(str(run_dir))


def test_replicas_are_bit_identical(default_run):
    """Same parameter bytes on every rank after training: DDP averaged the gradients."""
    *_, summary, _ = default_run
    checksums = summary["param_checksums"]
    assert len(checksums) == 2 and None not in checksums
    assert checksums[0] == checksums[1]


def test_every_epoch_has_the_cross_rank_picture(default_run):
    *_, epochs = default_run
    assert [e["epoch"] for e in epochs] == list(range(1, SHARED_EPOCHS + 1))
    for e in epochs:
        assert EPOCH_KEYS <= e.keys()
        assert e["train_loss_min"] <= e["train_loss"] <= e["train_loss_max"]
        assert len(set(e["val_accuracy_per_rank"])) == 1 and len(set(e["val_loss_per_rank"])) == 1
        # equal shards, together the whole training set (split evenly)
        assert e["samples_per_rank"] == [SHARED_TRAIN_ROWS // 2, SHARED_TRAIN_ROWS // 2]
        assert e["val_rows"] == SHARED_VAL_ROWS  # every validation row exactly once


def test_run_directory_holds_config_and_best_checkpoint(default_run):
    _, run_dir, summary, epochs = default_run
    assert "num_workers = 2" in (run_dir / "config.toml").read_text()
    state = torch.load(summary["best_checkpoint"], weights_only=True)
    assert {"model", "optimizer", "epoch", "metrics", "config"} <= state.keys()
    best_epoch = max(epochs, key=lambda e: e["val_accuracy"])
    assert state["metrics"]["val_accuracy"] == best_epoch["val_accuracy"]


def test_evaluate_reproduces_recorded_accuracy(default_run):
    *_, summary, _ = default_run
    result = run_cli("raytrain_ddp.evaluate", summary["best_checkpoint"], "--json", timeout=120)
    assert result.returncode == 0, result.stderr
    scored = json.loads(result.stdout)
    assert scored["val_rows"] == SHARED_VAL_ROWS
    assert abs(scored["val_accuracy"] - scored["recorded"]["val_accuracy"]) <= 1 / SHARED_VAL_ROWS
    assert scored["val_loss"] == pytest.approx(scored["recorded"]["val_loss"], rel=1e-4)


def test_finished_run_is_not_retrained(default_run):
    _, run_dir, *_ = default_run
    # the same command again, as a user reruns it: refused before any Ray starts
    result = run_cli("raytrain_ddp.run", *shared_run_args(run_dir.parent), timeout=120)
    assert result.returncode == 2
    assert "already finished" in result.stderr and "choose a new --name" in result.stderr
