"""The run report: plots and one self-contained HTML page for a run directory.

    python -m raytrain_ddp.report runs/NAME        # prints runs/NAME/report/index.html

:func:`write_report` reads what the trainer left in ``RUN_DIR`` (``summary.json``,
``metrics.jsonl``, ``config.toml``) and writes ``RUN_DIR/report/``: one PNG per
plot and ``index.html`` with the same plots embedded, so the page can be
copied or mailed on its own. Every section is optional: a field the run did
not record leaves out its plot or column; a failed run, or one still running,
gets a report that says so.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import logging
import math
import statistics
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from raytrain_ddp.errors import ConfigError, OneLineErrorParser, bad_input, plural
from raytrain_ddp.files import write_atomic
from raytrain_ddp.redact import redact
from raytrain_ddp.storage import RunPath, location
from raytrain_ddp.summary import RunSummary
from raytrain_ddp.worker.profile import PROFILE_DIR, TOP_OPS_GLOB

log = logging.getLogger(__name__)

REPORT_DIR = "report"
INDEX = "index.html"
MANY_RANKS = 12  # above this, per-rank plots show min/median/max instead of one line per rank


class ReportError(Exception):
    """RUN_DIR is not a run directory the report can be made from."""


# ---------------------------------------------------------------------------------------------
# Reading the run directory


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


def _num(value: Any) -> float | None:
    """A finite-or-NaN float, or None for anything that is not a number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _per_rank(record: dict, key: str) -> list[float | None] | None:
    values = record.get(key)
    if not isinstance(values, list):
        return None
    return [_num(v) for v in values]


def _throughput(record: dict) -> list[float | None] | None:
    samples, seconds = _per_rank(record, "samples_per_rank"), _num(record.get("seconds"))
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
        return self.derive(record) if self.derive else _per_rank(record, self.key)


RANK_FIELDS = [
    RankField("samples_per_rank", "samples", ",.0f"),
    RankField("steps_per_rank", "steps", ",.0f"),
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
    RankField("step_seconds_per_rank", "step time (s)", ".4f", "Step time per rank", "seconds"),
    RankField("gpu_memory_peak_gib_per_rank", "GPU mem peak (GiB)", ".2f", "Peak GPU memory per rank", "GiB"),
]
KNOWN_RANK_KEYS = {f.key for f in RANK_FIELDS}


def _unknown_rank_fields(record: dict) -> list[RankField]:
    """*_per_rank number lists this report has no entry for: shown in the worker table as they are."""
    extra = []
    for key, value in record.items():
        if (
            key.endswith("_per_rank")
            and key not in KNOWN_RANK_KEYS
            and isinstance(value, list)
            and any(_num(v) is not None for v in value)
        ):
            extra.append(RankField(key, key.removesuffix("_per_rank").replace("_", " "), ".4g"))
    return extra


# ---------------------------------------------------------------------------------------------
# Plots (matplotlib's object API on an Agg canvas: no pyplot, no global backend switch)

COLORS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#393b79",
    "#637939",
]
MARKERS = ["o", "s", "^", "D", "v", "P", "X", "<", ">", "p", "h", "*"]


def _new_axes(title: str, ylabel: str, xlabel: str = "epoch"):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 3.8), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def _series(records: list[dict], key: str, x: str = "epoch") -> tuple[list, list]:
    xs, ys = [], []
    for rec in records:
        y = _num(rec.get(key))
        if y is not None and _num(rec.get(x)) is not None:
            xs.append(rec[x])
            ys.append(y)
    return xs, ys


def _plot_step_loss(steps: list[dict]):
    xs, mean = _series(steps, "train_loss", "step")
    if not xs:
        return None
    fig, ax = _new_axes("Training loss per recorded step", "loss", "optimizer step")
    band = [(r["step"], _num(r.get("train_loss_min")), _num(r.get("train_loss_max"))) for r in steps]
    band = [b for b in band if b[1] is not None and b[2] is not None and _num(b[0]) is not None]
    if band:
        ax.fill_between(*zip(*band), color=COLORS[0], alpha=0.2, label="min..max over ranks")
    ax.plot(xs, mean, ".-", color=COLORS[0], label="mean over ranks")
    if all(y > 0 for y in mean) and max(mean) / min(mean) > 30:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    return fig


def _plot_step_throughput(steps: list[dict]):
    xs, rate = _series(steps, "samples_per_second", "step")
    if not xs:
        return None
    fig, ax = _new_axes("Samples per second per recorded step (all ranks)", "samples/s", "optimizer step")
    ax.plot(xs, rate, ".-", color=COLORS[2], label="samples/s since the previous record")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def _plot_loss(epochs: list[dict]):
    xs, mean = _series(epochs, "train_loss")
    vxs, val = _series(epochs, "val_loss")
    if not xs and not vxs:
        return None
    fig, ax = _new_axes("Loss per epoch", "loss")
    band = [(r["epoch"], _num(r.get("train_loss_min")), _num(r.get("train_loss_max"))) for r in epochs]
    band = [b for b in band if b[1] is not None and b[2] is not None and _num(b[0]) is not None]
    if band:
        ax.fill_between(
            [b[0] for b in band],
            [b[1] for b in band],
            [b[2] for b in band],
            color=COLORS[0],
            alpha=0.2,
            label="train min..max over ranks",
        )
    if xs:
        ax.plot(xs, mean, "o-", color=COLORS[0], label="train (mean over ranks)")
    if vxs:
        ax.plot(vxs, val, "s--", color=COLORS[1], label="validation")
    if all(y > 0 for y in mean + val) and max(mean + val) / min(mean + val) > 30:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    return fig


def _plot_accuracy(epochs: list[dict]):
    xs, acc = _series(epochs, "val_accuracy")
    if not xs:
        return None
    fig, ax = _new_axes("Validation accuracy per epoch", "accuracy")
    ax.plot(xs, acc, "o-", color=COLORS[2], label="validation accuracy")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def _plot_per_rank(epochs: list[dict], field: RankField):
    rows = [(rec["epoch"], field.values(rec)) for rec in epochs if _num(rec.get("epoch")) is not None]
    rows = [(e, v) for e, v in rows if v and any(x is not None for x in v)]
    if not rows:
        return None
    ranks = max(len(v) for _, v in rows)
    fig, ax = _new_axes(field.plot, field.ylabel)
    if ranks <= MANY_RANKS:
        for r in range(ranks):  # shrinking, varied markers: ranks with equal values stay visible
            pts = [(e, v[r]) for e, v in rows if r < len(v) and v[r] is not None]
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                color=COLORS[r % len(COLORS)],
                label=f"rank {r}",
                marker=MARKERS[r % len(MARKERS)],
                markersize=max(8 - r * 0.5, 3),
                linewidth=max(2.2 - r * 0.15, 1),
                alpha=0.85,
            )
        ax.legend(fontsize=8, ncol=min(ranks, 4))
    else:  # one line per rank would be unreadable: the spread instead
        stats = [(e, [x for x in v if x is not None]) for e, v in rows]
        xs = [e for e, _ in stats]
        ax.fill_between(
            xs,
            [min(s) for _, s in stats],
            [max(s) for _, s in stats],
            alpha=0.2,
            color=COLORS[0],
            label=f"min..max over {ranks} ranks",
        )
        ax.plot(xs, [statistics.median(s) for _, s in stats], "o-", color=COLORS[0], label="median rank")
        ax.legend(fontsize=8)
    top = ax.get_ylim()[1]
    ax.set_ylim(0, top * 1.15 if top > 0 else 1)  # from zero, with room above the highest line for the legend
    return fig


@dataclass
class Plot:
    file: str  # PNG name inside report/
    alt: str
    png: bytes


def make_plots(epochs: list[dict], steps: list[dict]) -> list[Plot]:
    """Every plot the records (per epoch, and per recorded step) have data for, as PNG bytes."""
    makers: list[tuple[str, str, Callable]] = [
        (
            "loss.png",
            "Loss per epoch: train mean with min..max band over ranks, and validation loss",
            lambda: _plot_loss(epochs),
        ),
        ("val_accuracy.png", "Validation accuracy per epoch", lambda: _plot_accuracy(epochs)),
        (
            "loss_per_step.png",
            "Training loss per recorded optimizer step: mean with min..max band over ranks",
            lambda: _plot_step_loss(steps),
        ),
        (
            "throughput_per_step.png",
            "Samples per second of all ranks per recorded optimizer step",
            lambda: _plot_step_throughput(steps),
        ),
    ]
    for field in RANK_FIELDS:
        if field.plot:
            makers.append(
                (
                    f"{field.key.removesuffix('_per_rank')}_per_rank.png",
                    field.plot,
                    lambda field=field: _plot_per_rank(epochs, field),
                )
            )
    plots = []
    for file, alt, make in makers:
        fig = make()
        if fig is None:
            log.debug("no data for %s; plot left out", file)
            continue
        from io import BytesIO

        buffer = BytesIO()
        fig.savefig(buffer, format="png")
        plots.append(Plot(file, alt, buffer.getvalue()))
    return plots


ALL_PLOT_FILES = {"loss.png", "val_accuracy.png", "loss_per_step.png", "throughput_per_step.png"} | {
    f"{f.key.removesuffix('_per_rank')}_per_rank.png" for f in RANK_FIELDS if f.plot
}


# ---------------------------------------------------------------------------------------------
# HTML

CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, "DejaVu Sans", Helvetica, Arial, sans-serif;
       margin: 0; background: #f4f5f7; color: #1d2330; font-size: 14px; }
main { max-width: 1240px; margin: 0 auto; padding: 20px 24px 40px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 16px; margin: 0 0 10px; }
section { background: #fff; border: 1px solid #dde1e7; border-radius: 8px; padding: 14px 18px; margin: 14px 0; }
.sub { color: #5b6475; font-size: 13px; }
.badge { display: inline-block; padding: 2px 10px; border-radius: 10px; font-weight: 600; font-size: 13px;
         vertical-align: middle; margin-left: 8px; }
.finished { background: #dff3e4; color: #17622e; }
.failed { background: #fbe0e0; color: #9b1c1c; }
.unknown { background: #fff1cc; color: #7a5b00; }
.alert { background: #fbe0e0; border: 1px solid #f0b4b4; color: #7d1616; border-radius: 6px; padding: 8px 12px;
         margin-top: 10px; white-space: pre-wrap; font-size: 12px;
         font-family: ui-monospace, Menlo, Consolas, monospace; }
.note { background: #fff8e1; border: 1px solid #f1dc9c; border-radius: 6px; padding: 6px 12px; margin-top: 8px; }
.facts { display: grid; grid-template-columns: max-content 1fr; gap: 4px 18px; margin: 0; }
.facts dt { color: #5b6475; }
.facts dd { margin: 0; }
code, .mono { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; word-break: break-all; }
table { border-collapse: collapse; width: 100%; font-size: 13px; }
th, td { padding: 4px 10px; border-bottom: 1px solid #e8ebf0; text-align: right; white-space: nowrap; }
th { background: #f0f2f5; font-weight: 600; }
th.l, td.l { text-align: left; }
tbody tr:hover { background: #f7f9fc; }
.scroll { overflow-x: auto; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 12px; }
.plots figure { margin: 0; }
img.plot { width: 100%; height: auto; border: 1px solid #e8ebf0; border-radius: 4px; }
.ok { color: #17622e; font-weight: 600; }
.bad { color: #9b1c1c; font-weight: 600; }
.config { display: grid; grid-template-columns: repeat(auto-fit, minmax(360px, 1fr)); gap: 0 24px; align-items: start; }
footer { color: #8a93a3; font-size: 12px; margin-top: 18px; }
"""

DASH = "\u2013"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(value: Any, spec: str = ".4f") -> str:
    number = _num(value)
    if number is None:
        return DASH if value is None else _e(value)
    if math.isnan(number) or math.isinf(number):
        return _e(number)
    return _e(format(number, spec))


def _yes_no(value: Any) -> str:
    if value is None:
        return DASH
    return '<span class="ok">yes</span>' if value else '<span class="bad">NO</span>'


def _metrics_text(metrics: dict | None) -> str:
    if not metrics:
        return DASH
    parts = []
    if "epoch" in metrics:
        parts.append(f"epoch {_e(metrics['epoch'])}")
    for key, label, spec in [
        ("train_loss", "train loss", ".4f"),
        ("val_loss", "val loss", ".4f"),
        ("val_accuracy", "val accuracy", ".4f"),
    ]:
        if key in metrics:
            parts.append(f"{label} {_fmt(metrics[key], spec)}")
    return ", ".join(parts) or DASH


def _summary_html(run: Run) -> str:
    s, status = run.summary, run.status
    name = s.name or run.run_dir.name
    badge = status if status in ("finished", "failed") else "unknown"
    head = [
        f'<h1>Run {_e(name)}<span class="badge {badge}">{_e(status)}</span></h1>',
        f'<div class="sub mono">{_e(s.run_dir or run.run_dir)}</div>',
    ]
    if s.error:
        head.append(f'<div class="alert">Error: {_e(s.error)}</div>')
    if status == "failed" and not run.epochs:
        head.append('<div class="note">The run failed before finishing any epoch: there are no metrics to plot.</div>')
    for note in run.notes:
        head.append(f'<div class="note">{_e(note)}</div>')

    facts: list[tuple[str, str]] = []
    done = s.epochs_completed if s.epochs_completed is not None else len(run.epochs)
    requested = s.epochs_requested or (run.config or {}).get("epochs")
    facts.append(("Status", _e(status)))
    facts.append(("Epochs", f"{_e(done)} of {_e(requested)} completed" if requested else f"{_e(done)} completed"))
    world = run.world_size
    facts.append(("World size", _e(plural(world, "worker")) if world else DASH))
    per_worker = s.per_worker_batch_size or (run.config or {}).get("batch_size")
    global_batch = s.global_batch_size or (per_worker * world if per_worker and world else None)
    workers = _e(plural(world, "worker")) if world else f"{DASH} workers"
    facts.append(
        (
            "Batch",
            f"{_e(per_worker or DASH)} per worker &times; {workers} = "
            f"<b>{_e(global_batch or DASH)}</b> global "
            '<span class="sub">(global batch = per-worker batch x workers: '
            "what DDP trains with)</span>",
        )
    )
    final = s.final_metrics or (run.epochs[-1] if run.epochs else None)
    facts.append(("Final metrics", _metrics_text(final)))
    facts.append(("Best metrics", _metrics_text(s.best_metrics)))
    facts.append(
        (
            "Best checkpoint",
            f'<span class="mono">{_e(s.best_checkpoint)}</span>' if s.best_checkpoint else DASH,
        )
    )
    sps = s.samples_per_second
    facts.append(("Throughput", f"{_fmt(sps, ',.0f')} samples/s over the whole run" if sps is not None else DASH))
    facts.append(("Restarts", _e(s.restarts if s.restarts is not None else DASH)))
    if s.lost_nodes:
        facts.append(
            (
                "Lost nodes",
                _e(
                    "; ".join(
                        f"{n['hostname']} ({n['node_ip']}), rank(s) {', '.join(map(str, n['ranks'])) or 'none'}"
                        for n in s.lost_nodes
                    )
                ),
            )
        )
    checksums = s.param_checksums or []
    reported = [c for c in checksums if c]
    if checksums and len(reported) < len(checksums):  # a failed run: some ranks never got to report
        same_text = (
            f'unknown <span class="sub">({len(reported)} of {plural(len(checksums), "rank")} reported a parameter '
            f"checksum)</span>"
        )
    else:
        distinct = len(set(reported))
        same_text = _yes_no(s.replicas_identical) + (
            f' <span class="sub">({plural(distinct, "distinct parameter checksum")} over '
            f"{plural(len(reported), 'rank')})</span>"
            if reported
            else ""
        )
    facts.append(("Replicas identical", same_text))
    if s.seconds is not None:
        facts.append(("Wall time", f"{_fmt(s.seconds, ',.1f')} s"))
    if (run.run_dir / "tensorboard").is_dir():
        facts.append(("TensorBoard", f"<code>tensorboard --logdir {_e(run.run_dir / 'tensorboard')}</code>"))
    rows = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts)
    return (
        f'<section id="summary">{"".join(head)}<h2 style="margin-top:14px">Summary</h2>'
        f'<dl class="facts">{rows}</dl></section>'
    )


def _workers_html(run: Run) -> str:
    last = run.epochs[-1] if run.epochs else {}
    workers = {w.get("rank"): w for w in run.summary.workers or [] if isinstance(w, dict)}
    fields = [f for f in RANK_FIELDS if f.values(last)] + _unknown_rank_fields(last)
    columns = {f.key: f.values(last) for f in fields}
    checksums = run.summary.param_checksums or []
    ranks = sorted(
        set(workers) | set(range(max([run.world_size] + [len(v) for v in columns.values()]))),
        key=lambda r: (not isinstance(r, int), r),
    )
    if not ranks:
        return '<section id="workers"><h2>Workers</h2><p class="sub">No worker information recorded.</p></section>'
    caption = f"per-rank numbers from the last epoch ({_e(last['epoch'])})" if last else "no epoch finished"
    head = [
        "<th>rank</th>",
        '<th class="l">hostname</th>',
        '<th class="l">node_ip</th>',
        '<th class="l">device</th>',
        "<th>pid</th>",
    ] + [f"<th>{_e(f.column)}</th>" for f in fields]
    if checksums:
        head.append('<th class="l">param checksum</th>')
    body = []
    for r in ranks:
        w = workers.get(r, {})
        cells = [f"<td>{_e(r)}</td>"]
        cells += [f'<td class="l">{_e(w.get(k, DASH))}</td>' for k in ("hostname", "node_ip", "device")]
        cells.append(f"<td>{_e(w.get('pid', DASH))}</td>")
        for f in fields:
            values = columns[f.key]
            cells.append(f"<td>{_fmt(values[r], f.fmt) if isinstance(r, int) and r < len(values) else DASH}</td>")
        if checksums:
            mark = checksums[r] if isinstance(r, int) and r < len(checksums) and checksums[r] else DASH
            cells.append(f'<td class="l mono">{_e(mark)}</td>')
        body.append(f'<tr data-rank="{_e(r)}">{"".join(cells)}</tr>')
    return (
        f'<section id="workers"><h2>Workers <span class="sub">{caption}</span></h2><div class="scroll">'
        f"<table><thead><tr>{''.join(head)}</tr></thead><tbody>{''.join(body)}</tbody></table></div></section>"
    )


def _rank_summaries_html(run: Run) -> str:
    """A large world's last epoch (above epochs.PER_RANK_LIMIT ranks): each per-rank figure's spread and the
    ranks at its ends, where a small world's worker table has a column per figure."""
    last = run.epochs[-1] if run.epochs else {}
    summaries = {
        key.removesuffix("_rank_summary"): value for key, value in last.items() if key.endswith("_rank_summary")
    }
    if not summaries:
        return ""
    head = ["figure", "min", "median", "p90", "max", "highest ranks", "lowest ranks"]
    body = []
    for name, summary in summaries.items():
        cells = [_e(name.replace("_", " "))]
        cells += [_fmt(summary.get(k), ".4g") for k in ("min", "median", "p90", "max")]
        cells += [_e(", ".join(map(str, summary.get(k, [])))) for k in ("highest_ranks", "lowest_ranks")]
        body.append(f"<tr>{''.join(f'<td>{c}</td>' for c in cells)}</tr>")
    caption = f"the last epoch ({_e(last['epoch'])}) over {_e(last.get('world_size'))} ranks; each rank's: " + _e(
        last.get("rank_lists_file", "")
    )
    return (
        f'<section id="rank-summaries"><h2>Ranks <span class="sub">{caption}</span></h2><div class="scroll">'
        f"<table><thead><tr>{''.join(f'<th>{_e(h)}</th>' for h in head)}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table></div></section>"
    )


def _epochs_html(run: Run) -> str:
    if not run.epochs:
        return '<section id="epochs"><h2>Epochs</h2><p class="sub">No epoch finished.</p></section>'
    head = [
        "epoch",
        "train loss",
        "min..max over ranks",
        "val loss",
        "val acc",
        "samples/s",
        "time (s)",
        "max data wait (s)",
        "val same on all ranks",
    ]
    body = []
    for rec in run.epochs:
        lo, hi = rec.get("train_loss_min"), rec.get("train_loss_max")
        spread = f"{_fmt(lo)}..{_fmt(hi)}" if lo is not None and hi is not None else DASH
        waits = [w for w in _per_rank(rec, "data_wait_seconds_per_rank") or [] if w is not None]
        waits = waits or [w for w in [rec.get("data_wait_seconds_rank_summary", {}).get("max")] if w is not None]
        cells = [
            _e(rec.get("epoch")),
            _fmt(rec.get("train_loss")),
            spread,
            _fmt(rec.get("val_loss")),
            _fmt(rec.get("val_accuracy")),
            _fmt(rec.get("samples_per_second"), ",.0f"),
            _fmt(rec.get("seconds"), ".1f"),
            _fmt(max(waits), ".2f") if waits else DASH,
            _yes_no(rec.get("val_identical_across_ranks")),
        ]
        body.append(f"<tr>{''.join(f'<td>{c}</td>' for c in cells)}</tr>")
    return (
        f'<section id="epochs"><h2>Epochs</h2><div class="scroll"><table><thead><tr>'
        f"{''.join(f'<th>{_e(h)}</th>' for h in head)}</tr></thead>"
        f"<tbody>{''.join(body)}</tbody></table></div></section>"
    )


PROFILE_ROWS = 10  # operators shown per rank


def _milliseconds(microseconds: Any) -> float | None:
    number = _num(microseconds)
    return None if number is None else number / 1000


def _profile_html(run: Run) -> str:
    """--profile-steps: each rank's operators that took most self time; nothing when the run has no profile."""
    if not run.profiles:
        return ""
    tables = []
    for rank, table in run.profiles.items():
        on_gpu = any("self_device_us" in op for op in table["ops"])
        columns = {"self_cpu_us": "self CPU (ms)", "cpu_total_us": "CPU total (ms)"}
        if on_gpu:
            columns["self_device_us"] = "self GPU (ms)"
        rows = "".join(
            f'<tr><td class="l mono">{_e(op.get("name"))}</td><td>{_fmt(op.get("calls"), ",.0f")}</td>'
            + "".join(f"<td>{_fmt(_milliseconds(op.get(key)), ',.2f')}</td>" for key in columns)
            + "</tr>"
            for op in table["ops"][:PROFILE_ROWS]
        )
        steps = DASH.join(_e(step) for step in table.get("steps") or []) or DASH
        tables.append(
            f'<div data-rank="{_e(rank)}"><h3 class="sub">rank {_e(rank)} on {_e(table.get("device", DASH))}, '
            f'optimizer steps {steps}</h3><div class="scroll"><table><thead><tr>'
            f'<th class="l">operator</th><th>calls</th>{"".join(f"<th>{_e(c)}</th>" for c in columns.values())}'
            "</tr></thead>"
            f"<tbody>{rows}</tbody></table></div></div>"
        )
    return (
        f'<section id="profile"><h2>Profile <span class="sub">top operators by self time per rank; each rank\'s '
        f"whole trace: <code>{_e(run.run_dir / PROFILE_DIR)}/rank-N.trace.json</code> (open it in "
        f"ui.perfetto.dev or chrome://tracing)</span></h2>"
        f'<div class="config">{"".join(tables)}</div></section>'
    )


def _config_html(run: Run) -> str:
    if run.config is None:
        return '<section id="config"><h2>Configuration</h2><p class="sub">config.toml not available.</p></section>'
    items = list(run.config.items())
    halves = [items[: (len(items) + 1) // 2], items[(len(items) + 1) // 2 :]] if len(items) > 8 else [items]
    tables = []
    for half in halves:
        rows = "".join(
            f'<tr><td class="l mono">{_e(k)}</td><td class="l mono">'
            f"{_e(v if isinstance(v, str) else json.dumps(v))}</td></tr>"
            for k, v in half
        )
        tables.append(
            f'<table><thead><tr><th class="l">setting</th><th class="l">value</th></tr></thead>'
            f"<tbody>{rows}</tbody></table>"
        )
    return (
        f'<section id="config"><h2>Configuration <span class="sub">config.toml: rerun with '
        f"<code>python -m raytrain_ddp.run --config {_e(run.run_dir / 'config.toml')} --name NEW_NAME</code>"
        "</span></h2>"
        f'<div class="config">{"".join(tables)}</div></section>'
    )


def _plots_html(plots: list[Plot]) -> str:
    if not plots:
        return '<section id="plots"><h2>Plots</h2><p class="sub">No epoch metrics to plot.</p></section>'
    figures = "".join(
        f'<figure><img class="plot" alt="{_e(p.alt)}" title="{_e(p.file)}" '
        f'src="data:image/png;base64,{base64.b64encode(p.png).decode("ascii")}"></figure>'
        for p in plots
    )
    return f'<section id="plots"><h2>Plots</h2><div class="plots">{figures}</div></section>'


def render_html(run: Run, plots: list[Plot]) -> str:
    """The whole page: inline CSS, images as data URIs, nothing fetched from anywhere."""
    title = f"Run {run.summary.name or run.run_dir.name} ({run.status})"
    made = time.strftime("%Y-%m-%d %H:%M:%S")
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{CSS}</style></head><body><main>"
        f"{_summary_html(run)}{_plots_html(plots)}{_rank_summaries_html(run)}{_workers_html(run)}{_profile_html(run)}"
        f"{_epochs_html(run)}{_config_html(run)}"
        f"<footer>Made by raytrain_ddp.report at {_e(made)} from {_e(run.run_dir)}</footer>"
        f"</main></body></html>\n"
    )


def write_report(run_dir: RunPath | str) -> RunPath:
    """Write RUN_DIR/report/ (PNG plots and a self-contained index.html); return the index.html path.

    Raises ReportError when RUN_DIR is missing or is not a run directory.
    """
    run = load_run(run_dir)
    out = run.run_dir / REPORT_DIR
    out.mkdir(exist_ok=True)
    plots = make_plots(run.epochs, run.steps)
    made = {p.file for p in plots}
    for stale in ALL_PLOT_FILES - made:  # a plot this run no longer has data for
        (out / stale).unlink(missing_ok=True)
    for plot in plots:
        write_atomic(out / plot.file, plot.png)
    index = write_atomic(out / INDEX, redact(render_html(run, plots)))  # also run dirs older than redaction
    log.debug("report for %s: %s (%d plots)", run.run_dir, index, len(plots))
    return index


# ---------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None, prog: str = "python -m raytrain_ddp.report") -> int:
    """prog: the command's name in --help (`raytrain-ddp report` calls this too)."""
    parser = OneLineErrorParser(
        prog=prog,
        description="Write RUN_DIR/report/index.html (summary, workers, epochs, "
        "configuration and plots) and print its path.",
        epilog="examples:\n  %(prog)s runs/NAME\n  xdg-open $(%(prog)s runs/NAME)   # and open it",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory: STORAGE_PATH/NAME")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what is read and written")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(message)s", stream=sys.stderr)
    try:
        index = write_report(args.run_dir)
    except ReportError as err:
        return bad_input(err)
    except OSError as err:  # e.g. a read-only run directory
        sys.stderr.write(f"error: cannot write the report: {err}\n")
        return 1
    print(index)  # the CLI's designed output: the page's path, for scripts and `xdg-open $(...)`
    return 0


if __name__ == "__main__":
    sys.exit(main())
