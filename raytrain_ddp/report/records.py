"""Reading a run directory for the report: summary.json, metrics.jsonl, steps.jsonl, config.toml and the
profile's tables, and the per-rank fields of an epoch record the report knows."""

from __future__ import annotations

import json
import logging
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytrain_ddp.errors import ConfigError
from raytrain_ddp.storage import RunPath, location
from raytrain_ddp.summary import RunSummary
from raytrain_ddp.worker.profile import PROFILE_DIR, TOP_OPS_GLOB

log = logging.getLogger(__name__)


class ReportError(Exception):
    """RUN_DIR is not a run directory the report can be made from."""


@dataclass
class Run:
    run_dir: RunPath
    summary: RunSummary  # RunSummary.missing() without summary.json (still running, or the driver died)
    epochs: list[dict]  # one record per epoch, sorted, last record wins for a repeated epoch
    config: dict | None  # None when config.toml is missing or unreadable
    notes: list[str]  # problems met while reading, shown on the page
    steps: list[dict]  # steps.jsonl's records (--log-every-steps), by step; [] when there are none
    profiles: dict[int, dict]  # rank -> its profile/rank-N.top_ops.json (--profile-steps); {} when none

    @property
    def status(self) -> str:
        return self.summary.status or "unknown"

    @property
    def world_size(self) -> int:
        if self.summary.world_size:
            return int(self.summary.world_size)
        lengths = [
            len(v) for rec in self.epochs for k, v in rec.items() if k.endswith("_per_rank") and isinstance(v, list)
        ]
        return max(lengths, default=0)


def _read_optional(path: RunPath, parse, notes: list[str], if_unreadable: str, if_missing: str):
    """Parse a file the report can do without; say in `notes` why it is absent."""
    if not path.exists():
        notes.append(f"no {path.name}: {if_missing}")
        return None
    try:
        return parse(path.read_text())
    except (OSError, ValueError) as err:  # JSONDecodeError and TOMLDecodeError are ValueErrors
        notes.append(f"{path.name} is unreadable ({err}); {if_unreadable}")
        return None


def load_run(run_dir: RunPath | str) -> Run:
    """Read a run directory (local, or a URI on object storage). Raises ReportError when it is not one."""
    if isinstance(run_dir, str):
        try:
            run_dir = location(run_dir, "RUN_DIR")
        except ConfigError as err:
            raise ReportError(str(err)) from None
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} does not exist")
    metrics_path, summary_path = run_dir / "metrics.jsonl", run_dir / "summary.json"
    if not metrics_path.exists() and not summary_path.exists():
        raise ReportError(f"{run_dir} has no metrics.jsonl (nor summary.json): not a run directory")
    notes: list[str] = []

    summary = (
        _read_optional(
            summary_path,
            lambda text: RunSummary.from_json(json.loads(text)),
            notes,
            "showing metrics only",
            "the run is still going, or its driver stopped before writing one",
        )
        or RunSummary.missing()
    )

    epochs = _read_records(metrics_path, "epoch", notes)
    steps = _read_records(run_dir / "steps.jsonl", "step", notes)
    config = _read_optional(
        run_dir / "config.toml", tomllib.loads, notes, "no configuration shown", "no configuration shown"
    )
    profiles = _read_profiles(run_dir, notes)
    for note in notes:
        log.warning("%s: %s", run_dir, note)
    return Run(run_dir, summary, epochs, config, notes, steps, profiles)


def _read_profiles(run_dir: RunPath, notes: list[str]) -> dict[int, dict]:
    """Each rank's table of top operators (the traces themselves are too big to read here)."""
    tables = {}
    found: list[RunPath] = list((run_dir / PROFILE_DIR).glob(TOP_OPS_GLOB))
    for path in sorted(found, key=str):
        table = _read_optional(path, json.loads, notes, "that rank's operators are not shown", "")
        if isinstance(table, dict) and isinstance(table.get("rank"), int) and isinstance(table.get("ops"), list):
            tables[table["rank"]] = table
    return dict(sorted(tables.items()))


def _read_records(path: RunPath, key: str, notes: list[str]) -> list[dict]:
    """A .jsonl file's records in `key` order; a key repeated after a restart: the last record counts."""
    by_key: dict[Any, dict] = {}
    if path.exists():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                notes.append(f"{path.name} line {number} is not JSON (cut short?); skipped")
                continue
            if isinstance(record, dict) and key in record:
                by_key[record[key]] = record
    return [by_key[k] for k in sorted(by_key, key=lambda k: (not isinstance(k, (int, float)), k))]


# ---------------------------------------------------------------------------------------------
# Per-rank fields the report knows. Unknown *_per_rank lists still get a worker-table column.


def as_number(value: Any) -> float | None:
    """A finite-or-NaN float, or None for anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def per_rank(record: dict, key: str) -> list[float | None] | None:
    values = record.get(key)
    if not isinstance(values, list):
        return None
    return [as_number(v) for v in values]


def _throughput(record: dict) -> list[float | None] | None:
    samples, seconds = per_rank(record, "samples_per_rank"), as_number(record.get("seconds"))
    if samples is None or not seconds:
        return None
    return [None if s is None else s / seconds for s in samples]


@dataclass(frozen=True)
class RankField:
    key: str  # the metrics.jsonl field, or a derived name
    column: str  # worker-table header
    fmt: str  # format spec for one value
    plot: str | None = None  # plot title; None: table only
    ylabel: str = ""
    derive: Callable[[dict], list | None] | None = None

    def values(self, record: dict) -> list[float | None] | None:
        return self.derive(record) if self.derive else per_rank(record, self.key)


RANK_FIELDS = [
    RankField("samples_per_rank", "samples", ",.0f"),
    RankField("micro_batches_per_rank", "micro-batches", ",.0f"),
    RankField(
        "throughput_per_rank",
        "samples/s",
        ",.0f",
        "Throughput per rank (samples / epoch seconds)",
        "samples/s",
        derive=_throughput,
    ),
    RankField("train_loss_per_rank", "train loss", ".4f"),
    RankField("val_loss_per_rank", "val loss", ".4f"),
    RankField("val_accuracy_per_rank", "val acc", ".4f"),
    RankField(
        "data_wait_seconds_per_rank",
        "data wait (s)",
        ".2f",
        "Data wait per rank (time blocked on input)",
        "seconds per epoch",
    ),
    RankField("micro_batch_seconds_per_rank", "micro-batch time (s)", ".4f", "Micro-batch time per rank", "seconds"),
    RankField("gpu_memory_peak_gib_per_rank", "GPU mem peak (GiB)", ".2f", "Peak GPU memory per rank", "GiB"),
]
KNOWN_RANK_KEYS = {f.key for f in RANK_FIELDS}


def unknown_rank_fields(record: dict) -> list[RankField]:
    """*_per_rank number lists this report has no entry for: shown in the worker table as they are."""
    extra = []
    for key, value in record.items():
        if (
            key.endswith("_per_rank")
            and key not in KNOWN_RANK_KEYS
            and isinstance(value, list)
            and any(as_number(v) is not None for v in value)
        ):
            extra.append(RankField(key, key.removesuffix("_per_rank").replace("_", " "), ".4g"))
    return extra
