"""Your own step in the built-in loop (--task): the two examples, a regression on columns of its own and a
two-view contrastive task under FSDP with gradient accumulation, on the real local Ray."""

from __future__ import annotations

import json

import pytest
from support import REPO, run_python_file

pytestmark = pytest.mark.ray


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_regression_task_on_its_own_columns_reports_its_validation_exactly_and_ranks_checkpoints_by_it(
    ray_address, tmp_path
):
    result = run_python_file(
        REPO / "examples" / "task_regression.py",
        cwd=tmp_path,
        env={"RAY_ADDRESS": ray_address},
        args=["--epochs", "3", "--train-size", "2048", "--val-size", "512", "--name", "regression", "--no-report"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch  train loss (min..max over ranks) val loss  val mae  samples/s" in result.stderr
    run_dir = tmp_path / "runs" / "regression"
    epochs = _records(run_dir / "metrics.jsonl")
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    for epoch in epochs:  # every rank's validation, over all 512 rows, identical
        assert epoch["val_rows"] == 512 and epoch["val_identical_across_ranks"], epoch
        assert epoch["val_mae_per_rank"][0] == epoch["val_mae_per_rank"][1] == epoch["val_mae"]
        assert epoch["samples_per_rank"] == [1024, 1024]
    assert epochs[-1]["val_loss"] < 0.1 < epochs[0]["train_loss"]  # it learned: noise is 0.05^2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoints_ranked_by"] == "val_mae (min)"
    assert summary["best_metrics"]["val_mae"] == min(e["val_mae"] for e in epochs)
    assert 'task = "task_regression:Regression"' in (run_dir / "config.toml").read_text()


def test_a_contrastive_task_from_python_trains_under_fsdp_with_accumulation(ray_address, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    from task_contrastive import TwoViews, encoder

    from raytrain_ddp import TrainConfig, fit

    config = TrainConfig(
        dataset="synthetic-tabular",
        num_workers=2,
        epochs=2,
        train_size=1024,
        val_size=300,  # 150 rows a rank: its last batch is short, and FSDP pads with it
        batch_size=64,
        grad_accum=2,
        strategy="fsdp",
        optimizer="adamw",
        lr=0.003,
        checkpoint_metric="val_top1",
        checkpoint_mode="max",
        storage_path=str(tmp_path),
        name="contrastive",
        report=False,
        tensorboard=False,
    )
    result = fit(config, model_fn=encoder, task=TwoViews)
    assert result.ok, result.summary["error"]
    assert [e["val_rows"] for e in result.epochs] == [300, 300]
    assert all(e["val_identical_across_ranks"] for e in result.epochs)
    assert result.epochs[-1]["optimizer_steps_per_rank"] == [4, 4]  # 512 rows a rank, 64 x 2 a step
    assert 0.0 < result.final_metrics["val_top1"] <= 1.0 and result.summary["checkpoints_ranked_by"] == "val_top1 (max)"
