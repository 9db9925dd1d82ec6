"""A rank slow in compute (not in data) is named: the others wait for it inside the gradient all-reduce."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ray


def test_rank_slow_in_compute_is_named_by_its_short_allreduce_wait(ray_address, tmp_path, monkeypatch):
    from raytrain_ddp import TrainConfig, fit

    monkeypatch.setenv("RAYTRAIN_WORKER_HOOKS", "worker_hooks:SlowCompute")
    monkeypatch.setenv("RAYTRAIN_TEST_SLOW_COMPUTE", "1:0.1")  # rank 1: 0.1 s more per micro-batch, 20 of them
    result = fit(
        TrainConfig(
            num_workers=2,
            epochs=1,
            dataset="synthetic-tabular",
            model="mlp",
            train_size=2000,
            val_size=200,
            batch_size=50,
            storage_path=str(tmp_path),
            name="slow-compute",
        )
    )
    assert result.ok, result.summary["error"]
    epoch = result.epochs[0]
    wait0, wait1 = epoch["allreduce_wait_seconds_per_rank"]
    assert wait0 > wait1  # rank 0 waits for rank 1 at every step
    assert [s["rank"] for s in epoch["stragglers"]] == [1], epoch["stragglers"]
    assert "its compute is the bottleneck" in epoch["stragglers"][0]["why"]
    assert "rank 1 is a straggler: all-reduce wait" in (result.run_dir / "driver.log").read_text()
