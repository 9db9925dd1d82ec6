"""Which checkpoint a run starts from: verified before any worker loads it.

Ray Train V2 keeps a run's checkpoints in a snapshot file in the run directory
and hands the workers the *latest* one when the same run starts again. Its
``resume_from_checkpoint`` argument is gone in V2 (it raises), so both of the
choices made here are expressed in that snapshot (edited through
raytrain_ddp._ray_compat, against the installed Ray's own schema):

* a corrupt latest checkpoint is moved to ``RUN_DIR/corrupt/`` and the newest
  good one becomes the latest (:func:`set_aside_corrupt_latest`), after metrics
  the snapshot could not hold are dropped;
* checkpoint directories the snapshot does not list (a run that ended while one was written) are removed
  when they do not load, and named when they do (:func:`clear_unrecorded`);
* ``--resume-from`` copies the given checkpoint into a new run directory and
  records it as that run's latest (:func:`seed_new_run`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from raytrain_ddp import _ray_compat
from raytrain_ddp.checkpoint.layout import CHECKPOINT_FILE, entry_point
from raytrain_ddp.checkpoint.state import describe
from raytrain_ddp.checkpoint.verify import check_fits_model, read_verified
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.errors import ConfigError, plural
from raytrain_ddp.storage import RunPath, copy_tree, location, move_tree, remove_tree

log = logging.getLogger("raytrain_ddp")

CORRUPT_DIR = "corrupt"
CHECKPOINT_GLOB = "checkpoint_*"  # Ray Train's checkpoint directories (and ShardedSaver's, named alike)


# ------------------------------------------------------------------ a resumed run
def read_snapshot(run_dir: RunPath) -> dict | None:
    """Ray Train's snapshot of the run's checkpoints (None: the run has none); ConfigError when unreadable."""
    return _ray_compat.read_snapshot(run_dir)


def latest_checkpoint(run_dir: RunPath) -> RunPath | None:
    """The checkpoint a restart of the run resumes from: its snapshot's latest (None: it has none)."""
    state = read_snapshot(run_dir)
    names = _ray_compat.checkpoints_newest_first(state) if state else []
    return run_dir / names[0] if names else None


def set_aside_corrupt_latest(run_dir: RunPath, state: dict) -> tuple[RunPath, dict] | None:
    """Make sure the checkpoint Ray Train will resume from loads; return it (its directory and state).

    Newest first, each checkpoint of the snapshot `state` that does not load is logged, moved to
    RUN_DIR/corrupt/ and dropped from the snapshot, until a good one is the
    latest; with none left the run starts from scratch.
    """
    if _ray_compat.drop_unsaved_metrics(state):
        _ray_compat.write_snapshot(run_dir, state)
    corrupt, resume_from = [], None
    for name in _ray_compat.checkpoints_newest_first(state):
        checkpoint_state, why = read_verified(run_dir / name)
        if why is None:
            resume_from = run_dir / name, checkpoint_state
            break
        log.error(
            "Checkpoint %s is corrupt (%s): moved to %s/; resuming from the one before it",
            entry_point(run_dir / name),
            why,
            run_dir / CORRUPT_DIR,
        )
        corrupt.append(name)
        if (run_dir / name).exists():
            (run_dir / CORRUPT_DIR).mkdir(exist_ok=True)
            move_tree(run_dir / name, run_dir / CORRUPT_DIR / name)
    if not corrupt:
        return resume_from
    if not _ray_compat.drop_checkpoints(state, corrupt):
        log.error("No good checkpoint left in %s: the run starts again from epoch 1", run_dir)
    _ray_compat.write_snapshot(run_dir, state)
    return resume_from


def clear_unrecorded(run_dir: RunPath, state: dict | None, cut_by: str = "the run ended while it was written") -> None:
    """Checkpoint directories of the run that Ray Train never recorded: the run ended (crashed, killed) while
    one was being written (a sharded one's ranks still writing, a full one's upload cut short), or after its
    write but before its report. Ray Train's retention never sees them: one that does not load is removed,
    one that does is kept and named (it is not resumed from: Ray Train resumes from its latest recorded).
    `state`: the run's snapshot (None when it has none); `cut_by`: what the log says cut an unfinished one short."""
    recorded = set(_ray_compat.checkpoints_newest_first(state)) if state else set()
    directories: list[RunPath] = sorted(run_dir.glob(CHECKPOINT_GLOB), key=str)
    for directory in directories:
        if directory.name in recorded or not directory.is_dir():
            continue
        _, why = read_verified(directory)
        if why is None:
            log.warning(
                "Checkpoint %s was written but never recorded (the run ended before reporting it): kept, not "
                "resumed from; give it to --resume-from to start a new run from it, or delete it",
                directory,
            )
        else:
            log.warning("Removed unfinished checkpoint %s (%s): %s", directory, why, cut_by)
            remove_tree(directory)


# ----------------------------------------------------------------- --resume-from
def check_resume_from(config: TrainConfig, spec, model: dict[str, tuple[int, ...]]) -> dict:
    """The --resume-from checkpoint's state, once it is known to fit this run and its `model` (tensor name ->
    shape). Raises ConfigError."""
    given, checkpoint_dir = _resume_from(config)
    flag = f"--resume-from {config.resume_from!r}"
    if not given.exists():
        raise ConfigError(f"{flag} does not exist")
    state, why = read_verified(checkpoint_dir)
    if why:
        raise ConfigError(f"{flag} is not a usable checkpoint: {why}")
    made_for = state["config"].get("model"), tuple(state["data_spec"]["input_shape"]), state["data_spec"]["num_classes"]
    wanted = config.model, tuple(spec.input_shape), spec.num_classes
    if made_for != wanted:
        raise ConfigError(
            f"{flag} was made for model {made_for[0]} on inputs {made_for[1]} with {made_for[2]} "
            f"classes; this run is model {wanted[0]} on inputs {wanted[1]} with {wanted[2]} classes"
        )
    if state["epoch"] >= config.epochs and not state.get("step_in_epoch"):
        raise ConfigError(
            f"{flag} has already trained {plural(state['epoch'], 'epoch')}; ask for more --epochs "
            f"(the total, counting those), got {config.epochs}"
        )
    check_fits_model(checkpoint_dir, state, model, flag, "give it a checkpoint of this model")
    return state


def has_own_checkpoints(run_dir: RunPath) -> bool:
    return _ray_compat.has_snapshot(run_dir)


def seed_new_run(config: TrainConfig, state: dict) -> None:
    """Copy the --resume-from checkpoint into the new run and make it the latest one Ray Train hands out."""
    _, source = _resume_from(config)
    name = source.name if source.name.startswith("checkpoint_") else f"checkpoint_from_{source.name}"
    copy_tree(source, config.run_dir / name)
    _ray_compat.write_snapshot(config.run_dir, _ray_compat.new_snapshot(name, state.get("metrics") or {}))
    log.info("Starting from run %s's checkpoint %s", state["config"].get("name", "?"), describe(source, state))


def _resume_from(config: TrainConfig) -> tuple[RunPath, RunPath]:
    """--resume-from as a path (local, made absolute, or on object storage), and its checkpoint directory."""
    given = location(config.resume_from or "", "--resume-from")
    given = given.expanduser().resolve() if isinstance(given, Path) else given
    return given, given.parent if given.name == CHECKPOINT_FILE else given
