"""SIGUSR1 (Slurm's warning: time limit or preemption) and SIGTERM: stop at a checkpoint, not in the middle."""

from __future__ import annotations

import _thread
import logging
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("raytrain_ddp")

STOP_SIGNALS = {
    signal.SIGUSR1: "SIGUSR1 (Slurm's warning: time limit or preemption)",
    signal.SIGTERM: "SIGTERM",
}

INTERRUPT_REASON = "SIGINT (Ctrl-C)"  # passed on to a launched script's ranks, as torchrun passes Ctrl-C on

_early: list[int] = []  # stop signals that came before fit() took over: while the CLI imported torch and Ray
_watchdog_interrupt = threading.Event()  # the watchdog ends fit() in the main thread (interrupt_main_thread)


def interrupt_main_thread() -> None:
    """End fit() in the main thread as a Ctrl-C would: the watchdog's way out when the cluster is gone."""
    _watchdog_interrupt.set()
    _thread.interrupt_main()


def _watchdog_only(signum, frame) -> None:
    """SIGINT where the process inherited it ignored (a background job of a non-interactive shell, where
    interrupt_main alone does nothing): a real one stays ignored, the watchdog's still ends fit()."""
    if _watchdog_interrupt.is_set():
        raise KeyboardInterrupt


def hold_early_stop_signals() -> None:
    """The CLI's first step: a stop signal while torch and Ray import is kept for fit(), not fatal."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: _early.append(signum))


@dataclass
class StopSignal:
    """The first stop signal of a run, and whether training had already ended by then."""

    reason: str | None = None
    at: float = 0.0
    training_over: bool = False
    monitor: Any = None  # a channel to the run's monitor (worker.channel.MonitorChannel), once training starts
    handler: Callable[[int, Any], None] | None = None  # stop_on_signals' handler, while it is in charge

    def take_back(self) -> None:
        """After ray.init, which sets its own SIGTERM handler (exit at once): a TERM stops at a checkpoint again."""
        if self.handler is not None:
            for signum in STOP_SIGNALS:
                signal.signal(signum, self.handler)

    def forward_to(self, monitor) -> None:
        """From now on the workers hear of a stop; one that came during start-up, at once."""
        self.monitor = monitor
        if self.reason:
            monitor.post("request_stop", self.reason)


@contextmanager
def stop_on_signals():
    """From fit()'s start until the summary is written, SIGUSR1/SIGTERM ask every rank to checkpoint
    at its next step and return (one that comes during start-up: at the first step check).

    A second signal, or one after training ended, is only logged: it must not
    kill the driver before the summary says where to resume from. Handlers can
    only be set from the main thread: elsewhere (a notebook thread, a test)
    signals keep their usual meaning.
    """
    stop = StopSignal()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_signal(signum, frame):
        reason = STOP_SIGNALS[signum]
        if stop.training_over:
            log.warning("Got %s after training ended: nothing left to stop", reason)
        elif stop.reason:
            log.warning("Got %s while already stopping on %s: still waiting for the checkpoint", reason, stop.reason)
        else:
            stop.reason, stop.at = reason, time.time()
            log.warning(
                "Got %s: every rank checkpoints at its next step and stops; run the same command again to resume",
                reason,
            )
            if stop.monitor is not None:
                stop.monitor.post("request_stop", reason)

    stop.handler = on_signal
    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    _watchdog_interrupt.clear()
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL):
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, _watchdog_only)
    if _early:
        on_signal(_early[0], None)
        _early.clear()
    try:
        yield stop
    finally:
        stop.handler = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def interrupts_deferred():
    """While a run winds down, a Ctrl-C is logged, not raised: the summary must still be written."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(
        signal.SIGINT, lambda signum, frame: log.warning("Interrupted again: writing the summary first")
    )
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
