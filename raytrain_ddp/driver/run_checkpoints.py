"""Which checkpoint a run starts from: verified before any worker loads it.

Ray Train V2 keeps a run's checkpoints in ``RUN_DIR/checkpoint_manager_snapshot.json``
and hands the workers the *latest* one when the same run starts again. Its
``resume_from_checkpoint`` argument is gone in V2 (it raises), so both of the
choices made here are expressed in that snapshot, validated against the
installed Ray's own schema:

* a corrupt latest checkpoint is moved to ``RUN_DIR/corrupt/`` and the newest
  good one becomes the latest (:func:`set_aside_corrupt_latest`), after metrics
  the snapshot could not hold are dropped (:func:`_drop_unsaved_metrics`);
* ``--resume-from`` copies the given checkpoint into a new run directory and
  records it as that run's latest (:func:`seed_new_run`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.errors import ConfigError
from raytrain_ddp.worker.checkpoint import CHECKPOINT_FILE, load_file

log = logging.getLogger("raytrain_ddp")

# What a worker reads when it resumes (raytrain_ddp/worker: Trainer.restore, checkpoint.load, position_of)
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "step_in_epoch", "global_step", "rng",
                 "config", "data_spec")
CORRUPT_DIR = "corrupt"


def read_verified(checkpoint_dir: Path) -> tuple[dict | None, str | None]:
    """(state, None) when the checkpoint loads and has what a resume needs, else (None, why not)."""
    path = checkpoint_dir / CHECKPOINT_FILE
    if not path.is_file():
        return None, f"{CHECKPOINT_FILE} is missing"
    try:
        state = load_file(path)
    except Exception as err:  # truncated, garbage, not a torch file: all mean "unusable"
        return None, f"it does not load ({_first_line(err)})"
    if not isinstance(state, dict):
        return None, f"it holds a {type(state).__name__}, not a checkpoint"
    missing = [key for key in REQUIRED_KEYS if key not in state]
    return (None, f"keys missing: {', '.join(missing)}") if missing else (state, None)


def describe(checkpoint_dir: Path, state: dict) -> str:
    """Where a checkpoint stands: "PATH (epoch E)", or "(epoch E, step S)" when taken mid-epoch."""
    step = f", step {state['step_in_epoch']}" if state.get("step_in_epoch") else ""
    return f"{checkpoint_dir} (epoch {state['epoch']}{step})"


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


# ------------------------------------------------------------------ a resumed run
def set_aside_corrupt_latest(run_dir: Path) -> str | None:
    """Make sure the checkpoint Ray Train will resume from loads; return what it is.

    Newest first, each checkpoint that does not load is logged, moved to
    RUN_DIR/corrupt/ and dropped from the snapshot, until a good one is the
    latest; with none left the run starts from scratch.
    """
    snapshot_path = run_dir / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    if not snapshot_path.exists():
        return None
    state = json.loads(snapshot_path.read_text())
    if _drop_unsaved_metrics(state):
        _write_snapshot(run_dir, state)
    newest_first = sorted(zip(state["checkpoint_report_indices"], state["checkpoint_results"]),
                          key=lambda pair: pair[0], reverse=True)
    corrupt, resume_from = [], None
    for _, result in newest_first:
        name = result["checkpoint_dir_name"]
        checkpoint_state, why = read_verified(run_dir / name)
        if why is None:
            resume_from = describe(run_dir / name, checkpoint_state)
            break
        log.error("Checkpoint %s is corrupt (%s): moved to %s/; resuming from the one before it",
                  run_dir / name / CHECKPOINT_FILE, why, run_dir / CORRUPT_DIR)
        corrupt.append(name)
        if (run_dir / name).exists():
            (run_dir / CORRUPT_DIR).mkdir(exist_ok=True)
            shutil.move(run_dir / name, run_dir / CORRUPT_DIR / name)
    if not corrupt:
        return resume_from
    kept = [(index, result) for index, result in zip(state["checkpoint_report_indices"], state["checkpoint_results"])
            if result["checkpoint_dir_name"] not in corrupt]
    state["checkpoint_report_indices"] = [index for index, _ in kept]
    state["checkpoint_results"] = [result for _, result in kept]
    state["latest_checkpoint_result"] = max(kept, key=lambda pair: pair[0])[1] if kept else None
    pending = [(result, spec) for result, spec in zip(state["pending_training_results"], state["pending_validation_specs"])
               if result["checkpoint_dir_name"] not in corrupt]
    state["pending_training_results"] = [result for result, _ in pending]
    state["pending_validation_specs"] = [spec for _, spec in pending]
    if not kept:
        log.error("No good checkpoint left in %s: the run starts again from epoch 1", run_dir)
    _write_snapshot(run_dir, state)
    return resume_from


def _drop_unsaved_metrics(state: dict) -> bool:
    """Remove metrics saved as null; say whether there were any.

    Ray writes the snapshot with pydantic, which turns inf and NaN into null
    (e.g. the -inf score of a checkpoint taken mid-epoch on a stop request, or
    a NaN validation loss). Read back, a null score makes Ray Train's
    checkpoint ranking fail (float * None) at the first report of the resumed
    run; a missing score ranks lowest instead.
    """
    results = state["checkpoint_results"] + state["pending_training_results"] + \
        ([state["latest_checkpoint_result"]] if state["latest_checkpoint_result"] else [])
    dropped = False
    for result in results:
        for key in [key for key, value in result["metrics"].items() if value is None]:
            del result["metrics"][key]
            dropped = True
    return dropped


def _write_snapshot(run_dir: Path, state: dict) -> None:
    """Write the snapshot atomically, after Ray's own schema has accepted it."""
    text = _CheckpointManagerState.parse_obj(state).json()
    tmp = run_dir / (CHECKPOINT_MANAGER_SNAPSHOT_FILENAME + ".tmp")
    tmp.write_text(text)
    tmp.replace(run_dir / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME)


# ----------------------------------------------------------------- --resume-from
def check_resume_from(config: TrainConfig, spec) -> dict:
    """The --resume-from checkpoint's state, once it is known to fit this run. Raises ConfigError."""
    given = Path(config.resume_from).expanduser()
    checkpoint_dir = given.parent if given.name == CHECKPOINT_FILE else given
    flag = f"--resume-from {config.resume_from!r}"
    if not given.exists():
        raise ConfigError(f"{flag} does not exist")
    state, why = read_verified(checkpoint_dir)
    if why:
        raise ConfigError(f"{flag} is not a usable checkpoint: {why}")
    made_for = state["config"].get("model"), tuple(state["data_spec"]["input_shape"]), state["data_spec"]["num_classes"]
    wanted = config.model, tuple(spec.input_shape), spec.num_classes
    if made_for != wanted:
        raise ConfigError(f"{flag} was made for model {made_for[0]} on inputs {made_for[1]} with {made_for[2]} "
                          f"classes; this run is model {wanted[0]} on inputs {wanted[1]} with {wanted[2]} classes")
    if state["epoch"] >= config.epochs and not state.get("step_in_epoch"):
        raise ConfigError(f"{flag} has already trained {state['epoch']} epochs; ask for more --epochs "
                          f"(the total, counting those), got {config.epochs}")
    return state


def has_own_checkpoints(run_dir: Path) -> bool:
    return (run_dir / CHECKPOINT_MANAGER_SNAPSHOT_FILENAME).exists()


def seed_new_run(config: TrainConfig, state: dict) -> None:
    """Copy the --resume-from checkpoint into the new run and make it the latest one Ray Train hands out."""
    given = Path(config.resume_from).expanduser().resolve()
    source = given.parent if given.name == CHECKPOINT_FILE else given
    name = source.name if source.name.startswith("checkpoint_") else f"checkpoint_from_{source.name}"
    shutil.copytree(source, config.run_dir / name)
    result = {"checkpoint_dir_name": name, "metrics": state.get("metrics") or {}}
    _write_snapshot(config.run_dir, {
        "checkpoint_results": [result], "checkpoint_report_indices": [0], "latest_checkpoint_result": result,
        "pending_training_results": [], "pending_validation_specs": [], "current_report_index": 1,
        "validated_checkpoint_dir_names": [], "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": [],
    })
    log.info("Starting from checkpoint %s of run %s", describe(source, state), state["config"].get("name", "?"))
