"""What each worker measures, and the collectives that make ranks agree."""

from __future__ import annotations

import hashlib
import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import ray
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raytrain_ddp.worker.aggregator import POST_TIMEOUT_S
from raytrain_ddp.worker.channel import MonitorChannel, RayChannel

log = logging.getLogger("raytrain_ddp")


@dataclass
class EpochMeter:
    """One rank's view of one training epoch, in micro-batches (one forward and backward each).

    The loss is summed on the device (no sync per micro-batch); `loss` is its
    host copy, refreshed only where the loop syncs anyway (`refresh_loss`), so
    that the heartbeat thread never touches the device.
    """

    samples: int = 0
    micro_batches: int = 0
    micro_batches_started: int = 0  # one ahead of `micro_batches` while one runs (or hangs in its all-reduce)
    loss: float = float("nan")  # mean training loss so far, as of the last refresh
    data_wait_s: float = 0.0
    skip_nonfinite: bool = False  # leave NaN/inf losses out of the mean (decided on the device)
    started: float = field(default_factory=time.perf_counter)
    _sums: torch.Tensor | None = None  # on the device: [weighted loss sum, samples counted]
    # --log-every-steps: the steps marked since the last refresh, each with its `_sums` (kept, not copied:
    # `add` makes a new tensor), read at the next refresh; and the records made of them, for the heartbeat
    _marks: list[tuple[dict, torch.Tensor, int, float]] = field(default_factory=list)
    _last_mark: tuple[float, float, int, float] | None = None  # loss sum, counted, samples, time
    step_records: list[dict] = field(default_factory=list)

    def add(self, loss: torch.Tensor, batch_size: int) -> None:
        """Count a micro-batch's loss."""
        loss = loss.detach().float()
        weight = torch.full_like(loss, batch_size)
        if self.skip_nonfinite:
            finite = torch.isfinite(loss)
            loss, weight = torch.where(finite, loss, 0.0), torch.where(finite, weight, 0.0)
        sums = torch.stack([loss * weight, weight])
        self._sums = sums if self._sums is None else self._sums + sums
        self.samples += batch_size
        self.micro_batches += 1

    def mark_step(self, record: dict, grad_norm: torch.Tensor | None = None) -> None:
        """An optimizer step to record in steps.jsonl: its loss (and gradient norm, when computed) are read at
        the next refresh, not now."""
        # [norm, 1.0] or [0.0, 0.0]: a flag, since a NaN norm (with --skip-nonfinite) is one to record
        norm = (
            self._sums.new_zeros(2)
            if grad_norm is None
            else F.pad(grad_norm.detach().float().view(1).to(self._sums.device), (0, 1), value=1.0)
        )
        self._marks.append((record, torch.cat([self._sums, norm]), self.samples, time.perf_counter()))

    def refresh_loss(self) -> float:
        """The mean loss so far, read from the device (one sync): call only at the documented cadences.

        The marked steps are read in the same sync; each becomes a record in `step_records` with this
        rank's mean loss, samples and seconds since the previous marked step (or the epoch's start).
        """
        if self._sums is None:
            return self.loss
        marks, self._marks = self._marks, []
        now = F.pad(self._sums, (0, 2))
        (loss_sum, counted, _, _), *marked = torch.stack([now, *(mark[1] for mark in marks)]).tolist()
        self.loss = loss_sum / counted if counted else float("nan")
        for (record, _, samples, at), (mark_sum, mark_counted, grad_norm, has_norm) in zip(marks, marked):
            last_sum, last_counted, last_samples, last_at = self._last_mark or (0.0, 0.0, 0, self.started)
            window = mark_counted - last_counted
            self.step_records.append(
                {
                    **record,
                    "loss": (mark_sum - last_sum) / window if window else float("nan"),
                    "samples": samples - last_samples,
                    "seconds": at - last_at,
                    **({"grad_norm": grad_norm} if has_norm else {}),
                }
            )
            self._last_mark = (mark_sum, mark_counted, samples, at)
        return self.loss

    def seconds(self) -> float:
        return time.perf_counter() - self.started


class StepClock:
    """Compute time of an epoch's micro-batches: CUDA events on a GPU (what the device spent, host running
    ahead or not), wall clock less the data wait on CPU, where the host is the device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        self._started = time.perf_counter()

    def seconds(self, meter: EpochMeter) -> float:
        """Read once, at the epoch's end (on a GPU: waits for the epoch's last kernel, a sync point anyway)."""
        if not self.cuda:
            return time.perf_counter() - self._started - meter.data_wait_s
        self._end.record()
        self._end.synchronize()
        return self._start.elapsed_time(self._end) / 1000


class Heartbeat:
    """Tells the driver where this rank is, once a second, from a thread of its own.

    The loop only sets attributes (no call, no sync per micro-batch); the thread
    posts them with `post(rank, epoch, micro_batches_started, samples, loss,
    phase, phase_done, step_records)` (the steps.jsonl records the loop's
    last loss refresh made), which answers a stop reason or None, and keeps posting
    while the loop is blocked, so the driver's watchdog sees every rank's
    position during a hang. It reads host values only: a device read would
    queue behind the very kernel (an NCCL all-reduce) that hangs. A rank stuck
    inside a collective has *started* one micro-batch more than the rank it
    waits for. Long phases report their own progress (`advance`), and a
    torch.compile compilation shows as the phase "compiling" (`follow_compiles`),
    so that a long validation pass, checkpoint or first compiled step moves.
    """

    INTERVAL_S = 1.0

    def __init__(self, post, rank: int, stop_reason: str | None = None) -> None:
        self.post, self.rank = post, rank
        self.step_records: deque[dict] = deque()  # the loop's steps.jsonl records, posted with the next beat
        self.sending = threading.Lock()  # a rank's step records reach the driver in step order
        self.phase, self.epoch, self.meter = "starting", 0, EpochMeter()
        # progress inside the phase: validation batches done, CHECKPOINT_STAGES index, bytes of shards written
        self.phase_done = 0
        self.compiling = False
        self.stop_reason = stop_reason  # set when the driver asks the run to stop (preemption)
        threading.Thread(target=self._post_forever, daemon=True, name="heartbeat").start()

    def at(self, phase: str, epoch: int, meter: EpochMeter) -> None:
        self.phase_done, self.phase, self.epoch, self.meter = 0, phase, epoch, meter

    def advance(self, done: int) -> None:
        """Progress inside the current phase: validation batches done, or the checkpoint stage reached."""
        self.phase_done = done

    def writing_checkpoint(self, written: int) -> None:
        """Waiting for a sharded checkpoint's background write (ShardedSaver.flush): the bytes its shards hold."""
        self.phase, self.phase_done = "writing checkpoint", written

    def follow_compiles(self) -> None:
        """Report torch.compile's compilations (the first step's, a recompile's) as the phase "compiling"."""
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._compile_started)
        callback_handler.register_end_callback(self._compile_ended)

    def _compile_started(self, *_args) -> None:  # older torch releases pass no arguments
        self.compiling = True

    def _compile_ended(self, *_args) -> None:
        self.compiling = False

    def send_step_records(self, send: Callable[[list[dict]], object]) -> None:
        """`send(records)` the step records not yet posted (with the epoch's message), in order with the beats."""
        with self.sending:
            send(self._take_step_records())

    def _take_step_records(self) -> list[dict]:
        return [self.step_records.popleft() for _ in range(len(self.step_records))]

    def _post_forever(self) -> None:
        while True:
            time.sleep(self.INTERVAL_S)
            meter, phase = self.meter, "compiling" if self.compiling else self.phase
            with self.sending:
                records = self._take_step_records()
                try:
                    self.stop_reason = (
                        self.post(
                            self.rank,
                            self.epoch,
                            meter.micro_batches_started,
                            meter.samples,
                            meter.loss,
                            phase,
                            self.phase_done,
                            records,
                        )
                        or self.stop_reason
                    )
                except Exception:  # the monitor restarting or busy: keep beating, ask again next time
                    self.step_records.extendleft(reversed(records))


class DriverLink:
    """A rank's news to the driver: its heartbeats and epoch messages through its node's aggregator (one
    message a second per node: `raytrain_ddp.worker.aggregator`), straight to the run monitor while that
    aggregator is gone (a rank never falls silent for want of one), or where the monitor hands out none
    (--quick-start's, in the driver process). :meth:`call` is every call a rank makes to the driver."""

    def __init__(self, channel: MonitorChannel, rank: int) -> None:
        self.channel, self.rank = channel, rank
        self.aggregator: RayChannel | None = None  # to the node's NodeAggregator actor, when the monitor gives one
        self.stop_reason: str | None = None  # the driver's stop request as it stood when the rank started
        self._said_gone = False
        try:
            if channel.aggregates:
                where = ray.get_runtime_context().get_node_id(), socket.gethostname()
                aggregator, self.stop_reason = channel.call("aggregator_for", *where, timeout=POST_TIMEOUT_S)
                self.aggregator = RayChannel(aggregator)
            else:
                self.stop_reason = channel.call("stop_requested", timeout=POST_TIMEOUT_S)
        except Exception as err:  # an old monitor, or one busy: the rank posts to it directly
            log.warning("rank %d: no node aggregator (%s); posting to the run monitor directly", rank, err)

    def post(self, *progress):
        """Heartbeat's `post`: answers the driver's stop request, if any."""
        return self._send("progress", *progress)

    def epoch_finished(self, metrics: dict, step_records: list[dict]) -> None:
        """The epoch's message; returns once the driver's monitor has it."""
        self._send("epoch_finished", self.rank, metrics, step_records)

    def add_step_records(self, step_records: list[dict]) -> None:
        """A launched rank's last reports; returns once the driver's monitor has them."""
        self._send("add_step_records", self.rank, step_records)

    def call(self, method: str, *args, timeout: float | None = POST_TIMEOUT_S):
        """The run monitor's `method(*args)`, waited for (no aggregator in between)."""
        return self.channel.call(method, *args, timeout=timeout)

    def _send(self, method: str, *args):
        if self.aggregator is not None:
            try:
                return self.aggregator.call(method, *args, timeout=POST_TIMEOUT_S)
            except ray.exceptions.RayActorError as err:  # its process gone (restarting, or for good): the monitor
                if not self._said_gone:
                    log.warning("rank %d: its node aggregator is gone (%s); posting to the run monitor", self.rank, err)
                self._said_gone = True
        return self.call(method, *args)


class WarningsToDriver(logging.Handler):
    """A logger's warnings on this rank (raytrain_ddp.storage's: a write it retries) on the driver's console too:
    Ray's worker output is kept off it. Posted without waiting where the channel allows: a rank never waits for
    the console."""

    def __init__(self, channel: MonitorChannel, rank: int) -> None:
        super().__init__(logging.WARNING)
        self.channel, self.rank = channel, rank

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.channel.post("warning", self.rank, record.getMessage())
        except Exception:  # the monitor gone (the run ending): the line stays in this worker's log
            self.handleError(record)


def default_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension: classes [batch, classes], or next tokens [batch, length, vocab]."""
    return F.cross_entropy(outputs.flatten(0, -2), targets.flatten())


def all_ranks_agree(local_flags: tuple[bool, ...], device: torch.device) -> tuple[bool, ...]:
    """Each flag true on every rank iff it is true on any rank (a collective: call at the same step everywhere).

    Several flags travel in one all-reduce, so deciding them costs the one wait for the device."""
    if not dist.is_initialized():
        return local_flags
    flags = torch.stack([torch.full((), float(flag), device=device) for flag in local_flags])  # fills, no copy
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return tuple(bool(flag) for flag in flags.tolist())  # the one sync


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches,
    loss_fn,
    device: torch.device,
    lockstep: tuple[dict | None, int] | None = None,
    on_batch: Callable[[int], None] | None = None,
    task: bool = False,
) -> dict:
    """Validation loss and accuracy (per target: a class, or a next token) over ALL ranks' shards; with `task`,
    `loss_fn` is the task's validation_step(model, batch) -> {name: sum over the batch, "count": rows}, and the
    result each name's mean over all rows, as val_NAME.

    Each rank sums over its own rows, then one all-reduce adds the sums, so
    every rank ends with the identical numbers, whatever rows it held.
    With `lockstep` = (padding batch, the most batches any rank has) (FSDP,
    whose forward is itself a collective) every rank runs that many forwards,
    running the padding batch (None: its last batch again) uncounted once it has run out: val shards may
    differ by a batch. `on_batch(n)` is told after the n-th forward was
    launched (a padding one too).
    """
    model.eval()
    if lockstep is not None:
        batches = _padded(batches, *lockstep)
    sums: dict[str, torch.Tensor] = {}
    for done, batch in enumerate(batches, start=1):
        outputs = loss_fn(model, batch) if task else model(batch["x"])  # a padding batch too: FSDP's lockstep
        if on_batch is not None:
            on_batch(done)
        if batch.get("padding"):  # uncounted (the built-in padding batch has no targets)
            continue
        counted = _task_sums(outputs) if task else _classification_sums(outputs, batch, loss_fn)
        for name, value in counted.items():
            sums[name] = sums[name] + value if name in sums else value.to(device, torch.float64)
    names = _names_over_ranks(sums) if task else ["loss", "correct", "targets", "rows"]
    totals = torch.stack([sums.get(name, torch.zeros((), dtype=torch.float64, device=device)) for name in names])
    if dist.is_initialized():
        dist.all_reduce(totals)
    total = dict(zip(names, totals.tolist()))
    if task:
        rows = total.pop("count")
        return {**{f"val_{name}": value / rows for name, value in total.items()}, "val_rows": int(rows)}
    return {
        "val_loss": total["loss"] / total["targets"],
        "val_accuracy": total["correct"] / total["targets"],
        "val_rows": int(total["rows"]),
    }


def _classification_sums(outputs: torch.Tensor, batch: dict, loss_fn) -> dict[str, torch.Tensor]:
    targets = batch["y"].numel()
    return {
        "loss": loss_fn(outputs, batch["y"]).double() * targets,
        "correct": (outputs.argmax(dim=-1) == batch["y"]).sum(),
        "targets": torch.tensor(float(targets)),
        "rows": torch.tensor(float(len(batch["y"]))),
    }


def _task_sums(sums: dict) -> dict[str, torch.Tensor]:
    """A task's validation_step result as float64 tensors; it must count its rows."""
    if not isinstance(sums, dict) or "count" not in sums:
        raise TypeError(
            "validation_step must return a dict of sums over the batch with the batch's row count under 'count', "
            f"got {type(sums).__name__}{' without count' if isinstance(sums, dict) else ''}"
        )
    return {name: torch.as_tensor(value, dtype=torch.float64).detach() for name, value in sums.items()}


def _names_over_ranks(sums: dict) -> list[str]:
    """Every name any rank's validation_step returned, in one order on every rank (a rank may have no batch)."""
    names = {"count", *sums}
    if dist.is_initialized():
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, sorted(names))
        names = names.union(*every)
    return sorted(names)


def _padded(batches: Iterable[dict], padding: dict | None, count: int) -> Iterator[dict]:
    """`batches`, then the padding batch (marked uncounted; None: the last batch) until `count` batches have gone
    by."""
    done, last = 0, None
    for last in batches:
        done += 1
        yield last
    for _ in range(count - done):
        yield dict(padding if padding is not None else last, padding=True)


def task_loss(result) -> torch.Tensor:
    """A task's training_step result: the loss, or a dict holding it under "loss"."""
    return result["loss"] if isinstance(result, dict) else result


def batch_rows(batch: dict) -> int:
    """The rows of a batch: its first tensor's length (a task's batches hold whatever columns the data has)."""
    return len(next(value for name, value in batch.items() if isinstance(value, torch.Tensor) and name != "id"))


def most_over_ranks(count: int, device: torch.device) -> int:
    """The largest `count` of any rank (one all-reduce)."""
    most = torch.tensor([count], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


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


def check_finite(loss: float, rank: int, epoch: int, micro_batch: int) -> None:
    """Stop on a NaN or infinite loss, saying where: retraining on from there is wasted work."""
    if not math.isfinite(loss):
        raise FloatingPointError(
            f"training loss is {loss} on rank {rank} at epoch {epoch}, micro-batch {micro_batch}; "
            "the latest checkpoint holds the last good weights"
        )


def parameter_checksum(model: nn.Module) -> str:
    """A hash of every parameter's bytes: equal on all ranks iff replicas agree.

    FSDP parameters are gathered whole first (a collective: every rank calls this).
    """
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        digest.update(name.encode())
        digest.update(full.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]
