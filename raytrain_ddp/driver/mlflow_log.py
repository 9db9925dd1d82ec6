"""Optional MLflow logging (`--mlflow-uri`): the config as params, each epoch's scalars as metrics (step = the
epoch), and each recorded optimizer step's (steps.jsonl: step = the optimizer step).

Works with a tracking server (http://...) or a local file store
(file:///path/mlruns). MLflow is an optional extra: pip install 'raytrain-ddp[mlflow]'.
"""

from __future__ import annotations

import logging
import os
import time

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.tensorboard_log import epoch_scalars, step_scalars
from raytrain_ddp.driver.tracker import QueuedTracker
from raytrain_ddp.redact import redact
from raytrain_ddp.summary import RunSummary

log = logging.getLogger("raytrain_ddp")

EXPERIMENT = "raytrain-ddp"


class MlflowLog(QueuedTracker):
    """One MLflow run per training run, named after it, logged from a thread of its own (driver/tracker.py);
    it ends FINISHED, FAILED or KILLED (stopped, interrupted) as the run's summary says."""

    label = "MLflow"

    def __init__(self, uri: str, config: TrainConfig) -> None:
        from mlflow.entities import Param

        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless asked; a local store is what was asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._uri, self._name = uri, config.name
        self._params = [Param(key, redact(str(value))) for key, value in config.to_dict().items() if value is not None]
        self._start(redact(uri))

    def _open(self) -> None:
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=self._uri)
        experiment = client.get_experiment_by_name(EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(EXPERIMENT)
        self._run_id = client.create_run(experiment_id, run_name=self._name).info.run_id
        client.log_batch(self._run_id, params=self._params)
        log.info("MLflow: run %s in experiment %r at %s", self._run_id, EXPERIMENT, self.where)

    def _write(self, kind: str, record: dict) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        scalars = epoch_scalars(record) if kind == "epoch" else step_scalars(record)
        self._client.log_batch(self._run_id, metrics=[Metric(k, v, now_ms, record[kind]) for k, v in scalars.items()])

    def _close(self, summary: RunSummary | None) -> None:
        status = summary.status if summary else None
        self._client.set_terminated(
            self._run_id,
            status="FINISHED" if status == "finished" else "FAILED" if status in (None, "failed") else "KILLED",
        )
