"""The loop every training worker runs, one process per GPU (or CPU slot).

Ray Train has already set up the process group (gloo on CPU, NCCL on GPU).
Read top to bottom: build the model the same way on every rank, spread it
over the ranks (DDP or FSDP), resume if there is a checkpoint, then per
epoch: train on this rank's shard, validate over all ranks, let rank zero
checkpoint, report. A stop request (Slurm preemption) ends the loop at the
next agreed step boundary with a checkpoint that resumes mid-epoch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Iterator

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
from torch import nn

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.pipeline import DataSpec, epoch_batches
from raytrain_ddp.models import build_model
from raytrain_ddp.plugins import add_import_roots, load_object, make_loss
from raytrain_ddp.worker import checkpoint as ckpt
from raytrain_ddp.worker import strategy
from raytrain_ddp.worker.metrics import (EpochMeter, Heartbeat, all_ranks_agree, check_finite, default_loss, evaluate,
                                         parameter_checksum, sync_buffers)
from raytrain_ddp.worker.schedule import make_scheduler, resume_schedule, steps_per_epoch

log = logging.getLogger("raytrain_ddp.worker")

NAN_CHECK_EVERY = 100  # micro-batches between loss checks: each one waits for the device
STOP_CHECK_EVERY = 10  # optimizer steps between all-ranks checks for a stop request (one tiny all-reduce)


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
    """The ids this rank trained on this epoch, in order: RUN_DIR/sample_ids/epoch-E-rank-R.npy."""
    directory = config.run_dir / "sample_ids"
    directory.mkdir(parents=True, exist_ok=True)
    np.save(directory / f"epoch-{epoch}-rank-{rank}.npy", np.concatenate(batches) if batches else np.empty(0, np.int64))


def _label_worker_logs(rank: int) -> None:
    """Every line this worker logs says which rank and host it came from."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank} on {socket.gethostname()}] %(levelname)s %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def timed_batches(batches, meter: EpochMeter, slow_data_s: float = 0.0) -> Iterator[tuple[dict, bool]]:
    """(batch, is_last) pairs, one batch ahead, adding the time spent waiting for data to the meter.

    Knowing the last batch lets a gradient-accumulation group that the epoch
    cuts short still end with a synchronising step.
    """
    iterator = iter(batches)

    def fetch():
        waited_from = time.perf_counter()
        batch = next(iterator, None)
        time.sleep(slow_data_s)
        meter.data_wait_s += time.perf_counter() - waited_from
        return batch

    batch = fetch()
    while batch is not None:
        following = fetch()
        yield batch, following is None
        batch = following


class Trainer:
    """Model, optimizer, schedule and scaler of one rank, and the two things done with them per batch."""

    def __init__(self, config: TrainConfig, spec: DataSpec, device: torch.device, plugins: dict,
                 world_size: int | None = None):
        self.config, self.device = config, device
        strategy.setup_device(config, device)
        # The same seed on every rank gives the same initial weights (DDP also
        # broadcasts rank zero's at wrap time); the data order comes from Ray Data.
        torch.manual_seed(config.seed)
        model = build_model(config, spec, plugins.get("model_fn"))
        self.model, self.grad_syncs = strategy.distribute(model, config, device)
        self.world_size = world_size or ray.train.get_context().get_world_size()  # elastic runs: this attempt's
        self.optimizer = make_optimizer(config, self.model, self.world_size)  # after FSDP: it steps the local shards
        self.epoch_steps = steps_per_epoch(spec.train_rows // self.world_size, config)
        self.scheduler = make_scheduler(self.optimizer, config, self.epoch_steps)
        self.scaler = strategy.grad_scaler(config, device)
        self.loss_fn = make_loss_fn(config, plugins.get("loss_fn"))

    def restore(self, state: dict) -> ckpt.Position:
        strategy.load_full_state(self.model, self.optimizer, state["model"], state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        position = ckpt.position_of(state)
        if state.get("world_size", self.world_size) != self.world_size:
            if position.step_in_epoch:
                # Shards are drawn for a world size: the rows done so far are no prefix of the new shards.
                log.info("world size changed from %d to %d: epoch %d starts over", state["world_size"],
                         self.world_size, position.epoch + 1)
                position.step_in_epoch = 0
            # The checkpoint's schedule counted another world size's steps per epoch (and lr, with --scale-lr).
            resume_schedule(self.scheduler, self.config.lr_for(self.world_size), position.epoch * self.epoch_steps)
        return position

    def micro_step(self, batch: dict, synchronise: bool) -> torch.Tensor:
        """Forward and backward on one micro-batch; gradients are all-reduced only when `synchronise`."""
        x = batch["x"].contiguous(memory_format=torch.channels_last) if self.config.channels_last else batch["x"]
        with (strategy.no_grad_sync(self.model, self.config) if not synchronise else contextlib.nullcontext()):
            with strategy.autocast(self.config, self.device):
                loss = self.loss_fn(self.model(x), batch["y"])
            self.scaler.scale(loss / self.config.grad_accum).backward()
        return loss

    def optimizer_step(self) -> bool:
        """Clip, step, advance the schedule. False when the step was skipped (non-finite gradients)."""
        self.scaler.unscale_(self.optimizer)  # clipping and the finite check see true gradients
        skipped = False
        if self.config.clip_grad_norm or self.config.skip_nonfinite:
            norm = strategy.gradient_norm(self.model, self.config.clip_grad_norm)
            skipped = self.config.skip_nonfinite and not bool(torch.isfinite(norm))  # equal on all ranks
        if not skipped:
            self.scaler.step(self.optimizer)  # with fp16, the scaler itself skips inf/NaN steps
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return not skipped

    def checkpoint(self, position: ckpt.Position, metrics: dict, run_info: dict, rank: int) -> None:
        """Every rank gathers (FSDP shards meet on rank zero); rank zero writes; every rank reports."""
        model_state, optimizer_state = strategy.full_state(self.model, self.optimizer)
        if rank == 0:
            with ckpt.scratch_dir() as directory:
                training_state = {"scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                                  "world_size": self.world_size}
                checkpoint = ckpt.save(directory, model_state, optimizer_state, training_state, position,
                                       metrics, run_info)
                ray.train.report(metrics, checkpoint=checkpoint)
        else:
            ray.train.report(metrics, checkpoint=None)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


def train_loop_per_worker(loop_config: dict) -> None:
    config = TrainConfig(**loop_config["config"])
    spec = DataSpec(**loop_config["spec"])
    monitor, plugins = loop_config["monitor"], loop_config["plugins"]
    run_info = {"config": loop_config["config"], "data_spec": loop_config["spec"]}
    add_import_roots(plugins["import_roots"])
    context = ray.train.get_context()
    rank = context.get_world_rank()
    device = ray.train.torch.get_device()
    monitor.worker_started.remote(rank, {
        "rank": rank, "world_size": context.get_world_size(), "hostname": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
        "device": str(device), "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
    })
    _label_worker_logs(rank)
    heartbeat = Heartbeat(monitor, rank)
    delays = loop_config.get("test_delays", {})  # test-only switches, see driver/fit.py
    stall, slow_data = delays.get("stall"), delays.get("slow_data")
    slow_data_s = slow_data[1] if slow_data and rank == slow_data[0] else 0.0

    trainer = Trainer(config, spec, device, plugins)
    position = ckpt.Position()
    if (resume_from := ray.train.get_checkpoint()) is not None:
        position = trainer.restore(ckpt.load(resume_from))
        log.info("rank %d resumed from %s after epoch %d%s", rank, resume_from.path, position.epoch,
                 f" and {position.step_in_epoch} steps of the next" if position.step_in_epoch else "")

    log.info("training on %s from epoch %d", device, position.epoch + 1)
    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    for epoch in range(position.epoch + 1, config.epochs + 1):  # epochs count from 1
        trainer.model.train()
        meter = EpochMeter()
        heartbeat.at("training", epoch, meter)
        seen_ids = []
        # A run stopped mid-epoch resumes after the micro-batches it had already trained on.
        skip_micro_batches = position.step_in_epoch * config.grad_accum if epoch == position.epoch + 1 else 0
        steps_in_epoch, skipped_steps, stop_reason = position.step_in_epoch if skip_micro_batches else 0, 0, None
        batches = epoch_batches(train_shard, config, epoch, device)
        for micro, (batch, is_last) in enumerate(timed_batches(batches, meter, slow_data_s), start=1):
            if micro <= skip_micro_batches:
                continue
            meter.steps_started += 1
            synchronise = micro % config.grad_accum == 0 or is_last
            loss = trainer.micro_step(batch, synchronise)
            if not config.skip_nonfinite or bool(torch.isfinite(loss)):
                meter.add(loss, len(batch["y"]))
            if config.record_sample_ids:
                seen_ids.append(batch["id"].cpu().numpy())
            if meter.steps % NAN_CHECK_EVERY == 0 and not config.skip_nonfinite:
                check_finite(meter.mean_loss(), rank, epoch, meter.steps)
            if stall and [rank, epoch, meter.steps] == stall[:3]:
                time.sleep(stall[3])
            if not synchronise:
                continue
            skipped_steps += not trainer.optimizer_step()
            steps_in_epoch += 1
            position.global_step += 1
            if position.global_step % STOP_CHECK_EVERY == 0 and not is_last and \
                    all_ranks_agree(heartbeat.stop_reason is not None, device):
                stop_reason = heartbeat.stop_reason or "another rank was asked to stop"
                break

        if stop_reason:  # preempted mid-epoch: save where we are, resume from exactly here
            heartbeat.at("checkpointing", epoch, meter)
            stopped_at = ckpt.Position(epoch - 1, steps_in_epoch, position.global_step)
            log.info("stopping at epoch %d, step %d: %s", epoch, steps_in_epoch, stop_reason)
            trainer.checkpoint(stopped_at, {"epoch": epoch - 1, "step_in_epoch": steps_in_epoch,
                                            "val_accuracy": float("-inf"), "stopped": stop_reason}, run_info, rank)
            return

        train_seconds = meter.seconds()
        if not config.skip_nonfinite:
            check_finite(meter.mean_loss(), rank, epoch, meter.steps)
        if config.record_sample_ids:
            save_sample_ids(config, epoch, rank, seen_ids)
        heartbeat.at("validating", epoch, meter)
        sync_buffers(trainer.model)
        # DDP: the bare module, not the wrapper: a DDP forward is itself a collective
        # (buffer broadcast), and ranks may hold different numbers of val batches.
        # FSDP: the sharded model, every rank in lockstep (its forward all-gathers).
        fsdp = config.strategy == "fsdp"
        val_batches = val_shard.iter_torch_batches(batch_size=config.batch_size, device=device)
        with strategy.autocast(config, device):  # the precision training ran in (evaluate.py does the same)
            val_metrics = evaluate(trainer.model if fsdp else strategy.unwrap(trainer.model), val_batches,
                                   trainer.loss_fn, device, lockstep_padding=batch if fsdp else None)
        rank_metrics = {
            "epoch": epoch, "rank": rank, "train_loss": meter.mean_loss(), "samples": meter.samples,
            "steps": meter.steps, "optimizer_steps": steps_in_epoch, "skipped_steps": skipped_steps,
            "grad_allreduces": trainer.grad_syncs.calls if config.strategy == "ddp" else None,  # FSDP: not counted
            "lr": trainer.lr, "train_seconds": train_seconds, "data_wait_seconds": meter.data_wait_s,
            "step_seconds": (train_seconds - meter.data_wait_s) / max(meter.steps, 1), **val_metrics,
        }
        trainer.grad_syncs.calls = 0
        if device.type == "cuda":
            rank_metrics["gpu_memory_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        ray.get(monitor.epoch_finished.remote(rank, rank_metrics))

        # Rank zero alone writes the checkpoint; every rank reports, so Ray
        # Train sees the whole group finish the epoch and keeps the best one.
        heartbeat.at("checkpointing", epoch, meter)
        position = ckpt.Position(epoch, 0, position.global_step)
        trainer.checkpoint(position, {"epoch": epoch, **val_metrics}, run_info, rank)
        if epoch < config.epochs and all_ranks_agree(heartbeat.stop_reason is not None, device):
            log.info("stopping after epoch %d: %s", epoch, heartbeat.stop_reason or "another rank was asked to stop")
            return

    ray.get(monitor.worker_finished.remote(rank, parameter_checksum(strategy.unwrap(trainer.model))))
