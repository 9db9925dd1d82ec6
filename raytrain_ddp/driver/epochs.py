"""One epoch's record from every rank's message: the numbers metrics.jsonl holds, and the stragglers; and one
recorded step's, for steps.jsonl.

Pure functions of the ranks' messages (see ``WorkerLoop.report_epoch`` and ``EpochMeter.refresh_loss``): no Ray,
no files.
"""

from __future__ import annotations

import statistics

from raytrain_ddp.config import TrainConfig

STRAGGLER_MIN_EXCESS_S = 0.25  # below this, waiting is noise, not a bottleneck
STRAGGLER_WARN_SHARE = 0.1  # a straggler costing less of the epoch's time is not worth a warning
# Above this world size a record holds a summary of each per-rank list (NAME_rank_summary), not the list: at 4,096 ranks
# the lists made an epoch record of ~1 MB (docs/scale.md); the epoch's lists go to a file of their own.
PER_RANK_LIMIT = 64
EXTREME_RANKS = 3  # the ranks a summary names at each end


def aggregate_epoch(by_rank: dict[int, dict], config: TrainConfig) -> dict:
    """The cross-rank record of one epoch, its stragglers included."""
    ranks = [by_rank[r] for r in sorted(by_rank)]
    samples = [m["samples"] for m in ranks]
    losses = [m["train_loss"] for m in ranks]
    seconds = max(m["train_seconds"] for m in ranks)
    first = ranks[0]
    record = {
        "epoch": first["epoch"],
        "train_loss": sum(l * n for l, n in zip(losses, samples)) / sum(samples),
        "train_loss_min": min(losses),
        "train_loss_max": max(losses),
        "train_loss_per_rank": losses,
        **{name: first[name] for name in validation_names(first)},
        "val_rows": first["val_rows"],
        **{f"{name}_per_rank": [m[name] for m in ranks] for name in validation_names(first)},
        "val_identical_across_ranks": len(validation_results(ranks)) == 1,
        "world_size": len(ranks),
        "global_batch_size": config.global_batch_for(len(ranks)),
        "samples_per_second": sum(samples) / seconds,
        "samples_per_rank": samples,
        "micro_batches_per_rank": [m["micro_batches"] for m in ranks],
        "optimizer_steps_per_rank": [m["optimizer_steps"] for m in ranks],
        "skipped_steps_per_rank": [m["skipped_steps"] for m in ranks],
        "grad_allreduces_per_rank": [m["grad_allreduces"] for m in ranks],
        "lr": first["lr"],
        "data_wait_seconds_per_rank": [round(m["data_wait_seconds"], 4) for m in ranks],
        "micro_batch_seconds_per_rank": [round(m["micro_batch_seconds"], 5) for m in ranks],
        "allreduce_wait_seconds_per_rank": [
            None if m.get("allreduce_wait_seconds") is None else round(m["allreduce_wait_seconds"], 4) for m in ranks
        ],
        "seconds": seconds,
    }
    if "gpu_memory_peak_gib" in first:
        record["gpu_memory_peak_gib_per_rank"] = [m["gpu_memory_peak_gib"] for m in ranks]
    if "model_tflops_per_second" in first:  # see raytrain_ddp/worker/flops.py
        record["model_tflops_per_second_per_rank"] = [m["model_tflops_per_second"] for m in ranks]
        record["model_tflops_per_second"] = sum(record["model_tflops_per_second_per_rank"])
        mfus = [m["mfu"] for m in ranks]
        record["mfu_per_rank"] = mfus
        record["mfu"] = None if None in mfus else sum(mfus) / len(mfus)
    record["stragglers"] = find_stragglers(record)
    return record


def aggregate_step(by_rank: dict[int, dict]) -> dict:
    """The cross-rank record of one recorded optimizer step: each rank's message covers its micro-batches since
    its previous recorded step (or the epoch's start)."""
    ranks = [by_rank[r] for r in sorted(by_rank)]
    samples = [m["samples"] for m in ranks]
    losses = [m["loss"] for m in ranks]
    seconds = max(m["seconds"] for m in ranks)
    first = ranks[0]
    return {
        "step": first["step"],
        "epoch": first["epoch"],
        "train_loss": sum(l * n for l, n in zip(losses, samples)) / sum(samples),
        "train_loss_min": min(losses),
        "train_loss_max": max(losses),
        "train_loss_per_rank": losses,
        "lr": first["lr"],
        "samples_per_second": sum(samples) / seconds if seconds > 0 else None,
        "seconds": seconds,
        "world_size": len(ranks),
        # the global norm (over all ranks' gradients and shards): the same number on every rank
        **({"grad_norm": first["grad_norm"]} if "grad_norm" in first else {}),
    }


def aggregate_report(by_rank: dict[int, dict]) -> dict:
    """The cross-rank record of one step a launched script reported (raytrain_ddp.session.report): each figure's
    mean over the ranks, and its spread where the ranks differ."""
    ranks = [by_rank[r] for r in sorted(by_rank)]
    record: dict = {"step": ranks[0]["step"], "world_size": len(ranks)}
    for key in sorted({key for m in ranks for key in m} - {"step"}):
        values = [m[key] for m in ranks if key in m]
        record[key] = sum(values) / len(values)
        if min(values) != max(values):
            record[f"{key}_min"], record[f"{key}_max"], record[f"{key}_per_rank"] = min(values), max(values), values
    return record


def summarize_ranks(values: list) -> dict:
    """A per-rank list in a few numbers: min, median, p90, max, and the ranks at each end (None values, a rank
    that measured nothing, are left out)."""
    known = sorted((value, rank) for rank, value in enumerate(values) if value is not None)
    if not known:
        return {"ranks_measured": 0}
    ordered = [value for value, _ in known]
    return {
        "ranks_measured": len(known),
        "min": ordered[0],
        "median": statistics.median(ordered),
        "p90": ordered[int(0.9 * (len(ordered) - 1))],
        "max": ordered[-1],
        "lowest_ranks": [rank for _, rank in known[:EXTREME_RANKS]],
        "highest_ranks": [rank for _, rank in reversed(known[-EXTREME_RANKS:])],
    }


def split_per_rank(record: dict) -> tuple[dict, dict[str, list]]:
    """(the record to keep, its per-rank lists): above PER_RANK_LIMIT ranks each NAME_per_rank list is replaced
    by NAME_rank_summary, its summary; at or below it the record is kept whole, and no lists are split off."""
    if record["world_size"] <= PER_RANK_LIMIT:
        return record, {}
    lists = {key: value for key, value in record.items() if key.endswith("_per_rank")}
    summaries = {
        key.removesuffix("_per_rank") + "_rank_summary": summarize_ranks(value) for key, value in lists.items()
    }
    return {**{key: value for key, value in record.items() if key not in lists}, **summaries}, lists


def validation_names(metrics: dict) -> list[str]:
    """The validation figures of a rank's message or an epoch record: val_loss and val_accuracy, or a --task's
    val_NAME (not the row count, the per-rank lists or the agreement flag)."""
    return [
        name
        for name, value in metrics.items()
        if name.startswith("val_") and name != "val_rows" and type(value) in (int, float)
    ]


def validation_results(ranks: list[dict]) -> list[tuple[float, ...]]:
    """The distinct validation results (val_loss, val_accuracy...) the ranks report: one when validation agrees,
    as it must."""
    return sorted({tuple(m[name] for name in validation_names(m)) for m in ranks})


def find_stragglers(record: dict) -> list[dict]:
    """Ranks whose data wait stands far above the others' median, and the rank slow in compute.

    In DDP a rank slow for any reason makes every rank slow: the others wait
    for it inside the all-reduce, so their step time grows as much as its own.
    Step time cannot name the culprit; time spent waiting for the next batch
    can, and it says "this rank's input pipeline is the bottleneck"; so can the
    time each rank waits inside the gradient all-reduce (the slow rank waits least).
    """
    waits = record.get("data_wait_seconds_per_rank") or []
    if len(waits) < 2:
        return []
    median = statistics.median(waits)
    slow_data_ranks = {
        rank for rank, wait in enumerate(waits) if wait - median > max(0.5 * median, STRAGGLER_MIN_EXCESS_S)
    }
    stragglers = [
        {
            "rank": rank,
            "why": f"data wait {waits[rank]:.3g}s vs median {median:.3g}s over the epoch: "
            "its input pipeline is the bottleneck",
        }
        for rank in sorted(slow_data_ranks)
    ]
    return stragglers + _slow_in_compute(record, slow_data_ranks)


def _slow_in_compute(record: dict, slow_in_data: set[int]) -> list[dict]:
    """The rank the others wait for inside the gradient all-reduce: it waits least there (it arrives last),
    unless its lateness is its data wait, flagged already."""
    waits = record.get("allreduce_wait_seconds_per_rank") or []
    if len(waits) < 2 or None in waits:
        return []
    rank = min(range(len(waits)), key=waits.__getitem__)
    others = min(wait for other, wait in enumerate(waits) if other != rank)
    if rank in slow_in_data or others - waits[rank] <= max(0.5 * others, STRAGGLER_MIN_EXCESS_S):
        return []
    return [
        {
            "rank": rank,
            "why": f"all-reduce wait {waits[rank]:.3g}s while every other rank waits "
            f">= {others:.3g}s for it over the epoch: its compute is the bottleneck",
        }
    ]


def stragglers_to_warn(record: dict, previous: dict | None) -> list[dict]:
    """The stragglers worth a warning: flagged in the previous epoch too (one slow epoch is noise: on a busy
    machine the flag moves from rank to rank), and late by a share of the epoch's time that matters."""
    before = {s["rank"] for s in (previous or {}).get("stragglers", [])}
    return [
        s
        for s in record["stragglers"]
        if s["rank"] in before and _lateness_s(record, s["rank"]) >= STRAGGLER_WARN_SHARE * record["seconds"]
    ]


def _lateness_s(record: dict, rank: int) -> float:
    """How much longer than the others `rank` took over the epoch: its data wait above the median, or how long
    the others waited for it in the all-reduce."""
    waits = record.get("data_wait_seconds_per_rank") or []
    in_data = waits[rank] - statistics.median(waits) if len(waits) > rank else 0.0
    allreduce = record.get("allreduce_wait_seconds_per_rank") or []
    others = [wait for other, wait in enumerate(allreduce) if other != rank]
    measured = len(allreduce) > rank and None not in allreduce and others
    in_compute = min(others) - allreduce[rank] if measured else 0.0
    return max(in_data, in_compute)
