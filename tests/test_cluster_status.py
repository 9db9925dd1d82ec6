"""What fits the cluster: `python -m raytrain_ddp.cluster status`, the per-node table preflight checks requests
against, and an elastic start on what fits."""

from __future__ import annotations

import os

import pytest
from support import run_cli

from raytrain_ddp import _ray_compat


@pytest.mark.ray
def test_status_prints_each_node_and_what_fits(ray_address):
    result = run_cli("raytrain_ddp.cluster", "status", "--address", ray_address, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "Ray cluster: 1 alive node"
    assert lines[1].split()[:4] == ["node", "CPUs", "GPUs", "memory"]
    node = lines[2].split()
    assert node[1:3] == ["3", "0"] and node[4:6] == ["3", "0"], lines  # 3 CPUs: 3 one-CPU workers, no GPU ones
    assert lines[3].startswith("total") and "2 (1 CPU left for data loading)" in lines[3], lines


@pytest.mark.ray
def test_python_api_elastic_start_on_uneven_data(ray_address, tmp_path):
    """fit() from Python on the shared Ray. --min-workers: 4 asked, 2 fit beside the data-loading CPU: it trains
    with 2 and says so; --scale-lr scales for the 2 that train, not the 4 asked for. Train rows that do not split
    evenly, an odd-sized val split.

    The first training run of its lane (this file sorts first): Ray Train sizes an elastic group by what Ray's
    autoscaling coordinator has reserved for it, and reservations Ray Data made for earlier runs can outlive
    them (a request expires 180 s after its last renewal): right after other runs it started with 1 (seen)."""
    from raytrain_ddp import TrainConfig, fit

    result = fit(
        TrainConfig(
            num_workers=4,
            min_workers=1,
            scale_lr=True,
            epochs=2,
            dataset="synthetic-tabular",
            model="mlp",
            train_size=1001,
            val_size=301,
            batch_size=50,
            storage_path=str(tmp_path),
            name="api",
            report=False,
            tensorboard=False,
        )
    )
    assert result.ok, result.summary["error"]
    # Ray Train's controller polled its workers every 0.5 s, not Ray's 2 s (each state change waits for a poll)
    assert os.environ[_ray_compat.HEALTH_CHECK_INTERVAL_ENV] == "0.5"
    log = (result.run_dir / "driver.log").read_text()
    assert "Only 2 of the 4 workers asked for fit the cluster: starting with 2 (--min-workers 1)" in log
    assert "Global batch = 50 per worker x 2 workers = 100" in log
    assert "Learning rate scaled linearly with the global batch: 0.02 x 2 = 0.04" in log
    assert result.summary["world_size"] == 2 and result.summary["global_batch_size"] == 100
    for epoch in result.epochs:
        assert epoch["samples_per_rank"] == [500, 500]  # equal shards: one row left out this epoch
        assert epoch["micro_batches_per_rank"] == [10, 10]  # the same count on every rank: no DDP hang
        assert epoch["val_rows"] == 301  # validation is exact, even when uneven across ranks
        assert epoch["lr"] == pytest.approx(0.04), epoch
    assert result.summary["replicas_identical"]
    assert result.final_metrics["val_accuracy"] > 0.5


def test_status_without_a_cluster_is_one_line_and_exit_2():
    result = run_cli("raytrain_ddp.cluster", "status", "--address", "127.0.0.1:1", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: cannot connect to the Ray cluster at 127.0.0.1:1: Connection refused"
