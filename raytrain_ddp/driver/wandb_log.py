"""Optional Weights & Biases logging (`--wandb-project`, `--wandb-entity`): one W&B run per training run.

Its name is the run's name, its config the resolved config (credentials inside URIs masked), its history each
recorded optimizer step (steps.jsonl: `step/*` by `global_step`) and each epoch (the TensorBoard names by
`epoch`), its summary the run's end (`status`, `best/*`, and W&B's last value of each metric). The W&B id is kept
in RUN_DIR/wandb-run-id, so a resumed run continues the same W&B run. `WANDB_MODE=offline` (wandb's own
setting) writes the run under RUN_DIR/wandb/ (or $WANDB_DIR) for a later `wandb sync`.
W&B is an optional extra: pip install 'raytrain-ddp[wandb]'.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.tensorboard_log import epoch_scalars, step_scalars
from raytrain_ddp.driver.tracker import QueuedTracker
from raytrain_ddp.files import write_atomic
from raytrain_ddp.redact import redact, redact_values
from raytrain_ddp.storage import RemotePath, RunPath
from raytrain_ddp.summary import RunSummary

log = logging.getLogger("raytrain_ddp")

ID_FILE = "wandb-run-id"


def run_id(run_dir: RunPath) -> str:
    """This run directory's W&B run id: made on its first start, read back when it resumes."""
    from wandb.sdk.lib.runid import generate_id

    path = run_dir / ID_FILE
    if path.exists() and (kept := path.read_text().strip()):
        return kept
    new = generate_id()
    write_atomic(path, new + "\n")
    return new


class WandbLog(QueuedTracker):
    """The W&B run, fed from a thread of its own (driver/tracker.py): wandb.init alone takes seconds."""

    label = "W&B"

    def __init__(self, config: TrainConfig, run_dir: RunPath) -> None:
        import wandb

        self.run_id = run_id(run_dir)
        self._init: dict[str, Any] = dict(
            project=config.wandb_project,
            entity=config.wandb_entity,
            name=config.name,
            id=self.run_id,
            resume="allow",
            config=redact_values(config.to_dict()),
            reinit="create_new",  # never take over (or end) a W&B run of the caller's own, in a notebook
            # the driver's console stays the driver's (its live progress line); driver.log holds it
            settings=wandb.Settings(console="off"),
            # on object storage wandb's files go to its default place (./wandb, or $WANDB_DIR)
            **({} if os.environ.get("WANDB_DIR") or isinstance(run_dir, RemotePath) else {"dir": str(run_dir)}),
        )
        self._epoch_keys: set[str] = set()
        self._start(f"{config.wandb_entity}/{config.wandb_project}" if config.wandb_entity else config.wandb_project)

    def _open(self) -> None:
        import wandb

        self._wandb = wandb.init(**self._init)
        self._wandb.define_metric("global_step")
        self._wandb.define_metric("step/*", step_metric="global_step")
        self._wandb.define_metric("epoch")
        if self._wandb.offline:
            log.info(
                "W&B: offline run %s in %s; `wandb sync %s` uploads it",
                self.run_id,
                self.where,
                self._wandb.settings.sync_dir,
            )
        else:
            log.info("W&B: run %s: %s", self.run_id, self._wandb.url)

    def _write(self, kind: str, record: dict) -> None:
        if kind == "step":
            self._wandb.log({"global_step": record["step"], **step_scalars(record)})
            return
        scalars = epoch_scalars(record)
        for key in scalars.keys() - self._epoch_keys:  # by epoch, not by W&B's own row counter
            self._wandb.define_metric(key, step_metric="epoch")
            self._epoch_keys.add(key)
        self._wandb.log({"epoch": record["epoch"], **scalars})

    def _close(self, summary: RunSummary | None) -> None:
        status = summary.status if summary else None
        if summary:
            best = {f"best/{key}": value for key, value in (summary.best_metrics or {}).items()}
            self._wandb.summary.update(
                {
                    "status": summary.status,
                    "epochs_completed": summary.epochs_completed,
                    "best_checkpoint": summary.best_checkpoint,
                    "error": redact(summary.error) if summary.error else None,
                    "checkpoints_ranked_by": summary.checkpoints_ranked_by,
                    **{key: value for key, value in best.items() if isinstance(value, (int, float))},
                }
            )
        if status in ("stopped", "interrupted"):  # it resumes when run again (a requeued Slurm job, a Ctrl-C)
            self._wandb.mark_preempting()
        self._wandb.finish(exit_code=0 if status == "finished" else 1)
