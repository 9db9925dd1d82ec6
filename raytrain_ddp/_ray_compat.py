"""Every Ray API this project uses that Ray does not promise to keep, in one place.

Private modules (``ray._private``), Ray Train V2 internals (``ray.train.v2._internal``) and the file
layout they write are read here and nowhere else. Each was written against the Ray versions in
TESTED_RAY (the range pyproject.toml pins); :func:`check_ray_version` says so in one line at start
when another Ray is installed. Ray's internal modules are imported where they are used, so that a Ray
that has moved them still gets that far and shows the warning first.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import re
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from raytrain_ddp.errors import ConfigError, StorageFull, one_line
from raytrain_ddp.files import create_private, write_atomic
from raytrain_ddp.storage import RemotePath, RunPath, retried

log = logging.getLogger("raytrain_ddp")

TESTED_RAY = ("2.60", "2.61")  # from, up to (excluded): the `ray[...]>=2.60,<2.61` of pyproject.toml

# Environment variables Ray Train's controller and workers read (ray.train.v2._internal.constants)
WORKER_GROUP_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
HEALTH_CHECK_INTERVAL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"  # how often the controller polls its workers
PRINT_PATCH_ENV = "RAY_TRAIN_ENABLE_PRINT_PATCH"
STATE_TRACKING_ENV = "RAY_TRAIN_ENABLE_STATE_TRACKING"  # the driver feeds the Train state actor the dashboard reads
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"  # an actor per run watching Ray's node drains

RAY_ADDRESS_ENV = "RAY_ADDRESS"  # where Ray's clients (the state API too) find the cluster
# A node's log monitor with this many log files looks for new ones every 0.5 s, not 0.1 (ray._private.log_monitor)
LOG_MONITOR_MANY_FILES_ENV = "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"
GCS_PORT_ENV = "RAY_GCS_SERVER_PORT"  # a local start's GCS port (ray._private.ray_constants)

# Token authentication (ray._private.authentication): the mode, and the token or the file that holds it
AUTH_MODE_ENV, AUTH_TOKEN_ENV, AUTH_TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
PRIVATE_BASE = Path.home() / ".raytrain"  # where the Slurm job keeps its token too (job-ID/auth_token)
# False (read at import, ray._private.ray_constants.ENABLE_RAY_CLUSTER): the node's address is 127.0.0.1
NODE_IS_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

# Ray Train V2 keeps a run's checkpoint list here (ray.train.v2._internal.constants)
SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def check_ray_version(version: str | None = None) -> str | None:
    """Log one warning line when `version` (default: the installed Ray) is outside TESTED_RAY; return it."""
    version = version or ray.__version__
    if _minor(TESTED_RAY[0]) <= _minor(version) < _minor(TESTED_RAY[1]):
        return None
    message = (
        f"Ray {version} is installed, but raytrain-ddp is tested with Ray >={TESTED_RAY[0]},<{TESTED_RAY[1]}: "
        f"it uses Ray internals that change between releases (raytrain_ddp/_ray_compat.py); "
        f"if anything fails, install ray[default,train]>={TESTED_RAY[0]},<{TESTED_RAY[1]}"
    )
    log.warning(message)
    return message


# ------------------------------------------------------------------ the connected Ray
def dashboard_url() -> str | None:
    """The dashboard address of the Ray this process is connected to (ray.init returns it; nothing public after)."""
    from ray._private.worker import get_dashboard_url

    return get_dashboard_url()


def session_dir() -> str | None:
    """This node's Ray session directory (its logs/ hold Ray's output), or None before ray.init."""
    node = getattr(ray._private.worker, "_global_node", None)
    return node.get_session_dir_path() if node else None


def own_gcs_process() -> Any | None:
    """The GCS process of the local Ray that this process's ray.init started (a `subprocess.Popen`), or None when
    it joined a running cluster: Ray's node keeps the processes it started by type."""
    from ray._private import ray_constants

    node = getattr(ray._private.worker, "_global_node", None)
    started = getattr(node, "all_processes", {}).get(ray_constants.PROCESS_TYPE_GCS_SERVER) if node else None
    return started[0].process if started else None


@contextlib.contextmanager
def workers_know_their_cluster(address: str, init_options: dict):
    """Give every worker of the job RAY_ADDRESS, its own cluster's address (added to `init_options`).

    Ray Train's PlacementGroupCleaner (an actor of each run) asks the state API whether the run's
    controller lives, finding "its" cluster through $RAY_ADDRESS, else /tmp/ray/ray_current_cluster:
    the Ray started last on the machine, not necessarily this one. A stale file makes every run end
    with a 12 s wait; a file naming another live Ray would make the cleaner remove this run's placement
    group mid-run. A local start gets its GCS port chosen here, so the address is known before it starts.
    """
    if address == "auto" or "://" in address:  # "the Ray on this machine", or Ray Client: left to Ray
        yield
        return
    port = None
    if address == "local":
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        address = f"{ray.util.get_node_ip_address()}:{port}"
    runtime_env = dict(init_options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), RAY_ADDRESS_ENV: address}
    init_options["runtime_env"] = runtime_env
    previous = os.environ.get(GCS_PORT_ENV)
    if port is not None:
        os.environ[GCS_PORT_ENV] = str(port)  # read by the local node's start, in this process
    try:
        yield
    finally:
        if port is not None:
            if previous is None:
                os.environ.pop(GCS_PORT_ENV, None)
            else:
                os.environ[GCS_PORT_ENV] = previous


@contextlib.contextmanager
def private_local_start():
    """Around the ray.init that starts a local Ray: a token of its own, and every listener on loopback."""
    private_token_for_local_start()
    with loopback_only():
        yield


@contextlib.contextmanager
def loopback_only():
    """Start Ray's processes with the node address 127.0.0.1, so that every one listens on loopback only.

    Ray binds the wildcard address (0.0.0.0 and ::) unless the node's address is 127.0.0.1: the GCS, the
    raylet and the object manager, each worker's gRPC server, the dashboard and runtime-env agents and the
    metrics exporters all check for it. ray.init(_node_ip_address="127.0.0.1") cannot say so (Ray turns
    a loopback address into the machine's own, services.resolve_ip_for_localhost); the node address is
    127.0.0.1 where Ray considers clusters disabled, its default on macOS and Windows, which
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 selects on Linux too. Only while the node starts: this process
    may join another cluster later, and there it needs its routable address.
    """
    from ray._private import ray_constants

    previous_env, previous = os.environ.get(NODE_IS_LOOPBACK_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[NODE_IS_LOOPBACK_ENV] = "0"  # Ray's processes started now read it at their import
    ray_constants.ENABLE_RAY_CLUSTER = False  # this one read it at its import
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = previous
        if previous_env is None:
            os.environ.pop(NODE_IS_LOOPBACK_ENV, None)
        else:
            os.environ[NODE_IS_LOOPBACK_ENV] = previous_env


def machine_address() -> str:
    """This machine's own address, the one Ray puts in place of a loopback address it is given."""
    from ray._common.network_utils import node_ip_address_from_perspective

    return node_ip_address_from_perspective()


def private_token_for_local_start() -> Path | None:
    """Give the Ray this process is about to start a token of its own; return its file (None: left to Ray).

    Ray 2.60 turns token auth on for a local ray.init and, finding no token, writes ~/.ray/auth_token
    with the umask's mode (0644: any user of the machine can read it and so run code as this user in
    every later Ray of theirs, since the file is kept for ever). Here the token is new for each process
    that starts a Ray, and dies with it: RAY_AUTH_TOKEN_PATH (which Ray's processes and workers inherit)
    names a file created exclusively, 0600, in a new 0700 directory, removed when the process exits.
    A token the user chose ($RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH) or RAY_AUTH_MODE=disabled is kept.
    """
    if os.environ.get(AUTH_MODE_ENV, "token").lower() != "token":
        return None
    if os.environ.get(AUTH_TOKEN_ENV) or os.environ.get(AUTH_TOKEN_PATH_ENV):
        return None
    PRIVATE_BASE.mkdir(mode=0o700, exist_ok=True)  # an existing one is the user's to set: never chmodded
    directory = Path(tempfile.mkdtemp(prefix="local-ray-", dir=PRIVATE_BASE))  # 0700, a name nobody had
    atexit.register(shutil.rmtree, directory, True)  # after Ray's own exit handler has stopped its processes
    token = create_private(directory / "auth_token", secrets.token_hex(32))
    os.environ[AUTH_TOKEN_PATH_ENV] = str(token)
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # not in its stub

    AuthenticationTokenLoader.instance().reset_cache()  # a token read before (another Ray of this process)
    return token


def kill_train_controller() -> None:
    """Kill this job's Ray Train controller, so that TorchTrainer.fit() raises, and free what it held.

    Ray offers no handle to the controller (it lives inside fit()); the job's actor table names it. Its
    placement group outlives it while this driver lives: Ray Train's PlacementGroupCleaner frees it only once
    the dashboard's state API says the controller is dead, and in a notebook the interrupt (SIGINT to the
    kernel's whole process group) has killed the dashboard of a Ray started there, so the next run would
    wait for those CPUs for ever. The placement groups the controller created go with it.
    """
    from ray._private.state import actors, state
    from ray.core.generated import gcs_pb2
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    job_id = ray.JobID.from_hex(ray.get_runtime_context().get_job_id())
    killed = set()
    for actor_id, actor in actors(job_id=job_id).items():
        if actor["ActorClassName"] == "TrainController" and actor["State"] != "DEAD":
            ray._private.worker.global_worker.core_worker.kill_actor(ray.ActorID.from_hex(actor_id), True)
            killed.add(actor_id)
    for raw in state._connect_and_get_accessor().get_placement_group_table():
        group = gcs_pb2.PlacementGroupTableData.FromString(raw)
        if group.creator_actor_id.hex() in killed and group.state != gcs_pb2.PlacementGroupTableData.REMOVED:
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(group.placement_group_id)))


# ------------------------------------------------------------------ which failures Ray Train retries
@functools.cache
def torch_trainer(may_retry: Callable[[BaseException], bool]) -> Any:
    """A TorchTrainer class whose failure policy retries an error only when Ray's default would and
    `may_retry(error)` agrees, and that leaves Ctrl-C to its caller.

    Ray Train V2 builds its failure policy from FailureConfig alone, with no public hook: the policy
    subclasses the private DefaultFailurePolicy and reaches the controller through the trainer's
    private `_initialize_and_run_controller`. That method also installs a SIGINT handler of Ray's that
    it never takes back (in a notebook every later interrupt is swallowed) and that exits the process
    with 1; without it a Ctrl-C is Python's KeyboardInterrupt, which fit() turns into an orderly end.
    """
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy

    class RetryRulePolicy(DefaultFailurePolicy):
        def _is_retryable_error(self, training_failed_error) -> bool:
            return may_retry(training_failed_error) and super()._is_retryable_error(training_failed_error)

    class RetryRuleTorchTrainer(TorchTrainer):
        def _initialize_and_run_controller(self, **controller_init_kwargs):
            controller_init_kwargs["failure_policy"] = RetryRulePolicy(self.run_config.failure_config)
            return super()._initialize_and_run_controller(**controller_init_kwargs)

        def _register_sigint_handler(self, controller) -> None:
            pass

    return RetryRuleTorchTrainer


def wrapped_error(error: BaseException) -> BaseException | None:
    """The error one of Ray's wrappers holds (a task's, with its ray:: traceback; the Train controller's),
    or None for an error that is not a wrapper."""
    from ray.train import ControllerError

    if isinstance(error, ray.exceptions.RayTaskError):
        return error.cause
    if isinstance(error, ControllerError):
        return error.controller_failure
    return None


# ------------------------------------------------------------------ the checkpoint upload
class _UploadGaveUp(Exception):
    """A checkpoint upload storage.retried gave up on, carried out of Ray Train's own retry of the upload: that
    repeats, 3 times, any error whose words name an AWS error (as StorageFull's do), and the budget is spent."""

    def __init__(self, full: StorageFull) -> None:
        super().__init__("the checkpoint upload gave up")
        self.full = full


def report_checkpoint(metrics: dict, checkpoint: Any, what: str, run_dir: RunPath, **report_options: Any) -> None:
    """ray.train.report(metrics, checkpoint=...), `checkpoint` (`what`, as messages name it) uploaded into
    `run_dir`. On object storage the upload is Ray Train's own (its storage context's copy into the run's
    checkpoint directory), each try inside storage.retried: a store that fails in passing is retried within the
    budget, one that stays down raises StorageFull (the run ends, exit 74) where pyarrow's error would restart the
    group.

    `checkpoint_upload_fn` is public; Ray Train's own upload (its storage context's) is not."""
    import ray.train

    if not isinstance(run_dir, RemotePath):  # a local run directory: Ray Train's copy, a full disk its OSError
        ray.train.report(metrics, checkpoint=checkpoint, **report_options)
        return

    def upload(local: Any, checkpoint_dir_name: str) -> Any:
        storage = ray.train.get_context().get_storage()
        try:
            return retried(what, run_dir, lambda: storage.persist_current_checkpoint(local, checkpoint_dir_name))
        except StorageFull as full:
            raise _UploadGaveUp(full) from None

    try:
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_fn=upload, **report_options)
    except _UploadGaveUp as gave_up:
        raise gave_up.full from None


# ------------------------------------------------------------------ the checkpoint snapshot
# Ray Train V2 hands the workers the snapshot's latest checkpoint when the same run starts again (its
# resume_from_checkpoint argument is gone), so choosing the checkpoint a run resumes from means
# editing the snapshot. Each edit is validated against the installed Ray's own schema when written.
def has_snapshot(run_dir: RunPath) -> bool:
    return (run_dir / SNAPSHOT_FILE).exists()


def read_snapshot(run_dir: RunPath) -> dict | None:
    path = run_dir / SNAPSHOT_FILE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:  # cut short: Ray Train could not resume from it either
        raise ConfigError(
            f"{path} is unreadable ({one_line(err)}): Ray Train cannot tell which checkpoint to resume from; "
            "move it aside to start this run again from epoch 1, or choose another --name"
        ) from None


def write_snapshot(run_dir: RunPath, state: dict) -> None:
    """Write the snapshot atomically, after Ray's own schema has accepted it."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState

    # Ray Train reads it with pydantic's v1 API (parse_obj); v2's model_validate/model_dump_json are the same
    # schema and text without v2's deprecation warnings
    text = _CheckpointManagerState.model_validate(state).model_dump_json()
    write_atomic(run_dir / SNAPSHOT_FILE, text)


def new_snapshot(checkpoint_dir_name: str, metrics: dict) -> dict:
    """A snapshot whose one checkpoint, `checkpoint_dir_name` in the run directory, is the latest."""
    result = {"checkpoint_dir_name": checkpoint_dir_name, "metrics": metrics}
    return {
        "checkpoint_results": [result],
        "checkpoint_report_indices": [0],
        "latest_checkpoint_result": result,
        "pending_training_results": [],
        "pending_validation_specs": [],
        "current_report_index": 1,
        "validated_checkpoint_dir_names": [],
        "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": [],
    }


def checkpoints_newest_first(state: dict) -> list[str]:
    """The directory names of the snapshot's checkpoints, the latest reported first."""
    pairs = sorted(
        zip(state["checkpoint_report_indices"], state["checkpoint_results"]), key=lambda pair: pair[0], reverse=True
    )
    return [result["checkpoint_dir_name"] for _, result in pairs]


def drop_checkpoints(state: dict, names: list[str]) -> bool:
    """Remove the checkpoints `names` from the snapshot (the newest left becomes the latest); say if any is left."""
    kept = [
        (index, result)
        for index, result in zip(state["checkpoint_report_indices"], state["checkpoint_results"])
        if result["checkpoint_dir_name"] not in names
    ]
    state["checkpoint_report_indices"] = [index for index, _ in kept]
    state["checkpoint_results"] = [result for _, result in kept]
    state["latest_checkpoint_result"] = max(kept, key=lambda pair: pair[0])[1] if kept else None
    pending = [
        (result, spec)
        for result, spec in zip(state["pending_training_results"], state["pending_validation_specs"])
        if result["checkpoint_dir_name"] not in names
    ]
    state["pending_training_results"] = [result for result, _ in pending]
    state["pending_validation_specs"] = [spec for _, spec in pending]
    return bool(kept)


def drop_unsaved_metrics(state: dict) -> bool:
    """Remove metrics saved as null; say whether there were any.

    Ray writes the snapshot with pydantic, which turns inf and NaN into null
    (e.g. the -inf score of a checkpoint taken mid-epoch on a stop request, or
    a NaN validation loss). Read back, a null score makes Ray Train's
    checkpoint ranking fail (float * None) at the first report of the resumed
    run; a missing score ranks lowest instead.
    """
    results = (
        state["checkpoint_results"]
        + state["pending_training_results"]
        + ([state["latest_checkpoint_result"]] if state["latest_checkpoint_result"] else [])
    )
    dropped = False
    for result in results:
        for key in [key for key, value in result["metrics"].items() if value is None]:
            del result["metrics"][key]
            dropped = True
    return dropped


# ------------------------------------------------------------------ --quick-start: Ray Train's local mode
# Local mode (ScalingConfig(num_workers=0)) runs the training function in this process: no controller, so none
# of its checkpoint bookkeeping either. The quick path's driver keeps the run's checkpoints with Ray Train's own
# CheckpointManager (the same snapshot, the same retention, so either path resumes the other's run), and a rank
# resumes from the checkpoint handed to local mode's train-function state.
def local_checkpoint_manager(storage_path: str, run_name: str, checkpoint_config: Any) -> Any:
    """Ray Train's CheckpointManager of run `run_name` under a local `storage_path`, its snapshot read if there is
    one (as the controller's is at a run's start)."""
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.storage import StorageContext

    return CheckpointManager(checkpoint_config, StorageContext(storage_path, run_name))


def register_local_checkpoint(manager: Any, checkpoint_dir_name: str, metrics: dict) -> None:
    """A checkpoint written into the run directory, recorded as a report of it would be: the snapshot rewritten,
    the checkpoints past --num-to-keep deleted."""
    import asyncio

    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    storage = manager._storage_context
    path = storage.build_checkpoint_path_from_name(checkpoint_dir_name)
    report = _TrainingReport(Checkpoint(path, filesystem=storage.storage_filesystem), metrics, validation=False)

    async def register() -> None:  # it wakes its waiters with an asyncio task: it needs a running loop
        manager.register_checkpoint(report)

    asyncio.run(register())


def local_result(manager: Any, run_dir: RunPath) -> Any:
    """A ray.train.Result of the manager's checkpoints, as the controller's fit() returns it."""
    from ray.train import Result

    latest = manager.latest_checkpoint_result
    return Result(
        metrics=None,  # the recorder has the run's metrics; Ray Train's Result is read for its checkpoints
        checkpoint=latest.checkpoint if latest else None,
        error=None,
        path=str(run_dir),
        best_checkpoints=[(result.checkpoint, result.metrics) for result in manager.best_checkpoint_results],
    )


def set_local_checkpoint(checkpoint: Any) -> None:
    """Hand `checkpoint` to the training function as ray.train.get_checkpoint()'s answer, in local mode (which
    answers its last reported one: none at the start)."""
    from ray.train.v2._internal.execution.train_fn_utils import get_train_fn_utils

    get_train_fn_utils()._last_checkpoint = checkpoint
