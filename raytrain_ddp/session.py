"""What a script of your own may tell the run, and ask of it: optional, and the same under torchrun.

    from raytrain_ddp import session

    session.report({"loss": loss, "accuracy": acc}, step=epoch)   # steps.jsonl, the console, TensorBoard, trackers
    snapshot = session.checkpoint_dir() / "snapshot.pt"            # where rank zero saves, and every rank resumes from
    if session.should_stop(): ...                                  # Slurm's time limit or a preemption: save and exit

Under ``raytrain-ddp launch`` (a script) or ``raytrain_ddp.launch(fn)`` (a function) the project sets
:data:`SESSION_ENV` (this rank's channel: a folder it reads ``reports.jsonl`` from and writes ``stop`` in) and
:data:`CHECKPOINT_DIR_ENV`; with object storage (``--storage-path s3://...``) rank zero's process also gets
:data:`CHECKPOINT_STORE_ENV`, the store's copy of the checkpoint folder, which its local folder is uploaded to
(what changed) at each report and when the script exits. Elsewhere (plain ``torchrun``, ``python script.py``)
reports are printed by rank zero, the checkpoint folder is ``$RAYTRAIN_DDP_CHECKPOINT_DIR`` or ``./checkpoints``,
and ``should_stop()`` turns true when SIGUSR1 or SIGTERM arrives (torchrun forwards SIGTERM): the same script
runs everywhere.
This module imports neither torch nor Ray.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Mapping
from pathlib import Path

SESSION_ENV = "RAYTRAIN_DDP_SESSION"
CHECKPOINT_DIR_ENV = "RAYTRAIN_DDP_CHECKPOINT_DIR"
CHECKPOINT_STORE_ENV = "RAYTRAIN_DDP_CHECKPOINT_STORE"  # rank zero's, with object storage: the folder's URI
REPORTS_FILE = "reports.jsonl"
RESTORED_FILE = "restored.json"  # the checkpoint files restored from the store before the script started
STOP_FILE = "stop"
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

_reports_made = 0  # this process's reports: the default step
_signalled: list[str] = []  # a stop signal caught by the handler should_stop() installs
_uploaded: dict[str, tuple[int, int]] = {}  # the checkpoint folder's files as last uploaded: (size, mtime)


def report(metrics: Mapping[str, float], step: int | None = None) -> None:
    """Record numbers for this rank at `step` (default: the count of earlier reports). Call it on every rank,
    with the same steps: the driver records a step once every rank has reported it (mean, min, max over ranks).
    Values must be numbers (a tensor: call ``.item()`` first)."""
    global _reports_made
    numbers = {key: _number(key, value) for key, value in metrics.items()}
    record = {"step": _reports_made if step is None else int(step), **numbers}
    _reports_made += 1
    upload_checkpoint()  # before the driver can read the report: what was saved before it is in the store
    channel = os.environ.get(SESSION_ENV)
    if channel:
        with open(Path(channel) / REPORTS_FILE, "a") as file:  # one line per write: the reader sees whole lines
            file.write(json.dumps(record) + "\n")
    elif os.environ.get("RANK", "0") == "0":
        figures = ", ".join(f"{key} {value:.6g}" for key, value in numbers.items())
        print(f"step {record['step']}: {figures}", flush=True)


def checkpoint_dir() -> Path:
    """The folder for this run's snapshot: rank zero writes there, every rank may read. It survives a restart,
    a requeued Slurm job and running the same command again, so a script resumes from what it finds there."""
    path = Path(os.environ.get(CHECKPOINT_DIR_ENV) or "checkpoints")
    path.mkdir(parents=True, exist_ok=True)
    return path


def upload_checkpoint() -> None:
    """With object storage, rank zero's: the checkpoint folder's new and changed files to the store (and files
    deleted there too). Here, in the script's own process, between its calls: never a file half written.
    Called by :func:`report` and when the script exits; elsewhere it does nothing."""
    store = os.environ.get(CHECKPOINT_STORE_ENV)
    if store:
        from raytrain_ddp import storage  # pyarrow: only where there is a store

        _take_restored()
        storage.upload_changed(checkpoint_dir(), storage.location(store), _uploaded)


def _take_restored() -> None:
    """Once: the files the launcher restored from the store count as uploaded (as they are: changed, they go up)."""
    channel = os.environ.get(SESSION_ENV)
    restored = Path(channel) / RESTORED_FILE if channel else None
    if restored is not None and restored.exists():
        _uploaded.update({name: (size, mtime) for name, (size, mtime) in json.loads(restored.read_text()).items()})
        restored.unlink()


def should_stop() -> bool:
    """True once the run was asked to stop (Slurm's time-limit warning, a preemption, SIGTERM): save a snapshot
    and return. The first call also keeps SIGUSR1/SIGTERM from ending this process, where nothing else handles
    them, so that the script stops at its own next check instead."""
    _catch_stop_signals()
    channel = os.environ.get(SESSION_ENV)
    return bool(_signalled) or (bool(channel) and (Path(channel) / STOP_FILE).exists())


def _catch_stop_signals() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # handlers can only be set from the main thread (a launched function runs in a worker thread)
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, lambda number, frame: _signalled.append(signal.Signals(number).name))


def _number(key: str, value) -> float:
    if hasattr(value, "item"):  # a one-element tensor or numpy scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"session.report: {key!r} is {type(value).__name__}, not a number")
    return value
