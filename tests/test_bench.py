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
KEYS = ("throughput_ratio", "first_step_ratio", "ingest_ratio")
SCALE_KEYS = (
    "ranks",
    "driver_cpu_cores",
    "driver_rss_mib",
    "heartbeat_lag_p99_s",
    "stopped_rank_named_s",
    "epoch_record_bytes",
    "step_record_bytes",
)


def test_smoke_bench_writes_the_three_figures(tmp_path):
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
    # the parts --smoke leaves out: the Parquet pair, the 1-worker run (the scaling figure)
    assert "throughput_parquet" not in result["figures"] and "scaling" not in result["figures"]
    assert "| Figure |" in md.read_text() and "| Figure |" in proc.stdout


def _bench(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_checkpoint_formats_bench_measures_both_formats_at_each_size(tmp_path):
    out = tmp_path / "formats.json"
    proc = _bench(
        "bench.checkpoint_formats",
        "--dim",
        "64",
        "--depth",
        "1",
        "2",
        "--saves",
        "1",
        "--steps",
        "1",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert sorted(results) == ["1", "2"] and all(sorted(r) == ["full", "none", "sharded"] for r in results.values())
    for by_format in results.values():
        for r in by_format.values():
            assert len(r["blocked_s"]) == 1 and r["rank0_peak_rss_gib"] >= r["rank0_rss_before_gib"] > 0, r
    assert results["2"]["full"]["parameters"] > results["1"]["full"]["parameters"]
    assert "| added (GiB) |" in proc.stdout


def test_resume_after_kill_bench_measures_a_resume_from_an_interval_checkpoint(tmp_path):
    """A real SIGKILL of one of its own run's Ray Train workers (never another lane's) after a sharded interval
    checkpoint: the run resumes from it, so the steps trained again are those after it, not the whole epoch."""
    out = tmp_path / "kill.json"
    proc = _bench(
        "bench.resume_after_kill",
        "--dim",
        "64",
        "--depth",
        "1",
        "--kills",
        "1",
        "--minutes",
        "0.05",
        "--steps-past",
        "1",
        "--train-size",
        "8000",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (round_,) = json.loads(out.read_text())["rounds"]
    assert round_["kill_to_first_step_s"] > 0
    assert round_["resumed_at_step"] > 1 and round_["steps_trained_again"] > 0, round_  # mid-epoch, from the checkpoint
    assert "kill -> first trained step" in proc.stdout


def test_scale_simulator_measures_the_driver_at_its_smallest_size(tmp_path):
    """64 fake ranks through the real monitor, watcher and recorder: every figure, the stuck rank named, records
    bounded (the figures at thousands of ranks: docs/scale.md)."""
    out = tmp_path / "scale.json"
    proc = _bench("bench.scale", "--ranks", "64", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())
    assert set(SCALE_KEYS) <= set(result) and result["ranks"] == 64
    assert result["named_rank"] == result["stuck_rank"] and result["stopped_rank_named_s"] is not None
    assert 0 < result["epoch_record_bytes"] < 2**16 and 0 < result["step_record_bytes"] < 2**12, result
    assert result["driver_cpu_cores"] > 0 and result["heartbeat_lag_p99_s"] > 0
    assert "| Ranks |" in proc.stdout


def test_bringup_bench_plans_starts_joins_and_checks_a_small_allocation_and_refuses_a_single_node(tmp_path):
    """The launcher's planning functions on simulated allocations (no Ray): every figure, messages bounded (the
    figures at 512 and 4,096 nodes: docs/scale.md)."""
    out = tmp_path / "bringup.json"
    proc = _bench("bench.bringup", "--nodes", "2", "64", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    small, large = json.loads(out.read_text())
    assert (small["nodes"], large["nodes"]) == (2, 64) and large["plan_json_bytes"] > small["plan_json_bytes"]
    assert 0 < large["join_failure_chars"] < 400 and 0 < large["preflight_message_chars"] < 400, large
    assert "| Nodes |" in proc.stdout
    refused = _bench("bench.bringup", "--nodes", "1")
    assert refused.returncode == 2 and "--nodes: each size must be 2 or more" in refused.stderr
