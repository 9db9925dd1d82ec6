"""The driver side of `raytrain-ddp launch`: a user's own script or function as a run's work.

It runs under everything a built-in run has (the run lock, stop signals, the cluster checks, the run
directory, the watcher and watchdog, trackers, summary.json), through :func:`raytrain_ddp.driver.fit.run`;
only what each worker does differs (:mod:`raytrain_ddp.worker.launched`).
"""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ray import cloudpickle

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver import run_directory
from raytrain_ddp.driver.fit import describe_device, warn_if_fewer
from raytrain_ddp.errors import ConfigError, plural
from raytrain_ddp.launch import LAUNCH_FIELDS, script_path
from raytrain_ddp.plugins import import_root
from raytrain_ddp.storage import RunPath, uri_of
from raytrain_ddp.summary import RunSummary
from raytrain_ddp.worker.args import LaunchArgs
from raytrain_ddp.worker.launched import rank_log, run_function_per_worker, run_script_per_worker

log = logging.getLogger("raytrain_ddp")

TEE_CHOICES = ("0", "all")  # whose output the console shows: rank 0's, or every rank's
# After a Ctrl-C, how long each rank's script has to exit on the SIGINT passed on to it before it is killed:
# torchrun's wait between its signal and SIGKILL
INTERRUPT_GRACE_S = 30


@dataclass
class LaunchedWork:
    """A script (run as `python SCRIPT ARGS` on every worker) or a function (called on every worker)."""

    script: str | None = None
    script_args: list[str] = field(default_factory=list)
    function: Callable | None = None
    function_args: Any = None
    tee: str = "0"
    environment: dict[str, str] = field(default_factory=lambda: dict(os.environ))  # the caller's, for every rank
    cwd: str = field(default_factory=os.getcwd)

    import_roots: list[str] = field(default_factory=list)  # the function's module's folder (before_ray)

    launched = True
    config_fields = LAUNCH_FIELDS  # config.toml: the settings a launched run reads
    train_rows = 0  # no data of the project's: the script reads its own
    data_kind = "script"

    @property
    def interrupt_grace_s(self) -> int:
        """A script gets a Ctrl-C as SIGINT and this long to exit; a function (a thread of Ray's worker, which no
        signal reaches) is ended at once."""
        return INTERRUPT_GRACE_S if self.script else 0

    @property
    def what(self) -> str:
        if self.script:
            return shlex.join([self.script, *self.script_args])
        return getattr(self.function, "__qualname__", repr(self.function))

    def before_ray(self, config: TrainConfig) -> list[str]:
        """Refuse, in one line, what cannot run; nothing started, nothing written. Returns the folder the
        function's module is imported from, for the workers."""
        if self.script is not None:
            self.script = script_path(self.script)
        if self.tee not in TEE_CHOICES:
            raise ConfigError(f"--tee {self.tee!r} is unknown; choose one of: {', '.join(TEE_CHOICES)}")
        if run_directory.read_summary(config.run_dir).status == "finished":
            raise ConfigError(
                f"run {config.name!r} already finished in {config.run_dir}; choose a new --name to run it again"
            )
        root = import_root(f"{getattr(self.function, '__module__', '__main__')}:") if self.function else None
        self.import_roots = [root] if root else []
        return self.import_roots

    def with_ray(self, config: TrainConfig) -> None:
        pass

    def choose_start(self, config: TrainConfig, run_dir: RunPath) -> None:
        snapshot = run_dir / "checkpoint"
        if snapshot.exists() and any(snapshot.iterdir()):  # the script's own: it decides what to make of it
            log.info("The script's checkpoint folder holds an earlier attempt's: %s", snapshot)

    def describe(self, config: TrainConfig, workers: int) -> None:
        log.info("Launching %s on %s x %s", self.what, plural(workers, "worker"), describe_device(config))
        warn_if_fewer(config, workers)
        teed = "every rank's" if self.tee == "all" else "rank 0's"
        log.info("Each rank's output: %s; %s on the console", rank_log(str(config.run_dir), "N"), teed)

    def trainer_parts(self, config: TrainConfig, monitor) -> tuple:
        """Ray Train's training function and its config; no datasets."""
        args = LaunchArgs(monitor, uri_of(config.run_dir), config.name, self.tee)
        if self.script:
            script_args = tuple(self.script_args)
            args = replace(
                args, script=self.script, script_args=script_args, environment=self.environment, cwd=self.cwd
            )
            return run_script_per_worker, args.to_loop_config(), {}, None
        # pickled here, unpickled on the worker once the function's module is on its path (a Ray this process
        # joined or started before had no say in its workers' PYTHONPATH)
        function = cloudpickle.dumps((self.function, self.function_args))
        args = replace(args, pickled_function=function, import_roots=tuple(self.import_roots))
        return run_function_per_worker, args.to_loop_config(), {}, None

    def summary_fields(self, recorder) -> dict:
        """What the built-in loop's summary says of epochs, batches and checkpoints is the script's own business
        here: those keys are None; the last step every rank reported is the final metrics."""
        reported = recorder.steps_file.records if recorder.steps_file else []
        return {
            "launched": {"script": self.script, "args": self.script_args} if self.script else {"function": self.what},
            "epochs_requested": None,
            "per_worker_batch_size": None,
            "global_batch_size": None,
            "checkpoints_ranked_by": None,
            "final_metrics": reported[-1] if reported else None,
        }

    def interrupted_line(self, config: TrainConfig, summary: RunSummary) -> str:
        return (
            f"interrupted (Ctrl-C): every rank of {self.what} is stopped; run the same command again, and a script "
            f"that saves to session.checkpoint_dir() resumes from there ({config.run_dir / 'summary.json'})"
        )

    def say_outcome(self, config: TrainConfig, summary: RunSummary, trained_here: int) -> None:
        if summary.status == "stopped":
            log.warning(
                "Stopped early (%s): every rank of %s returned; run the same command again to resume from the "
                "script's own snapshot",
                summary.stop_reason,
                self.what,
            )
        else:
            log.info("Finished %s on %s in %.0fs", self.what, plural(summary.world_size, "worker"), summary.seconds)
