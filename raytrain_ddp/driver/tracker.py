"""An experiment tracker fed from a thread of its own (MLflow, W&B): a slow or failing service never holds up
the run. The driver only queues each record (write_epoch/write_step are called from the watchdog's thread);
an error is logged once and the tracker is left out for the rest of the run; closing waits at most
CLOSE_WAIT_S for what is still queued."""

from __future__ import annotations

import contextlib
import importlib
import logging
import queue
import threading

from raytrain_ddp.errors import ConfigError, one_line
from raytrain_ddp.summary import RunSummary

log = logging.getLogger("raytrain_ddp")

CLOSE_WAIT_S = 60


def require(package: str, flag: str, extra: str, label: str) -> None:
    """Fail before anything starts when `flag` is given without its tracker's package installed."""
    try:
        importlib.import_module(package)
    except ImportError:
        raise ConfigError(f"{flag} needs {label}: pip install 'raytrain-ddp[{extra}]'") from None


class QueuedTracker:
    """Subclasses name the service (`label`), say where it logs (`_start(where)` at the end of their __init__)
    and define `_open()`, `_write(kind, record)` (kind: "epoch" or "step") and `_close(summary)`, all run
    on the tracker's thread."""

    label = "tracker"

    def _start(self, where: str) -> None:
        self.where = where
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"{self.label}-log", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        opened = False
        try:
            self._open()
            opened = True
            while (item := self._queue.get())[0] != "close":
                self._write(*item)
            self._close(item[1])
        except Exception as err:  # the server, the network, a credential: the training goes on
            if opened:  # end the tracker's run (W&B's would stay live in a notebook, MLflow's RUNNING)
                with contextlib.suppress(Exception):
                    self._close(None)
            log.error(
                "%s at %s failed (%s: %s): the run goes on without %s",
                self.label,
                self.where,
                type(err).__name__,
                one_line(err)[:300],
                self.label,
            )

    def _open(self) -> None:
        raise NotImplementedError

    def _write(self, kind: str, record: dict) -> None:
        raise NotImplementedError

    def _close(self, summary: RunSummary | None) -> None:
        raise NotImplementedError

    def write_epoch(self, record: dict) -> None:
        self._queue.put(("epoch", record))

    def write_step(self, record: dict) -> None:
        self._queue.put(("step", record))

    def close(self, summary: RunSummary | None = None) -> None:
        """`summary`: the run's summary (None: the run ended before it had one)."""
        self._queue.put(("close", summary))
        self._thread.join(CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning(
                "%s at %s has not answered for %ds: the run ends without waiting", self.label, self.where, CLOSE_WAIT_S
            )
