"""Optional MLflow logging (`--mlflow-uri`): the config as params, each epoch's scalars as metrics.

Works with a tracking server (http://...) or a local file store
(file:///path/mlruns). MLflow is an optional extra: pip install 'raytrain-ddp[mlflow]'.
"""

from __future__ import annotations

import logging
import os
import time

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.tensorboard_log import epoch_scalars
from raytrain_ddp.errors import ConfigError

log = logging.getLogger("raytrain_ddp")

EXPERIMENT = "raytrain-ddp"


def require_mlflow() -> None:
    """Fail before anything starts when --mlflow-uri is given without MLflow installed."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise ConfigError("--mlflow-uri needs MLflow: pip install 'raytrain-ddp[mlflow]'") from None


class MlflowLog:
    """One MLflow run per training run, named after it.

    Uses an explicit client and run id: epochs are logged from the driver's
    watcher thread, where mlflow's thread-local "active run" would be another run.
    """

    def __init__(self, uri: str, config: TrainConfig) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless asked; a local store is what was asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(EXPERIMENT)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(EXPERIMENT)
        self.run_id = self._client.create_run(experiment_id, run_name=config.name).info.run_id
        params = [Param(key, str(value)) for key, value in config.to_dict().items() if value is not None]
        self._client.log_batch(self.run_id, params=params)
        log.info("MLflow: run %s in experiment %r at %s", self.run_id, EXPERIMENT, uri)

    def write_epoch(self, record: dict) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(key, value, now_ms, record["epoch"]) for key, value in epoch_scalars(record).items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self, status: str = "FINISHED") -> None:
        self._client.set_terminated(self.run_id, status=status)
