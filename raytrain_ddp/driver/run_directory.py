"""What a run directory already holds, checked before Ray starts, and the files the driver writes there.

A name reused for other work (another model, data, strategy or optimizer: the
checkpoints would not load) is refused with one line, before anything is
written; a finished run is only continued with more --epochs. Files cut short
by a crash are named and handled: summary.json is written anew when the run
ends, metrics.jsonl keeps its whole lines, an unreadable config.toml is
refused while checkpoints depend on it.
"""

from __future__ import annotations

import json
import logging
import os
import tomllib

from raytrain_ddp.checkpoint import registry
from raytrain_ddp.config import TrainConfig, to_toml
from raytrain_ddp.errors import ConfigError, one_line, plural
from raytrain_ddp.files import write_atomic
from raytrain_ddp.redact import redact
from raytrain_ddp.storage import RunPath
from raytrain_ddp.summary import RunSummary

log = logging.getLogger("raytrain_ddp")

# The settings a run's checkpoints were made for: with another value they do not load (or mean other work)
SAME_WORK_FIELDS = (
    "model",
    "dataset",
    "data",
    "train_data",
    "val_data",
    "feature_columns",
    "image_column",
    "label_column",
    "strategy",
    "optimizer",
)


def check(config: TrainConfig) -> None:
    """Raise ConfigError when the run directory holds a finished run, or other work; writes nothing."""
    run_dir = config.run_dir
    finished = read_summary(run_dir)
    if finished.status == "finished":
        done = finished.epochs_completed or 0
        if done >= config.epochs:
            raise ConfigError(
                f"run {config.name!r} already finished in {run_dir}; choose a new --name to train "
                f"again, or ask for more than {done} --epochs to continue it"
            )
        log.info("Continuing finished run %s from epoch %d to %d", config.name, done + 1, config.epochs)
    _check_same_work(config, run_dir)


def read_summary(run_dir: RunPath) -> RunSummary:
    """summary.json, or none (RunSummary.missing()) when there is none or it is cut short (it is written anew
    when this run ends)."""
    path = run_dir / "summary.json"
    if not path.exists():
        return RunSummary.missing()
    try:
        return RunSummary.from_json(json.loads(path.read_text()))
    except (OSError, ValueError) as err:
        log.warning("%s is unreadable (%s): ignored; it is written anew when this run ends", path, one_line(err))
        return RunSummary.missing()


def _check_same_work(config: TrainConfig, run_dir: RunPath) -> None:
    path = run_dir / "config.toml"
    if not path.exists():
        return
    try:
        saved = tomllib.loads(path.read_text())
    except (OSError, ValueError) as err:
        if registry.has_own_checkpoints(run_dir):
            raise ConfigError(
                f"{path} is unreadable ({one_line(err)}): cannot tell whether run {config.name!r}'s "
                "checkpoints fit these settings; restore or delete that file, or choose another --name"
            ) from None
        log.warning("%s is unreadable (%s): no checkpoints depend on it; it is written anew", path, one_line(err))
        return
    changed = [
        (field, saved.get(field), wanted)
        for field in SAME_WORK_FIELDS
        if _normal(field, saved.get(field)) != _normal(field, wanted := _recorded(getattr(config, field)))
    ]
    if changed:
        was = ", ".join(f"{field} {old!r}" for field, old, _ in changed)
        now = ", ".join(f"{field} {new!r}" for field, _, new in changed)
        raise ConfigError(
            f"run {config.name!r} in {run_dir} was made with {was}, not {now}: its checkpoints do not fit; "
            f"choose another --name, or repeat its settings (--config {path})"
        )


def _recorded(value):
    """A value as config.toml records it."""
    return redact(value) if isinstance(value, str) else value


def _normal(field: str, value):
    """Two spellings of one local data path are the same data."""
    if field.endswith("data") and isinstance(value, str) and "://" not in value:
        return os.path.normpath(value)
    return value


def prepare(config: TrainConfig, fields: tuple[str, ...] | None = None) -> RunPath:
    """Create the run directory, (re)write config.toml (`fields`: the settings the run's work reads, default
    all), keep the whole lines of a metrics.jsonl or steps.jsonl cut short."""
    run_dir = config.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "config.toml", redact(to_toml(config, fields)))
    _repair_records(run_dir / "metrics.jsonl", "epoch")
    _repair_records(run_dir / "steps.jsonl", "step")
    return run_dir


def _repair_records(path: RunPath, key: str) -> None:
    if not path.exists():
        return
    kept, dropped = [], []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            record = None
        if isinstance(record, dict) and key in record:
            kept.append(line)
        elif line.strip():
            dropped.append(number)
    if dropped:
        log.warning(
            "%s: dropped %s %s: no %s (cut short?); %s kept",
            path,
            "line" if len(dropped) == 1 else "lines",
            ", ".join(map(str, dropped)),
            f"{key} record" if len(dropped) == 1 else f"{key} records",
            plural(len(kept), f"{key} record"),
        )
        write_atomic(path, "".join(line + "\n" for line in kept))
