"""The loop every training worker runs, one process per GPU (or CPU slot).

Ray Train has already set up the process group (gloo on CPU, NCCL on GPU).
Read top to bottom: build the model the same way on every rank, spread it
over the ranks (DDP or FSDP), resume if there is a checkpoint, then per
epoch: train on this rank's shard, validate over all ranks, let rank zero
checkpoint, report. A stop request (Slurm preemption) ends the loop at the
next agreed step boundary with a checkpoint that resumes mid-epoch; interval
checkpoints (--checkpoint-every-steps/-minutes) are the same checkpoint taken
without stopping.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn

from raytrain_ddp import storage
from raytrain_ddp.checkpoint import ranking
from raytrain_ddp.checkpoint import saver as ckpt
from raytrain_ddp.checkpoint.state import Position, plain_state, position_of
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.pipeline import rank_inputs
from raytrain_ddp.data.spec import DataSpec
from raytrain_ddp.errors import plural, storage_full_as
from raytrain_ddp.files import write_atomic
from raytrain_ddp.models import build_model
from raytrain_ddp.plugins import load_object, make_loss, make_task
from raytrain_ddp.worker import strategy
from raytrain_ddp.worker.args import UserCode, WorkerArgs
from raytrain_ddp.worker.channel import MonitorChannel, channel_to
from raytrain_ddp.worker.device_feed import DeviceFeed, padding_batch
from raytrain_ddp.worker.flops import peak_tflops, training_flops_per_sample
from raytrain_ddp.worker.hooks import WorkerHooks
from raytrain_ddp.worker.metrics import (
    DriverLink,
    EpochMeter,
    Heartbeat,
    StepClock,
    WarningsToDriver,
    all_ranks_agree,
    batch_rows,
    check_finite,
    default_loss,
    evaluate,
    most_over_ranks,
    parameter_checksum,
    sync_buffers,
    task_loss,
)
from raytrain_ddp.worker.phases import CHECKPOINT_STAGES
from raytrain_ddp.worker.profile import StepProfile
from raytrain_ddp.worker.schedule import make_scheduler, optimizer_steps_per_epoch, resume_schedule

log = logging.getLogger("raytrain_ddp.worker")

NAN_CHECK_EVERY = 100  # micro-batches between loss checks: each one waits for the device
STOP_CHECK_EVERY = 10  # optimizer steps between all-ranks checks for a stop or a timed checkpoint (one all-reduce)


def make_optimizer(config: TrainConfig, model: nn.Module, world_size: int) -> torch.optim.Optimizer:
    lr = config.lr_for(world_size)
    if config.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=config.momentum, weight_decay=config.weight_decay)


def make_loss_fn(config: TrainConfig, loss_fn=None):
    """The Python API's callable, else --loss's import path, else cross-entropy."""
    if loss_fn is None and config.loss:
        loss_fn = make_loss(load_object(config.loss, "--loss"))
    return loss_fn or default_loss


def save_sample_ids(config: TrainConfig, epoch: int, rank: int, batches: list) -> None:
    """The ids this rank trained on this epoch, in order: RUN_DIR/sample_ids/epoch-E-rank-R.npy (on object
    storage too: one object, written whole)."""
    directory = config.run_dir / "sample_ids"
    array = io.BytesIO()
    np.save(array, np.concatenate(batches) if batches else np.empty(0, np.int64))
    with storage_full_as(f"the sample ids of epoch {epoch}", directory):
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / f"epoch-{epoch}-rank-{rank}.npy", array.getvalue())


def _storage_warnings_to(channel: MonitorChannel, rank: int) -> None:
    """This rank's object-store retries (its checkpoint uploads) said on the driver's console, once each."""
    storage_log = logging.getLogger(storage.__name__)
    storage_log.handlers[:] = [WarningsToDriver(channel, rank)]  # one, however often a group restarts here
    storage_log.setLevel(logging.INFO)


def _rank_device(config: TrainConfig) -> torch.device:
    """This rank's device: Ray Train's choice, or under --quick-start (no Ray worker) the torchrun way, a GPU per
    local rank (Ray Train's local mode has made it the current one)."""
    if not config.quick_start:
        return ray.train.torch.get_device()
    return torch.device("cuda", torch.cuda.current_device()) if config.use_gpu else torch.device("cpu")


def _where(device: torch.device, quick: bool) -> dict:
    """Where this rank runs, for the driver's records; under --quick-start there is no Ray node (no Ray at all)."""
    return {
        "hostname": socket.gethostname(),
        "node_ip": "127.0.0.1" if quick else ray.util.get_node_ip_address(),
        "device": str(device),
        "pid": os.getpid(),
        "node_id": "local" if quick else ray.get_runtime_context().get_node_id(),
    }


def _label_worker_logs(rank: int) -> None:
    """Every line this worker logs says which rank and host it came from."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank} on {socket.gethostname()}] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def fed_batches(
    batches: Iterable[dict], feed: DeviceFeed, meter: EpochMeter, hooks: WorkerHooks, rank: int
) -> Iterator[tuple[dict, bool]]:
    """(device batch, is_last) pairs, the next batch's copy started before the current one is handed out.

    The meter's data wait times only the host-side fetch: the copies are
    asynchronous, so it never includes waiting for the device. Knowing the last
    batch lets a gradient-accumulation group that the epoch cuts short still
    end with a synchronising step.
    """

    def timed() -> Iterator[dict]:
        iterator = iter(batches)
        while True:
            waited_from = time.perf_counter()
            hooks.on_fetch(rank)
            batch = next(iterator, None)
            meter.data_wait_s += time.perf_counter() - waited_from
            if batch is None:
                return
            yield batch

    return feed.ahead(timed())


@dataclass
class EpochRun:
    """What one epoch of training leaves for validation, the epoch record and a stop checkpoint."""

    meter: EpochMeter
    optimizer_steps: int = 0  # this epoch's, counting those done before a resume
    skipped_steps: int = 0
    stop_reason: str | None = None
    seen_ids: list = field(default_factory=list)
    train_seconds: float = 0.0
    compute_seconds: float = 0.0  # see StepClock


# What the order of an epoch's micro-batches depends on besides the world size (pipeline.rest_of_epoch_pieces)
REPLAYED_SETTINGS = ("seed", "batch_size", "grad_accum")


class RankTrainer:
    """Model, optimizer, schedule and scaler of one rank, and the two things done with them per batch."""

    def __init__(self, config: TrainConfig, spec: DataSpec, device: torch.device, code: UserCode, world_size: int):
        self.config, self.device, self.world_size = config, device, world_size
        strategy.setup_device(config, device)
        # The same seed on every rank gives the same initial weights (DDP also
        # broadcasts rank zero's at wrap time); the data order comes from Ray Data.
        torch.manual_seed(config.seed)
        model = build_model(config, spec, code.model_fn)
        self.peak_tflops = peak_tflops(device, config.peak_tflops)
        # Counted before sharding, on GPUs (or given a peak): the counter's first use imports torch._dynamo (2 s)
        counted = (device.type == "cuda" or self.peak_tflops is not None) and not config.task  # a task's: any columns
        self.flops_per_sample = training_flops_per_sample(model, padding_batch(spec, "cpu")["x"]) if counted else None
        self.model, self.grad_syncs = strategy.distribute(model, config, device)
        self.optimizer = make_optimizer(config, self.model, self.world_size)  # after FSDP: it steps the local shards
        self.epoch_steps = optimizer_steps_per_epoch(spec.train_rows // self.world_size, config)
        self.scheduler = make_scheduler(self.optimizer, config, self.epoch_steps)
        self.scaler = strategy.grad_scaler(config, device)
        self.loss_fn = make_loss_fn(config, code.loss_fn)
        self.task = (
            None if code.task is None else make_task(code.task, config, repr(config.task))
        )  # --task: the user's step
        self.grad_norm: torch.Tensor | None = None  # the last optimizer step's, when computed
        sharded, rank = config.checkpoint_format == "sharded", dist.get_rank()
        self.saver = ckpt.ShardedSaver(config.run_dir, rank) if sharded else ckpt.FullSaver(config, rank)

    def restore(self, state: dict, resizable: bool) -> Position:
        """Load a checkpoint; where it was taken mid-epoch at another world size, the epoch goes on with the
        rows not yet trained when `resizable` (the pipeline's own shards), else it starts over."""
        self.saver.load(self.model, self.optimizer, state)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        position = position_of(state)
        saved_world_size = state.get("world_size", self.world_size)
        if saved_world_size == self.world_size:
            return position
        done_steps = 0.0  # of this epoch, in this world size's optimizer steps
        if position.step_in_epoch:
            # the earlier parts are replayed with this run's seed and micro-batch sizes: they must be the checkpoint's
            same_order = all(state["config"].get(key) == getattr(self.config, key) for key in REPLAYED_SETTINGS)
            if resizable and same_order:
                position.earlier_parts += ((saved_world_size, position.step_in_epoch),)
                done_steps = sum(size * steps for size, steps in position.earlier_parts) / self.world_size
                goes_on = f"goes on with the rows its {plural(position.step_in_epoch, 'optimizer step')} did not train"
            else:  # a plug-in's dataset (Ray Data splits it) or another order: no part can be replayed
                position.earlier_parts, goes_on = (), "starts over"
            log.info(
                "world size changed from %d to %d: epoch %d %s",
                saved_world_size,
                self.world_size,
                position.epoch + 1,
                goes_on,
            )
        position.step_in_epoch = 0
        # The checkpoint's schedule counted another world size's steps per epoch (and lr, with --scale-lr).
        step = position.epoch * self.epoch_steps + int(done_steps)
        resume_schedule(self.scheduler, self.config.lr_for(self.world_size), step)
        return position

    def micro_batch(self, batch: dict, synchronise: bool) -> torch.Tensor:
        """Forward and backward on one micro-batch; gradients are all-reduced only when `synchronise`.
        Returns the loss, detached: its graph is spent."""
        with strategy.no_grad_sync(self.model, self.config) if not synchronise else contextlib.nullcontext():
            with strategy.autocast(self.config, self.device):
                loss = self.training_loss(batch)
            self.scaler.scale(loss / self.config.grad_accum).backward()
        return loss.detach()

    def training_loss(self, batch: dict) -> torch.Tensor:
        """The --task's training_step, or the built-in step: the loss of the model's outputs for x against y."""
        if self.task is not None:
            return task_loss(self.task.training_step(self.model, batch))
        x = batch["x"].contiguous(memory_format=torch.channels_last) if self.config.channels_last else batch["x"]
        return self.loss_fn(self.model(x), batch["y"])

    def optimizer_step(self) -> bool:
        """Clip, step, advance the schedule. False when the step was skipped (non-finite gradients).

        `grad_norm` keeps the step's global gradient norm, on the device, when clipping or the finite check
        computed it (None otherwise): steps.jsonl reads it at the next refresh, not now.
        """
        self.scaler.unscale_(self.optimizer)  # clipping and the finite check see true gradients
        skipped, self.grad_norm = False, None
        if self.config.clip_grad_norm or self.config.skip_nonfinite:
            self.grad_norm = norm = strategy.gradient_norm(self.model, self.config.clip_grad_norm)
            skipped = self.config.skip_nonfinite and not bool(torch.isfinite(norm))  # equal on all ranks
        if not skipped:
            self.scaler.step(self.optimizer)  # with fp16, the scaler itself skips inf/NaN steps
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return not skipped

    def checkpoint(self, position: Position, metrics: dict, run_info: dict, stage: Callable[[int], None]) -> None:
        """The run's saver's checkpoint. Full format: every rank gathers (FSDP shards meet on rank zero); rank zero
        writes; every rank reports. Sharded: every rank stages its own shards and writes them in the background
        (ckpt.ShardedSaver, which reports the previous checkpoint first when it is still pending).

        `stage(i)` is told each stage reached, an index into CHECKPOINT_STAGES (gathering first).
        """
        training_state = {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "world_size": self.world_size,
        }
        model_state, optimizer_state = self.saver.state_of(self.model, self.optimizer)
        stage(CHECKPOINT_STAGES.index("saving"))
        plain = plain_state(training_state, position, metrics, run_info)
        reporting = functools.partial(stage, CHECKPOINT_STAGES.index("reporting"))
        self.saver.save(model_state, optimizer_state, plain, metrics, reporting)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


class WorkerLoop:
    """One rank's run: the pieces `train_loop_per_worker` strings together, in its order."""

    def __init__(self, args: WorkerArgs) -> None:
        self.config = config = args.config
        self.spec = args.spec
        self.run_info = {"config": config.to_dict(), "data_spec": args.spec.__dict__}
        code = args.user_code()
        self.hooks = code.hooks or WorkerHooks()
        context = ray.train.get_context()
        self.rank, world_size = context.get_world_rank(), context.get_world_size()  # elastic runs: this attempt's
        self.device = device = _rank_device(config)
        channel = channel_to(args.monitor)
        where = _where(device, config.quick_start)
        channel.post("worker_started", self.rank, {"rank": self.rank, "world_size": world_size, **where})
        _label_worker_logs(self.rank)
        _storage_warnings_to(channel, self.rank)
        self.link = DriverLink(channel, self.rank)
        self.heartbeat = Heartbeat(self.link.post, self.rank, self.link.stop_reason)
        if config.compile:
            self.heartbeat.follow_compiles()
        self.trainer = RankTrainer(config, self.spec, device, code, world_size)
        self.trainer.saver.progress = self.heartbeat.writing_checkpoint
        if config.quick_start:  # no Ray Train controller to report checkpoints to: the driver records them
            self.trainer.saver.register = functools.partial(self.link.call, "checkpoint_written", timeout=None)
        self.feed = DeviceFeed(self.spec, device)
        # the run directory only when profiling: on object storage, opening it would cost a lookup on each worker
        run_dir = config.run_dir if config.profile_window else None
        self.profile = StepProfile(config.profile_window, run_dir, self.rank, device)
        self.train_input, self.val_input = rank_inputs(args.local_sources)
        self.position = Position()
        self.last_checkpoint_at = time.monotonic()  # for --checkpoint-every-minutes

    def resume(self) -> Position:
        """Where training starts: after the checkpoint Ray Train hands over, if any."""
        if (resume_from := ray.train.get_checkpoint()) is not None:
            with ckpt.loaded(resume_from, self.config.run_dir) as state:
                self.position = self.trainer.restore(state, self.train_input.resizable)
            log.info("rank %d resumes from %s %s", self.rank, resume_from.path, self.position.resumes())
        log.info("training on %s from epoch %d", self.device, self.position.epoch + 1)
        return self.position

    def train_epoch(self, epoch: int) -> EpochRun:
        """This rank's shard of `epoch`, until it ends or every rank agrees to stop."""
        config, meter = self.config, EpochMeter(skip_nonfinite=self.config.skip_nonfinite)
        self.trainer.model.train()
        self.heartbeat.at("training", epoch, meter)
        run, clock = EpochRun(meter), StepClock(self.device)
        # A run stopped mid-epoch resumes after the micro-batches it had already trained on.
        resumed = epoch == self.position.epoch + 1
        done = self.position.step_in_epoch if resumed else 0
        earlier_parts = self.position.earlier_parts if resumed else ()
        run.optimizer_steps = done
        shard_batches = self.train_input.host_batches(config, epoch, earlier_parts)
        batches = itertools.islice(shard_batches, done * config.grad_accum, None)
        fed = fed_batches(batches, self.feed, meter, self.hooks, self.rank)
        for micro_batch, (batch, is_last) in enumerate(fed, start=done * config.grad_accum + 1):
            if self.train_micro_batch(run, epoch, micro_batch, batch, is_last):
                break
        run.train_seconds, run.compute_seconds = meter.seconds(), clock.seconds(meter)
        if not run.stop_reason:
            self.check_loss(epoch, meter)
        return run

    def train_micro_batch(self, run: EpochRun, epoch: int, micro_batch: int, batch: dict, is_last: bool) -> bool:
        """One micro-batch, and the optimizer step that ends its group. True when every rank agreed to stop.

        The host waits for the device only at the cadences: the loss every
        NAN_CHECK_EVERY micro-batches, the stop flag every STOP_CHECK_EVERY
        optimizer steps (see docs/gpu.md).
        """
        config, meter, trainer = self.config, run.meter, self.trainer
        self.profile.step_begins(self.position.global_step + 1)
        meter.micro_batches_started += 1
        synchronise = micro_batch % config.grad_accum == 0 or is_last
        meter.add(trainer.micro_batch(batch, synchronise), batch_rows(batch))
        if config.record_sample_ids:
            run.seen_ids.append(batch["id"].numpy())  # ids never leave the host
        if meter.micro_batches % NAN_CHECK_EVERY == 0:
            self.check_loss(epoch, meter)
        self.hooks.on_micro_batch(self.rank, epoch, micro_batch)
        if not synchronise:
            return False
        lr = trainer.lr  # this step's; the schedule moves it on in optimizer_step
        run.skipped_steps += not trainer.optimizer_step()
        run.optimizer_steps += 1
        self.hooks.on_optimizer_step(self.rank, epoch, run.optimizer_steps)
        self.position.global_step += 1
        self.profile.step_ended(self.position.global_step)
        if config.log_every_steps and self.position.global_step % config.log_every_steps == 0:
            meter.mark_step({"step": self.position.global_step, "epoch": epoch, "lr": lr}, trainer.grad_norm)
        return not is_last and self.between_steps(epoch, run)  # after the last step: the epoch's own checkpoint

    def between_steps(self, epoch: int, run: EpochRun) -> bool:
        """After an optimizer step: every STOP_CHECK_EVERY steps the ranks agree whether to stop (True) or to
        take a timed checkpoint; every --checkpoint-every-steps steps, an interval checkpoint."""
        step, checkpoint_due = self.position.global_step, False
        if step % STOP_CHECK_EVERY == 0:
            saver = self.trainer.saver
            stop, checkpoint_due, unfinished = all_ranks_agree(
                (self.heartbeat.stop_reason is not None, self.minutes_due(), not saver.done_here()), self.device
            )
            if not unfinished:  # every rank's shards are written: Ray Train may count them now (none: nothing to do)
                saver.flush()
            if stop:
                run.stop_reason = self.heartbeat.stop_reason or "another rank was asked to stop"
                return True
        every = self.config.checkpoint_every_steps
        if checkpoint_due or (every and step % every == 0):  # the same step on every rank
            self.mid_epoch_checkpoint(epoch, run, {"interval": True})
            self.heartbeat.at("training", epoch, run.meter)
        return False

    def check_loss(self, epoch: int, meter: EpochMeter) -> None:
        """Refresh the host copy of the loss (the heartbeat's) and of the marked steps' (to the heartbeat's
        steps.jsonl records); stop on NaN/inf unless skipping them."""
        loss = meter.refresh_loss()
        self.heartbeat.step_records.extend(meter.step_records)
        meter.step_records.clear()
        if not self.config.skip_nonfinite:
            check_finite(loss, self.rank, epoch, meter.micro_batches)

    def stop_agreed(self) -> bool:
        """Whether any rank was asked to stop, the same answer on every rank."""
        return all_ranks_agree((self.heartbeat.stop_reason is not None,), self.device)[0]

    def minutes_due(self) -> bool:
        minutes = self.config.checkpoint_every_minutes
        return bool(minutes) and time.monotonic() - self.last_checkpoint_at >= minutes * 60

    def stop_checkpoint(self, epoch: int, run: EpochRun) -> None:
        """Preempted mid-epoch: save where we are, to resume from exactly here."""
        log.info("stopping at epoch %d, optimizer step %d: %s", epoch, run.optimizer_steps, run.stop_reason)
        self.mid_epoch_checkpoint(epoch, run, {"stopped": run.stop_reason})

    def mid_epoch_checkpoint(self, epoch: int, run: EpochRun, why: dict) -> None:
        """A checkpoint after `run.optimizer_steps` steps of `epoch`, which a restart resumes from exactly.

        It has no validation score: it records the worst (checkpoint/ranking.py says what follows)."""
        self.heartbeat.at("checkpointing", epoch, run.meter)
        at = Position(epoch - 1, run.optimizer_steps, self.position.global_step, self.position.earlier_parts)
        if self.rank == 0 and "interval" in why:
            log.info("checkpoint at epoch %d, optimizer step %d", epoch, run.optimizer_steps)
        unscored = ranking.unscored(*self.config.checkpoint_ranking(self.spec.kind))
        metrics = {"epoch": epoch - 1, "step_in_epoch": run.optimizer_steps, **unscored, **why}
        self.trainer.checkpoint(at, metrics, self.run_info, self.heartbeat.advance)
        self.last_checkpoint_at = time.monotonic()

    def validate(self, epoch: int, run: EpochRun) -> dict:
        """Validation over all ranks' shards, with rank zero's buffers everywhere."""
        self.heartbeat.at("validating", epoch, run.meter)
        model, config = self.trainer.model, self.config
        sync_buffers(model)
        # DDP: the bare module, not the wrapper: a DDP forward is itself a collective
        # (buffer broadcast), and ranks may hold different numbers of val batches.
        # FSDP: the sharded model, every rank in lockstep (its forward all-gathers).
        fsdp, lockstep = config.strategy == "fsdp", None
        batches, most = self.val_input.batches(config.batch_size)
        if fsdp:
            if most is None:  # a plug-in's split: counted once read, held on the host (never on the device)
                batches = list(batches)
                most = most_over_ranks(len(batches), self.device)
            # a task's batches hold its own columns: it pads with its last batch again
            lockstep = (None if self.trainer.task else padding_batch(self.spec, self.device), most)
        with strategy.autocast(config, self.device):  # the precision training ran in (evaluate.py does the same)
            return evaluate(
                model if fsdp else strategy.unwrap(model),
                (batch for batch, _ in self.feed.ahead(batches)),
                self.trainer.loss_fn if self.trainer.task is None else self.trainer.task.validation_step,
                self.device,
                lockstep=lockstep,
                on_batch=lambda done: self.validated(epoch, done),
                task=self.trainer.task is not None,
            )

    def validated(self, epoch: int, done: int) -> None:
        """A validation batch's forward was launched: the heartbeat counts it (a long pass keeps moving)."""
        self.heartbeat.advance(done)
        self.hooks.on_validation_batch(self.rank, epoch, done)

    def report_epoch(self, epoch: int, run: EpochRun, val_metrics: dict) -> None:
        """This rank's epoch record to the driver, which aggregates the ranks' into metrics.jsonl."""
        config, meter, trainer = self.config, run.meter, self.trainer
        if config.record_sample_ids:
            save_sample_ids(config, epoch, self.rank, run.seen_ids)
        micro_batches = meter.micro_batches
        rank_metrics = {
            "epoch": epoch,
            "rank": self.rank,
            "train_loss": meter.loss,
            "samples": meter.samples,
            "micro_batches": micro_batches,
            "optimizer_steps": run.optimizer_steps,
            "skipped_steps": run.skipped_steps,
            "grad_allreduces": trainer.grad_syncs.calls if config.strategy == "ddp" else None,  # FSDP: not counted
            "lr": trainer.lr,
            "train_seconds": run.train_seconds,
            "data_wait_seconds": meter.data_wait_s,
            "micro_batch_seconds": run.compute_seconds / max(micro_batches, 1),
            **val_metrics,
        }
        # gloo completes a future when its all-reduce has; NCCL's may complete at enqueue: no wait measured there
        rank_metrics["allreduce_wait_seconds"] = (
            trainer.grad_syncs.wait_s if config.strategy == "ddp" and self.device.type == "cpu" else None
        )
        trainer.grad_syncs.calls, trainer.grad_syncs.wait_s = 0, 0.0
        if trainer.flops_per_sample is not None and run.train_seconds > 0:
            tflops = trainer.flops_per_sample * meter.samples / run.train_seconds / 1e12
            rank_metrics["model_tflops_per_second"] = tflops
            rank_metrics["mfu"] = tflops / trainer.peak_tflops if trainer.peak_tflops else None
        if self.device.type == "cuda":
            rank_metrics["gpu_memory_peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        self.heartbeat.send_step_records(lambda steps: self.link.epoch_finished(rank_metrics, steps))

    def checkpoint(self, epoch: int, run: EpochRun, val_metrics: dict) -> None:
        """Rank zero alone writes the checkpoint; every rank reports, so Ray Train sees the whole group finish
        the epoch and keeps the best one."""
        self.heartbeat.at("checkpointing", epoch, run.meter)
        self.position = Position(epoch, 0, self.position.global_step)
        self.trainer.checkpoint(self.position, {"epoch": epoch, **val_metrics}, self.run_info, self.heartbeat.advance)
        self.last_checkpoint_at = time.monotonic()

    def finish(self) -> None:
        checksum = parameter_checksum(strategy.unwrap(self.trainer.model))
        self.link.call("worker_finished", self.rank, checksum, timeout=None)


def train_epochs(worker: WorkerLoop, position: Position) -> bool:
    """The epochs left; False when the run stopped early (with its checkpoint)."""
    for epoch in range(position.epoch + 1, worker.config.epochs + 1):  # epochs count from 1
        run = worker.train_epoch(epoch)
        if run.stop_reason:
            worker.stop_checkpoint(epoch, run)
            return False
        val_metrics = worker.validate(epoch, run)
        worker.report_epoch(epoch, run, val_metrics)
        worker.checkpoint(epoch, run, val_metrics)
        if epoch < worker.config.epochs and worker.stop_agreed():
            log.info(
                "stopping after epoch %d: %s", epoch, worker.heartbeat.stop_reason or "another rank was asked to stop"
            )
            return False
    return True


def train_loop_per_worker(loop_config: dict) -> None:
    worker = WorkerLoop(WorkerArgs.from_loop_config(loop_config))
    position = worker.resume()
    with worker.profile:  # a --profile-steps window the run ends inside is written on the way out
        completed = train_epochs(worker, position)
    worker.trainer.saver.flush()  # the run's last checkpoint (a sharded one), written and counted before it ends
    if completed:
        worker.finish()
