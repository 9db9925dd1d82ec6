"""What a fresh Ray worker pays to unpickle this project's code before a run's first step.

Every Ray actor and task worker is a new Python that imports the modules of what it unpickles: Ray Train's
controller the worker loop, its DatasetManager and Ray Data's task workers the data pipeline. Importing torch
costs about two seconds of CPU, torch.distributed.checkpoint and fsdp about one more; on a small machine each
is seconds of every run's start (docs/benchmarks.md).
"""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("module", "not_imported"),
    [
        ("raytrain_ddp.data.pipeline", "torch"),  # DatasetManager, Ray Data's tasks
        ("raytrain_ddp.data.validate", "torch"),  # the driver's dataset check tasks
        ("raytrain_ddp.worker.loop", "torch.distributed.checkpoint"),  # the controller; DDP workers until a save
        ("raytrain_ddp.worker.loop", "torch.distributed.fsdp"),
        ("raytrain_ddp.driver.monitor", "torch"),  # the RunMonitor actor, on the driver's node
    ],
)
def test_unpickled_modules_leave_heavy_imports_to_first_use(module, not_imported):
    code = f"import sys, ray.train, {module}; print(sorted(m for m in sys.modules if m == {not_imported!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing {module} imports {not_imported}"
