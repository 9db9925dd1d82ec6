"""Session fixture for tests/slurm: a 2-node Slurm testbed (see slurm_testbed.py)."""

from __future__ import annotations

import os
import subprocess

import pytest
from slurm_testbed import NODES, TESTBED, TESTBED_DIR, Testbed, _unavailable_reason


@pytest.fixture(scope="session")
def testbed() -> Testbed:
    reason = _unavailable_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the Slurm testbed is unavailable: {reason}", pytrace=False)
        pytest.skip(reason)
    was_up = (TESTBED_DIR / "nodes.count").exists()
    up = subprocess.run([str(TESTBED / "up.sh"), str(len(NODES))], capture_output=True, text=True, timeout=300)
    print(up.stdout, up.stderr)
    if up.returncode != 0:
        pytest.fail(f"cluster/testbed/up.sh failed (rc={up.returncode}):\n{up.stdout}\n{up.stderr}", pytrace=False)
    shared = TESTBED_DIR / "shared"
    shared.mkdir(parents=True, exist_ok=True)
    try:
        yield Testbed(shared=shared)
    finally:
        if not was_up and os.environ.get("RAYTRAIN_TESTBED_KEEP") != "1":
            down = subprocess.run([str(TESTBED / "down.sh")], capture_output=True, text=True, timeout=300)
            print(down.stdout, down.stderr)
