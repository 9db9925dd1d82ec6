"""Optional MLflow logging (`--mlflow-uri`): the config as params, each epoch's scalars as metrics (step = the
epoch), and each recorded optimizer step's (steps.jsonl: step = the optimizer step).

Works with a tracking server (http://...) or a local file store
(file:///path/mlruns). MLflow is an optional extra: pip install 'raytrain-ddp[mlflow]'.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver.tensorboard_log import epoch_scalars, step_scalars
from raytrain_ddp.errors import ConfigError, one_line
from raytrain_ddp.redact import redact

log = logging.getLogger("raytrain_ddp")

EXPERIMENT = "raytrain-ddp"
CLOSE_WAIT_S = 60


def require_mlflow() -> None:
    """Fail before anything starts when --mlflow-uri is given without MLflow installed."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise ConfigError("--mlflow-uri needs MLflow: pip install 'raytrain-ddp[mlflow]'") from None


class MlflowLog:
    """One MLflow run per training run, named after it, logged from a thread of its own.

    A slow or failing tracking server never holds up the run: the driver only
    queues each epoch's scalars (write_epoch is called from the watchdog's thread),
    an error is logged once and MLflow is left out for the rest of the run, and
    closing waits at most CLOSE_WAIT_S for what is still queued.
    """

    def __init__(self, uri: str, config: TrainConfig) -> None:
        from mlflow.entities import Param

        if uri.startswith("file:"):  # MLflow 3 refuses its file store unless asked; a local store is what was asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.shown_uri = redact(uri)
        params = [Param(key, redact(str(value))) for key, value in config.to_dict().items() if value is not None]
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(
            target=self._log, args=(uri, config.name, params), name="mlflow-log", daemon=True
        )
        self._thread.start()

    def _log(self, uri: str, name: str, params: list) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        try:
            client = MlflowClient(tracking_uri=uri)
            experiment = client.get_experiment_by_name(EXPERIMENT)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(EXPERIMENT)
            run_id = client.create_run(experiment_id, run_name=name).info.run_id
            client.log_batch(run_id, params=params)
            log.info("MLflow: run %s in experiment %r at %s", run_id, EXPERIMENT, self.shown_uri)
            while (item := self._queue.get())[0] != "close":
                now_ms = int(time.time() * 1000)
                kind, record = item
                scalars = epoch_scalars(record) if kind == "epoch" else step_scalars(record)
                metrics = [Metric(key, value, now_ms, record[kind]) for key, value in scalars.items()]
                client.log_batch(run_id, metrics=metrics)
            client.set_terminated(run_id, status=item[1])
        except Exception as err:  # the server, the network, a credential: the training goes on
            log.error(
                "MLflow at %s failed (%s: %s): the run goes on without MLflow",
                self.shown_uri,
                type(err).__name__,
                one_line(err)[:300],
            )

    def write_epoch(self, record: dict) -> None:
        self._queue.put(("epoch", record))

    def write_step(self, record: dict) -> None:
        self._queue.put(("step", record))

    def close(self, status: str = "FINISHED") -> None:
        self._queue.put(("close", status))
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning(
                "MLflow at %s has not answered for %ds: the run ends without waiting", self.shown_uri, CLOSE_WAIT_S
            )
