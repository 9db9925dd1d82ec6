"""What a checkpoint records of where training stands, and how messages name it (raytrain_ddp/checkpoint/saver.py
lists a checkpoint's keys)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from raytrain_ddp.errors import plural
from raytrain_ddp.redact import redact_values
from raytrain_ddp.storage import RunPath


@dataclass
class Position:
    """Where training stands: what a checkpoint records and a resume starts from."""

    epoch: int = 0  # epochs completed
    step_in_epoch: int = 0  # optimizer steps done in epoch `epoch + 1`
    global_step: int = 0
    # (world size, optimizer steps) of epoch `epoch + 1`'s parts trained before the world size changed
    earlier_parts: tuple[tuple[int, int], ...] = ()

    def resumes(self) -> str:
        """Where training goes on from here, in words: the epoch it resumes in, not the last one done."""
        return resume_point(self.epoch, self.step_in_epoch)


def resume_point(epochs_done: int, steps_in_next: int) -> str:
    """'at the start of epoch 3', or 'in epoch 3, 24 optimizer steps into it'."""
    if not steps_in_next:
        return f"at the start of epoch {epochs_done + 1}"
    return f"in epoch {epochs_done + 1}, {plural(steps_in_next, 'optimizer step')} into it"


def plain_state(training_state: dict, position: Position, metrics: dict, run_info: dict) -> dict:
    """Everything a checkpoint holds but the model and optimizer state; credentials in the config's URIs masked,
    as in config.toml (checkpoints travel: to a bucket, to a colleague)."""
    return {
        **training_state,
        "epoch": position.epoch,
        "step_in_epoch": position.step_in_epoch,
        "global_step": position.global_step,
        "earlier_parts": [list(part) for part in position.earlier_parts],
        "rng": {"torch": torch.get_rng_state()},
        "metrics": metrics,
        **run_info,
        "config": redact_values(run_info["config"]),
    }


def described(position: Position) -> str:
    """How a message names the checkpoint taken at `position`."""
    if position.step_in_epoch:
        return f"the checkpoint of epoch {position.epoch + 1} at step {position.step_in_epoch}"
    return f"the checkpoint of epoch {position.epoch}"


def position_of(state: dict) -> Position:
    earlier = tuple((int(world_size), int(steps)) for world_size, steps in state.get("earlier_parts", ()))
    return Position(state["epoch"], state["step_in_epoch"], state["global_step"], earlier)


def describe(checkpoint_dir: RunPath, state: dict) -> str:
    """Where training goes on from a checkpoint: "PATH, at the start of epoch 3" or "PATH, in epoch 3, 24
    optimizer steps into it" (a checkpoint records the epochs done, not the one it resumes in)."""
    return f"{checkpoint_dir}, {resume_point(state['epoch'], state.get('step_in_epoch', 0))}"
