"""The benchmark suite keeps working: `python -m bench --smoke --json OUT`, every part once on the least data
(no timing asserts: the figures are measured by `python -m bench`, see docs/benchmarks.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parent.parent
KEYS = ("throughput_ratio", "first_step_ratio", "ingest_ratio", "scaling_efficiency")


def test_smoke_bench_writes_the_four_figures(tmp_path):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--json", str(out), "--md", str(md)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in KEYS:
        value = result[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)
    for name in ("throughput", "first_step", "ingest"):
        figure = result["figures"][name]
        assert {"ours", "plain", "ratio", "target", "met"} <= set(figure)
        assert figure["ours"]["min"] <= figure["ours"]["median"] <= figure["ours"]["max"]
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"] and result["machine"]["ray"]
    assert "throughput_parquet" not in result["figures"]  # the part --smoke leaves out
    assert "| Figure |" in md.read_text() and "| Figure |" in proc.stdout
