"""The one configuration object shared by the CLI, TOML files and the Python API.

Every field of :class:`TrainConfig` is a command-line flag (``num_workers`` is
``--num-workers``) and a key in a TOML file (``--config run.toml``); flags given
on the command line override the file. ``validate()`` checks the values the
same way for all three entry points, raising :class:`ConfigError` with one line
that names the flag and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from raytrain_ddp import storage
from raytrain_ddp.errors import ConfigError, plural
from raytrain_ddp.storage import RunPath

BUILTIN_MODELS = ("cnn", "resnet18", "resnet50", "mlp", "transformer")
BUILTIN_DATASETS = ("synthetic", "synthetic-tabular", "synthetic-tokens")
OPTIMIZERS = ("sgd", "adamw")
STRATEGIES = ("ddp", "fsdp")
PRECISIONS = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "cosine", "step")
VALIDATION_METRICS = ("val_accuracy", "val_loss")  # what validation reports: each can rank checkpoints
CHECKPOINT_MODES = ("min", "max")
CHECKPOINT_FORMATS = ("auto", "full", "sharded")  # auto: validate() makes it sharded for FSDP, full otherwise


def _flag(help: str, **extra: Any) -> dict:
    """A field's metadata: its --help text; `choices` and `metavar` for argparse; the bounds validate() checks:
    `maximum` (beyond it a typo, not a run), `minimum` (included), `above` (excluded), `below` (excluded, with
    `minimum`: one interval), `choices`, `builtins` (the names known, or else an import path), `import_path` (the
    form it must take, as an example)."""
    return {"help": help, **extra}


@dataclass
class TrainConfig:
    """A training run, fully described. Defaults are the built-in first run."""

    # Cluster and workers
    num_workers: int = field(
        default=2, metadata=_flag("training workers (one per GPU with --use-gpu)", minimum=1, maximum=100_000)
    )
    use_gpu: bool = field(default=False, metadata=_flag("one GPU per worker, NCCL; CPU and gloo otherwise"))
    min_workers: int | None = field(
        default=None,
        metadata=_flag(
            "elastic: start and keep training with as few as this many workers when workers or nodes are lost "
            "(Ray Train's num_workers=(min, max)); the global batch shrinks with them",
            maximum=100_000,  # at least 1 and at most --num-workers: checked with it
        ),
    )
    cpus_per_worker: float = field(
        default=1.0, metadata=_flag("CPUs reserved for each training worker", above=0, maximum=1024)
    )
    address: str | None = field(
        default=None,
        metadata=_flag("Ray cluster to join, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else a local Ray)"),
    )
    quick_start: bool = field(
        default=False,
        metadata=_flag(
            "one machine, no Ray cluster: N local processes torchrun-style under Ray Train's local mode "
            "(no restarts on failure, no hang watchdog, no Ray dashboard); DDP with full checkpoints on the built-in "
            "or Parquet data only (docs/launch.md)"
        ),
    )
    # Model and data
    model: str = field(
        default="cnn",
        metadata=_flag(
            f"model: {', '.join(BUILTIN_MODELS)}, or an import path pkg.module:build "
            "(a callable taking the config, returning an nn.Module)",
            builtins=BUILTIN_MODELS,
        ),
    )
    dataset: str = field(
        default="synthetic",
        metadata=_flag(
            f"dataset when --data is not given: {', '.join(BUILTIN_DATASETS)}, or an import path pkg.module:build "
            "(a callable taking the config, returning {'train': ray.data.Dataset, 'val': ...} with columns x, y)",
            builtins=BUILTIN_DATASETS,
        ),
    )
    loss: str | None = field(
        default=None,
        metadata=_flag(
            "loss as an import path pkg.module:fn, called as fn(outputs, targets) "
            "(default: cross-entropy over the last dimension)",
            import_path="pkg.module:fn",
        ),
    )
    task: str | None = field(
        default=None,
        metadata=_flag(
            "your own step in the built-in loop, as an import path pkg.module:Task: a class (made with no arguments, "
            "or with the config) with training_step(model, batch) -> loss and validation_step(model, batch) -> "
            "{name: sum over the batch, 'count': rows} (see docs/launch.md)",
            import_path="pkg.module:Task",
        ),
    )
    data: str | None = field(
        default=None,
        metadata=_flag("Parquet dataset directory with train/ and val/ (see `python -m raytrain_ddp.data`)"),
    )
    train_data: str | None = field(
        default=None, metadata=_flag("Parquet files or glob for training (instead of --data)")
    )
    val_data: str | None = field(
        default=None, metadata=_flag("Parquet files or glob for validation (instead of --data)")
    )
    image_column: str = field(default="image", metadata=_flag("column holding encoded images"))
    label_column: str = field(default="label", metadata=_flag("column holding integer class labels"))
    feature_columns: str | None = field(
        default=None, metadata=_flag("comma-separated numeric columns for tabular data")
    )
    train_size: int = field(default=8192, metadata=_flag("rows of the built-in training set", minimum=1, maximum=10**9))
    val_size: int = field(default=2048, metadata=_flag("rows of the built-in validation set", minimum=1, maximum=10**9))
    # Optimisation
    epochs: int = field(default=5, metadata=_flag("passes over the training set", minimum=1, maximum=1_000_000))
    batch_size: int = field(
        default=64,
        metadata=_flag(
            "per-worker batch; the global batch is this x --grad-accum x --num-workers", minimum=1, maximum=2**24
        ),
    )
    grad_accum: int = field(
        default=1,
        metadata=_flag(
            "micro-batches per optimizer step; gradients are all-reduced once per step", minimum=1, maximum=100_000
        ),
    )
    strategy: str = field(
        default="ddp",
        metadata=_flag(
            "ddp: a full replica per worker; fsdp: parameters, gradients and optimizer state sharded across workers",
            choices=STRATEGIES,
        ),
    )
    precision: str = field(
        default="fp32", metadata=_flag("autocast precision (fp16 adds a gradient scaler)", choices=PRECISIONS)
    )
    compile: bool = field(default=False, metadata=_flag("torch.compile the model"))
    channels_last: bool = field(
        default=False,
        metadata=_flag(
            "channels_last memory format for image models (faster convolutions on GPU); "
            "refused for tabular and token data"
        ),
    )
    peak_tflops: float | None = field(
        default=None,
        metadata=_flag(
            "the device's peak dense TFLOP/s, for MFU (default: a table of known GPUs' bf16 peaks; none on CPU)",
            above=0,
            maximum=1e6,  # a thousand petaFLOP/s per device
        ),
    )
    tf32: bool = field(
        default=True,
        metadata=_flag("TF32 tensor cores for fp32 matmuls and convolutions on GPU (--no-tf32: full fp32)"),
    )
    lr: float = field(
        default=0.02, metadata=_flag("learning rate (for the global batch, unless --scale-lr)", above=0, maximum=1e12)
    )
    scale_lr: bool = field(
        default=False,
        metadata=_flag("linear scaling: multiply --lr by the workers x --grad-accum (lr given for one worker's batch)"),
    )
    lr_schedule: str = field(
        default="constant",
        metadata=_flag(
            "learning rate after warm-up: constant, cosine to 0, or step (x0.1 at 50%% and 75%% of training)",
            choices=LR_SCHEDULES,
        ),
    )
    warmup_epochs: float = field(
        default=0.0, metadata=_flag("epochs of linear learning-rate warm-up from 0", minimum=0, maximum=1_000_000)
    )
    clip_grad_norm: float | None = field(
        default=None, metadata=_flag("clip the global gradient norm to this value", above=0, maximum=1e9)
    )
    optimizer: str = field(default="sgd", metadata=_flag("optimizer", choices=OPTIMIZERS))
    momentum: float = field(default=0.9, metadata=_flag("SGD momentum", minimum=0, below=1, maximum=1.0))
    weight_decay: float = field(default=5e-4, metadata=_flag("weight decay", minimum=0, maximum=10.0))
    seed: int = field(
        default=0, metadata=_flag("seed for data generation, shuffling and model init", minimum=0, maximum=2**32 - 1)
    )
    # Run directory and checkpoints
    storage_path: str = field(default="runs", metadata=_flag("where run directories go (shared storage on a cluster)"))
    name: str | None = field(
        default=None, metadata=_flag("run name; the run directory is STORAGE_PATH/NAME (default: a timestamp)")
    )
    num_to_keep: int = field(
        default=2,
        metadata=_flag(
            "best checkpoints to keep, by --checkpoint-metric (the latest is kept too)", minimum=1, maximum=100_000
        ),
    )
    checkpoint_metric: str | None = field(
        default=None,
        metadata=_flag(
            f"the validation metric that ranks checkpoints for --num-to-keep: {', '.join(VALIDATION_METRICS)} "
            "(default: val_accuracy for classifiers, val_loss for the language model)"
        ),
    )
    checkpoint_mode: str | None = field(
        default=None,
        metadata=_flag(
            "whether a lower (min) or a higher (max) --checkpoint-metric is better (default: min for a loss, "
            "max otherwise)",
            choices=CHECKPOINT_MODES,
        ),
    )
    checkpoint_every_steps: int = field(
        default=0,
        metadata=_flag(
            "also checkpoint every N optimizer steps inside an epoch, so a restart loses at most N steps "
            "(0: only at the end of each epoch)",
            minimum=0,
            maximum=10**9,
        ),
    )
    checkpoint_every_minutes: float = field(
        default=0.0,
        metadata=_flag(
            "also checkpoint once M minutes have passed since the last checkpoint, at the next step the ranks "
            "agree on (0: off)",
            minimum=0,
            maximum=7 * 1440,
        ),
    )
    checkpoint_format: str = field(
        default="auto",
        metadata=_flag(
            "full: rank zero gathers the model and writes one checkpoint.pt; sharded: every rank writes its own "
            "shards in the background (torch.distributed.checkpoint), resumable at any world size "
            "(`raytrain-ddp checkpoint consolidate` makes it one file); auto: sharded with --strategy fsdp, "
            "full otherwise (config.toml records the choice)",
            choices=CHECKPOINT_FORMATS,
        ),
    )
    resume_from: str | None = field(
        default=None,
        metadata=_flag(
            "start a new run from this checkpoint (a checkpoint directory or its checkpoint.pt): "
            "its weights, optimizer state and epoch; --epochs is the total"
        ),
    )
    # Robustness
    max_failures: int = field(
        default=2, metadata=_flag("worker-group restarts allowed before the run fails", minimum=0, maximum=1000)
    )
    capacity_wait_s: int = field(
        default=300,
        metadata=_flag(
            "after a node or worker is lost, seconds to wait for capacity for the workers (--min-workers with elastic) "
            "to come back before the run fails, naming what was lost",
            minimum=1,
            maximum=7 * 86400,
        ),
    )
    skip_nonfinite: bool = field(
        default=False,
        metadata=_flag("skip optimizer steps whose gradients are NaN/inf (all ranks agree) instead of stopping"),
    )
    collective_timeout_s: int = field(
        default=600,
        metadata=_flag("seconds a DDP collective may wait before it fails", minimum=1, maximum=7 * 86400),
    )
    hang_timeout_s: int = field(
        default=300,
        metadata=_flag(
            "seconds without progress from any rank before the watchdog names the stuck rank and restarts the workers",
            minimum=1,
            maximum=7 * 86400,
        ),
    )
    record_sample_ids: bool = field(
        default=False,
        metadata=_flag("save the row ids each rank trained on, per epoch, in RUN_DIR/sample_ids/ (audits sharding)"),
    )
    log_every_steps: int = field(
        default=10,
        metadata=_flag(
            "record every N optimizer steps in RUN_DIR/steps.jsonl (loss over ranks, lr, samples/s); 0: off",
            minimum=0,
            maximum=10**9,
        ),
    )
    profile_steps: str | None = field(
        default=None,
        metadata=_flag(
            "record a torch.profiler trace of optimizer steps A to B (global step numbers, as in steps.jsonl) "
            "on every rank, in RUN_DIR/profile/",
            metavar="A:B",
        ),
    )
    tensorboard: bool = field(default=True, metadata=_flag("write TensorBoard event files to RUN_DIR/tensorboard/"))
    mlflow_uri: str | None = field(
        default=None,
        metadata=_flag("also log to MLflow: a tracking server URL or file:///path/mlruns (needs the mlflow extra)"),
    )
    wandb_project: str | None = field(
        default=None,
        metadata=_flag(
            "also log to Weights & Biases, in this project (needs the wandb extra; WANDB_MODE=offline: to "
            "RUN_DIR/wandb/ only, for a later `wandb sync`)"
        ),
    )
    wandb_entity: str | None = field(
        default=None, metadata=_flag("the W&B team or user of --wandb-project (default: your W&B default entity)")
    )
    report: bool = field(default=True, metadata=_flag("write the HTML report with plots to RUN_DIR/report/ at the end"))
    # Console
    verbose: bool = field(default=False, metadata=_flag("show Ray's own logs and worker logs on the console"))

    # ------------------------------------------------------------------ derived
    @property
    def global_batch_size(self) -> int:
        """What one optimizer step really trains with: every micro-batch of every worker, averaged."""
        return self.global_batch_for(self.num_workers)

    def batches_for(self, rows_per_rank: int) -> int:
        """Micro-batches a rank takes per epoch over its shard (the last one partial)."""
        return math.ceil(rows_per_rank / self.batch_size)

    def global_batch_for(self, workers: int) -> int:
        """The global batch with this many workers (an elastic run's world size changes)."""
        return self.batch_size * self.grad_accum * workers

    @property
    def fewest_workers(self) -> int:
        """The workers a run cannot go below: --min-workers (elastic), else --num-workers."""
        return self.min_workers or self.num_workers

    def lr_for(self, workers: int) -> float:
        """--lr, times workers x --grad-accum with --scale-lr: it follows the global batch (elastic runs too)."""
        return self.lr * (workers * self.grad_accum if self.scale_lr else 1)

    @property
    def run_dir(self) -> RunPath:
        """STORAGE_PATH/NAME: a Path, or a RemotePath on object storage (raytrain_ddp.storage)."""
        return storage.location(self.storage_path) / self.name

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """--profile-steps as (first, last) optimizer step, both included; None when not profiling."""
        if self.profile_steps is None:
            return None
        first, last = self.profile_steps.split(":")
        return int(first), int(last)

    @property
    def uses_parquet(self) -> bool:
        return bool(self.data or self.train_data)

    def checkpoint_ranking(self, data_kind: str) -> tuple[str, str]:
        """(metric, "min" or "max") by which checkpoints are kept: the flags, else the data kind's default (a
        --task's: val_loss, the mean of the "loss" its validation_step sums)."""
        metric = self.checkpoint_metric or ("val_loss" if data_kind == "tokens" or self.task else "val_accuracy")
        return metric, self.checkpoint_mode or ("min" if metric.endswith("loss") else "max")

    def _checked_metric(self) -> str:
        """--checkpoint-metric as validate() checks it: a --task's val_NAME (what its validation_step sums) passes."""
        metric = self.checkpoint_metric or VALIDATION_METRICS[0]
        return VALIDATION_METRICS[0] if self.task and metric.startswith("val_") else metric

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # --------------------------------------------------------------- validation
    def validate(self) -> TrainConfig:
        """Check every value; fill in the defaults that depend on other fields (the run name too). Raises
        ConfigError."""
        for f in fields(self):
            _check_field(f, getattr(self, f.name))
        self._check_together()
        self._resolve_defaults()
        _check_name(self.name)
        self.storage_path = _check_storage_path(self.storage_path)
        return self

    def _check_together(self) -> None:
        """What a field's own bounds cannot say: values checked against other fields (and --profile-steps' form)."""
        if self.min_workers is not None and not 1 <= self.min_workers <= self.num_workers:
            raise ConfigError(
                f"--min-workers must be between 1 and --num-workers ({self.num_workers}), got {self.min_workers}"
            )
        if (metric := self._checked_metric()) not in VALIDATION_METRICS:
            raise ConfigError(_unknown("--checkpoint-metric", metric, VALIDATION_METRICS))
        _check_profile_steps(self.profile_steps)
        if self.data and (self.train_data or self.val_data):
            raise ConfigError("give either --data DIR or --train-data/--val-data, not both")
        if bool(self.train_data) != bool(self.val_data):
            raise ConfigError("--train-data and --val-data go together")
        _check_wandb_names(self.wandb_project, self.wandb_entity)
        if self.quick_start:
            _check_quick_start(self)

    def _resolve_defaults(self) -> None:
        """The one place the defaults that depend on other fields are decided."""
        if self.checkpoint_format == "auto":
            self.checkpoint_format = "sharded" if self.strategy == "fsdp" else "full"
        if self.name is None:
            self.name = "run-" + _timestamp()


# A run name becomes directory and file names (NAME_MAX is 255 bytes; Ray Train adds its own suffixes).
MAX_NAME_LENGTH = 200
WANDB_NAME_LENGTH = 128  # W&B's limit for project and entity names


def _check_field(f: dataclasses.Field, value: Any) -> None:
    """One field's value within the bounds its metadata gives (None: the field's default, decided later)."""
    if value is None:
        return
    bounds, flag_name, kind = f.metadata, "--" + f.name.replace("_", "-"), field_type(f)
    if kind in (int, float):
        if not math.isfinite(value):  # NaN would pass every `<` test
            raise ConfigError(f"{flag_name} must be a finite number, got {value}")
        if "maximum" in bounds and value > bounds["maximum"]:
            raise ConfigError(f"{flag_name} must be at most {bounds['maximum']:g}, got {value:g}")
        if "below" in bounds and not bounds["minimum"] <= value < bounds["below"]:
            raise ConfigError(f"{flag_name} must be in [{bounds['minimum']}, {bounds['below']}), got {value}")
        if "minimum" in bounds and not value >= bounds["minimum"]:
            at_least = "at least" if kind is int else ">="
            raise ConfigError(f"{flag_name} must be {at_least} {bounds['minimum']}, got {value}")
        if "above" in bounds and not value > bounds["above"]:
            raise ConfigError(f"{flag_name} must be > {bounds['above']}, got {value}")
    if kind is str:
        if value == "":
            raise ConfigError(f"{flag_name} must not be empty")
        if "choices" in bounds and value not in bounds["choices"]:
            raise ConfigError(_unknown(flag_name, value, bounds["choices"]))
        if "builtins" in bounds and value not in bounds["builtins"] and not is_import_path(value):
            raise ConfigError(_unknown(flag_name, value, bounds["builtins"]) + " or an import path pkg.module:name")
        if "import_path" in bounds and not is_import_path(value):
            raise ConfigError(f"{flag_name} {value!r} is not an import path like {bounds['import_path']}")


def _unknown(flag_name: str, value: str, allowed: tuple[str, ...]) -> str:
    return f"{flag_name} {value!r} is unknown; choose one of: {', '.join(allowed)}"


def _check_quick_start(config: TrainConfig) -> None:
    """--quick-start runs N processes on this machine without a Ray cluster: what needs one is refused."""
    if config.address:
        raise ConfigError(f"--quick-start runs on this machine only; it cannot join --address {config.address}")
    if config.min_workers is not None:
        raise ConfigError("--quick-start cannot train elastically (--min-workers): it has no restarts")
    if urlsplit(config.storage_path).scheme not in ("", "file"):  # by its form: opening it may reach the network
        raise ConfigError(f"--quick-start writes to a local --storage-path only, got {config.storage_path!r}")
    cpus = os.cpu_count() or 1
    if not config.use_gpu and config.num_workers > cpus:
        raise ConfigError(
            f"--quick-start runs one process per CPU: {plural(config.num_workers, 'worker')} asked, "
            f"this machine has {plural(cpus, 'CPU')}"
        )
    _check_quick_start_features(config)


def _check_quick_start_features(config: TrainConfig) -> None:
    """What the quick path's ranks do not do (each its own process, no Ray Data, full checkpoints by rank zero)."""
    if config.strategy == "fsdp" or config.checkpoint_format == "sharded":
        raise ConfigError(
            "--quick-start trains with DDP and full checkpoints only; run --strategy fsdp or "
            "--checkpoint-format sharded without --quick-start"
        )
    if is_import_path(config.dataset):
        raise ConfigError(
            f"--quick-start reads the data in each rank's own process: a --dataset plug-in ({config.dataset}) "
            "returns Ray Datasets, which need a Ray cluster; run without --quick-start"
        )


def _check_name(name: str) -> None:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise ConfigError(f"--name {name!r} may hold only letters, digits, '.', '_' and '-'")
    if len(name) > MAX_NAME_LENGTH:
        raise ConfigError(
            f"--name is {len(name)} characters long; at most {MAX_NAME_LENGTH} fit a file name "
            "beside what Ray Train appends"
        )


def _check_wandb_names(project: str | None, entity: str | None) -> None:
    """What W&B accepts as a project or entity name, checked before a run starts rather than seconds into it."""
    if entity is not None and project is None:
        raise ConfigError("--wandb-entity goes with --wandb-project")
    for flag_name, value in (("--wandb-project", project), ("--wandb-entity", entity)):
        if value is None:
            continue
        if len(value) > WANDB_NAME_LENGTH:
            raise ConfigError(f"{flag_name} is {len(value)} characters long; W&B takes at most {WANDB_NAME_LENGTH}")
        if re.search(r"[/\\#?%:\s]", value):
            raise ConfigError(
                f"{flag_name} {value!r} may not hold '/', '\\', '#', '?', '%', ':' or spaces (W&B's rule)"
            )


MAX_STEP = 10**9
MAX_PROFILE_STEPS = 50  # a trace of more steps is too big for a viewer to open (and for the run to write quickly)


def _check_profile_steps(value: str | None) -> None:
    if value is None:
        return
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", value)
    if not match:
        raise ConfigError(f"--profile-steps {value!r} is not A:B, two optimizer step numbers such as 10:12")
    first, last = int(match[1]), int(match[2])
    if first < 1:
        raise ConfigError(f"--profile-steps {value!r}: steps count from 1, got {first}")
    if last < first:
        raise ConfigError(f"--profile-steps {value!r}: the last step B must not come before the first A")
    if last > MAX_STEP:
        raise ConfigError(f"--profile-steps {value!r}: steps must be at most {MAX_STEP:g}")
    if last - first + 1 > MAX_PROFILE_STEPS:
        raise ConfigError(
            f"--profile-steps {value!r} asks for {last - first + 1} steps; at most {MAX_PROFILE_STEPS} make a "
            "trace a viewer can open"
        )


def is_import_path(text: str) -> bool:
    """`pkg.module:name`: how plug-in models, datasets and losses are named."""
    return re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", text) is not None


def _timestamp() -> str:
    """UTC to the millisecond and a random suffix: two runs started together never share a default name."""
    import datetime
    import secrets

    now = datetime.datetime.now(datetime.UTC)
    return now.strftime("%Y%m%d-%H%M%S-") + f"{now.microsecond // 1000:03d}Z-{secrets.token_hex(2)}"


def _check_storage_path(storage_path: str) -> str:
    """Make the storage path absolute and prove it is writable, before Ray starts."""
    where = storage.location(storage_path, "--storage-path")  # an unknown scheme or option: ConfigError
    if isinstance(where, storage.RemotePath):
        storage.check_remote(where)  # the server answers, the bucket exists
        return storage_path
    path = Path(where).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--storage-path {storage_path!r} is not writable: {err.strerror or err}") from None
    return str(path)


# ---------------------------------------------------------------- TOML files
def load_toml(path: str) -> dict:
    """Read a TOML config file into a dict of known fields. Raises ConfigError."""
    try:
        with open(path, "rb") as f:
            values = tomllib.load(f)
    except OSError as err:
        raise ConfigError(f"--config {path!r} cannot be read: {err.strerror or err}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path!r} is not valid TOML: {err}") from None
    known = {f.name: f for f in fields(TrainConfig)}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"--config {path!r}: unknown key {key!r}")
        expected = field_type(known[key])
        if not _fits(value, expected):
            raise ConfigError(f"--config {path!r}: {key} must be {expected.__name__}, got {value!r}")
    return values


def to_toml(config: TrainConfig, only: tuple[str, ...] | None = None) -> str:
    """The config as a TOML file that `--config` reads back (None values are left out; `only` these fields)."""
    lines = []
    for key, value in config.to_dict().items():
        if value is None or (only is not None and key not in only):
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def field_type(f: dataclasses.Field) -> type:
    """The plain type of a field: int, float, bool or str (Optional is unwrapped)."""
    return _FIELD_TYPES[f.name]


def _plain_type(hint: Any) -> type:
    """int for `int` and `int | None`: the one type a field holds besides None."""
    [kind] = [arg for arg in typing.get_args(hint) if arg is not type(None)] or [hint]
    return kind


_FIELD_TYPES = {name: _plain_type(hint) for name, hint in typing.get_type_hints(TrainConfig).items()}


def _fits(value: Any, expected: type) -> bool:
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)
