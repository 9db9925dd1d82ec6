"""Pieces shared by the contenders: the probe event format and the steady-state arithmetic.

Both contenders record the same events on rank 0, with the same clock
(time.time() on this machine): ("e", t) when an epoch's training loop starts,
("s", t, n) right after each optimizer.step() on a batch of n rows.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # scripts run as `python bench/x.py` still import raytrain_ddp
    sys.path.insert(0, str(ROOT))

WARMUP_STEPS = 10  # steps of each epoch not counted in the steady state (the first ~10: data pipeline spin-up)

SGD = dict(lr=0.02, momentum=0.9, weight_decay=5e-4)  # the project's defaults, used by both contenders
MODEL = "cnn"  # on the built-in synthetic images, 3x32x32, 10 classes
NORM_MEAN, NORM_STD = (0.5,) * 3, (0.25,) * 3  # the project's synthetic-data normalisation


def split_epochs(events: list) -> list[list[tuple[float, int]]]:
    """Events -> per epoch, the (time, rows) of each completed step."""
    epochs: list[list[tuple[float, int]]] = []
    for event in events:
        if event[0] == "e":
            epochs.append([])
        elif event[0] == "s" and epochs:
            epochs[-1].append((event[1], event[2]))
    return epochs


def steady_samples_per_s(events: list, world_size: int, first_epoch: int = 2) -> float:
    """Samples/s over all ranks, after warm-up: in each epoch >= first_epoch, from the
    end of step WARMUP_STEPS to the end of its last step (rank 0's clock; DDP's
    all-reduce keeps the ranks in step). Epoch boundaries (validation,
    checkpointing, reshuffling) are left out on both sides."""
    rows, seconds = 0, 0.0
    for steps in split_epochs(events)[first_epoch - 1 :]:
        if len(steps) <= WARMUP_STEPS + 1:
            continue
        counted = steps[WARMUP_STEPS - 1 :]
        rows += sum(n for _, n in counted[1:])
        seconds += counted[-1][0] - counted[0][0]
    if seconds <= 0:
        raise ValueError("not enough steps after warm-up to measure a steady state; use more data")
    return rows * world_size / seconds


def first_step_time(events: list) -> float:
    return next(e[1] for e in events if e[0] == "s")


def summarise(values: list[float]) -> dict:
    """Median, min and max of a figure over rounds."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def save_results(out: str | Path, result: dict, table: str) -> None:
    """A bench's figures as JSON at `out`, its Markdown table beside it (.md), the table printed."""
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    Path(out).with_suffix(".md").write_text(table + "\n")
    print(table)


def write_json(path: str | Path, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj))


def markdown_table(header: str, rows: list[str]) -> str:
    """A Markdown table of its header line (`| a | b |`) and row lines."""
    return "\n".join([header, "|---" * (header.count("|") - 1) + "|", *rows])


def publish(results: list[dict], table: str, json_path: Path | None) -> None:
    """A bench's figures: its table printed, and with --json the figures per size written there."""
    print(table)
    if json_path:
        json_path.write_text(json.dumps(results, indent=1) + "\n")
