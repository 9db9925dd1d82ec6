"""Sharded checkpoints without Ray: two gloo processes write an FSDP model's shards in the background; one
process loads them (DCP reshards), `consolidate` makes them one full file; damaged ones are named."""

from __future__ import annotations

import copy
import multiprocessing
import shutil
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

    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.models import TransformerLM
    from raytrain_ddp.worker import checkpoint as ckpt
    from raytrain_ddp.worker import strategy

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    config = TrainConfig(strategy="fsdp", model="transformer", dataset="synthetic-tokens")
    torch.manual_seed(0)
    model, _ = strategy.distribute(TransformerLM(VOCAB, LENGTH, dim=32, depth=2), config, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    reported: list[str] = []
    saver = ckpt.ShardedSaver(run_dir, rank, report=lambda metrics, directory: reported.append(str(directory)))

    def step() -> None:
        model(torch.randint(0, VOCAB, (4, LENGTH), generator=torch.Generator().manual_seed(rank))).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    if load_from:
        strategy.load_sharded_state(model, optimizer, str(Path(load_from) / ckpt.SHARDS_DIR), saver.group)
        full = strategy.full_state(model, optimizer)
    else:
        step(), step()
        full = copy.deepcopy(strategy.full_state(model, optimizer))  # its CPU tensors (AdamW's step) are live
        spec = {"kind": "tokens", "input_shape": [LENGTH], "num_classes": VOCAB, "train_rows": 64, "val_rows": 16}
        run_info = {"config": config.to_dict(), "data_spec": spec}
        plain = ckpt.plain_state(
            {"scheduler": {}, "scaler": {}, "world_size": world}, ckpt.Position(1, 0, 2), {}, run_info
        )
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


def test_sharded_checkpoint_written_by_two_ranks_loads_on_one_and_consolidates(tmp_path):
    from torch.distributed.checkpoint.api import CheckpointException

    from raytrain_ddp.driver.run_checkpoints import read_verified
    from raytrain_ddp.worker.checkpoint import consolidate

    (tmp_path / "run").mkdir()
    saved = _spawn(2, tmp_path, "save")
    [directory] = saved["reported"]  # one checkpoint, which both ranks wrote into
    checkpoint = Path(directory)
    shards = sorted(path.name for path in (checkpoint / "shards").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (checkpoint / "checkpoint.pt").exists()  # nothing gathered on one rank
    state, why = read_verified(checkpoint)
    assert why is None and state["format"] == "sharded" and state["global_step"] == 2

    # Its model's tensors are read from DCP's index: a model of other shapes is refused in one line, unloaded
    from raytrain_ddp.driver.run_checkpoints import check_fits_model
    from raytrain_ddp.errors import ConfigError
    from raytrain_ddp.models import TransformerLM

    def shapes(depth: int) -> dict:
        return {
            name: tuple(value.shape)
            for name, value in TransformerLM(VOCAB, LENGTH, dim=32, depth=depth).state_dict().items()
        }

    check_fits_model(checkpoint, state, shapes(depth=2), "it", "")  # the model it was trained with
    with pytest.raises(
        ConfigError,
        match=r"^it holds another model than this run's \(it lacks blocks\.2\.attn_norm\.weight, "
        r"blocks\.2\.attn_norm\.bias, blocks\.2\.attn\.qkv\.weight and 9 more\); build that one$",
    ):
        check_fits_model(checkpoint, state, shapes(depth=3), "it", "build that one")

    # One process loads the two ranks' shards: the same weights and AdamW moments as were saved
    loaded = _spawn(1, tmp_path, "load", load_from=directory)
    _assert_same_state(loaded["full"], saved["full"])

    # consolidate: one full checkpoint.pt, the same state, that a plain torch.load reads
    done = run_cli("raytrain_ddp.checkpoint", "consolidate", directory, str(tmp_path / "full"))
    assert done.returncode == 0, done.stderr
    full = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=True)
    _assert_same_state((full["model"], full["optimizer"]), saved["full"])
    assert full["global_step"] == 2 and "format" not in full
    assert read_verified(tmp_path / "full")[1] is None
    assert (
        done.stdout.strip()
        == f"wrote {tmp_path / 'full' / 'checkpoint.pt'} (OUT {tmp_path / 'full'} is a new directory)"
    )
    # an OUT named as a file (.pt, .pth) is that file, not a directory of that name
    as_file = run_cli("raytrain_ddp", "checkpoint", "consolidate", directory, str(tmp_path / "full.pt"))
    assert as_file.returncode == 0 and as_file.stdout.strip() == f"wrote {tmp_path / 'full.pt'}", as_file.stderr
    assert (tmp_path / "full.pt").is_file()
    assert torch.load(tmp_path / "full.pt", weights_only=True)["global_step"] == 2

    # a target that exists: one line, exit 2, untouched
    before = (tmp_path / "full" / "checkpoint.pt").read_bytes()
    again = run_cli("raytrain_ddp", "checkpoint", "consolidate", directory, str(tmp_path / "full"))
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "already exists" in again.stderr
    assert (tmp_path / "full" / "checkpoint.pt").read_bytes() == before
    # a full checkpoint is no sharded one
    not_sharded = run_cli("raytrain_ddp.checkpoint", "consolidate", str(tmp_path / "full"), str(tmp_path / "x"))
    assert not_sharded.returncode == 2 and "not a sharded checkpoint" in not_sharded.stderr

    # --resume-from takes a sharded checkpoint too, and refuses one made for another model in one line
    other = run_cli("raytrain_ddp.run", "--storage-path", str(tmp_path / "runs"), "--resume-from", directory)
    assert other.returncode == 2 and other.stderr.count("\n") == 1, other.stderr
    assert "was made for model transformer on inputs (16,) with 64 classes; this run is model cnn" in other.stderr

    # a truncated shard, a missing one: named, and consolidate refuses (exit 2, one line, nothing written)
    truncated = tmp_path / "truncated"
    shutil.copytree(checkpoint, truncated)
    shard = truncated / "shards" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    assert "shard shards/__1_0.distcp is truncated" in read_verified(truncated)[1]
    refused = run_cli("raytrain_ddp.checkpoint", "consolidate", str(truncated), str(tmp_path / "y"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "truncated" in refused.stderr
    assert not (tmp_path / "y").exists()
    with pytest.raises(CheckpointException):  # past the checks, DCP's read fails: no half-made OUT blocks a retry
        consolidate(truncated, tmp_path / "y")
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith((".y", "y"))) == []
    resumed = run_cli("raytrain_ddp.run", "--storage-path", str(tmp_path / "runs"), "--resume-from", str(truncated))
    assert resumed.returncode == 2 and "is not a usable checkpoint: shard shards/__1_0.distcp is truncated" in (
        resumed.stderr
    )
    shard.unlink()
    assert read_verified(truncated)[1] == "shard shards/__1_0.distcp is missing"
    (truncated / "shards" / ".metadata").unlink()
    assert "shards/.metadata does not load" in read_verified(truncated)[1]
    # evaluate refuses a damaged one the same way
    scored = run_cli("raytrain_ddp.evaluate", str(truncated), "--device", "cpu")
    assert scored.returncode == 2 and scored.stderr.count("\n") == 1, scored.stderr


def test_waiting_for_a_sharded_write_tells_the_bytes_written(tmp_path):
    """flush() waits for DCP's background write; meanwhile it tells `progress` what the shard files hold (the
    heartbeat's "writing checkpoint" phase), so the watchdog sees a long write move and a stalled one stand
    still. The write here is a thread filling a real shard file, 1 MiB every 0.3 s, then the future's result."""
    from support import one_process_group

    from raytrain_ddp.driver.liveness import describe_phase
    from raytrain_ddp.worker import checkpoint as ckpt

    directory = tmp_path / "checkpoint_2026-12-02_10-00-00.000000"
    (directory / ckpt.SHARDS_DIR).mkdir(parents=True)
    written: Future = Future()

    def write() -> None:
        with open(directory / ckpt.SHARDS_DIR / "__0_0.distcp", "wb") as shard:
            for _ in range(8):
                shard.write(b"\0" * 2**20)
                shard.flush()
                time.sleep(0.3)
        written.set_result(None)

    reported, told = [], []
    with one_process_group():
        saver = ckpt.ShardedSaver(tmp_path, 0, report=lambda metrics, where: reported.append(where))
        saver.progress = told.append
        saver.pending = ckpt._Pending(written, directory, {"epoch": 1}, "the checkpoint of epoch 1")
        threading.Thread(target=write, daemon=True).start()
        saver.flush()
    assert reported == [directory] and not saver.in_flight
    assert len(told) >= 3 and told == sorted(told) and 0 < told[0] < told[-1] <= 8 * 2**20, told
    assert describe_phase({"phase": "writing checkpoint", "phase_done": 3 * 2**20}) == (
        "writing checkpoint (3.0 MiB of shards written)"
    )
