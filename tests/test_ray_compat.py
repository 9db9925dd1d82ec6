"""The one module that touches Ray's internals: its version check and its snapshot edits, against the installed Ray.

No Ray cluster: Ray's own constants and its snapshot schema (pydantic) are read, nothing is started.
"""

from __future__ import annotations

import inspect
import logging
import tomllib
from pathlib import Path

import pytest
import ray
from support import processes_with

from raytrain_ddp import _ray_compat

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["2.60.0", "2.60.7", "2.60.1rc1"])
def test_a_tested_ray_is_quiet(version, caplog):
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp"):
        assert _ray_compat.check_ray_version(version) is None
    assert not caplog.records


@pytest.mark.parametrize("version", ["2.59.3", "2.61.0", "3.0.0.dev0"])
def test_an_untested_ray_gets_one_warning_line(version, caplog):
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp"):
        message = _ray_compat.check_ray_version(version)
    assert [record.getMessage() for record in caplog.records] == [message]
    assert "\n" not in message
    assert message.startswith(f"Ray {version} is installed, but raytrain-ddp is tested with Ray >=2.60,<2.61")


def test_the_installed_ray_is_a_tested_one():
    assert _ray_compat.check_ray_version() is None, f"Ray {ray.__version__}"


def test_pyproject_pins_the_tested_range():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = [d for d in dependencies if d.startswith("ray[")]
    low, high = _ray_compat.TESTED_RAY
    assert pinned == [f"ray[default,train]>={low},<{high}"]


def test_names_match_the_installed_ray_trains():
    from ray.train.v2._internal import constants

    assert _ray_compat.WORKER_GROUP_START_TIMEOUT_ENV == constants.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR
    assert _ray_compat.PRINT_PATCH_ENV == constants.ENABLE_PRINT_PATCH_ENV_VAR
    assert _ray_compat.HEALTH_CHECK_INTERVAL_ENV == constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR
    assert _ray_compat.HEALTH_CHECK_INTERVAL_ENV in constants.ENV_VARS_TO_PROPAGATE  # the driver's reaches it
    assert _ray_compat.PREEMPTION_WATCHER_ENV == constants.ENABLE_PREEMPTION_WATCHER_ENV_VAR
    assert _ray_compat.PREEMPTION_WATCHER_ENV in constants.ENV_VARS_TO_PROPAGATE
    assert _ray_compat.SNAPSHOT_FILE == constants.CHECKPOINT_MANAGER_SNAPSHOT_FILENAME


def test_snapshot_edits_pass_rays_schema(tmp_path):
    """Written, read back, a corrupt latest dropped: each state is one Ray's schema accepts and ranks."""
    state = _ray_compat.new_snapshot("checkpoint_a", {"val_accuracy": 0.5})
    second = {"checkpoint_dir_name": "checkpoint_b", "metrics": {"val_accuracy": float("-inf")}}
    state["checkpoint_results"].append(second)
    state["checkpoint_report_indices"].append(1)
    state["latest_checkpoint_result"] = second
    _ray_compat.write_snapshot(tmp_path, state)
    assert _ray_compat.has_snapshot(tmp_path)

    state = _ray_compat.read_snapshot(tmp_path)
    assert state["latest_checkpoint_result"]["metrics"] == {"val_accuracy": None}  # pydantic wrote -inf as null
    assert _ray_compat.drop_unsaved_metrics(state)
    assert state["latest_checkpoint_result"]["metrics"] == {}
    assert _ray_compat.checkpoints_newest_first(state) == ["checkpoint_b", "checkpoint_a"]

    assert _ray_compat.drop_checkpoints(state, ["checkpoint_b"])
    _ray_compat.write_snapshot(tmp_path, state)
    state = _ray_compat.read_snapshot(tmp_path)
    assert state["latest_checkpoint_result"]["checkpoint_dir_name"] == "checkpoint_a"
    assert not _ray_compat.drop_checkpoints(state, ["checkpoint_a"])
    assert state["latest_checkpoint_result"] is None
    _ray_compat.write_snapshot(tmp_path, state)
    assert not (tmp_path / (_ray_compat.SNAPSHOT_FILE + ".tmp")).exists()


def test_no_snapshot_reads_as_none(tmp_path):
    assert _ray_compat.read_snapshot(tmp_path) is None
    assert not _ray_compat.has_snapshot(tmp_path)


@pytest.mark.ray
def test_the_workers_of_a_ray_we_start_know_its_address(ray_address):
    """Ray Train's placement-group cleaner finds "its" cluster by $RAY_ADDRESS, else by the file of the Ray
    started last on this machine (stale, or another live Ray: then it removes a live run's placement group)."""

    @ray.remote(num_cpus=0)
    def address_seen_by_a_worker() -> str | None:
        import os

        return os.environ.get("RAY_ADDRESS")

    assert ray.get(address_seen_by_a_worker.remote()) == ray_address


@pytest.mark.ray
def test_the_session_rays_log_monitor_looks_for_new_files_as_on_a_node_with_many(ray_address):
    """The test session's Ray (conftest): its log monitor has the setting, which the installed Ray reads."""
    from ray._private import log_monitor

    assert f'os.getenv("{_ray_compat.LOG_MONITOR_MANY_FILES_ENV}"' in inspect.getsource(log_monitor)
    here = f"--session-dir={_ray_compat.session_dir()}".encode()
    (monitor,) = [pid for pid in processes_with(b"log_monitor.py") if here in Path(f"/proc/{pid}/cmdline").read_bytes()]
    environment = Path(f"/proc/{monitor}/environ").read_bytes().split(b"\0")
    assert f"{_ray_compat.LOG_MONITOR_MANY_FILES_ENV}=0".encode() in environment


def test_the_retry_rule_reaches_ray_trains_controller_without_torch():
    """The failure policy carries may_retry to Ray Train's controller, which unpickles it: importing its module there
    imported torch as well (torch_trainer ran at its import; 3-5 CPU seconds of every run's start, in a process that
    trains nothing). Unpickled here as the controller does, in a new interpreter."""
    import subprocess
    import sys

    from ray import cloudpickle

    from raytrain_ddp.driver.failures import may_retry

    loads = "import sys, ray.cloudpickle as p; p.loads(sys.stdin.buffer.read()); print('torch' in sys.modules)"
    unpickled = subprocess.run(
        [sys.executable, "-c", loads], input=cloudpickle.dumps(may_retry), capture_output=True, cwd=ROOT, timeout=120
    )
    assert unpickled.returncode == 0, unpickled.stderr[-2000:]
    assert unpickled.stdout.decode().strip() == "False"
