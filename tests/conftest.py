"""Shared fixtures: one real Ray instance per test session."""

from __future__ import annotations

import pytest


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
