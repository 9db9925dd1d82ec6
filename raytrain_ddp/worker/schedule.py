"""The learning rate per optimizer step: linear warm-up, then constant, cosine or step decay."""

from __future__ import annotations

import math

import torch

from raytrain_ddp.config import TrainConfig

STEP_DECAY_AT = (0.5, 0.75)  # fractions of the post-warm-up steps where --lr-schedule step divides by 10


def optimizer_steps_per_epoch(rows_per_rank: int, config: TrainConfig) -> int:
    """Optimizer steps one rank takes per epoch (a last partial accumulation still steps)."""
    return max(1, math.ceil(config.batches_for(rows_per_rank) / config.grad_accum))


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """Multiplier of the learning rate for optimizer step `step` (counting from 0)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * progress))
    if schedule == "step":
        return 0.1 ** sum(progress >= point for point in STEP_DECAY_AT)
    return 1.0


def make_scheduler(
    optimizer: torch.optim.Optimizer, config: TrainConfig, epoch_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    total_steps = config.epochs * epoch_steps
    warmup_steps = round(config.warmup_epochs * epoch_steps)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, warmup_steps, config.lr_schedule)
    )


def resume_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, base_lr: float, step: int) -> None:
    """Put a restored schedule at optimizer step `step` with base rate `base_lr`, as if this run's world size
    had trained from the start: the checkpoint's step count and rate were for another one (elastic runs)."""
    scheduler.base_lrs = [base_lr] * len(scheduler.optimizer.param_groups)
    scheduler.last_epoch = step
    scheduler._last_lr = [base_lr * factor(step) for factor in scheduler.lr_lambdas]
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler._last_lr):
        group["initial_lr"], group["lr"] = base_lr, lr
