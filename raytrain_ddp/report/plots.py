"""The report's plots, as PNG bytes: loss and accuracy per epoch, loss and throughput per recorded step, and
the per-rank figures."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from raytrain_ddp.report.records import RANK_FIELDS, RankField, as_number

log = logging.getLogger(__name__)

MANY_RANKS = 12  # above this, per-rank plots show min/median/max instead of one line per rank

# matplotlib's object API on an Agg canvas: no pyplot, no global backend switch

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
        y = as_number(rec.get(key))
        if y is not None and as_number(rec.get(x)) is not None:
            xs.append(rec[x])
            ys.append(y)
    return xs, ys


def _plot_step_loss(steps: list[dict]):
    xs, mean = _series(steps, "train_loss", "step")
    if not xs:
        return None
    fig, ax = _new_axes("Training loss per recorded step", "loss", "optimizer step")
    band = [(r["step"], as_number(r.get("train_loss_min")), as_number(r.get("train_loss_max"))) for r in steps]
    band = [b for b in band if b[1] is not None and b[2] is not None and as_number(b[0]) is not None]
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
    band = [(r["epoch"], as_number(r.get("train_loss_min")), as_number(r.get("train_loss_max"))) for r in epochs]
    band = [b for b in band if b[1] is not None and b[2] is not None and as_number(b[0]) is not None]
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
    rows = [(rec["epoch"], field.values(rec)) for rec in epochs if as_number(rec.get("epoch")) is not None]
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
