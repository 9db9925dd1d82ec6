"""`fit(config)`: one training run from the driver, start to summary.

Connect to Ray (or start it), check the request fits, build the Ray Data
datasets, hand the worker loop to Ray Train's ``TorchTrainer``, watch the
workers' news while it runs, and write ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import ray.data
from ray.train import FailureConfig, Result, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from raytrain_ddp import _ray_compat
from raytrain_ddp.checkpoint import ranking, registry
from raytrain_ddp.checkpoint.layout import entry_point
from raytrain_ddp.checkpoint.state import describe as describe_checkpoint
from raytrain_ddp.checkpoint.verify import check_fits_model
from raytrain_ddp.cluster import health
from raytrain_ddp.config import TrainConfig, is_import_path
from raytrain_ddp.data.pipeline import ShardingDataConfig, build_datasets, local_sources
from raytrain_ddp.data.spec import DataPlan, DataSpec, plan_data, plugin_plan
from raytrain_ddp.driver import dashboard, preflight, quick, run_directory, run_lock, tracker
from raytrain_ddp.driver.console import finished_text
from raytrain_ddp.driver.failures import describe_failure, may_retry, storage_full_in
from raytrain_ddp.driver.mlflow_log import MlflowLog
from raytrain_ddp.driver.monitor import RunRecorder, start_monitor
from raytrain_ddp.driver.signals import INTERRUPT_REASON, StopSignal, interrupts_deferred, stop_on_signals
from raytrain_ddp.driver.tensorboard_log import TensorBoardLog
from raytrain_ddp.driver.wandb_log import WandbLog
from raytrain_ddp.driver.watchdog import NodeWatch, watch
from raytrain_ddp.errors import ConfigError, RunTakenOver, StorageFull, one_line, plural, storage_full_as
from raytrain_ddp.files import write_atomic
from raytrain_ddp.models import build_model
from raytrain_ddp.plugins import describe, import_root, load_object, make_task
from raytrain_ddp.redact import RedactFilter, redact
from raytrain_ddp.report import write_report
from raytrain_ddp.storage import RETRY_BUDGET_ENV, RemotePath, RunPath, Spool, stored, uri_of
from raytrain_ddp.summary import RunSummary
from raytrain_ddp.worker.args import UserCode, WorkerArgs
from raytrain_ddp.worker.channel import MonitorChannel, RayChannel
from raytrain_ddp.worker.hooks import WorkerHooks, chosen_hooks
from raytrain_ddp.worker.loop import train_loop_per_worker
from raytrain_ddp.worker.profile import PROFILE_DIR

log = logging.getLogger("raytrain_ddp")
progress_log = logging.getLogger("raytrain_ddp.progress")  # driver.log only
progress_log.propagate = False
for _logger in (log, progress_log):  # credentials inside URIs (--mlflow-uri, --storage-path) never reach a log
    _logger.addFilter(RedactFilter())

# How long Ray Train waits to place a worker group before it counts a controller failure and decides
# again. Right after a node dies Ray still counts it, so the first restart asks for too many workers:
# this wait bounds how long an elastic run (--min-workers) takes to notice and start with fewer.
# The environment variable overrides it (seconds; the elastic tests wait 5).
PLACEMENT_WAIT_ENV = "RAYTRAIN_PLACEMENT_WAIT_S"
WORKER_GROUP_PLACEMENT_WAIT_S = 30
# How often Ray Train's controller polls the workers (Ray's default: 2 s). Each change of the run's state (the
# workers started, finished, failed) waits for the next poll; a poll is one small call per worker, and one that
# takes longer is not a failure (Ray's health-check timeout is 10 minutes). A user's own setting is kept.
CONTROLLER_POLL_S = 0.5
DRIVER_LOG = "driver.log"
QUIET_ENV = {
    "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
    _ray_compat.PRINT_PATCH_ENV: "0",
}


class Interrupted(KeyboardInterrupt):
    """Ctrl-C ended the run: its workers are gone and summary.json says how far it got. The message is the
    one line the CLI prints."""


@dataclass
class FitResult:
    """What a run left behind: its directory, summary and per-epoch records."""

    run_dir: RunPath
    run_summary: RunSummary
    epochs: list[dict]

    @property
    def summary(self) -> dict:
        """What summary.json holds."""
        return self.run_summary.to_json()

    @property
    def ok(self) -> bool:
        return self.run_summary.status == "finished"

    @property
    def storage_full(self) -> bool:
        """Failed for a full disk or quota (or a read-only mount): free space, then running it again resumes it."""
        return bool(self.run_summary.storage_full)

    @property
    def stopped(self) -> bool:
        """Stopped early on request (a signal) with epochs left: running it again resumes it."""
        return self.run_summary.status == "stopped"

    @property
    def stop_reason(self) -> str | None:
        return self.run_summary.stop_reason

    @property
    def best_checkpoint(self) -> str | None:
        return self.run_summary.best_checkpoint

    @property
    def final_metrics(self) -> dict:
        return self.run_summary.final_metrics or {}


def connect(config: TrainConfig, import_roots: Sequence[str] = ()) -> str | None:
    """Join the cluster at --address / $RAY_ADDRESS, or start a local Ray. Returns the dashboard URL.

    `import_roots` go on the PYTHONPATH of every Ray worker of this job, so
    plug-in modules import in Ray Data's tasks as well as in the training workers.
    """
    _ray_compat.check_ray_version()
    os.environ.update({**QUIET_ENV, **dashboard.TRAIN_STATE_ENV})  # the driver feeds the dashboard's Train API
    if not config.verbose:  # Ray's own INFO lines stay in its session logs, off the console
        for noisy in ("ray", "ray.data", "ray.train"):
            logging.getLogger(noisy).setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module="ray")
    if not ray.is_initialized():
        address = config.address or os.environ.get("RAY_ADDRESS")
        quiet = logging.INFO if config.verbose else logging.ERROR
        options = dict(
            logging_level=quiet,
            log_to_driver=config.verbose,
            runtime_env={"env_vars": {**QUIET_ENV, **_pythonpath(import_roots), **_storage_retry_budget()}},
            job_config=ray.job_config.JobConfig(metadata={"job_name": config.name}),
        )  # Jobs page
        if address:
            context = preflight.init_ray(address, **options)
        else:
            preflight.check_local_capacity(config)
            cpus = preflight.local_cpus(config)
            log.info(
                "Starting a local Ray with %s on %s", plural(cpus, "logical CPU"), plural(os.cpu_count() or 0, "core")
            )
            context = preflight.init_ray("local", include_dashboard=True, num_cpus=cpus, **options)
        url = context.dashboard_url
    else:
        url = _ray_compat.dashboard_url()  # already connected (a notebook, a test session)
    ray.data.DataContext.get_current().enable_progress_bars = config.verbose
    return f"http://{url}" if url and not url.startswith("http") else url


def _storage_retry_budget() -> dict:
    """The object-store retry budget the driver was given, for the workers too (their checkpoint uploads)."""
    budget = os.environ.get(RETRY_BUDGET_ENV)
    return {RETRY_BUDGET_ENV: budget} if budget else {}


def _pythonpath(import_roots: Sequence[str]) -> dict:
    paths = list(import_roots) + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    return {"PYTHONPATH": os.pathsep.join(paths)} if paths else {}


def _describe_cluster(config: TrainConfig, dashboard_url: str | None, nodes: list[dict]) -> None:
    log.info("Ray cluster: %s: %s", plural(len(nodes), "node"), preflight.describe(nodes))
    if dashboard_url:
        log.info("Ray dashboard: %s%s", dashboard_url, dashboard.login_hint())
        log.info(dashboard.where_the_run_shows(dashboard_url, config.name))


def describe_device(config: TrainConfig) -> str:
    return "GPU (NCCL)" if config.use_gpu else "CPU (gloo)"


def warn_if_fewer(config: TrainConfig, workers: int) -> None:
    """An elastic run that starts with fewer workers than asked for says so."""
    if workers < config.num_workers:
        log.warning(
            "Only %d of the %d workers asked for fit the cluster: starting with %d (--min-workers %d)",
            workers,
            config.num_workers,
            workers,
            config.min_workers,
        )


def _describe_training(config: TrainConfig, workers: int, spec: DataSpec) -> None:
    device = describe_device(config)
    elastic = f" (elastic: {config.min_workers}..{workers})" if config.min_workers else ""
    log.info(
        "Training %s on %s with %s%s x %s, %s, %s, %s",
        f"{config.task} (model {config.model})" if config.task else config.model,
        config.data or config.train_data or config.dataset,
        plural(workers, "worker"),
        elastic,
        device,
        config.strategy.upper(),
        config.precision,
        plural(config.epochs, "epoch"),
    )
    warn_if_fewer(config, workers)
    accumulation = f" x {config.grad_accum} micro-batches" if config.grad_accum > 1 else ""
    log.info(
        "Global batch = %d per worker%s x %s = %d (what each optimizer step really trains with)",
        config.batch_size,
        accumulation,
        plural(workers, "worker"),
        config.global_batch_for(workers),
    )
    if config.scale_lr:
        log.info(
            "Learning rate scaled linearly with the global batch: %g x %d = %g",
            config.lr,
            workers * config.grad_accum,
            config.lr_for(workers),
        )
    if spec.constant_inputs:
        log.warning(
            "Constant over the training split (std 0), so scaled by 1, not divided by 0: %s",
            ", ".join(spec.constant_inputs),
        )


class _RunLogFile(logging.FileHandler):
    """driver.log: lines its file system refuses (full) are lost and said once on the console, not a traceback
    per line (logging's default), nor one when the log closes."""

    refused = False

    def handleError(self, record: logging.LogRecord) -> None:
        self._say_refused(sys.exc_info()[1])

    def close(self) -> None:
        try:
            super().close()
        except OSError as err:  # its last lines
            self._say_refused(err)

    def _say_refused(self, err: BaseException | None) -> None:
        if not self.refused:
            self.refused = True
            sys.stderr.write(f"{self.baseFilename}: lines left out ({one_line(err or OSError())})\n")


def _log_to_console_and_file(run_dir: RunPath) -> tuple[logging.Handler, Spool]:
    """Console output for scripts and notebooks that set up no logging; a full log in the run dir (on object
    storage: written locally, uploaded when the run ends)."""
    if not logging.getLogger().handlers and not log.handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.setLevel(logging.INFO)
    spool = Spool(run_dir, fetch=(DRIVER_LOG,))
    log_file = _RunLogFile(spool.local / DRIVER_LOG)
    log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log_file.addFilter(RedactFilter())  # records of child loggers too (they skip the parent's own filters)
    log.addHandler(log_file)
    progress_log.setLevel(logging.INFO)
    progress_log.addHandler(log_file)
    return log_file, spool


def placement_wait_s() -> float:
    """RAYTRAIN_PLACEMENT_WAIT_S, else WORKER_GROUP_PLACEMENT_WAIT_S; ConfigError (one line) for a bad value."""
    try:
        return health.env_number(os.environ, PLACEMENT_WAIT_ENV, WORKER_GROUP_PLACEMENT_WAIT_S, 3600, "seconds", 1)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _make_trainer(config: TrainConfig, work, monitor, start_workers: int, data_kind: str) -> TorchTrainer:
    placement_wait = placement_wait_s()
    os.environ[_ray_compat.WORKER_GROUP_START_TIMEOUT_ENV] = str(placement_wait)
    os.environ.setdefault(_ray_compat.HEALTH_CHECK_INTERVAL_ENV, str(CONTROLLER_POLL_S))
    # Ray Train's PreemptionWatcher is one more actor process per run (2-3 CPU seconds of a run's start on two
    # cores: docs/benchmarks.md) for ray.train.get_preemption_info(), which this loop does not read: a Slurm
    # preemption arrives as a signal (driver/signals.py). A user's own setting is kept.
    os.environ.setdefault(_ray_compat.PREEMPTION_WATCHER_ENV, "0")
    # Ray's default retries a worker group that cannot be placed for ever (-1). Here it gives up a little
    # after --capacity-wait-s: the watcher's own deadline comes first and names the lost node.
    placement_tries = math.ceil(config.capacity_wait_s / placement_wait) + 1
    # Elastic: never more than fit at the start, which preflight packed with a CPU left for Ray Data
    # (Ray Train's own count would fill every CPU and starve the data pipeline).
    workers = (config.min_workers, start_workers) if config.min_workers else config.num_workers
    train_loop, loop_config, datasets, dataset_config = work.trainer_parts(config, monitor)
    # TorchTrainer with may_retry in its failure policy, made here, not where may_retry is defined: Ray Train's
    # controller unpickles the policy, so it imports driver/failures.py, which then imports no torch
    return _ray_compat.torch_trainer(may_retry)(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=workers, use_gpu=config.use_gpu, resources_per_worker={"CPU": config.cpus_per_worker}
        ),
        run_config=RunConfig(
            name=config.name,
            storage_path=config.storage_path,
            checkpoint_config=ranking.retention(config, work.data_kind),
            failure_config=FailureConfig(max_failures=config.max_failures, controller_failure_limit=placement_tries),
        ),
        torch_config=TorchConfig(timeout_s=config.collective_timeout_s),
        datasets=datasets,
        dataset_config=dataset_config,
    )


def resolve_plugins(
    config: TrainConfig, model_fn=None, dataset_fn=None, loss_fn=None, task=None, hooks: WorkerHooks | None = None
) -> tuple[UserCode, list[str], object]:
    """Import the plug-ins the config names (a typo fails here, in one line): the code the workers run, the
    folders they import it from, and the dataset plug-in (None: no plug-in) the driver calls once Ray is up.

    Python API callables are recorded in the config by name, for the run directory's config.toml.
    """
    paths = [
        (flag, path)
        for flag, path in (
            ("--model", config.model),
            ("--dataset", config.dataset),
            ("--loss", config.loss),
            ("--task", config.task),
        )
        if path and is_import_path(path)
    ]
    loaded = {flag: load_object(path, flag) for flag, path in paths}
    hooks, hooks_roots = chosen_hooks(hooks)
    for field_name, fn in (("model", model_fn), ("dataset", dataset_fn), ("loss", loss_fn), ("task", task)):
        if fn is not None:
            setattr(config, field_name, describe(fn))
    task = task if task is not None else loaded.get("--task")
    if task is not None:  # a task without its methods fails here, in one line
        make_task(task, config, repr(config.task))
    api_paths = [
        f"{getattr(obj, '__module__', '__main__')}:" for obj in (model_fn, loss_fn, task, dataset_fn) if obj is not None
    ]
    roots = {root for path in [p for _, p in paths] + api_paths if (root := import_root(path))} | set(hooks_roots)
    code = UserCode(model_fn=model_fn, loss_fn=loss_fn, task=task, hooks=hooks)
    return code, sorted(roots), dataset_fn or loaded.get("--dataset")


def model_shapes(config: TrainConfig, plan: DataPlan, model_fn) -> dict[str, tuple[int, ...]]:
    """Build the model on the meta device (no memory): wrong model/data pairs and broken plug-ins fail here.
    Returns the shape of each tensor of its state, by name: what a checkpoint it resumes from must hold."""
    import torch

    with torch.device("meta"):
        model = build_model(config, plan.spec, model_fn)
    return {name: tuple(value.shape) for name, value in model.state_dict().items() if isinstance(value, torch.Tensor)}


def _check_plan(config: TrainConfig, plan: DataPlan, model_fn) -> tuple[dict | None, dict[str, tuple[int, ...]]]:
    """The model builds for this data, and --resume-from was made for both: --resume-from's state (or None)
    and the model's tensor shapes."""
    if plan.spec.train_rows < config.num_workers:
        where = "the training data" if config.uses_parquet or plan.spec.kind == "custom" else "--train-size"
        raise ConfigError(
            f"{where} holds {plan.spec.train_rows} training rows, fewer than --num-workers "
            f"{config.num_workers}: every worker needs at least one"
        )
    shapes = model_shapes(config, plan, model_fn)
    return (registry.check_resume_from(config, plan.spec, shapes) if config.resume_from else None), shapes


def fit(
    config: TrainConfig, model_fn=None, dataset_fn=None, loss_fn=None, task=None, hooks: WorkerHooks | None = None
) -> FitResult:
    """Train as `config` says; return where the results are. Raises ConfigError on bad input, StorageFull when
    the run directory's storage is full before training starts (once it has started, the result says so).

    `model_fn(config) -> nn.Module`, `dataset_fn(config) -> {"train", "val"}` (Ray
    Datasets of rows {x, y}), `loss_fn(outputs, targets)` and `task` (training_step/validation_step, see
    docs/launch.md) replace the built-in model, data, loss and step, as --model/--dataset/--loss/--task import
    paths do on the CLI. `hooks` (a worker.hooks.WorkerHooks) steps into the loop on every rank: tests and
    benchmarks slow, stall or count a rank with it.
    """
    if task is not None:  # recorded by name before validate(), which lets a task rank checkpoints by its val_NAME
        config.task = describe(task)
    return run(config, BuiltinWork(model_fn, dataset_fn, loss_fn, task, hooks))


def run(config: TrainConfig, work) -> FitResult:
    """One run of `work` (the built-in loop's :class:`BuiltinWork`, or a user's script or function:
    driver.launch.LaunchedWork) under the same lock, signals, cluster, run directory, watcher and summary."""
    config.validate()
    placement_wait_s()  # a bad RAYTRAIN_PLACEMENT_WAIT_S: refused before anything starts
    # a full disk met anywhere else (the lock, config.toml) ends the run too, as StorageFull
    with (
        storage_full_as("the run directory", config.run_dir),
        run_lock.hold(config.run_dir) as lock,
        stop_on_signals() as stop_signal,
    ):
        return _run(config, work, stop_signal, lock)


class BuiltinWork:
    """The built-in training loop (worker/loop.py) on a data plan: what a run needs from its work, before Ray
    starts and once it is up."""

    launched = False
    config_fields = None  # config.toml: every setting
    interrupt_grace_s = 0  # a Ctrl-C ends the ranks at once: their last checkpoint is where a resume starts

    def __init__(self, model_fn=None, dataset_fn=None, loss_fn=None, task=None, hooks=None) -> None:
        self.model_fn, self.dataset_fn, self.loss_fn, self.task = model_fn, dataset_fn, loss_fn, task
        self.hooks = hooks
        self.plan: DataPlan | None = None
        self.start_state: dict | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.resume_from: str | None = None  # --quick-start: the checkpoint its ranks resume from (Ray Train's choice)

    def before_ray(self, config: TrainConfig) -> list[str]:
        """Plug-ins imported, the run directory checked, the data planned and checked against the model (nothing
        started, nothing written); returns the folders the workers import plug-ins from."""
        self.code, self.import_roots, self.dataset_fn = resolve_plugins(
            config, self.model_fn, self.dataset_fn, self.loss_fn, self.task, self.hooks
        )
        run_directory.check(config)  # a finished run, or the name taken by other work: before Ray starts
        if self.dataset_fn and config.quick_start:
            raise ConfigError(
                "--quick-start reads the data in each rank's own process: a dataset function returns Ray Datasets, "
                "which need a Ray cluster; run without --quick-start"
            )
        if not self.dataset_fn:
            self.plan = plan_data(config)
            self._check(config)
        return self.import_roots

    def with_ray(self, config: TrainConfig) -> None:
        if self.dataset_fn:  # a plug-in's datasets are Ray Datasets: made once Ray is up
            self.plan = plugin_plan(config, self.dataset_fn, repr(config.dataset))
            self._check(config)

    def _check(self, config: TrainConfig) -> None:
        self.start_state, self.shapes = _check_plan(config, self.plan, self.model_fn)

    @property
    def train_rows(self) -> int:
        return self.plan.spec.train_rows

    @property
    def data_kind(self) -> str:
        return self.plan.spec.kind

    def choose_start(self, config: TrainConfig, run_dir: RunPath) -> None:
        _choose_start(config, run_dir, self.start_state, self.shapes)
        if config.quick_start:  # what Ray Train's controller would hand the workers: the snapshot's latest
            latest = registry.latest_checkpoint(run_dir)
            self.resume_from = str(latest) if latest else None

    def describe(self, config: TrainConfig, workers: int) -> None:
        _describe_training(config, workers, self.plan.spec)

    def interrupted_line(self, config: TrainConfig, summary: RunSummary) -> str:
        return (
            f"interrupted (Ctrl-C) after {summary.epochs_completed} of {plural(config.epochs, 'epoch')}; the "
            "workers are stopped; run the same command again to resume from the latest checkpoint "
            f"({config.run_dir / 'summary.json'})"
        )

    def say_outcome(self, config: TrainConfig, summary: RunSummary, trained_here: int) -> None:
        """The last line of a run that stopped early or finished (`trained_here`: epochs this driver trained)."""
        if summary.status == "stopped":
            log.warning(
                "Stopped early (%s) after %d of %s; resume from %s by running the same command again",
                summary.stop_reason,
                summary.epochs_completed,
                plural(config.epochs, "epoch"),
                summary.resume_checkpoint,
            )
        else:
            log.info(
                "Finished %s; best checkpoint: %s",
                finished_text(summary.epochs_completed, trained_here, summary.seconds),
                summary.best_checkpoint,
            )

    def summary_fields(self, recorder: RunRecorder) -> dict:
        """The summary's fields this work sets its own way (RunSummary's names)."""
        return {}

    def trainer_parts(self, config: TrainConfig, monitor) -> tuple:
        """Ray Train's training function, its config, the datasets and their sharding."""
        args = WorkerArgs.pack(config, self.plan.spec, monitor, self.import_roots, self.code)
        return train_loop_per_worker, args.to_loop_config(), build_datasets(config, self.plan), ShardingDataConfig()

    def quick_args(self, config: TrainConfig, address) -> WorkerArgs:
        """--quick-start's ranks' arguments: the monitor's local address, the splits each rank reads itself."""
        return WorkerArgs.pack(
            config, self.plan.spec, address, self.import_roots, self.code, local_sources(config, self.plan)
        )


def _run(config: TrainConfig, work, stop_signal: StopSignal, lock: run_lock.RunLock) -> FitResult:
    started = time.time()
    import_roots = work.before_ray(config)
    if config.mlflow_uri:
        tracker.require("mlflow", "--mlflow-uri", "mlflow", "MLflow")
    if config.wandb_project:
        tracker.require("wandb", "--wandb-project", "wandb", "the wandb package")
    if config.quick_start:  # no Ray cluster: the ranks are this machine's processes (driver/quick.py)
        dashboard_url, nodes, start_workers = None, list[dict](), config.num_workers
    else:
        cluster = _bring_up_cluster(config, work, import_roots, stop_signal)
        if isinstance(cluster, FitResult):
            return cluster
        dashboard_url, nodes, start_workers = cluster
    lock.check_held()  # a start that took longer than the lock's stale limit: another driver went on
    run_dir = run_directory.prepare(config, work.config_fields)
    log_file, log_spool = _log_to_console_and_file(run_dir)
    try:
        work.choose_start(config, run_dir)
        if config.quick_start:
            quick.announce(config)
        else:
            _describe_cluster(config, dashboard_url, nodes)
        work.describe(config, start_workers)
        log.info("Run directory: %s", config.run_dir)
        return _train(config, work, run_dir, nodes, start_workers, started, stop_signal, lock)
    finally:
        log.removeHandler(log_file)
        progress_log.removeHandler(log_file)
        log_file.close()
        if not lock.taken_over.is_set():  # the run directory's driver.log is the other driver's now
            log_spool.upload()


def _bring_up_cluster(
    config: TrainConfig, work, import_roots: list[str], stop_signal: StopSignal
) -> tuple[str | None, list[dict], int] | FitResult:
    """Ray connected (or started), the work's Ray part done, the request checked against the cluster: the
    dashboard's URL, the nodes and the workers to start with; or the result of a run failed before it started."""
    dashboard_url = connect(config, import_roots)
    stop_signal.take_back()
    work.with_ray(config)
    nodes = preflight.node_table()
    start_workers = preflight.check_fits(config, nodes)
    if config.use_gpu:
        try:
            preflight.check_gpus_usable(nodes)
        except preflight.UnusableGPUNodes as err:
            return _failed_before_start(config, str(err), gpu_failed_nodes=err.hosts)
    return dashboard_url, nodes, start_workers


def _failed_before_start(config: TrainConfig, error: str, gpu_failed_nodes: list[str]) -> FitResult:
    """A run that failed on some nodes before any worker started: summary.json says so, naming them (what the
    Slurm launcher reads to requeue the job without them); what it said of earlier attempts stays."""
    log.error("Training failed: %s", error)
    summary = run_directory.read_summary(config.run_dir).with_fields(
        status="failed", error=error, gpu_failed_nodes=gpu_failed_nodes
    )
    _write_summary(config.run_dir, summary)
    return FitResult(config.run_dir, summary, [])


def _choose_start(
    config: TrainConfig, run_dir: RunPath, start_state: dict | None, shapes: dict[str, tuple[int, ...]]
) -> None:
    """A run with checkpoints of its own continues from its newest good one (of this model); else
    --resume-from's."""
    snapshot = registry.read_snapshot(run_dir)  # None: no checkpoints of its own
    registry.clear_unrecorded(run_dir, snapshot)
    if snapshot is not None:
        latest = registry.set_aside_corrupt_latest(run_dir, snapshot)
        if latest:
            check_fits_model(
                *latest,
                shapes,
                f"run {config.name!r}'s latest checkpoint {latest[0]}",
                "build the model it was trained with, or choose another --name",
            )
            log.info("Resuming from checkpoint %s", describe_checkpoint(*latest))
        if start_state is not None:
            log.info("Run %s has checkpoints of its own: continuing from them, not from --resume-from", config.name)
    elif start_state is not None:
        registry.seed_new_run(config, start_state)


@dataclass
class _Observers:
    """What follows a run while Ray Train runs it: the monitor actor the workers post to, the trackers, the
    recorder, and the watcher thread that feeds the recorder (stopped by `stop`)."""

    monitor: Any  # the RunMonitor actor's handle, or --quick-start's QuickMonitor
    sinks: list
    recorder: RunRecorder
    stop: threading.Event
    watcher: threading.Thread

    @property
    def channel(self) -> MonitorChannel:
        """The driver's own line to the monitor."""
        return self.monitor if isinstance(self.monitor, quick.QuickMonitor) else RayChannel(self.monitor)

    def end_monitor(self) -> None:
        if isinstance(self.monitor, quick.QuickMonitor):
            self.monitor.close()
        else:
            ray.kill(self.monitor)


@dataclass
class _Outcome:
    """How Ray Train's fit() ended: its result, or the error that ended it, or a Ctrl-C; and the stop request the
    monitor held (None: none, or no monitor left to ask)."""

    result: Result | None = None
    error: str | None = None
    failure: BaseException | None = None  # the exception behind `error`, when it is the workers' or Ray Train's
    interrupted: bool = False
    stop_reason: str | None = None


def _train(
    config: TrainConfig,
    work,
    run_dir: RunPath,
    nodes: list[dict],
    start_workers: int,
    started: float,
    stop_signal: StopSignal,
    lock: run_lock.RunLock,
) -> FitResult:
    if config.quick_start:
        observers = _start_quick_observers(config, work, run_dir)
        outcome = _run_quick(config, work, run_dir, observers, stop_signal, lock)
    else:
        observers = _start_observers(config, work, run_dir, nodes, start_workers, lock)
        outcome = _run_ray_train(config, work, start_workers, observers, stop_signal, lock)
    return _conclude(config, work, run_dir, observers, outcome, started, stop_signal, lock)


def _start_observers(
    config: TrainConfig, work, run_dir: RunPath, nodes: list[dict], start_workers: int, lock: run_lock.RunLock
) -> _Observers:
    monitor = start_monitor()
    sinks, recorder = _sinks_and_recorder(config, work, run_dir, start_workers)
    stop = threading.Event()
    watch_args = (monitor, recorder, stop, config, NodeWatch(nodes, ray.get_runtime_context().gcs_address), lock)
    watcher = threading.Thread(target=watch, args=watch_args, daemon=True)
    watcher.start()
    return _Observers(monitor, sinks, recorder, stop, watcher)


def _sinks_and_recorder(config: TrainConfig, work, run_dir: RunPath, start_workers: int) -> tuple[list, RunRecorder]:
    """The trackers, and the recorder that takes in the workers' news (and says which epochs a resumed run has)."""
    sinks = (
        ([TensorBoardLog(run_dir)] if config.tensorboard else [])
        + ([MlflowLog(config.mlflow_uri, config)] if config.mlflow_uri else [])
        + ([WandbLog(config, run_dir)] if config.wandb_project else [])
    )
    recorder = RunRecorder(run_dir, config, work.train_rows, start_workers, sinks, launched=work.launched)
    if recorder.epochs:
        log.info(
            "Resuming run %s: epochs %s already recorded; training continues from its latest checkpoint",
            config.name,
            ", ".join(map(str, sorted(recorder.epochs))),
        )
    return sinks, recorder


def _start_quick_observers(config: TrainConfig, work, run_dir: RunPath) -> _Observers:
    """--quick-start's: the monitor in this process, the trackers, the recorder and the thread that feeds it."""
    monitor = quick.QuickMonitor(config, work.data_kind)
    sinks, recorder = _sinks_and_recorder(config, work, run_dir, config.num_workers)
    stop = threading.Event()
    watcher = threading.Thread(target=quick.drain_until, args=(monitor, recorder, stop), daemon=True)
    watcher.start()
    return _Observers(monitor, sinks, recorder, stop, watcher)


def _run_quick(
    config: TrainConfig, work, run_dir: RunPath, observers: _Observers, stop_signal: StopSignal, lock: run_lock.RunLock
) -> _Outcome:
    """The ranks' processes to their end, whichever way it comes; then the observers stopped. A rank that fails
    ends the run (no restarts); a Ctrl-C ends the ranks at once, as the full path ends its controller."""
    outcome = _Outcome()
    stop_signal.forward_to(observers.channel)
    ranks = []
    try:
        ranks = quick.start_ranks(config, work.quick_args(config, observers.monitor.address), work.resume_from)
        outcome.error = quick.wait_for(ranks, lock)
        if outcome.error is None:
            outcome.result = observers.monitor.result(run_dir)
    except KeyboardInterrupt:
        outcome.interrupted = True
    finally:
        with interrupts_deferred():
            quick.end_ranks(ranks)
        outcome.stop_reason = _stop_observers(observers, stop_signal, lock)
    return outcome


def _run_ray_train(
    config: TrainConfig,
    work,
    start_workers: int,
    observers: _Observers,
    stop_signal: StopSignal,
    lock: run_lock.RunLock,
) -> _Outcome:
    """Ray Train's fit() to its end, whichever way it ends; then the observers stopped."""
    outcome, recorder = _Outcome(), observers.recorder
    stop_signal.forward_to(observers.channel)
    try:
        outcome.result = _make_trainer(config, work, observers.monitor, start_workers, work.data_kind).fit()
    except KeyboardInterrupt:  # Ctrl-C (Ray Train's own SIGINT handler is kept off: see _ray_compat.torch_trainer)
        if recorder.verdict and recorder.verdict.cluster_gone:  # the watcher's, not the user's: nothing to stop
            outcome.error = recorder.verdict.reason
        else:
            outcome.interrupted = True
            _let_ranks_exit(work, observers)
            with interrupts_deferred():
                _ray_compat.kill_train_controller()  # its workers go with it
    except ray.train.TrainingFailedError as err:
        outcome.error, outcome.failure = describe_failure(err), err
    except ray.exceptions.RayActorError as err:  # the watcher ended the controller: capacity did not come back
        outcome.error = (
            recorder.verdict.reason if recorder.verdict else f"the Ray Train controller died: {one_line(err)}"
        )
    except Exception as err:  # the controller itself failed: the run still ends with a summary
        progress_log.info("Ray Train failed", exc_info=True)  # the traceback in driver.log; the console: one line
        outcome.error, outcome.failure = describe_failure(err), err
    finally:
        outcome.stop_reason = _stop_observers(observers, stop_signal, lock)
    return outcome


def _let_ranks_exit(work, observers: _Observers) -> None:
    """After a Ctrl-C, a launched script's ranks get SIGINT, as torchrun passes it on, and up to
    `work.interrupt_grace_s` to exit (to save, say); a second Ctrl-C ends the wait. The built-in loop's ranks
    (grace 0) are ended at once: their last checkpoint is their resume point."""
    grace = work.interrupt_grace_s
    if not grace:
        return
    log.warning(
        "Interrupted: SIGINT passed on to every rank's script, which has %ds to exit; Ctrl-C again to end it now",
        grace,
    )
    deadline = time.monotonic() + grace
    try:
        observers.monitor.request_stop.remote(INTERRUPT_REASON)
        while ray.get(observers.monitor.ranks_running.remote()):
            if time.monotonic() > deadline:
                log.warning("Not every rank's script exited within %ds of the Ctrl-C: ending them", grace)
                return
            time.sleep(0.2)
    except KeyboardInterrupt:
        log.warning("Interrupted again: ending every rank's script now")


def _stop_observers(observers: _Observers, stop_signal: StopSignal, lock: run_lock.RunLock) -> str | None:
    """The watcher stopped after its last drain, the records written, the monitor ended; returns the stop request
    the monitor held (a signal's reason), None when there was none or no cluster is left to ask."""
    with interrupts_deferred():
        stop_signal.training_over = True
        observers.stop.set()
        observers.watcher.join()
        if not lock.taken_over.is_set():
            observers.recorder.flush_files()
        if observers.recorder.cluster_gone:
            return None
        stop_reason = observers.channel.call("stop_requested", timeout=None)
        observers.end_monitor()
        return stop_reason


def _conclude(
    config: TrainConfig,
    work,
    run_dir: RunPath,
    observers: _Observers,
    outcome: _Outcome,
    started: float,
    stop_signal: StopSignal,
    lock: run_lock.RunLock,
) -> FitResult:
    """summary.json, the trackers' outcome (W&B's summary, MLflow's status), the report, the run's last line."""
    recorder, sinks = observers.recorder, observers.sinks
    if lock.taken_over.is_set():  # no summary, report or tracker outcome over the other driver's
        for sink in sinks:
            sink.close(None)
        raise RunTakenOver(lock.takeover_message())
    if stop_signal.reason:
        log.info("Workers returned %.1fs after %s", time.time() - stop_signal.at, stop_signal.reason)
    full = _storage_full(run_dir, recorder, outcome.failure)
    error = str(full) if full else outcome.error  # the workers' first: their failure ended the run
    with interrupts_deferred():
        summary = None
        try:
            seconds = time.time() - started
            summary = _summary(
                config, work, recorder, outcome.result, error, outcome.stop_reason, seconds, outcome.interrupted
            )
            summary.storage_full = full.record() if full else None
        finally:
            for sink in sinks:
                sink.close(summary)
        _finish(config, run_dir, summary, report=not outcome.interrupted and not full and not work.launched)  # epochs
    _say_how_it_ended(config, work, run_dir, recorder, summary, outcome.interrupted)
    return FitResult(run_dir, summary, [recorder.epochs[e] for e in sorted(recorder.epochs)])


def _storage_full(run_dir: RunPath, recorder: RunRecorder, failure: BaseException | None) -> StorageFull | None:
    """The full storage that ended the run, or left records unwritten after one more try (None: none did)."""
    ranks_full = storage_full_in(failure, run_dir) if failure else None
    if ranks_full or recorder.unwritten:
        _after_storage_full(run_dir, recorder)
    return ranks_full or recorder.unwritten


def _say_how_it_ended(
    config: TrainConfig, work, run_dir: RunPath, recorder: RunRecorder, summary: RunSummary, interrupted: bool
) -> None:
    """The run's last line; a Ctrl-C raises Interrupted with it."""
    if interrupted:
        raise Interrupted(work.interrupted_line(config, summary))
    if summary.error:
        log.error("Training failed: %s", summary.error)  # with the watchdog's verdict, if any
    else:
        work.say_outcome(config, summary, len(recorder.trained_here))
        if summary.status == "finished":
            _warn_if_profile_cut(config, run_dir, recorder)


def _after_storage_full(run_dir: RunPath, recorder: RunRecorder) -> None:
    """A run a full disk ended (or left records unwritten): the checkpoint cut short removed (a resume takes the
    latest whole one, and its space is free again), then what the driver could not write tried once more."""
    try:
        snapshot = registry.read_snapshot(run_dir)
        registry.clear_unrecorded(run_dir, snapshot, cut_by="the storage refused the rest of it")
    except (ConfigError, OSError) as err:  # the next start tries again
        log.warning("Unfinished checkpoints not cleared yet: %s", one_line(err))
    recorder.flush_files()


def _optimizer_steps(record: dict) -> int:
    """Rank zero's optimizer steps in an epoch record; a large world's record holds their summary (the same on
    every rank)."""
    if "optimizer_steps_rank_summary" in record:
        return record["optimizer_steps_rank_summary"].get("max", 0)
    return (record.get("optimizer_steps_per_rank") or [0])[0]


def _warn_if_profile_cut(config: TrainConfig, run_dir: RunPath, recorder: RunRecorder) -> None:
    """A finished run that ended before --profile-steps' last step: one line, the run stays finished."""
    if (window := config.profile_window) is None:
        return
    first, last = window
    steps = sum(_optimizer_steps(record) for record in recorder.epochs.values())
    if steps < first:
        log.warning(
            "--profile-steps %d:%d recorded nothing: the run ended after %s",
            first,
            last,
            plural(steps, "optimizer step"),
        )
    elif steps < last:
        log.warning(
            "--profile-steps %d:%d: the run ended after %s; %s holds steps %d-%d",
            first,
            last,
            plural(steps, "optimizer step"),
            run_dir / PROFILE_DIR,
            first,
            steps,
        )


def _finish(config: TrainConfig, run_dir: RunPath, summary: RunSummary, report: bool) -> None:
    """summary.json (whole, credentials masked), the link to Ray's logs, the report (not after a Ctrl-C):
    a report that fails is logged, never the run's outcome."""
    _write_summary(run_dir, summary)
    _link_ray_logs(run_dir)
    if config.report and report:
        try:
            log.info("Report: %s", write_report(run_dir))
        except Exception as err:
            log.error(
                "The report could not be written (%s: %s); the run's results are in %s",
                type(err).__name__,
                one_line(err),
                run_dir,
            )


def _write_summary(run_dir: RunPath, summary: RunSummary) -> None:
    """RUN_DIR/summary.json, whole, credentials masked; where its storage is full, one JSON line on stderr."""
    try:
        with storage_full_as("summary.json", run_dir):
            write_atomic(run_dir / "summary.json", redact(json.dumps(summary.to_json(), indent=2)) + "\n")
    except StorageFull as full:
        log.warning("%s not written (%s); the summary follows as one JSON line", run_dir / "summary.json", full.reason)
        print(redact(json.dumps(summary.to_json())), file=sys.stderr, flush=True)


def _link_ray_logs(run_dir: RunPath) -> None:
    """RUN_DIR/ray-logs -> this node's Ray session logs: Ray's own output, kept off the console."""
    if isinstance(run_dir, RemotePath):
        return  # object storage holds no links (and this node's logs are not there)
    session_dir = _ray_compat.session_dir()
    link = run_dir / "ray-logs"
    if session_dir and link.is_symlink():
        link.unlink()  # a resumed run (a requeued job, a new Ray): point at this session's logs
    if session_dir and not link.exists():
        try:
            link.symlink_to(Path(session_dir) / "logs")
        except OSError as err:  # a full disk: the logs stay where Ray keeps them
            log.warning("%s not linked to %s: %s", link, session_dir, one_line(err))


def _entry_uri(config: TrainConfig, fs_path: str) -> str:
    """The checkpoint Ray Train names by its path in the storage, as a user hands it to evaluate or
    --resume-from: a local path, or a URI with the storage's options."""
    return uri_of(entry_point(stored(config.storage_path, fs_path)))


def _summary(
    config: TrainConfig,
    work,
    recorder: RunRecorder,
    result,
    error: str | None,
    stop_reason: str | None,
    seconds: float,
    interrupted: bool,
) -> RunSummary:
    epochs = [recorder.epochs[e] for e in sorted(recorder.epochs)]
    best_checkpoint, best_metrics = None, None
    metric, mode = config.checkpoint_ranking(work.data_kind)
    pairs = result.best_checkpoints if result is not None else []
    if best := ranking.best(pairs, metric, mode):
        checkpoint, best_metrics = best
        best_checkpoint = _entry_uri(config, checkpoint.path)
    checksums = [recorder.checksums.get(rank) for rank in range(recorder.world_size)]
    if error and recorder.hangs:
        error = f"watchdog: {recorder.hangs[-1]} -> {error}"
    # Stopped only with epochs left: a stop request that came as the last epoch ended changes nothing. A launched
    # script's ranks returned early only when asked to stop (worker/launched.py).
    epochs_left = work.launched or max(recorder.epochs, default=0) < config.epochs
    stopped = not error and stop_reason is not None and epochs_left
    latest = result.checkpoint if result is not None else None
    return RunSummary(
        status="failed" if error else "interrupted" if interrupted else "stopped" if stopped else "finished",
        error=error,
        stop_reason=stop_reason if stopped else None,
        resume_checkpoint=_entry_uri(config, latest.path) if stopped and latest else None,
        name=config.name,
        run_dir=uri_of(recorder.run_dir),
        epochs_completed=len(epochs),
        epochs_requested=config.epochs,
        world_size=recorder.world_size,
        per_worker_batch_size=config.batch_size,
        global_batch_size=config.global_batch_for(recorder.world_size),
        workers=[recorder.workers[rank] for rank in sorted(recorder.workers)],
        restarts=recorder.restarts,
        hangs=recorder.hangs,
        stuck_nodes=recorder.liveness.stuck_nodes,
        lost_nodes=recorder.lost_nodes,
        final_metrics=epochs[-1] if epochs else None,
        best_checkpoint=best_checkpoint,
        best_metrics=best_metrics,
        checkpoints_ranked_by=f"{metric} ({mode})",
        latest_checkpoint=_entry_uri(config, latest.path) if latest else None,
        samples_per_second=_mean_of(epochs, "samples_per_second"),
        model_tflops_per_second=_mean_of(epochs, "model_tflops_per_second"),
        mfu=_mean_of(epochs, "mfu"),
        param_checksums=checksums,
        replicas_identical=None not in checksums and len(set(checksums)) == 1,
        seconds=round(seconds, 2),
    ).with_fields(**work.summary_fields(recorder))


def _mean_of(epochs: list[dict], key: str) -> float | None:
    """The mean of the epochs' `key`; None when there are no epochs or one has no value."""
    values = [epoch.get(key) for epoch in epochs]
    return None if not values or None in values else sum(values) / len(values)
