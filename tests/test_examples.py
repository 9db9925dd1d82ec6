"""Every example runs, on a small setting, against the session's Ray (the FSDP example into a bucket:
tests/test_object_storage.py; the Hugging Face one: tests/test_hf_example.py)."""

from __future__ import annotations

import json

import pytest
from support import REPO, run_python_file

pytestmark = pytest.mark.ray


def test_train_from_python_example(ray_address, tmp_path):
    result = run_python_file(REPO / "examples" / "train_from_python.py", cwd=tmp_path, env={"RAY_ADDRESS": ray_address})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "status: finished" in result.stdout and "replicas identical: True" in result.stdout
    summary = json.loads((tmp_path / "runs" / "from-python" / "summary.json").read_text())
    assert summary["epochs_completed"] == 2


def test_custom_plugins_example(ray_address, tmp_path):
    result = run_python_file(
        REPO / "examples" / "custom_plugins.py",
        cwd=tmp_path,
        env={"RAY_ADDRESS": ray_address},
        args=["--epochs", "2", "--train-size", "1024", "--val-size", "256", "--name", "plugins-example", "--no-report"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "plugins-example" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs_completed"] == 2
    assert summary["final_metrics"]["val_accuracy"] > 0.6  # 4 quadrant classes: chance is 0.25
    assert summary["final_metrics"]["samples_per_rank"] == [512, 512]  # the plug-in data, sharded by the project
    config = (tmp_path / "runs" / "plugins-example" / "config.toml").read_text()
    for line in ('model = "custom_plugins:build_model"', 'loss = "custom_plugins:smoothed_cross_entropy"'):
        assert line in config, config
