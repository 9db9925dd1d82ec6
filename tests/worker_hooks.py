"""Worker hooks the tests install: `fit(config, hooks=SlowData(rank=0, seconds=0.2))`, or for a command,
RAYTRAIN_WORKER_HOOKS=worker_hooks:<name> with the arguments in RAYTRAIN_WORKER_HOOKS_ARGS (JSON; see
`command_hooks`). Made in the driver, they travel to the workers pickled, arguments and all.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

from raytrain_ddp.worker.hooks import WorkerHooks

TESTS = Path(__file__).resolve().parent


def command_hooks(name: str, **arguments) -> dict[str, str]:
    """The environment that installs hooks `name`(**arguments) in a command's run (this folder on its path)."""
    return {
        "RAYTRAIN_WORKER_HOOKS": f"worker_hooks:{name}",
        "RAYTRAIN_WORKER_HOOKS_ARGS": json.dumps(arguments),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }


@dataclass
class SlowValidation(WorkerHooks):
    """Every rank sleeps `seconds` after each validation batch of epoch 1 (a pass longer than the hang timeout,
    each batch well inside it); then `stall_at` = (rank, epoch, batch): that rank sleeps for good (an hour)
    after that validation batch."""

    seconds: float
    stall_at: tuple[int, int, int]

    def on_validation_batch(self, rank: int, epoch: int, batch: int) -> None:
        if epoch == 1:
            time.sleep(self.seconds)
        if (rank, epoch, batch) == tuple(self.stall_at):
            time.sleep(3600)


@dataclass
class SlowData(WorkerHooks):
    """That rank waits this long for every batch."""

    rank: int
    seconds: float

    def on_fetch(self, rank: int) -> None:
        if rank == self.rank:
            time.sleep(self.seconds)


@dataclass
class SlowDataThenCompute(WorkerHooks):
    """In epoch 1 that rank waits `data_seconds` for every training batch (its input pipeline is the
    bottleneck); from epoch 2 on it spends `compute_seconds` more on every micro-batch instead (its compute is)."""

    rank: int
    data_seconds: float
    compute_seconds: float
    epoch: int = 1  # of the next fetch: the loop fetches a batch ahead, so micro-batches cannot tell it

    def on_fetch(self, rank: int) -> None:
        if rank == self.rank and self.epoch == 1:
            time.sleep(self.data_seconds)

    def on_micro_batch(self, rank: int, epoch: int, micro_batch: int) -> None:
        if rank == self.rank and epoch >= 2:
            time.sleep(self.compute_seconds)

    def on_validation_batch(self, rank: int, epoch: int, batch: int) -> None:
        self.epoch = epoch + 1  # validation ends a training epoch


@dataclass
class DieOnce(WorkerHooks):
    """At `at` = (rank, epoch, micro_batch) that rank's process exits (after `wait_s`), the first time only
    (directory/died marks it), as a killed process would: Ray Train restarts the group, a new attempt. The wait
    lets Ray Train's controller take in the checkpoints reported before (it polls the workers every 2 s)."""

    directory: str
    at: tuple[int, int, int]
    wait_s: float = 0.0

    def on_micro_batch(self, rank: int, epoch: int, micro_batch: int) -> None:
        marker = os.path.join(self.directory, "died")
        if (rank, epoch, micro_batch) == tuple(self.at) and not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(self.wait_s)
            os._exit(1)


@dataclass
class CountSyncs(WorkerHooks):
    """Each rank counts the calls that make the host wait for the device, from the end of micro-batch `first`
    of epoch 1 to the end of micro-batch `last`, in every thread of its process, and writes
    {"count": n, "calls": {...}} to directory/rank-R.json."""

    directory: str
    first: int
    last: int
    calls: dict[str, int] | None = field(default=None)  # None: not counting

    def on_fetch(self, rank: int) -> None:
        if not getattr(self, "_installed", False):
            self._installed = True
            count_synchronising_calls(self._count)

    def _count(self, name: str) -> None:
        if self.calls is not None:
            self.calls[name] = self.calls.get(name, 0) + 1

    def on_micro_batch(self, rank: int, epoch: int, micro_batch: int) -> None:
        if epoch != 1:
            return
        if micro_batch == self.first:
            self.calls = {}
        elif micro_batch == self.last:
            calls, self.calls = self.calls, None
            with open(os.path.join(self.directory, f"rank-{rank}.json"), "w") as file:
                json.dump({"count": sum(calls.values()), "calls": calls}, file)


def count_synchronising_calls(count) -> None:
    """Patch torch so that each call that can make the host wait for the device calls count(name) first:
    Tensor.item / __bool__ / cpu / tolist, torch.tensor(..., device=...), and Tensor.to(device) not marked
    non_blocking (on CPU these wait for nothing, but they are the calls that would on a GPU)."""
    for name in ("item", "__bool__", "cpu", "tolist"):
        original = getattr(torch.Tensor, name)
        setattr(torch.Tensor, name, _counting(original, f"Tensor.{name}", count))

    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        targets = [*args, kwargs.get("device")]
        if not kwargs.get("non_blocking") and any(isinstance(t, (torch.device, str, torch.Tensor)) for t in targets):
            count("Tensor.to (blocking)")
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to
    original_tensor = torch.tensor

    def tensor(*args, **kwargs):
        if kwargs.get("device") is not None:
            count("torch.tensor(device=)")
        return original_tensor(*args, **kwargs)

    torch.tensor = tensor


def _counting(original, name: str, count):
    def counted(self, *args, **kwargs):
        count(name)
        return original(self, *args, **kwargs)

    return counted


@dataclass
class FillDisk(WorkerHooks):
    """At the first micro-batch of `epoch`, rank 0 fills the file system that holds `ballast` with that file
    (allocated, not written) until `bytes_left` bytes are free: the disk fills at a known point, whatever the run
    wrote before."""

    ballast: str
    bytes_left: int
    epoch: int

    def on_micro_batch(self, rank: int, epoch: int, micro_batch: int) -> None:
        if (rank, epoch, micro_batch) == (0, self.epoch, 1):
            disk = os.statvfs(os.path.dirname(self.ballast))
            with open(self.ballast, "wb") as file:
                os.posix_fallocate(file.fileno(), 0, disk.f_bavail * disk.f_frsize - self.bytes_left)


@dataclass
class StoreFault(WorkerHooks):
    """At the first micro-batch of `epoch`, rank 0 waits `wait_s` (Ray Train's controller takes in the checkpoint
    reported before: it polls every 0.5 s), then GETs `control`, the URL at which the test's store proxy
    (tests/test_storage_retry.py) starts a fault: the store fails at a known point, whatever the run did before."""

    control: str
    epoch: int
    wait_s: float = 2.0

    def on_micro_batch(self, rank: int, epoch: int, micro_batch: int) -> None:
        if (rank, epoch, micro_batch) == (0, self.epoch, 1):
            time.sleep(self.wait_s)
            with urllib.request.urlopen(self.control, timeout=10) as answer:
                answer.read()
