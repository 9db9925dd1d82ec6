"""Shared fixtures: one real Ray instance per test session, and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_address() -> str:
    """A real local Ray (3 logical CPUs: 2 workers + data loading), shared by the session.

    Started in this process so in-process `fit()` calls reuse it; CLI tests
    join it with --address. Small object store: this machine has 2 cores.
    """
    import ray

    ray.init(num_cpus=3, object_store_memory=300 * 2**20, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def run_cli(module: str, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` the way a user would, capturing its output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=full_env)
