"""Beyond plain DDP, on 2 CPU workers: precision, accumulation, schedules, compile (FSDP: test_object_storage and
test_flag_matrix).

Every run here is a real `fit()` with real gloo collectives, on the quick path's local processes (`--quick-start`):
the rules are the loop's, the same code under Ray Train's workers (Ray's part: test_train, test_data_train).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from raytrain_ddp import TrainConfig
from raytrain_ddp.worker.schedule import lr_factor, make_scheduler, optimizer_steps_per_epoch, resume_schedule


def _config(tmp_path: Path, name: str, **overrides) -> TrainConfig:
    # the loop's rules: the quick path's local processes (Ray's part of a run is tested where it is the rule)
    values = dict(num_workers=2, epochs=1, storage_path=str(tmp_path), name=name, report=False, tensorboard=False)
    values["quick_start"] = True
    return TrainConfig(**{**values, **overrides})


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ schedules (pure functions)
def test_warmup_then_cosine_step_and_constant_schedules():
    # 10 warm-up steps of 110: 0.1, 0.2, ... 1.0, then the schedule over the remaining 100.
    assert [lr_factor(s, 110, 10, "cosine") for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_factor(10, 110, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(60, 110, 10, "cosine") == pytest.approx(0.5)  # half-way: cos(pi/2)
    assert lr_factor(110, 110, 10, "cosine") == pytest.approx(0.0)
    assert [lr_factor(s, 110, 10, "step") for s in (59, 60, 84, 85)] == pytest.approx([1, 0.1, 0.1, 0.01])
    assert lr_factor(100, 110, 10, "constant") == 1.0
    assert lr_factor(0, 100, 0, "constant") == 1.0  # no warm-up: the full rate from the first step


def test_linear_scaling_and_steps_per_epoch():
    config = TrainConfig(lr=0.1, num_workers=4, grad_accum=2, batch_size=32, scale_lr=True)
    assert config.global_batch_size == 256
    assert config.lr_for(4) == pytest.approx(0.8) and config.lr_for(1) == pytest.approx(0.2)  # elastic: 1 left
    assert TrainConfig(lr=0.1, num_workers=4, scale_lr=False).lr_for(4) == 0.1
    # 1000 rows on a rank, batches of 32: 32 micro-batches (the last partial), 16 optimizer steps.
    assert optimizer_steps_per_epoch(1000, config) == 16


def test_a_schedule_resumed_at_another_world_size_follows_it():
    """Elastic: a checkpoint from 2 workers (cosine, --scale-lr) resumed on 1 continues at the same point of the
    schedule, in the new world size's steps, with the rate for 1 worker; the next step goes on from there."""
    config = TrainConfig(lr=0.1, epochs=4, lr_schedule="cosine", warmup_epochs=1, scale_lr=True)
    two = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=config.lr_for(2), momentum=0.9)
    two_schedule = make_scheduler(two, config, epoch_steps=8)
    for _ in range(2 * 8):  # two epochs of 8 steps on 2 workers
        two.step()
        two_schedule.step()
    one = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=config.lr_for(1), momentum=0.9)
    one_schedule = make_scheduler(one, config, epoch_steps=16)
    one.load_state_dict(two.state_dict())
    one_schedule.load_state_dict(two_schedule.state_dict())
    assert one.param_groups[0]["lr"] == pytest.approx(0.2 * lr_factor(16, 32, 8, "cosine"))  # as saved: 2 workers
    resume_schedule(one_schedule, config.lr_for(1), 2 * 16)
    half_way = 0.1 * lr_factor(32, 64, 16, "cosine")  # epoch 2 of 4 done, counted in 1 worker's 16 steps
    assert (
        one.param_groups[0]["lr"] == pytest.approx(half_way) == pytest.approx(0.1 * 0.5 * (1 + math.cos(math.pi / 3)))
    )
    assert one_schedule.get_last_lr() == pytest.approx([half_way])
    one.step()
    one_schedule.step()
    assert one.param_groups[0]["lr"] == pytest.approx(0.1 * lr_factor(33, 64, 16, "cosine"))


# ------------------------------------------------------------------ gradient accumulation
def test_gradient_accumulation_is_exact_and_all_reduces_once_per_step_and_a_compiled_model_trains(tmp_path):
    """2 micro-batches of 32 == 1 batch of 64, to float tolerance; one gradient all-reduce per optimizer step.
    The batch-of-64 run is compiled (torch.compile under DDP): it trains to the same weights."""
    from raytrain_ddp import fit
    from raytrain_ddp.checkpoint.layout import load_file

    common = dict(model="mlp", dataset="synthetic-tabular", train_size=1024, val_size=256, lr=0.05)
    accumulated = fit(_config(tmp_path, "accum", batch_size=32, grad_accum=2, **common))
    whole = fit(_config(tmp_path, "whole", batch_size=64, grad_accum=1, compile=True, **common))
    assert accumulated.ok and whole.ok, (accumulated.summary["error"], whole.summary["error"])
    assert whole.final_metrics["val_accuracy"] > 0.5 and whole.summary["replicas_identical"]

    record = accumulated.epochs[0]
    assert record["micro_batches_per_rank"] == [16, 16]  # micro-batches: 512 rows per rank / 32
    assert record["optimizer_steps_per_rank"] == [8, 8]
    # The MLP's gradients fit one DDP bucket: one all-reduce per synchronising backward.
    assert record["grad_allreduces_per_rank"] == [8, 8]
    assert whole.epochs[0]["grad_allreduces_per_rank"] == [8, 8]

    a = load_file(accumulated.best_checkpoint)
    b = load_file(whole.best_checkpoint)
    assert a["global_step"] == b["global_step"] == 8
    a, b = a["model"], b["model"]
    for name in b:
        assert torch.allclose(a[name], b[name], atol=1e-5, rtol=1e-4), name
    assert accumulated.final_metrics["val_loss"] == pytest.approx(whole.final_metrics["val_loss"], rel=1e-4)


# FSDP end to end (the transformer, its sharded checkpoints resharded and consolidated): test_object_storage,
# whose run directory is in a bucket


# ------------------------------------------------------------------ precision and schedules, end to end
def test_fp16_with_grad_scaler_warmup_and_step_schedule(tmp_path):
    from raytrain_ddp import fit

    # the MLP: fp16 kernels are emulated on this CPU, a CNN's take minutes (the CNN with fp16 and channels-last:
    # tests/test_flag_matrix.py)
    config = _config(
        tmp_path,
        "fp16",
        model="mlp",
        dataset="synthetic-tabular",
        precision="fp16",
        epochs=2,
        train_size=1024,
        val_size=256,
        batch_size=32,
        lr=0.01,
        scale_lr=True,
        warmup_epochs=1,
        lr_schedule="step",
        clip_grad_norm=5.0,
    )
    result = fit(config)
    assert result.ok, result.summary["error"]
    assert all(math.isfinite(r["train_loss"]) for r in result.epochs)
    assert result.final_metrics["val_accuracy"] > 0.3  # chance is 0.1
    # lr 0.01 x 2 workers = 0.02; 512 rows per rank / 32 = 16 steps per epoch; epoch 1 warms up
    # to the full 0.02; epoch 2 is the step schedule's whole span, ending after both decays.
    assert [r["lr"] for r in result.epochs] == pytest.approx([0.02, 0.0002])


def test_model_flops_are_three_forwards_and_change_nothing():
    """An MLP's forward is 2 FLOPs per weight (a multiply and an add); training counts 3 forwards."""
    from raytrain_ddp.models import MLP
    from raytrain_ddp.worker.flops import peak_tflops, training_flops_per_sample

    model = MLP(20, 4)
    before = [p.detach().clone() for p in model.parameters()]
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert training_flops_per_sample(model, torch.zeros(1, 20)) == 6 * weights
    assert model.training and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert peak_tflops(torch.device("cpu"), None) is None and peak_tflops(torch.device("cpu"), 3.5) == 3.5


def test_model_flops_of_a_model_that_cannot_run_on_meta_tensors_come_from_a_real_forward():
    """A plug-in whose forward reads a value (`.item()`, which a meta tensor has not) still gets its count."""
    from raytrain_ddp.worker.flops import training_flops_per_sample

    class ReadsAValue(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(20, 4)

        def forward(self, x):
            return self.linear(x) * (2.0 if x.abs().max().item() > 1 else 1.0)

    model = ReadsAValue()
    assert training_flops_per_sample(model, torch.zeros(1, 20)) == 6 * 20 * 4
    assert model.training and all(p.grad is None for p in model.parameters())


def test_model_flops_count_attention():
    """The built-in language model's count is its matmuls, 2 FLOPs per weight per token, plus attention's two
    (S x d) by (d x S) products per block, 2 * S * S * d FLOPs each, times 3: on CPU too, whose fused attention
    kernel the counter does not see."""
    from raytrain_ddp.models import TransformerLM
    from raytrain_ddp.worker.flops import training_flops_per_sample

    length, dim, depth = 64, 128, 4
    model = TransformerLM(vocab_size=256, max_length=length, dim=dim, depth=depth, heads=4)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    attention = depth * 2 * (2 * length * length * dim)
    assert training_flops_per_sample(model, torch.zeros(1, length, dtype=torch.long)) == 3 * (
        2 * length * weights + attention
    )


def test_fsdp_units_are_the_outermost_listed_blocks_or_the_layer_list():
    """`_no_split_modules` (as transformers models publish it): a listed class inside a listed block is part of
    that block's unit, not a unit of its own (FSDP shards bottom-up); names that match nothing fall through."""
    from torch import nn

    from raytrain_ddp.worker.strategy import fsdp_units

    class Mlp(nn.Sequential):
        pass

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = Mlp(nn.Linear(4, 4))

    class Model(nn.Module):
        _no_split_modules = ["Block", "Mlp"]

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

    model = Model()
    assert fsdp_units(model) == list(model.layers)
    Model._no_split_modules = ["NoSuchBlock"]
    assert fsdp_units(model) == list(model.layers)
