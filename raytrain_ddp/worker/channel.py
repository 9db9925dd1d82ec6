"""How a rank calls the driver's run monitor: one seam, two transports.

The full path's monitor is a Ray actor (:class:`RayChannel`: ``ray.get(handle.method.remote(*args))``);
--quick-start's lives in the driver process itself and answers over a loopback
``multiprocessing.connection`` with an authkey (:class:`LocalChannel`, served by :func:`serve_calls`). Worker code
names a method and its arguments (``channel.call("worker_finished", rank, checksum)``) and never knows which.

No torch here; Ray only where the Ray transport is used.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Protocol

log = logging.getLogger("raytrain_ddp")

CALL_TIMEOUT_S = 30.0  # a call the monitor does not answer in this long fails (the caller retries or gives up)


class MonitorChannel(Protocol):
    """A rank's line to the run monitor. `aggregates`: the monitor hands out node aggregators (the Ray one)."""

    aggregates: bool

    def call(self, method: str, *args: Any, timeout: float | None = CALL_TIMEOUT_S) -> Any:
        """The monitor's `method(*args)`, waited for; its answer."""
        ...

    def post(self, method: str, *args: Any) -> None:
        """The monitor's `method(*args)`, not waited for where the transport allows it."""
        ...


class RayChannel:
    """The Ray actor's handle (the run monitor, or a node's aggregator)."""

    aggregates = True

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def call(self, method: str, *args: Any, timeout: float | None = CALL_TIMEOUT_S) -> Any:
        import ray

        return ray.get(getattr(self.handle, method).remote(*args), timeout=timeout)

    def post(self, method: str, *args: Any) -> None:
        getattr(self.handle, method).remote(*args)


@dataclass(frozen=True)
class LocalAddress:
    """Where the quick path's in-process monitor listens (loopback), and the key a rank proves itself with."""

    host: str
    port: int
    authkey: bytes


class LocalChannel:
    """Calls to the quick path's monitor over one connection; the heartbeat thread and the loop share it."""

    aggregates = False

    def __init__(self, address: LocalAddress) -> None:
        self.connection = Client((address.host, address.port), authkey=address.authkey)
        self.lock = threading.Lock()  # one call at a time on the connection: answers come back in order

    def call(self, method: str, *args: Any, timeout: float | None = CALL_TIMEOUT_S) -> Any:
        with self.lock:
            self.connection.send((method, args))
            if not self.connection.poll(timeout):
                raise TimeoutError(f"the run monitor did not answer {method} within {timeout}s")
            failed, answer = self.connection.recv()
        if failed:
            raise RuntimeError(f"the run monitor's {method} failed: {answer}")
        return answer

    def post(self, method: str, *args: Any) -> None:
        self.call(method, *args)  # a loopback round trip: cheap enough to wait for


def channel_to(monitor: Any) -> MonitorChannel:
    """The channel to the run monitor WorkerArgs carries: a local address (--quick-start) or a Ray actor's handle."""
    return LocalChannel(monitor) if isinstance(monitor, LocalAddress) else RayChannel(monitor)


def serve_calls(listener: Listener, dispatch: Callable[..., Any], stop: threading.Event) -> None:
    """Accept ranks' connections until `stop`, each answered by a thread of its own: `dispatch(method, *args)`'s
    answer, or its error as text (a bad call never ends the server)."""
    while not stop.is_set():
        try:
            connection = listener.accept()
        except (OSError, EOFError, AuthenticationError):  # the listener closed (the run ended), or a wrong key
            if stop.is_set():
                return
            continue
        threading.Thread(target=_answer, args=(connection, dispatch), daemon=True, name="monitor-calls").start()


def _answer(connection: Connection, dispatch: Callable[..., Any]) -> None:
    with connection:
        while True:
            try:
                method, args = connection.recv()
            except (EOFError, OSError):  # the rank exited
                return
            try:
                reply = (False, dispatch(method, *args))
            except Exception as err:  # said to the rank, which raises it
                log.debug("monitor call %s failed", method, exc_info=True)
                reply = (True, f"{type(err).__name__}: {err}")
            try:
                connection.send(reply)
            except OSError:
                return
