"""What the driver hands every rank, one picklable value under one key of Ray Train's `train_loop_config`:
:class:`WorkerArgs` for the built-in loop (written by driver/fit.py, read by worker/loop.py), :class:`LaunchArgs`
for a launched script or function (driver/launch.py, worker/launched.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray import cloudpickle

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.spec import DataSpec
from raytrain_ddp.plugins import add_import_roots
from raytrain_ddp.worker.hooks import WorkerHooks

LOOP_CONFIG_KEY = "worker_args"


@dataclass(frozen=True)
class UserCode:
    """The user's objects a rank runs: the Python API's callables, the --task, the hooks (None: the built-in
    model and loss, no task, hooks that do nothing)."""

    model_fn: Callable | None = None
    loss_fn: Callable | None = None
    task: object | None = None  # a class or an object; made on each worker
    hooks: WorkerHooks | None = None


@dataclass(frozen=True)
class WorkerArgs:
    """The run's settings, its data's spec, the driver's monitor, and the user's code with the folders it
    imports from.

    The code travels pickled and is unpickled by `user_code()` once those folders are on the worker's path:
    Ray Train's controller unpickles the loop's config first, where a user's module would not import.
    """

    config: TrainConfig
    spec: DataSpec
    monitor: Any  # the RunMonitor actor's handle, or --quick-start's LocalAddress (worker.channel.channel_to)
    import_roots: tuple[str, ...]
    pickled_code: bytes
    local_sources: Any = None  # --quick-start: the splits each rank reads itself (data.pipeline.LocalSources)

    @classmethod
    def pack(
        cls, config: TrainConfig, spec: DataSpec, monitor, import_roots, code: UserCode, local_sources=None
    ) -> WorkerArgs:
        return cls(config, spec, monitor, tuple(import_roots), cloudpickle.dumps(code), local_sources)

    def to_loop_config(self) -> dict:
        return {LOOP_CONFIG_KEY: self}

    @staticmethod
    def from_loop_config(loop_config: dict) -> WorkerArgs:
        return loop_config[LOOP_CONFIG_KEY]

    def user_code(self) -> UserCode:
        add_import_roots(list(self.import_roots))
        return cloudpickle.loads(self.pickled_code)


@dataclass(frozen=True)
class LaunchArgs:
    """A launched script's (`script` and its arguments, run in `cwd` with the caller's `environment`) or function's
    (`pickled_function`: cloudpickled (function, args), unpickled once `import_roots` are on the worker's path),
    with the driver's monitor, the run directory's URI and whose output the console shows (`tee`: "0" or "all")."""

    monitor: Any
    run_dir: str
    run_name: str
    tee: str
    script: str | None = None
    script_args: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    pickled_function: bytes = b""
    import_roots: tuple[str, ...] = ()

    def to_loop_config(self) -> dict:
        return {LOOP_CONFIG_KEY: self}

    @staticmethod
    def from_loop_config(loop_config: dict) -> LaunchArgs:
        return loop_config[LOOP_CONFIG_KEY]

    def function_and_args(self) -> tuple[Callable, Any]:
        add_import_roots(list(self.import_roots))
        return cloudpickle.loads(self.pickled_function)
