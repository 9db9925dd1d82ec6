"""Worker hooks the tests install with RAYTRAIN_WORKER_HOOKS=worker_hooks:<name>.

Each factory runs in the driver, so parameters come from the test's environment
and travel to the workers inside the pickled object.
"""

from __future__ import annotations

import json
import os
import time

import torch

from raytrain_ddp.worker.hooks import WorkerHooks


def _numbers(variable: str) -> list[float]:
    return [float(v) for v in os.environ[variable].split(":")]


class SlowValidation(WorkerHooks):
    """RAYTRAIN_TEST_SLOW_VALIDATION=seconds:rank:epoch:batch: every rank sleeps `seconds` after each validation
    batch of epoch 1 (a pass longer than the hang timeout, each batch well inside it); then `rank` sleeps for
    good (an hour) after validation batch `batch` of `epoch`."""

    def __init__(self) -> None:
        self.seconds, rank, epoch, batch = _numbers("RAYTRAIN_TEST_SLOW_VALIDATION")
        self.stall_at = (int(rank), int(epoch), int(batch))

    def on_validation_batch(self, rank: int, epoch: int, batch: int) -> None:
        if epoch == 1:
            time.sleep(self.seconds)
        if (rank, epoch, batch) == self.stall_at:
            time.sleep(3600)


class SlowData(WorkerHooks):
    """RAYTRAIN_TEST_SLOW_DATA=rank:seconds: that rank waits this long for every batch."""

    def __init__(self) -> None:
        rank, self.seconds = _numbers("RAYTRAIN_TEST_SLOW_DATA")
        self.rank = int(rank)

    def on_fetch(self, rank: int) -> None:
        if rank == self.rank:
            time.sleep(self.seconds)


class SlowDataThenCompute(WorkerHooks):
    """RAYTRAIN_TEST_SLOW_RANK=rank:data_seconds:compute_seconds: in epoch 1 that rank waits `data_seconds` for
    every training batch (its input pipeline is the bottleneck); from epoch 2 on it spends `compute_seconds`
    more on every micro-batch instead (its compute is)."""

    def __init__(self) -> None:
        rank, self.data_seconds, self.compute_seconds = _numbers("RAYTRAIN_TEST_SLOW_RANK")
        self.rank = int(rank)
        self.epoch = 1  # of the next fetch: the loop fetches a batch ahead, so micro-batches cannot tell it

    def on_fetch(self, rank: int) -> None:
        if rank == self.rank and self.epoch == 1:
            time.sleep(self.data_seconds)

    def on_micro_batch(self, rank: int, epoch: int, micro_batch: int) -> None:
        if rank == self.rank and epoch >= 2:
            time.sleep(self.compute_seconds)

    def on_validation_batch(self, rank: int, epoch: int, batch: int) -> None:
        self.epoch = epoch + 1  # validation ends a training epoch


class DieOnce(WorkerHooks):
    """RAYTRAIN_TEST_DIE_ONCE=directory:rank:epoch:micro_batch[:seconds]: that rank's process exits there (after
    `seconds`), the first time only (directory/died marks it), as a killed process would: Ray Train restarts the
    group, a new attempt. The wait lets Ray Train's controller take in the checkpoints reported before (it polls
    the workers every 2 s)."""

    def __init__(self) -> None:
        self.directory, *at = os.environ["RAYTRAIN_TEST_DIE_ONCE"].split(":")
        self.at = tuple(int(n) for n in at[:3])
        self.wait_s = float(at[3]) if len(at) > 3 else 0.0

    def on_micro_batch(self, rank: int, epoch: int, micro_batch: int) -> None:
        marker = os.path.join(self.directory, "died")
        if (rank, epoch, micro_batch) == self.at and not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(self.wait_s)
            os._exit(1)


class CountSyncs(WorkerHooks):
    """RAYTRAIN_TEST_COUNT_SYNCS=directory:first:last: each rank counts the calls that make the host wait for
    the device, from the end of micro-batch `first` of epoch 1 to the end of micro-batch `last`, in every
    thread of its process, and writes {"count": n, "calls": {...}} to directory/rank-R.json."""

    def __init__(self) -> None:
        directory, first, last = os.environ["RAYTRAIN_TEST_COUNT_SYNCS"].split(":")
        self.directory, self.first, self.last = directory, int(first), int(last)
        self.calls: dict[str, int] | None = None  # None: not counting

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


class FillDisk(WorkerHooks):
    """RAYTRAIN_TEST_FILL_DISK=ballast:bytes_left:epoch: at the first micro-batch of `epoch`, rank 0 fills the file
    system that holds `ballast` with that file (allocated, not written) until `bytes_left` bytes are free: the
    disk fills at a known point, whatever the run wrote before."""

    def __init__(self) -> None:
        self.ballast, left, epoch = os.environ["RAYTRAIN_TEST_FILL_DISK"].split(":")
        self.bytes_left, self.epoch = int(left), int(epoch)

    def on_micro_batch(self, rank: int, epoch: int, micro_batch: int) -> None:
        if (rank, epoch, micro_batch) == (0, self.epoch, 1):
            disk = os.statvfs(os.path.dirname(self.ballast))
            with open(self.ballast, "wb") as file:
                os.posix_fallocate(file.fileno(), 0, disk.f_bavail * disk.f_frsize - self.bytes_left)
