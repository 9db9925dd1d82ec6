"""Every example runs, on a small setting, against the session's Ray."""

from __future__ import annotations

import json

import pytest

from support import REPO, run_python_file

pytestmark = pytest.mark.ray


def test_train_from_python_example(ray_address, tmp_path):
    result = run_python_file(REPO / "examples" / "train_from_python.py", cwd=tmp_path,
                             env={"RAY_ADDRESS": ray_address})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "status: finished" in result.stdout and "replicas identical: True" in result.stdout
    summary = json.loads((tmp_path / "runs" / "from-python" / "summary.json").read_text())
    assert summary["epochs_completed"] == 2
