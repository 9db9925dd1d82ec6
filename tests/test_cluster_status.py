"""What fits the cluster: `python -m raytrain_ddp.cluster status`, the per-node table preflight checks requests
against, an elastic start on what fits and the requests that cannot fit, refused in seconds; and that a local Ray
we start is private (first in its lane: no Ray head of another test listens beside it)."""

from __future__ import annotations

import ipaddress
import os
import stat
import time
from pathlib import Path

import pytest
from support import listening_addresses, processes_with, run_cli, run_python_file

from raytrain_ddp import _ray_compat


@pytest.mark.ray
def test_a_local_ray_is_private(ray_address):
    """The session's Ray, started as the command starts one: its token file is new, 0600 in a 0700 directory
    of its own (not ~/.ray/auth_token, 0644 and kept for ever), and its GCS and raylet were started with it;
    every listener of the Ray processes it started is on loopback (not 0.0.0.0 or ::)."""
    token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
    assert token.parent.parent == Path.home() / ".raytrain", token
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    started_with = f"RAY_AUTH_TOKEN_PATH={token}".encode()
    for program in (b"gcs_server", b"raylet"):
        assert any(started_with in _environment(pid) for pid in processes_with(program)), program
    # the Ray processes this one started (its own sockets include other tests', a torch TCPStore's)
    listening = [found for found in listening_addresses(os.getpid()) if found[2] != os.getpid()]
    programs = {Path(_command(pid)[0]).name for _, _, pid in listening}
    assert {"gcs_server", "raylet"} <= programs, listening  # the GCS, the raylet and its object manager...
    open_to_all = [(address, port, _command(pid)) for address, port, pid in listening if not _loopback(address)]
    assert not open_to_all, open_to_all  # ...the workers' gRPC servers, the agents: loopback only


def _loopback(address: str) -> bool:
    parsed = ipaddress.ip_address(address)
    return (getattr(parsed, "ipv4_mapped", None) or parsed).is_loopback


def _command(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return ["?"]


def _environment(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return b""


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


# ------------------------------------------------------------------ requests that cannot fit, refused in seconds
@pytest.mark.ray
def test_infeasible_request_fails_in_seconds(ray_address, tmp_path):
    started = time.monotonic()
    result = run_cli(
        "raytrain_ddp.run", "--address", ray_address, "--num-workers", "8", "--storage-path", str(tmp_path), timeout=60
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert (
        "asked for 8 workers x 1 CPU" in line
        and "hold 2 beside 1 CPU for Ray Data loading" in line
        and "try --num-workers 2" in line
    )
    assert elapsed < 30  # not Ray Train's 60 s start timeout, nor for ever
    assert not any(tmp_path.iterdir())


def _refusal(tmp_path, **fields) -> str:
    """What fit() on the shared Ray says to a request it must refuse (the CLI prints it as one `error:` line,
    exit code 2: test_infeasible_request_fails_in_seconds); nothing is written."""
    from raytrain_ddp import TrainConfig, fit
    from raytrain_ddp.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        fit(TrainConfig(storage_path=str(tmp_path), **fields))
    assert not any(tmp_path.iterdir())
    return str(refused.value)


@pytest.mark.ray
def test_elastic_request_that_cannot_reach_its_minimum_is_refused(ray_address, tmp_path):
    message = _refusal(tmp_path, num_workers=8, min_workers=3)
    assert "asked for at least 3 workers x 1 CPU" in message and "try --min-workers 2" in message


@pytest.mark.ray
def test_request_that_starves_data_loading_fails_in_seconds(ray_address, tmp_path):
    message = _refusal(tmp_path, num_workers=2, cpus_per_worker=1.5)
    assert "hold 1 beside 1 CPU for Ray Data loading" in message and "try --num-workers 1" in message


GPUS_RAY_SEES_CUDA_DOES_NOT = """
import sys
import ray
from raytrain_ddp.run import main
# This machine has no GPU: a Ray that counts one is exactly Ray seeing a GPU that CUDA does not.
ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, object_store_memory=100 * 2**20,
         log_to_driver=False)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.ray
def test_gpus_ray_counts_but_cuda_cannot_see_fail_in_seconds(tmp_path):
    script = tmp_path / "fake_gpu_cluster.py"
    script.write_text(GPUS_RAY_SEES_CUDA_DOES_NOT)
    started = time.monotonic()
    result = run_python_file(
        script,
        tmp_path,
        args=["--use-gpu", "--num-workers", "1", "--storage-path", str(tmp_path / "runs")],
        timeout=120,
    )
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --use-gpu: Ray counts GPUs on ") and "but CUDA sees none in a Ray worker" in line
    assert "CUDA_VISIBLE_DEVICES=0" in line, line  # Ray did hand the worker its GPU
    assert elapsed < 60
    assert not any((tmp_path / "runs").iterdir())  # the storage dir is checked writable; no run dir


@pytest.mark.ray
def test_gpu_request_without_gpus_fails_in_seconds(ray_address, tmp_path):
    assert "--use-gpu, but no GPU in the Ray cluster" in _refusal(tmp_path, use_gpu=True)
