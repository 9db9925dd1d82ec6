"""What a checkpoint holds (:class:`CheckpointState`, key by key), where training stands (:class:`Position`), and
how messages name them."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

import torch

from raytrain_ddp.errors import plural
from raytrain_ddp.redact import redact_values
from raytrain_ddp.storage import RunPath

IN_SHARDS = {"in_shards": True}  # a CheckpointState field a sharded checkpoint keeps in its shards/


@dataclass
class CheckpointState:
    """What a checkpoint holds, key by key: a full one's checkpoint.pt (saver.py describes the two formats); a
    sharded one's training_state.pt holds the same keys but `model` and `optimizer` (its shards/ hold them, keyed
    alike), and `format`. Only tensors and plain Python values: it loads with ``torch.load(path,
    weights_only=True)``.

    The fields without a default are what a resume reads (worker/loop.py: RankTrainer.restore; saver.loaded;
    position_of): :func:`required_keys`, which verify.read_verified checks. The others are absent from older files
    (`format`, from a full checkpoint's)."""

    # full (unsharded) state dicts keyed by parameter name, for DDP and FSDP alike: a plain model loads `model`
    # directly (None while a sharded checkpoint's are in its shards/)
    model: dict | None = field(metadata=IN_SHARDS)
    optimizer: dict | None = field(metadata=IN_SHARDS)
    scheduler: dict  # the learning-rate schedule's state
    scaler: dict  # the fp16 loss scale's state
    epoch: int  # epochs completed (counting from 1)
    step_in_epoch: int  # optimizer steps already taken in the next epoch when it was taken mid-epoch, else 0
    global_step: int  # optimizer steps so far
    rng: dict  # torch's random state, {"torch": ...} (the same on every rank: all were seeded alike)
    config: dict  # what produced it, credentials in its URIs masked as in config.toml
    data_spec: dict
    world_size: int | None = None  # how many ranks trained it (elastic runs change it)
    # [world size, optimizer steps] of the next epoch's parts trained at other world sizes before a resize (empty
    # but after one)
    earlier_parts: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)  # what it scored (taken mid-epoch: ranking.unscored)
    format: str | None = None  # "sharded" in a sharded checkpoint's training_state.pt

    def to_dict(self) -> dict:
        """The dict a checkpoint file holds, its keys in field order, those whose value is None left out (not
        dataclasses.asdict: that deep-copies every tensor)."""
        return {key.name: getattr(self, key.name) for key in fields(self) if getattr(self, key.name) is not None}


def required_keys(sharded: bool) -> list[str]:
    """The keys a resume reads, in CheckpointState's order: its fields without a default, less those a `sharded`
    checkpoint keeps in its shards/."""
    return [
        key.name
        for key in fields(CheckpointState)
        if key.default is MISSING and key.default_factory is MISSING and not (sharded and key.metadata.get("in_shards"))
    ]


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
    """Everything a checkpoint holds but the model and optimizer state (CheckpointState's other keys, as a dict).
    `training_state`: the scheduler's and scaler's state and the world size; `run_info`: the config and data spec,
    the plain-data facts needed to use the checkpoint alone. Credentials in the config's URIs masked, as in
    config.toml (checkpoints travel: to a bucket, to a colleague)."""
    state = CheckpointState(
        model=None,
        optimizer=None,
        **training_state,
        epoch=position.epoch,
        step_in_epoch=position.step_in_epoch,
        global_step=position.global_step,
        earlier_parts=[list(part) for part in position.earlier_parts],
        rng={"torch": torch.get_rng_state()},
        metrics=metrics,
        config=redact_values(run_info["config"]),
        data_spec=run_info["data_spec"],
    )
    return state.to_dict()


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
