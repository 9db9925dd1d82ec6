"""Sharded checkpoints without Ray: two gloo processes write an FSDP model's shards in the background; one
process loads them (DCP reshards), `consolidate` makes them one full file; damaged ones are named."""

from __future__ import annotations

import copy
import multiprocessing
import shutil
import subprocess
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from support import run_cli

VOCAB, LENGTH = 64, 16


def _rank(rank: int, world: int, store: str, run_dir: str, load_from: str | None, out: str) -> None:
    """Train 2 AdamW steps and save sharded (then train on while it is written), or load `load_from`;
    rank zero writes the full state (gathered) it saved or loaded, and what was reported."""
    import torch.distributed as dist

    from raytrain_ddp.checkpoint.layout import SHARDS_DIR
    from raytrain_ddp.checkpoint.saver import ShardedSaver
    from raytrain_ddp.checkpoint.state import Position, plain_state
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.models import TransformerLM
    from raytrain_ddp.worker import strategy

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    config = TrainConfig(strategy="fsdp", model="transformer", dataset="synthetic-tokens")
    torch.manual_seed(0)
    model, _ = strategy.distribute(TransformerLM(VOCAB, LENGTH, dim=32, depth=2), config, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    reported: list[str] = []
    saver = ShardedSaver(run_dir, rank, report=lambda metrics, directory: reported.append(str(directory)))

    def step() -> None:
        model(torch.randint(0, VOCAB, (4, LENGTH), generator=torch.Generator().manual_seed(rank))).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    if load_from:
        strategy.load_sharded_state(model, optimizer, str(Path(load_from) / SHARDS_DIR), saver.group)
        full = strategy.full_state(model, optimizer)
    else:
        step(), step()
        full = copy.deepcopy(strategy.full_state(model, optimizer))  # its CPU tensors (AdamW's step) are live
        spec = {"kind": "tokens", "input_shape": [LENGTH], "num_classes": VOCAB, "train_rows": 64, "val_rows": 16}
        run_info = {"config": config.to_dict(), "data_spec": spec}
        plain = plain_state({"scheduler": {}, "scaler": {}, "world_size": world}, Position(1, 0, 2), {}, run_info)
        saver.save(*strategy.sharded_state(model, optimizer), plain, {"epoch": 1})
        step()  # training goes on while the shards are written
        assert not reported  # counted only once written everywhere
        saver.flush()
    if rank == 0:
        torch.save({"full": full, "reported": reported}, out)
    dist.destroy_process_group()


def _spawn(world: int, tmp_path: Path, tag: str, load_from: str | None = None) -> dict:
    context = multiprocessing.get_context("spawn")
    out = tmp_path / f"{tag}.pt"
    args = (str(tmp_path / f"store-{tag}"), str(tmp_path / "run"), load_from, str(out))
    ranks = [context.Process(target=_rank, args=(rank, world, *args)) for rank in range(world)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=300)
        assert process.exitcode == 0
    return torch.load(out, weights_only=True)


def _assert_same_state(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    (got_model, got_optim), (want_model, want_optim) = got, want
    assert got_model.keys() == want_model.keys()
    assert all(torch.equal(got_model[key], want_model[key]) for key in want_model)
    assert got_optim["state"].keys() == want_optim["state"].keys()
    for key, moments in want_optim["state"].items():
        assert all(torch.equal(got_optim["state"][key][name], value) for name, value in moments.items())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> tuple[Path, dict]:
    """Two ranks' sharded checkpoint after 2 AdamW steps, and the full state they saved (gathered on rank 0)."""
    tmp_path = tmp_path_factory.mktemp("sharded")
    (tmp_path / "run").mkdir()
    saved = _spawn(2, tmp_path, "save")
    [directory] = saved["reported"]  # one checkpoint, which both ranks wrote into
    return Path(directory), saved


@pytest.fixture
def damaged(sharded, tmp_path) -> Path:
    """A copy of the sharded checkpoint whose rank 1 shard is cut to 100 bytes."""
    truncated = tmp_path / "truncated"
    shutil.copytree(sharded[0], truncated)
    shard = truncated / "shards" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    return truncated


def test_each_rank_writes_its_own_shard_and_nothing_is_gathered_on_one(sharded):
    from raytrain_ddp.checkpoint.verify import read_verified

    checkpoint, _ = sharded
    assert sorted(path.name for path in (checkpoint / "shards").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert not (checkpoint / "checkpoint.pt").exists()
    state, why = read_verified(checkpoint)
    assert why is None and state["format"] == "sharded" and state["global_step"] == 2


def test_a_model_of_other_shapes_is_refused_in_one_line_from_the_index_alone(sharded):
    """The checkpoint's tensors are read from DCP's index: nothing is loaded to refuse it."""
    from raytrain_ddp.checkpoint.verify import check_fits_model, read_verified
    from raytrain_ddp.errors import ConfigError
    from raytrain_ddp.models import TransformerLM

    def shapes(depth: int) -> dict:
        model = TransformerLM(VOCAB, LENGTH, dim=32, depth=depth)
        return {name: tuple(value.shape) for name, value in model.state_dict().items()}

    checkpoint, _ = sharded
    state, _ = read_verified(checkpoint)
    check_fits_model(checkpoint, state, shapes(depth=2), "it", "")  # the model it was trained with
    with pytest.raises(
        ConfigError,
        match=r"^it holds another model than this run's \(it lacks blocks\.2\.attn_norm\.weight, "
        r"blocks\.2\.attn_norm\.bias, blocks\.2\.attn\.qkv\.weight and 9 more\); build that one$",
    ):
        check_fits_model(checkpoint, state, shapes(depth=3), "it", "build that one")


def test_one_process_loads_two_ranks_shards_to_the_same_weights_and_moments(sharded, tmp_path):
    checkpoint, saved = sharded
    loaded = _spawn(1, tmp_path, "load", load_from=str(checkpoint))
    _assert_same_state(loaded["full"], saved["full"])


@pytest.fixture(scope="module")
def consolidated(sharded, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`checkpoint consolidate` of the sharded checkpoint into a new directory, run once for the tests that read
    it: (that directory, the command's result)."""
    out = tmp_path_factory.mktemp("consolidated") / "full"
    return out, run_cli("raytrain_ddp.checkpoint", "consolidate", str(sharded[0]), str(out))


def test_consolidate_writes_one_full_checkpoint_a_plain_torch_load_reads(sharded, consolidated):
    from raytrain_ddp.checkpoint.verify import read_verified

    (_, saved), (out, done) = sharded, consolidated
    assert done.returncode == 0, done.stderr
    full = torch.load(out / "checkpoint.pt", weights_only=True)
    _assert_same_state((full["model"], full["optimizer"]), saved["full"])
    assert full["global_step"] == 2 and "format" not in full
    assert read_verified(out)[1] is None
    assert done.stdout.strip() == f"wrote {out / 'checkpoint.pt'} (OUT {out} is a new directory)"


def test_consolidate_to_a_name_ending_in_pt_writes_that_file(sharded, tmp_path):
    checkpoint, _ = sharded
    as_file = run_cli("raytrain_ddp", "checkpoint", "consolidate", str(checkpoint), str(tmp_path / "full.pt"))
    assert as_file.returncode == 0 and as_file.stdout.strip() == f"wrote {tmp_path / 'full.pt'}", as_file.stderr
    assert torch.load(tmp_path / "full.pt", weights_only=True)["global_step"] == 2


def test_consolidate_leaves_a_target_that_exists_untouched_in_one_line(sharded, tmp_path):
    checkpoint, _ = sharded
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "checkpoint.pt").write_bytes(b"earlier")
    again = run_cli("raytrain_ddp", "checkpoint", "consolidate", str(checkpoint), str(tmp_path / "full"))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "already exists" in again.stderr
    assert (tmp_path / "full" / "checkpoint.pt").read_bytes() == b"earlier"


def test_consolidate_refuses_a_full_checkpoint(consolidated, tmp_path):
    full, done = consolidated
    assert done.returncode == 0, done.stderr
    not_sharded = run_cli("raytrain_ddp.checkpoint", "consolidate", str(full), str(tmp_path / "x"))
    assert not_sharded.returncode == 2 and "not a sharded checkpoint" in not_sharded.stderr


def test_resume_from_a_sharded_checkpoint_of_another_model_is_refused_in_one_line(sharded, tmp_path):
    checkpoint, _ = sharded
    other = run_cli("raytrain_ddp.run", "--storage-path", str(tmp_path / "runs"), "--resume-from", str(checkpoint))
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert "was made for model transformer on inputs (16,) with 64 classes; this run is model cnn" in other.stderr


def test_a_truncated_shard_is_named_and_consolidate_writes_nothing(damaged, tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from raytrain_ddp.checkpoint.consolidate import consolidate
    from raytrain_ddp.checkpoint.verify import read_verified

    assert "shard shards/__1_0.distcp is truncated" in read_verified(damaged)[1]
    refused = run_cli("raytrain_ddp.checkpoint", "consolidate", str(damaged), str(tmp_path / "y"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "truncated" in refused.stderr
    assert not (tmp_path / "y").exists()
    with pytest.raises(CheckpointException):  # past the checks, DCP's read fails: no half-made OUT blocks a retry
        consolidate(damaged, tmp_path / "y")
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith((".y", "y"))) == []


def test_resume_from_and_evaluate_refuse_a_truncated_shard_in_one_line(damaged, tmp_path):
    resumed = run_cli("raytrain_ddp.run", "--storage-path", str(tmp_path / "runs"), "--resume-from", str(damaged))
    assert resumed.returncode == 2 and resumed.stderr.count("\n") == 1, resumed.stderr
    assert "is not a usable checkpoint: shard shards/__1_0.distcp is truncated" in resumed.stderr
    scored = run_cli("raytrain_ddp.evaluate", str(damaged), "--device", "cpu")
    assert scored.returncode == 2 and scored.stderr.count("\n") == 1, scored.stderr


def test_a_missing_shard_and_an_index_that_does_not_load_are_named(damaged):
    from raytrain_ddp.checkpoint.verify import read_verified

    (damaged / "shards" / "__1_0.distcp").unlink()
    assert read_verified(damaged)[1] == "shard shards/__1_0.distcp is missing"
    (damaged / "shards" / ".metadata").unlink()
    assert "shards/.metadata does not load" in read_verified(damaged)[1]


def test_waiting_for_a_sharded_write_tells_the_bytes_written(tmp_path):
    """flush() waits for DCP's background write; meanwhile it tells `progress` what the shard files hold (the
    heartbeat's "writing checkpoint" phase), so the watchdog sees a long write move and a stalled one stand
    still. The write here is a thread filling a real shard file, 1 MiB every 0.3 s, then the future's result."""
    from support import one_process_group

    from raytrain_ddp.checkpoint.layout import SHARDS_DIR
    from raytrain_ddp.checkpoint.saver import ShardedSaver, _Pending
    from raytrain_ddp.driver.liveness import describe_phase

    directory = tmp_path / "checkpoint_2026-12-02_10-00-00.000000"
    (directory / SHARDS_DIR).mkdir(parents=True)
    written: Future = Future()

    def write() -> None:
        with open(directory / SHARDS_DIR / "__0_0.distcp", "wb") as shard:
            for _ in range(8):
                shard.write(b"\0" * 2**20)
                shard.flush()
                time.sleep(0.3)
        written.set_result(None)

    reported, told = [], []
    with one_process_group():
        saver = ShardedSaver(tmp_path, 0, report=lambda metrics, where: reported.append(where))
        saver.progress = told.append
        saver.pending = _Pending(written, directory, {"epoch": 1}, "the checkpoint of epoch 1")
        threading.Thread(target=write, daemon=True).start()
        saver.flush()
    assert reported == [directory] and not saver.in_flight
    assert len(told) >= 3 and told == sorted(told) and 0 < told[0] < told[-1] <= 8 * 2**20, told
    assert describe_phase({"phase": "writing checkpoint", "phase_done": 3 * 2**20}) == (
        "writing checkpoint (3.0 MiB of shards written)"
    )
