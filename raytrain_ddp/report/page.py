"""The report's page: one self-contained index.html (inline CSS, plots as data URIs), and writing
RUN_DIR/report/."""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import time
from typing import Any

from raytrain_ddp.errors import named, plural
from raytrain_ddp.files import write_atomic
from raytrain_ddp.redact import redact
from raytrain_ddp.report.plots import ALL_PLOT_FILES, Plot, make_plots
from raytrain_ddp.report.records import RANK_FIELDS, Run, as_number, load_run, per_rank, unknown_rank_fields
from raytrain_ddp.storage import RunPath
from raytrain_ddp.worker.profile import PROFILE_DIR

log = logging.getLogger(__name__)

REPORT_DIR = "report"
INDEX = "index.html"

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
    number = as_number(value)
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
    rows = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in _summary_facts(run))
    return (
        f'<section id="summary">{"".join(_summary_head(run))}<h2 style="margin-top:14px">Summary</h2>'
        f'<dl class="facts">{rows}</dl></section>'
    )


def _summary_head(run: Run) -> list[str]:
    """The title with the status badge, the run directory, and what went wrong or could not be read."""
    s, status = run.summary, run.status
    badge = status if status in ("finished", "failed") else "unknown"
    head = [
        f'<h1>Run {_e(s.name or run.run_dir.name)}<span class="badge {badge}">{_e(status)}</span></h1>',
        f'<div class="sub mono">{_e(s.run_dir or run.run_dir)}</div>',
    ]
    if s.error:
        head.append(f'<div class="alert">Error: {_e(s.error)}</div>')
    if status == "failed" and not run.epochs:
        head.append('<div class="note">The run failed before finishing any epoch: there are no metrics to plot.</div>')
    for note in run.notes:
        head.append(f'<div class="note">{_e(note)}</div>')
    return head


def _summary_facts(run: Run) -> list[tuple[str, str]]:
    """The summary's (label, HTML) rows; a fact the run did not record reads as a dash or is left out."""
    s = run.summary
    done = s.epochs_completed if s.epochs_completed is not None else len(run.epochs)
    requested = s.epochs_requested or (run.config or {}).get("epochs")
    world = run.world_size
    final = s.final_metrics or (run.epochs[-1] if run.epochs else None)
    sps = s.samples_per_second
    facts = [
        ("Status", _e(run.status)),
        ("Epochs", f"{_e(done)} of {_e(requested)} completed" if requested else f"{_e(done)} completed"),
        ("World size", _e(plural(world, "worker")) if world else DASH),
        ("Batch", _batch_text(run)),
        ("Final metrics", _metrics_text(final)),
        ("Best metrics", _metrics_text(s.best_metrics)),
        ("Best checkpoint", f'<span class="mono">{_e(s.best_checkpoint)}</span>' if s.best_checkpoint else DASH),
        ("Throughput", f"{_fmt(sps, ',.0f')} samples/s over the whole run" if sps is not None else DASH),
        ("Restarts", _e(s.restarts if s.restarts is not None else DASH)),
    ]
    if s.lost_nodes:
        facts.append(("Lost nodes", _lost_nodes_text(s.lost_nodes)))
    facts.append(("Replicas identical", _replicas_text(s.param_checksums or [], s.replicas_identical)))
    if s.seconds is not None:
        facts.append(("Wall time", f"{_fmt(s.seconds, ',.1f')} s"))
    if (run.run_dir / "tensorboard").is_dir():
        facts.append(("TensorBoard", f"<code>tensorboard --logdir {_e(run.run_dir / 'tensorboard')}</code>"))
    return facts


def _batch_text(run: Run) -> str:
    """Per-worker batch x workers = global batch: what DDP really trains with."""
    s, world = run.summary, run.world_size
    per_worker = s.per_worker_batch_size or (run.config or {}).get("batch_size")
    global_batch = s.global_batch_size or (per_worker * world if per_worker and world else None)
    workers = _e(plural(world, "worker")) if world else f"{DASH} workers"
    return (
        f"{_e(per_worker or DASH)} per worker &times; {workers} = "
        f"<b>{_e(global_batch or DASH)}</b> global "
        '<span class="sub">(global batch = per-worker batch x workers: '
        "what DDP trains with)</span>"
    )


def _lost_nodes_text(lost_nodes: list[dict]) -> str:
    return _e("; ".join(f"{n['hostname']} ({n['node_ip']}), {named('rank', n['ranks'])}" for n in lost_nodes))


def _replicas_text(checksums: list[str | None], identical: bool | None) -> str:
    """Whether the ranks' parameters ended identical, with how many distinct checksums over how many ranks."""
    reported = [c for c in checksums if c]
    if checksums and len(reported) < len(checksums):  # a failed run: some ranks never got to report
        return (
            f'unknown <span class="sub">({len(reported)} of {plural(len(checksums), "rank")} reported a parameter '
            f"checksum)</span>"
        )
    distinct = len(set(reported))
    return _yes_no(identical) + (
        f' <span class="sub">({plural(distinct, "distinct parameter checksum")} over '
        f"{plural(len(reported), 'rank')})</span>"
        if reported
        else ""
    )


def _workers_html(run: Run) -> str:
    last = run.epochs[-1] if run.epochs else {}
    workers = {w.get("rank"): w for w in run.summary.workers or [] if isinstance(w, dict)}
    fields = [f for f in RANK_FIELDS if f.values(last)] + unknown_rank_fields(last)
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
        waits = [w for w in per_rank(rec, "data_wait_seconds_per_rank") or [] if w is not None]
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
    number = as_number(microseconds)
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
