"""Parquet data through Ray Data into 2 real DDP workers: sharding semantics, round trip, bad input."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from support import run_cli
from worker_hooks import DieOnce

from raytrain_ddp.data import synthetic

# Real tables hold features that never change (a flag set on every row, an all-zero pixel): they must train.
CONSTANT = ("always_one", "always_zero")
FEATURES = ",".join((*synthetic.FEATURE_NAMES[:16], CONSTANT[0], *synthetic.FEATURE_NAMES[16:], CONSTANT[1]))


@pytest.fixture(scope="module")
def tabular_data(tmp_path_factory) -> Path:
    """1203 rows with unique ids, several files and row groups, two constant features; prepared from a CSV
    file by the command a user runs."""
    rows = synthetic.tabular_rows(np.arange(1203), seed=3)
    columns = {name: rows[name] for name in synthetic.FEATURE_NAMES}
    columns.update({CONSTANT[0]: np.ones(1203), CONSTANT[1]: np.zeros(1203)})
    where = tmp_path_factory.mktemp("data")
    csv = where / "table.csv"
    pacsv.write_csv(pa.table({name: columns[name] for name in FEATURES.split(",")} | {"label": rows["label"]}), csv)
    out = where / "tabular"
    prepared = run_cli(
        "raytrain_ddp.data",
        *("prepare", "--from", "csv", str(csv), "--label-column", "label", "--out", str(out)),
        *("--val-fraction", "0.2", "--rows-per-file", "300", "--row-group-size", "100"),
        timeout=120,
    )
    assert prepared.returncode == 0, prepared.stderr
    return out


def test_inspect_names_the_constant_features(tabular_data):
    shown = run_cli("raytrain_ddp.data", "inspect", str(tabular_data), timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert f"constant   {', '.join(CONSTANT)} (std 0 over the train split: training scales them by 1)" in shown.stdout


def _train_ids(data: Path) -> set[int]:
    return set(pq.ParquetDataset(str(data / "train")).read(columns=["id"]).column("id").to_pylist())


def _config(data: Path, seed: int = 0):
    from raytrain_ddp import TrainConfig

    return TrainConfig(
        num_workers=2,
        epochs=2,
        data=str(data),
        feature_columns=FEATURES,
        model="mlp",
        batch_size=32,
        seed=seed,
        report=False,
        tensorboard=False,
    )


def _train_shards(config) -> list:
    """The training shards of 2 ranks, built from scratch as a new driver builds them."""
    from raytrain_ddp.data.pipeline import ShardingDataConfig, build_datasets
    from raytrain_ddp.data.spec import plan_data

    datasets = build_datasets(config, plan_data(config))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # as the driver makes it for every run: no deprecated Ray Data option
        sharding = ShardingDataConfig()
    per_rank = sharding.configure({"train": datasets["train"]}, world_size=2, worker_handles=None, worker_node_ids=None)
    return [shards["train"] for shards in per_rank]


def _epoch_ids(shard, config, epoch: int) -> np.ndarray:
    from raytrain_ddp.worker.device_feed import epoch_batches

    return np.concatenate([batch["id"].numpy() for batch in epoch_batches(shard, config, epoch, "cpu")])


def _pipeline_order(data: Path, seed: int) -> dict:
    """(epoch, rank) -> the ids that rank reads in that epoch, from a new build of the pipeline (another run)."""
    config = _config(data, seed)
    return {
        (epoch, rank): _epoch_ids(shard, config, epoch)
        for rank, shard in enumerate(_train_shards(config))
        for epoch in (1, 2)
    }


def _seen(result, epoch: int, rank: int) -> np.ndarray:
    return np.load(result.run_dir / "sample_ids" / f"epoch-{epoch}-rank-{rank}.npy")


CHECKPOINT_EVERY = 4  # optimizer steps
DIES_AT = 11  # rank 1's process dies at this micro-batch of epoch 2, after 10 steps, the first time


def _recording_config(tabular_data, runs: Path, name: str, **changes):
    """A 2-worker run on the tabular data that records the ids its micro-batches saw and checkpoints every
    CHECKPOINT_EVERY optimizer steps."""
    import dataclasses

    return dataclasses.replace(
        _config(tabular_data),
        record_sample_ids=True,
        storage_path=str(runs),
        name=name,
        checkpoint_every_steps=CHECKPOINT_EVERY,
        **changes,
    )


def _fit_losing_rank_1(config, epoch: int):
    """fit(config), rank 1's process dying once at micro-batch DIES_AT of `epoch`."""
    from raytrain_ddp import fit

    # 3 s: the checkpoints taken before count
    return fit(config, hooks=DieOnce(str(config.storage_path), at=(1, epoch, DIES_AT), wait_s=3))


@pytest.fixture(scope="module")
def recorded_run(ray_address, tabular_data, tmp_path_factory):
    """A real 2-worker fit that records, per epoch and rank, the ids its training steps saw. It checkpoints every
    CHECKPOINT_EVERY optimizer steps and loses rank 1's process once in epoch 2: Ray Train restarts the group
    from the latest (interval) checkpoint."""
    config = _recording_config(tabular_data, tmp_path_factory.mktemp("runs"), "first", num_to_keep=1)
    result = _fit_losing_rank_1(config, epoch=2)
    assert result.ok, result.summary["error"]
    assert result.summary["restarts"] == 1, result.summary
    return result


@pytest.mark.ray
def test_constant_features_train_and_are_named(recorded_run):
    log = (recorded_run.run_dir / "driver.log").read_text()
    assert f"Constant over the training split (std 0), so scaled by 1, not divided by 0: {', '.join(CONSTANT)}" in log
    assert all(np.isfinite(epoch["train_loss"]) and np.isfinite(epoch["val_loss"]) for epoch in recorded_run.epochs)


@pytest.mark.ray
def test_shards_are_disjoint_complete_and_equal(recorded_run, tabular_data):
    first = recorded_run
    train_ids = _train_ids(tabular_data)
    rank0, rank1 = _seen(first, 1, 0), _seen(first, 1, 1)
    assert len(rank0) == len(rank1)  # equal shards...
    assert len(set(rank0)) == len(rank0) and len(set(rank1)) == len(rank1)  # no row twice on a rank
    assert not set(rank0) & set(rank1)  # ...disjoint across ranks...
    covered = set(rank0) | set(rank1)
    assert covered <= train_ids and len(train_ids) - len(covered) <= 1  # ...complete but world_size-1 rows
    record = first.epochs[0]
    assert record["samples_per_rank"] == [len(rank0), len(rank1)]
    assert record["micro_batches_per_rank"][0] == record["micro_batches_per_rank"][1]  # same steps: no DDP hang
    assert first.summary["replicas_identical"]


@pytest.mark.ray
def test_a_restart_resumes_at_the_latest_interval_checkpoint_and_trains_exactly_the_rest(recorded_run, tabular_data):
    """Epoch 2 lost rank 1 after 10 optimizer steps; the restart resumed from the interval checkpoint before that
    (not from epoch 1's end) and trained, rank by rank, exactly the rows of epoch 2's order after it."""
    expected = _pipeline_order(tabular_data, seed=0)
    steps_in_epoch_1 = recorded_run.epochs[0]["optimizer_steps_per_rank"][0]
    resumed_after = max(k for k in range(1, DIES_AT) if (steps_in_epoch_1 + k) % CHECKPOINT_EVERY == 0)
    batch = _config(tabular_data).batch_size
    for rank in (0, 1):
        seen, order = _seen(recorded_run, 2, rank), expected[2, rank]
        where = f"rank {rank}: {len(seen)} of {len(order)} rows, from row {list(order).index(seen[0])} of the order"
        assert np.array_equal(seen, order[resumed_after * batch :]), f"{where}; expected from {resumed_after * batch}"


@pytest.mark.ray
def test_retention_keeps_the_best_and_the_latest_epoch_checkpoint(recorded_run):
    """--num-to-keep 1 with interval checkpoints: what is left is the best epoch's checkpoint and the latest, no
    interval one (each was dropped once a newer checkpoint came); the summary names both."""
    import torch

    summary = recorded_run.summary
    assert summary["checkpoints_ranked_by"] == "val_accuracy (max)"
    kept = {str(path) for path in recorded_run.run_dir.glob("checkpoint_*/checkpoint.pt")}
    assert kept == {summary["best_checkpoint"], summary["latest_checkpoint"]}, kept
    states = [torch.load(path, weights_only=True) for path in kept]
    assert all(state["step_in_epoch"] == 0 for state in states), [s["metrics"] for s in states]
    best_epoch = max(recorded_run.epochs, key=lambda record: record["val_accuracy"])["epoch"]
    assert torch.load(summary["best_checkpoint"], weights_only=True)["epoch"] == best_epoch
    assert torch.load(summary["latest_checkpoint"], weights_only=True)["epoch"] == 2


@pytest.mark.ray
def test_each_epoch_reshuffles_across_ranks(recorded_run):
    first = recorded_run
    epoch1, epoch2 = _seen(first, 1, 0), _seen(first, 2, 0)
    assert not np.array_equal(epoch1, epoch2)  # a new order...
    assert set(epoch1) != set(epoch2)  # ...and a new split of rows between ranks, like DistributedSampler.set_epoch


@pytest.mark.ray
def test_same_seed_same_order_other_seed_other_order(recorded_run, tabular_data):
    """What the run's ranks trained on, id for id, is what any other build with its seed reads; another seed
    reads another order. A new driver builds the shards from scratch (test_epoch_order_... below)."""
    again, other_seed = _pipeline_order(tabular_data, seed=0), _pipeline_order(tabular_data, seed=1)
    for rank in (0, 1):  # epoch 2: see the restart test
        assert np.array_equal(_seen(recorded_run, 1, rank), again[1, rank])
    assert not np.array_equal(_seen(recorded_run, 1, 0), other_seed[1, 0])


@pytest.mark.ray
def test_a_run_resumed_with_fewer_workers_trains_exactly_the_rows_its_epoch_had_left(
    ray_address, tabular_data, tmp_path
):
    """2 workers checkpoint every CHECKPOINT_EVERY optimizer steps and rank 1's process dies in epoch 1 (no
    retries: the run fails); the same run started again with 1 worker resumes from the step-8 checkpoint and
    trains the rows of epoch 1 that the 2 ranks had not trained: over both attempts, each row once."""
    import dataclasses

    from raytrain_ddp import fit

    config = _recording_config(tabular_data, tmp_path, "resized", epochs=1, max_failures=0)
    interrupted = _fit_losing_rank_1(config, epoch=1)
    assert not interrupted.ok and interrupted.summary["epochs_completed"] == 0, interrupted.summary
    resumed = fit(dataclasses.replace(config, num_workers=1))
    assert resumed.ok, resumed.summary["error"]
    first_attempt = _pipeline_order(tabular_data, seed=0)
    steps_done = (DIES_AT - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY  # the latest checkpoint before the death
    trained_before = np.concatenate([first_attempt[1, rank][: steps_done * config.batch_size] for rank in (0, 1)])
    trained_after = _seen(resumed, 1, 0)
    both = np.concatenate([trained_before, trained_after])
    assert len(np.unique(both)) == len(both), "a row trained twice"
    epoch_rows = set(first_attempt[1, 0]) | set(first_attempt[1, 1])  # all but the last train_rows % 2
    assert set(both) == epoch_rows, f"{len(epoch_rows - set(both))} rows of the epoch never trained"


@pytest.mark.ray
def test_epoch_order_does_not_depend_on_what_ran_before(ray_address, tabular_data):
    """A run resumed at epoch 2 (a new driver: everything built again, epoch 1 never read)
    gets, rank by rank, the ids in the order the uninterrupted run got them."""
    config = _config(tabular_data)
    uninterrupted = _train_shards(config)
    for shard in uninterrupted:
        _epoch_ids(shard, config, 1)
    expected = [_epoch_ids(shard, config, 2) for shard in uninterrupted]
    resumed = [_epoch_ids(shard, config, 2) for shard in _train_shards(config)]
    for rank in (0, 1):
        assert np.array_equal(resumed[rank], expected[rank])
    assert not set(expected[0]) & set(expected[1])


def test_shuffle_window_depends_on_row_order_not_on_blocks():
    """Every row once, full batches but the last, and the same batches however the stream is cut into blocks
    (Ray Data's block sizes are not part of an epoch's order)."""
    from raytrain_ddp.data.order import window_shuffled

    rows = {"id": np.arange(1000), "x": np.arange(1000, dtype=np.float32)[:, None] * [1, 2], "y": np.arange(1000) % 10}

    def reader(cuts: list[int]):
        blocks = [{name: values[a:b] for name, values in rows.items()} for a, b in zip([0, *cuts], [*cuts, 1000])]
        pending = {name: values[:0] for name, values in rows.items()}

        def read(n: int) -> dict:  # what _TrainStream.read hands out: n rows, fewer at the end
            nonlocal pending
            while len(pending["id"]) < n and blocks:
                pending = {name: np.concatenate([pending[name], blocks[0][name]]) for name in rows}
                blocks.pop(0)
            taken, pending = (
                {name: v[:n] for name, v in pending.items()},
                {name: v[n:] for name, v in pending.items()},
            )
            return taken

        return read

    batches = list(window_shuffled(reader([100, 350, 999]), 64, 256, seed=7))
    assert [len(b["id"]) for b in batches] == [64] * 15 + [40]
    ids = np.concatenate([b["id"] for b in batches])
    assert sorted(ids) == list(range(1000)) and not np.array_equal(ids, np.arange(1000))
    assert all(np.array_equal(b["x"][:, 1], 2 * b["id"]) for b in batches)  # rows kept whole
    again = np.concatenate([b["id"] for b in window_shuffled(reader([1, 2, 500]), 64, 256, seed=7)])
    assert np.array_equal(ids, again)


def test_train_tasks_are_consecutive_pieces_of_about_task_bytes():
    """A stream's pieces (three epochs) go to Ray Data tasks in order, each once; a task stops at the first
    piece that brings it to TASK_BYTES of decoded rows (the last task may hold less)."""
    from raytrain_ddp.data.order import epoch_pieces
    from raytrain_ddp.data.pipeline import TASK_BYTES, _group_pieces, _task_rows
    from raytrain_ddp.data.spec import DataSpec

    images = DataSpec("image", (3, 32, 32), 10, 10_521, 0)  # uint8 pixels + 16 bytes of id and label a row
    task_rows = _task_rows(images)
    assert task_rows == TASK_BYTES // (3 * 32 * 32 + 16)
    assert _task_rows(DataSpec("tabular", (16,), 10, 10_521, 0)) == TASK_BYTES // (16 * 4 + 16)  # float32
    pieces = [(*piece, epoch) for epoch in (1, 2, 3) for piece in epoch_pieces([500] * 21 + [21], 0, epoch, 1, 2)]
    tasks = _group_pieces(pieces, task_rows)
    assert [piece for task in tasks for piece in task] == pieces and len(tasks) > 2
    rows = [[stop - start for _, start, stop, _ in task] for task in tasks]
    assert all(sum(task) >= task_rows for task in rows[:-1])
    assert all(sum(task[:-1]) < task_rows for task in rows)


@pytest.mark.parametrize("in_memory", [True, False], ids=["built-in", "streamed"])
def test_a_resized_epoch_goes_on_with_exactly_the_rows_not_yet_trained(in_memory):
    """An epoch begun by 4 ranks (5 optimizer steps), continued by 3 (4 steps), finished by 2: over the three
    parts every row of the epoch is trained once, but for the last split's remainder (as any epoch drops fewer
    rows than its world size): earlier splits' remainders are trained later. Each part's ranks read their
    pieces and shuffle them as TrainShard.host_batches does."""
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.data.order import (
        SHUFFLE_BUFFER_ROWS,
        epoch_pieces,
        rest_of_epoch_pieces,
        shuffle_seed,
        window_shuffled,
    )

    unit_rows = [100] * 30 + [37, 2]
    config, epoch = TrainConfig(batch_size=16, grad_accum=2, seed=5), 3
    starts = np.cumsum([0, *unit_rows])

    def trained_ids(pieces, rank, part, steps):
        ids = np.concatenate([np.arange(starts[unit] + a, starts[unit] + b) for unit, a, b in pieces])
        seed = shuffle_seed(config.seed, epoch, rank, part)
        if in_memory:
            order = ids[np.random.default_rng(seed).permutation(len(ids))]
        else:
            stream = iter(np.array_split(ids, np.arange(7, len(ids), 7)))  # a stream cut in blocks of 7 rows
            buffer = np.empty(0, int)

            def read(count):
                nonlocal buffer
                while len(buffer) < count and (block := next(stream, None)) is not None:
                    buffer = np.concatenate([buffer, block])
                taken, buffer = buffer[:count], buffer[count:]
                return {"y": taken}

            order = np.concatenate([b["y"] for b in window_shuffled(read, 16, SHUFFLE_BUFFER_ROWS, seed)])
        return order if steps is None else order[: steps * config.grad_accum * config.batch_size]

    # (world size, optimizer steps); the last part trains to the end. 3039 rows: the first split leaves 3 out
    parts = [(4, 5), (3, 4), (2, None)]
    trained = []
    for part, (world_size, steps) in enumerate(parts):
        earlier = tuple(parts[:part])
        untrained = sum(unit_rows) - sum(map(len, trained))  # at the part's start; its split drops untrained % W
        for rank in range(world_size):
            if part == 0:
                pieces = epoch_pieces(unit_rows, config.seed, epoch, rank, world_size)
            else:
                pieces = rest_of_epoch_pieces(unit_rows, config, epoch, rank, world_size, earlier, in_memory)
            trained.append(trained_ids(pieces, rank, part, steps))
    ids = np.concatenate(trained)
    assert len(np.unique(ids)) == len(ids)  # nothing twice
    left_over = set(range(sum(unit_rows))) - set(ids)
    assert len(left_over) == untrained % parts[-1][0]  # and nothing missed but the last split's remainder


def test_a_resize_with_another_seed_or_micro_batch_size_starts_the_epoch_over():
    """The earlier parts of a resized epoch are replayed with this run's seed, batch size and grad_accum: where
    the checkpoint's differ, the replay would pick the wrong rows, so the epoch starts over."""
    from support import one_process_group

    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.data.spec import synthetic_spec
    from raytrain_ddp.worker import strategy
    from raytrain_ddp.worker.args import UserCode
    from raytrain_ddp.worker.loop import RankTrainer

    with one_process_group():
        config = TrainConfig(model="mlp", dataset="synthetic-tabular", train_size=64, val_size=16, batch_size=4)
        trainer = RankTrainer(config, synthetic_spec(config), torch.device("cpu"), UserCode(), world_size=1)
        model_state, optimizer_state = strategy.full_state(trainer.model, trainer.optimizer)
        saved = {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": trainer.scheduler.state_dict(),
            "scaler": trainer.scaler.state_dict(),
            "world_size": 2,
            "epoch": 0,
            "step_in_epoch": 3,
            "global_step": 3,
            "config": config.to_dict(),
        }
        assert trainer.restore(saved, resizable=True).earlier_parts == ((2, 3),)  # the same order: goes on
        for change in ({"seed": 1}, {"batch_size": 8}, {"grad_accum": 2}):
            changed = {**saved, "config": {**config.to_dict(), **change}}
            assert trainer.restore(changed, resizable=True).earlier_parts == (), change


@pytest.mark.ray
def test_the_quick_paths_shards_are_the_full_paths_rows_in_the_same_order(ray_address, tabular_data):
    """--quick-start's ranks read their own shards (driver/quick.py): Parquet (row groups read with pyarrow in the
    rank) and the built-in rows (generated in the rank). Every rank's train batches of each epoch and its val
    batches are the Ray Data path's, row for row."""
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.data.pipeline import ShardingDataConfig, build_datasets, local_sources
    from raytrain_ddp.data.spec import plan_data

    parquet = _config(tabular_data)
    built_in = TrainConfig(num_workers=2, epochs=2, train_size=1500, val_size=700)
    for config in (parquet, built_in):
        plan = plan_data(config)
        full = ShardingDataConfig().configure(build_datasets(config, plan), 2, None, None)
        for rank in (0, 1):
            local_train, local_val = local_sources(config, plan).rank_inputs(rank, 2)
            for epoch in (1, 2):
                ours = list(local_train.host_batches(config, epoch))
                theirs = list(full[rank]["train"].host_batches(config, epoch))
                _same_batches(ours, theirs)
            (ours, most), (theirs, their_most) = local_val.batches(64), full[rank]["val"].batches(64)
            assert most == their_most
            _same_batches(list(ours), list(theirs))


def _same_batches(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for mine, their in zip(ours, theirs):
        assert set(mine) == set(their)
        for name in mine:
            assert torch.equal(mine[name], their[name]), name


def _image_folder(root: Path, per_class: int = 60) -> Path:
    """4 classes of 16x16 PNGs, each class its own dominant colour under noise."""
    rng = np.random.default_rng(0)
    colours = np.array([[200, 40, 40], [40, 200, 40], [40, 40, 200], [200, 200, 40]])
    for label, colour in enumerate(colours):
        (root / f"class_{label}").mkdir(parents=True)
        for i in range(per_class):
            pixels = np.clip(colour + rng.normal(0, 60, (16, 16, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / f"class_{label}" / f"{i:03d}.png")
    return root


@pytest.mark.ray
def test_imagefolder_to_parquet_to_training(ray_address, tmp_path):
    images = _image_folder(tmp_path / "images")
    out = tmp_path / "ds"
    prepared = run_cli(
        "raytrain_ddp.data",
        "prepare",
        "--from",
        "imagefolder",
        str(images),
        "--out",
        str(out),
        "--val-fraction",
        "0.25",
        timeout=120,
    )
    assert prepared.returncode == 0, prepared.stderr
    inspected = run_cli("raytrain_ddp.data", "inspect", str(out), timeout=60)
    assert inspected.returncode == 0 and "class_3" in inspected.stdout
    # Training and scoring in this process (their CLIs are test_train.py's), training on the quick path's local
    # processes, which read the PNG rows as Ray Data's tasks do (test_quick_start compares their rows)
    import dataclasses

    from raytrain_ddp import TrainConfig, fit
    from raytrain_ddp.evaluate import evaluate_checkpoint

    config = TrainConfig(
        num_workers=2,
        data=str(out),
        epochs=3,
        batch_size=16,
        report=False,
        tensorboard=False,
        storage_path=str(tmp_path / "runs"),
        name="folder",
    )
    trained = fit(dataclasses.replace(config, quick_start=True))
    assert trained.ok, trained.summary["error"]
    summary = json.loads((tmp_path / "runs" / "folder" / "summary.json").read_text())
    assert summary["final_metrics"]["val_rows"] == 60
    assert summary["final_metrics"]["val_accuracy"] >= 0.6  # chance is 0.25
    scored = evaluate_checkpoint(summary["best_checkpoint"])
    assert abs(scored["val_accuracy"] - summary["best_metrics"]["val_accuracy"]) <= 1 / 60
    # Validation images cross the object store as uint8 too (a quarter of the bytes), normalised where used:
    # the score above matches evaluate's, which normalises on the host
    from raytrain_ddp.data.pipeline import ShardingDataConfig, build_datasets
    from raytrain_ddp.data.spec import plan_data

    datasets = build_datasets(config, plan_data(config))
    shards = ShardingDataConfig().configure(
        {"val": datasets["val"]}, world_size=2, worker_handles=None, worker_node_ids=None
    )
    batches, most = shards[1]["val"].batches(16)
    assert next(iter(batches))["x"].dtype == torch.uint8
    assert most == 2  # 30 rows per rank, 16 a batch: what FSDP's lockstep pads to, known before reading


# ------------------------------------------------------------------ bad data
def _bad_data(tmp_path: Path, case: str, tabular: Path) -> list[str]:
    """Flags pointing at one kind of broken data."""
    target = tmp_path / case
    target.mkdir()
    good_train = sorted((tabular / "train").glob("*.parquet"))
    if case == "missing":
        return ["--data", str(tmp_path / "nowhere")]
    if case == "empty":
        return ["--data", str(target)]
    if case == "not-parquet":
        (target / "part-0.parquet").write_text("id,label\n1,2\n")
        return ["--train-data", str(target / "part-0.parquet"), "--val-data", str(target / "part-0.parquet")]
    if case == "truncated":
        data = good_train[0].read_bytes()
        (target / "part-0.parquet").write_bytes(data[: len(data) // 2])
        return [
            "--train-data",
            str(target / "part-0.parquet"),
            "--val-data",
            str(good_train[1]),
            "--feature-columns",
            FEATURES,
            "--model",
            "mlp",
        ]
    if case == "missing-column":
        return ["--data", str(tabular), "--feature-columns", FEATURES, "--label-column", "target", "--model", "mlp"]
    if case == "string-labels":
        pq.write_table(pa.table({"f0": [0.1, 0.2], "label": ["cat", "dog"]}), target / "part-0.parquet")
        return [
            "--train-data",
            str(target / "part-0.parquet"),
            "--val-data",
            str(target / "part-0.parquet"),
            "--feature-columns",
            "f0",
            "--model",
            "mlp",
        ]
    if case == "model-mismatch":
        return ["--data", str(tabular), "--feature-columns", FEATURES, "--model", "cnn"]
    raise ValueError(case)


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("empty", "no .parquet files"),
        ("not-parquet", "not a Parquet file"),
        ("truncated", "part-0.parquet"),
        ("missing-column", "'target'"),
        ("string-labels", "integer"),
        ("model-mismatch", "--model cnn takes image data, but the data holds tabular"),
    ],
)
def test_bad_data_fails_before_anything_starts(tmp_path, tabular_data, case, message, caplog):
    """Each kind of bad data, through fit() in this process (no interpreter start-up per case); the CLI's side,
    one `error:` line and exit code 2, is the test below."""
    from raytrain_ddp import fit
    from raytrain_ddp.errors import ConfigError
    from raytrain_ddp.run import config_from_args

    storage = tmp_path / "runs"
    config = config_from_args(
        [*_bad_data(tmp_path, case, tabular_data), "--storage-path", str(storage), "--name", "bad"]
    )
    with caplog.at_level(logging.INFO), pytest.raises(ConfigError) as refused:
        fit(config)
    assert "\n" not in str(refused.value) and message in str(refused.value), refused.value
    assert not caplog.records, caplog.text  # nothing else said: on the CLI that one line is all of stderr
    assert not (storage / "bad").exists()  # nothing written to the run directory


def test_bad_data_on_the_cli_is_one_line_exit_2(tmp_path, tabular_data):
    storage = tmp_path / "runs"
    result = run_cli(
        "raytrain_ddp.run",
        *_bad_data(tmp_path, "truncated", tabular_data),
        "--storage-path",
        str(storage),
        "--name",
        "bad",
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "part-0.parquet" in lines[0], result.stderr
    assert not (storage / "bad").exists()
