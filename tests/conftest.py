"""Shared fixtures: one real Ray instance per test session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

S3_TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "raytrain-test-key",
    "AWS_SECRET_ACCESS_KEY": "raytrain-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _export_s3_credentials() -> None:
    """The test server's credentials in the environment, as a user exports them (before Ray starts, so every Ray
    worker has them too); the S3-compatible test server (the `s3_server` fixture) takes any key."""
    for key, value in S3_TEST_CREDENTIALS.items():
        os.environ.setdefault(key, value)


def pytest_configure(config: pytest.Config) -> None:
    # Every process this worker starts (its Ray and Ray's workers, CLI runs, the bench) inherits the mark:
    # support.processes_with then leaves the other lane's processes out.
    from support import LANE_ENV

    os.environ[LANE_ENV] = os.environ.get("PYTEST_XDIST_WORKER", "main")


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    # A scheduler of our own, not xdist_group marks: `--dist loadgroup` reads them into the node id, which
    # pytest 9.2's node ids no longer take, so every test was its own group (two Slurm tests at once broke
    # the testbed). Each lane is one scope: one worker runs it whole, in file order. A file of either lane is a
    # scope of its own: xdist hands it to the first worker with at most two tests left (scopes with the most
    # tests go first, so each worker starts on a lane), and the lane that ends first does not wait idle.
    from support import lane_of
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            lane = lane_of(nodeid)
            return nodeid.split("::", 1)[0] if lane == "either" else lane

    return LaneScheduling(config, log)


@pytest.fixture(scope="session")
def ray_address() -> str:
    """A real local Ray (3 logical CPUs: 2 workers + data loading), shared by the session.

    Started in this process so in-process `fit()` calls reuse it; CLI tests
    join it with --address. Small object store: this machine has 2 cores.
    """
    import ray

    from raytrain_ddp._ray_compat import LOG_MONITOR_MANY_FILES_ENV
    from raytrain_ddp.driver.preflight import init_ray

    _export_s3_credentials()

    # "local": a new Ray of our own, never one that `ray start` left on this machine (the Slurm testbed's);
    # started as fit() starts one, so its workers know its address (RAY_ADDRESS). Its log monitor looks for new
    # log files every 0.5 s, not 0.1 (Ray's setting for nodes with many): this Ray gathers hundreds of worker
    # logs, and that scan was its largest idle cost (91 CPU seconds of a 36-minute suite). Set only while it
    # starts: the commands the tests run start their Rays as a user's do.
    with pytest.MonkeyPatch.context() as starting:
        starting.setenv(LOG_MONITOR_MANY_FILES_ENV, "0")
        init_ray(
            "local",
            num_cpus=3,
            object_store_memory=300 * 2**20,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """`python -m raytrain_ddp.run` with the built-in defaults but the sizes, on a local Ray of its own (dashboard
    on), trained once for every test that only reads what a run prints and writes: (the command's output, its
    run directory).

    It also logs to an MLflow file store, STORAGE/mlruns, to an offline W&B run in RUN_DIR/wandb/, records
    every 4th optimizer step and profiles steps 3 and 4 (test_observe and test_report read them back).
    """
    from support import WANDB_OFFLINE, run_cli, shared_run_args

    storage = tmp_path_factory.mktemp("shared-runs")
    # not the session Ray's token (this process's environment holds it): the one the command makes for its own;
    # W&B: no network here, and nothing prompts
    env = {**WANDB_OFFLINE, "RAY_AUTH_TOKEN_PATH": ""}
    result = run_cli("raytrain_ddp.run", *shared_run_args(storage), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, storage / "shared"


@pytest.fixture(scope="session")
def trained_run(shared_run):
    """The shared run's directory."""
    return shared_run[1]


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible HTTP server on 127.0.0.1 (moto's server mode, a subprocess) holding an empty bucket
    `raytrain`: its endpoint URL. The credentials come by environment (ray_address sets them up)."""
    import pyarrow.fs as pafs

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _export_s3_credentials()
        fs = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                fs.create_dir("raytrain")
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the S3 test server did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)
