"""--quick-start: the built-in loop on N local processes under Ray Train's local mode, no Ray cluster.

Real processes, real gloo, real Parquet; the same run directory, records and console as the full path."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from support import REPO, one_failure_line, processes_left, processes_with, run_cli
from test_train import EPOCH_KEYS, SUMMARY_KEYS

EPOCHS, TRAIN_ROWS, VAL_ROWS = 2, 2048, 512
RANK_MODULE = b"raytrain_ddp.worker.quick"


def quick_args(storage: Path, name: str, *more: str) -> list[str]:
    return [
        *("--quick-start", "--num-workers", "2", "--storage-path", str(storage), "--name", name),
        *("--epochs", str(EPOCHS), "--train-size", str(TRAIN_ROWS), "--val-size", str(VAL_ROWS)),
        *("--no-tensorboard", "--record-sample-ids", "--log-every-steps", "4", *more),
    ]


def _no_ray_started(result: subprocess.CompletedProcess) -> None:
    assert "Starting a local Ray" not in result.stderr and "Ray dashboard: " not in result.stderr, result.stderr


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """`python -m raytrain_ddp.run --quick-start` on the built-in data, 2 ranks: (its output, its run directory)."""
    storage = tmp_path_factory.mktemp("quick-runs")
    result = run_cli("raytrain_ddp.run", *quick_args(storage, "quick"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, storage / "quick"


def _records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def test_a_quick_run_trains_and_prints_the_table_without_a_ray_cluster(quick_run):
    result, run_dir = quick_run
    _no_ray_started(result)
    said = result.stderr
    assert "Quick start: 2 ranks, each a process of this machine under Ray Train's local mode" in said
    assert "not here: restarts on failure (a rank that fails ends the run), the hang watchdog" in said
    assert "Global batch = 64 per worker x 2 workers = 128" in said
    assert "train loss (min..max over ranks)" in said and f"Finished {EPOCHS} epochs in " in said
    assert (run_dir / "logs" / "rank-0.log").exists() and (run_dir / "logs" / "rank-1.log").exists()
    assert not (run_dir / "ray-logs").exists()  # made when the driver is connected to a Ray: it never was


def test_a_quick_run_writes_the_full_paths_records(quick_run):
    _, run_dir = quick_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary) and summary["status"] == "finished", summary
    assert summary["epochs_completed"] == EPOCHS and summary["world_size"] == 2
    assert summary["replicas_identical"] and summary["restarts"] == 0
    assert [worker["node_id"] for worker in summary["workers"]] == ["local", "local"]
    epochs = _records(run_dir, "metrics.jsonl")
    assert [epoch["epoch"] for epoch in epochs] == [1, 2] and all(EPOCH_KEYS <= set(epoch) for epoch in epochs)
    steps = _records(run_dir, "steps.jsonl")
    assert steps and all(step["step"] % 4 == 0 for step in steps)


def test_a_quick_runs_validation_is_identical_on_both_ranks_over_every_row(quick_run):
    _, run_dir = quick_run
    for epoch in _records(run_dir, "metrics.jsonl"):
        assert epoch["val_identical_across_ranks"], epoch
        assert len(set(epoch["val_loss_per_rank"])) == 1 and epoch["val_rows"] == VAL_ROWS


def test_a_quick_runs_ranks_train_disjoint_shards_that_cover_the_epoch_in_the_pipelines_order(quick_run):
    """Each epoch: the ranks' rows are disjoint, equal, and all the epoch's rows but fewer than 2; each rank's in
    exactly the order the project's pipeline draws for (seed, epoch, rank)."""
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.data.pipeline import local_sources
    from raytrain_ddp.data.spec import plan_data

    _, run_dir = quick_run
    config = TrainConfig(train_size=TRAIN_ROWS, val_size=VAL_ROWS, epochs=EPOCHS)
    sources = local_sources(config, plan_data(config))
    for epoch in range(1, EPOCHS + 1):
        seen = [np.load(run_dir / "sample_ids" / f"epoch-{epoch}-rank-{rank}.npy") for rank in (0, 1)]
        assert len(seen[0]) == len(seen[1]) and not set(seen[0]) & set(seen[1])
        assert len(set(seen[0]) | set(seen[1])) > TRAIN_ROWS - 2
        for rank in (0, 1):
            train, _ = sources.rank_inputs(rank, 2)
            order = np.concatenate([batch["id"].numpy() for batch in train.host_batches(config, epoch)])
            assert np.array_equal(seen[rank], order), f"epoch {epoch}, rank {rank}"


def test_a_quick_run_keeps_checkpoints_as_ray_train_does(quick_run):
    """Rank zero's full checkpoint.pt per epoch, recorded in Ray Train's snapshot; the summary names them."""
    from raytrain_ddp._ray_compat import checkpoints_newest_first, read_snapshot

    _, run_dir = quick_run
    summary = json.loads((run_dir / "summary.json").read_text())
    names = checkpoints_newest_first(read_snapshot(run_dir))
    assert len(names) == EPOCHS and summary["latest_checkpoint"] == str(run_dir / names[0] / "checkpoint.pt")
    state = torch.load(summary["latest_checkpoint"], weights_only=False)
    assert state["epoch"] == EPOCHS and state["world_size"] == 2 and state["config"]["quick_start"]


def test_a_quick_run_resumes_from_its_latest_checkpoint(quick_run):
    """The same command with one more epoch: it resumes after epoch 2 and trains epoch 3 alone."""
    _, run_dir = quick_run
    result = run_cli("raytrain_ddp.run", *quick_args(run_dir.parent, "quick", "--epochs", "3"), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resuming from checkpoint" in result.stderr and "Finished 3 epochs" in result.stderr, result.stderr
    assert "resumes from" in (run_dir / "logs" / "rank-1.log").read_text()
    assert [epoch["epoch"] for epoch in _records(run_dir, "metrics.jsonl")] == [1, 2, 3]
    assert (run_dir / "sample_ids" / "epoch-3-rank-0.npy").exists()
    assert json.loads((run_dir / "summary.json").read_text())["epochs_completed"] == 3


def test_the_full_path_resumes_a_quick_runs_checkpoint(quick_run, tmp_path):
    """A copy of the quick run, continued one more epoch without --quick-start (on the local Ray the command starts,
    as a user's would): Ray Train hands the workers the quick run's latest checkpoint from the snapshot the quick
    driver kept."""
    _, run_dir = quick_run
    shutil.copytree(run_dir, tmp_path / "quick")
    done = json.loads((run_dir / "summary.json").read_text())["epochs_completed"]
    more = quick_args(tmp_path, "quick", "--epochs", str(done + 1))
    result = run_cli("raytrain_ddp.run", *[a for a in more if a != "--quick-start"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Resuming from checkpoint" in result.stderr, result.stderr
    epochs = _records(tmp_path / "quick", "metrics.jsonl")
    assert [epoch["epoch"] for epoch in epochs] == list(range(1, done + 2))


def _rank_pid(rank: int, timeout: float = 120) -> int:
    """The pid of the quick run's rank `rank` (its RANK in its environment), once it has started."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in processes_with(RANK_MODULE):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return pid
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never started")


def _start(storage: Path, name: str, *more: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp.run", *quick_args(storage, name, "--epochs", "20", *more)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a suite in the background ignores it
    )


def _after_first_epoch(run_dir: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(0.2)


def test_a_killed_rank_ends_the_run_in_one_line_naming_it_with_exit_1(tmp_path):
    driver = _start(tmp_path, "killed")
    _after_first_epoch(tmp_path / "killed")
    os.kill(_rank_pid(1), signal.SIGKILL)
    _, stderr = driver.communicate(timeout=120)
    line = one_failure_line(subprocess.CompletedProcess(driver.args, driver.returncode, "", stderr), exit_code=1)
    assert line.startswith("Training failed: rank 1 (pid ") and line.endswith("was killed by SIGKILL"), line
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("rank 1 ")
    assert processes_left(RANK_MODULE, timeout=10) == []


def test_a_rank_that_raises_ends_the_run_in_one_line_with_its_error_and_exit_1(tmp_path):
    """A learning rate that blows the loss up: the ranks raise at the epoch's loss check; the run's one line names
    the first rank with the error its output's traceback ends with."""
    args = quick_args(tmp_path, "diverged", "--epochs", "1", "--train-size", "512", "--lr", "1e12")
    result = run_cli("raytrain_ddp.run", *args, timeout=300)
    line = one_failure_line(result, exit_code=1)
    # both ranks diverge at the same check: whichever exits first on a busy machine is the one named
    assert line.startswith(("Training failed: rank 0 (pid ", "Training failed: rank 1 (pid ")), line
    assert "failed: FloatingPointError: training loss is " in line and line.endswith("(exit code 1)"), line


def test_ctrl_c_ends_the_ranks_and_exits_130_with_a_summary(tmp_path):
    driver = _start(tmp_path, "interrupted")
    _after_first_epoch(tmp_path / "interrupted")
    driver.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the driver (the ranks: a session apart)
    _, stderr = driver.communicate(timeout=120)
    assert driver.returncode == 130, stderr[-3000:]
    assert "interrupted (Ctrl-C) after " in stderr
    assert json.loads((tmp_path / "interrupted" / "summary.json").read_text())["status"] == "interrupted"
    assert processes_left(RANK_MODULE, timeout=10) == []


def test_usr1_stops_every_rank_at_a_checkpoint_with_exit_75(tmp_path):
    driver = _start(tmp_path, "stopped")
    _after_first_epoch(tmp_path / "stopped")
    driver.send_signal(signal.SIGUSR1)
    _, stderr = driver.communicate(timeout=120)
    assert driver.returncode == 75, stderr[-3000:]
    summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["stop_reason"].startswith("SIGUSR1"), summary
    assert summary["resume_checkpoint"] == summary["latest_checkpoint"] is not None
    assert processes_left(RANK_MODULE, timeout=10) == []


def test_a_dataset_function_is_refused_under_quick_start_in_one_line(tmp_path):
    from raytrain_ddp import TrainConfig, fit
    from raytrain_ddp.errors import ConfigError

    config = TrainConfig(quick_start=True, storage_path=str(tmp_path), name="refused")
    with pytest.raises(ConfigError, match="^--quick-start reads the data in each rank's own process: a dataset fun"):
        fit(config, dataset_fn=lambda config: {})
    assert not (tmp_path / "refused").exists()
