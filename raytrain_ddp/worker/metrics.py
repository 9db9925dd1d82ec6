"""What each worker measures, and the collectives that make ranks agree."""

from __future__ import annotations

import hashlib
import math
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class EpochMeter:
    """One rank's view of one training epoch."""

    samples: int = 0
    steps: int = 0
    steps_started: int = 0  # one ahead of `steps` while a step runs (or hangs in its all-reduce)
    loss_sum: torch.Tensor | None = None  # kept on the device: no sync per step
    data_wait_s: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, batch_size: int) -> None:
        weighted = loss.detach() * batch_size
        self.loss_sum = weighted if self.loss_sum is None else self.loss_sum + weighted
        self.samples += batch_size
        self.steps += 1

    def mean_loss(self) -> float:
        return float(self.loss_sum.item()) / max(self.samples, 1) if self.samples else float("nan")

    def seconds(self) -> float:
        return time.perf_counter() - self.started


class Heartbeat:
    """Tells the driver where this rank is, once a second, from a thread of its own.

    The loop only sets attributes (no call, no sync per step); the thread posts
    them fire-and-forget, and keeps posting while the loop is blocked, so the
    driver's watchdog sees every rank's position during a hang. A rank stuck
    inside a collective has *started* one step more than the rank it waits for.
    """

    INTERVAL_S = 1.0

    def __init__(self, monitor, rank: int) -> None:
        self.monitor, self.rank = monitor, rank
        self.phase, self.epoch, self.meter = "starting", 0, EpochMeter()
        threading.Thread(target=self._post_forever, daemon=True, name="heartbeat").start()

    def at(self, phase: str, epoch: int, meter: EpochMeter) -> None:
        self.phase, self.epoch, self.meter = phase, epoch, meter

    def _post_forever(self) -> None:
        while True:
            time.sleep(self.INTERVAL_S)
            meter = self.meter
            loss = meter.mean_loss() if meter.samples else float("nan")
            self.monitor.progress.remote(self.rank, self.epoch, meter.steps_started, meter.samples, loss, self.phase)


@torch.no_grad()
def evaluate(model: nn.Module, batches, loss_fn) -> dict:
    """Validation loss and accuracy over ALL ranks' shards.

    Each rank sums over its own rows, then one all-reduce adds the sums, so
    every rank ends with the identical numbers, whatever rows it held.
    """
    model.eval()
    device = next(model.parameters()).device
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, rows
    for batch in batches:
        logits = model(batch["x"])
        totals[0] += loss_fn(logits, batch["y"]).double() * len(batch["y"])
        totals[1] += (logits.argmax(dim=1) == batch["y"]).sum()
        totals[2] += len(batch["y"])
    if dist.is_initialized():
        dist.all_reduce(totals)
    loss_sum, correct, rows = totals.tolist()
    return {"val_loss": loss_sum / rows, "val_accuracy": correct / rows, "val_rows": int(rows)}


@torch.no_grad()
def sync_buffers(model: nn.Module) -> None:
    """Give every rank rank zero's buffers (BatchNorm statistics).

    DDP keeps parameters identical but each rank updates its BatchNorm running
    statistics on its own batches; validating with rank zero's buffers everywhere
    makes the recorded accuracy exactly what rank zero's checkpoint reproduces.
    """
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def check_finite(loss: float, rank: int, epoch: int, step: int) -> None:
    """Stop on a NaN or infinite loss, saying where: retraining on from there is wasted work."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"training loss is {loss} on rank {rank} at epoch {epoch}, by step {step}; "
                                 "the latest checkpoint holds the last good weights")


def parameter_checksum(model: nn.Module) -> str:
    """A hash of every parameter's bytes: equal on all ranks iff replicas agree."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
