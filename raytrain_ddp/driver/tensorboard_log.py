"""TensorBoard event files for a run: one point per epoch record, written by the driver.

    tb = TensorBoardLog(run_dir)          # events go to RUN_DIR/tensorboard/
    tb.write_epoch(record)                # each metrics.jsonl record, as it is written
    tb.write_step(record)                 # each steps.jsonl record (--log-every-steps)
    tb.close()

    tensorboard --logdir RUN_DIR/tensorboard     (or STORAGE_PATH to compare runs)

Scalars, all with ``global_step = epoch``: train/loss, train/loss_min, train/loss_max,
val/loss, val/accuracy, throughput/samples_per_second, time/epoch_seconds, and per
rank ``throughput/rank_{r}`` (samples_per_rank / seconds), ``data_wait/rank_{r}``,
``train_loss/rank_{r}``, ``micro_batches/rank_{r}``, ``micro_batch_seconds/rank_{r}`` and
``gpu_memory_peak_gib/rank_{r}``. Any other ``NAME_per_rank`` number list becomes
``NAME/rank_{r}``. Above 64 ranks a record holds summaries instead of per-rank lists
(epochs.split_per_rank): ``data_wait/min``, ``/median``, ``/p90``, ``/max`` and the like, no scalar per
rank. A field a record lacks (or holds as a non-number) is skipped:
logging must never stop a training run.

Per recorded optimizer step, with ``global_step`` = the optimizer step: step/train_loss,
step/train_loss_min, step/train_loss_max, step/lr, step/samples_per_second.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from raytrain_ddp.errors import full_storage_error, one_line
from raytrain_ddp.storage import RunPath, Spool
from raytrain_ddp.summary import RunSummary

log = logging.getLogger("raytrain_ddp")

TENSORBOARD_DIR = "tensorboard"

SCALARS = {  # record field -> tag
    "train_loss": "train/loss",
    "train_loss_min": "train/loss_min",
    "train_loss_max": "train/loss_max",
    "val_loss": "val/loss",
    "val_accuracy": "val/accuracy",
    "samples_per_second": "throughput/samples_per_second",
    "seconds": "time/epoch_seconds",
}
STEP_SCALARS = {  # steps.jsonl field -> tag
    "train_loss": "step/train_loss",
    "train_loss_min": "step/train_loss_min",
    "train_loss_max": "step/train_loss_max",
    "lr": "step/lr",
    "samples_per_second": "step/samples_per_second",
    "grad_norm": "step/grad_norm",
}
PER_RANK = {  # record field -> tag group; each rank r is GROUP/rank_{r}
    "data_wait_seconds_per_rank": "data_wait",
    "train_loss_per_rank": "train_loss",
    "samples_per_rank": "samples",
    "micro_batch_seconds_per_rank": "micro_batch_seconds",
    "gpu_memory_peak_gib_per_rank": "gpu_memory_peak_gib",
    # val_loss/val_accuracy per rank: the same on every rank (val_identical_across_ranks); not logged
    "val_loss_per_rank": None,
    "val_accuracy_per_rank": None,
}


SUMMARY_STATS = ("min", "median", "p90", "max")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _scalars(record: dict, tags: dict[str, str]) -> dict[str, float]:
    return {tag: value for key, tag in tags.items() if (value := _number(record.get(key))) is not None}


def step_scalars(record: dict) -> dict[str, float]:
    """The tag -> value pairs one steps.jsonl record gives (no step)."""
    return _scalars(record, STEP_SCALARS)


def epoch_scalars(record: dict) -> dict[str, float]:
    """The tag -> value pairs one epoch record gives (no step)."""
    out = _scalars(record, SCALARS)
    seconds = _number(record.get("seconds"))
    samples = record.get("samples_per_rank")
    if seconds and isinstance(samples, list):
        for rank, n in enumerate(samples):
            if _number(n) is not None:
                out[f"throughput/rank_{rank}"] = float(n) / seconds
    for key, values in record.items():
        if not key.endswith("_per_rank") or not isinstance(values, list):
            continue
        group = PER_RANK.get(key, key.removesuffix("_per_rank"))
        if group is None:
            continue
        for rank, value in enumerate(values):
            if _number(value) is not None:
                out[f"{group}/rank_{rank}"] = float(value)
    return out | _summary_scalars(record)


def _summary_scalars(record: dict) -> dict[str, float]:
    """A large world's record (epochs.split_per_rank): each per-rank figure's spread, not a scalar per rank."""
    out = {}
    for key, summary in record.items():
        group = PER_RANK.get(key.replace("_rank_summary", "_per_rank"), key.removesuffix("_rank_summary"))
        if not key.endswith("_rank_summary") or group is None:
            continue
        for stat in SUMMARY_STATS:
            if (value := _number(summary.get(stat))) is not None:
                out[f"{group}/{stat}"] = value
    return out


def _quiet_full_disk_in_writer(args: threading.ExceptHookArgs) -> None:
    """TensorBoard's writer thread ends on a full disk with a traceback on stderr; the next write raises the same
    error in the driver's thread, which says it in one line. Any other error of any thread goes on as before."""
    if type(args.thread).__name__ != "_AsyncWriterThread" or full_storage_error(args.exc_value) is None:
        _quiet_full_disk_in_writer.previous(args)  # type: ignore[attr-defined]


class TensorBoardLog:
    """Writes each epoch record as TensorBoard scalars into RUN_DIR/tensorboard/."""

    label = "TensorBoard"

    def __init__(self, run_dir: RunPath) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch is there; the tensorboard package is not
            raise ImportError(
                f"TensorBoard logging needs the tensorboard package (pip install tensorboard): {err}"
            ) from err
        self._spool = Spool(run_dir / TENSORBOARD_DIR)  # on object storage: uploaded by close()
        self.log_dir = self._spool.local
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        self._refused = False  # a full disk stopped the writer (its thread is gone): said once
        if threading.excepthook is not _quiet_full_disk_in_writer:
            _quiet_full_disk_in_writer.previous = threading.excepthook  # type: ignore[attr-defined]
            threading.excepthook = _quiet_full_disk_in_writer

    def write_epoch(self, record: dict) -> None:
        """One point per scalar at global_step = record["epoch"]; flushed so TensorBoard shows it now."""
        self._write("epoch", record, epoch_scalars(record))

    def write_step(self, record: dict) -> None:
        """One point per scalar at global_step = record["step"], the optimizer step."""
        self._write("step", record, step_scalars(record))

    def _write(self, key: str, record: dict, scalars: dict[str, float]) -> None:
        step = record.get(key)
        if self._writer is None or isinstance(step, bool) or not isinstance(step, int):
            log.debug("TensorBoard: record without an integer %s (or log closed); skipped", key)
            return
        try:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, global_step=step)
            self._writer.flush()
        except Exception as err:  # a full disk is the recorder's one warning; else the metrics are in the .jsonl
            if full_storage_error(err) is not None:
                self._refused = True
                raise
            log.warning("TensorBoard: could not write %s %s: %s", key, step, err)

    def close(self, summary: RunSummary | None = None) -> None:
        """`summary` (the run's, as the other trackers take it) adds nothing to the event files."""
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception as err:  # its last events
                if full_storage_error(err) is None:
                    raise
                if not self._refused:
                    log.warning("TensorBoard: the last events not written: %s", one_line(err))
            self._writer = None
            self._spool.upload()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
