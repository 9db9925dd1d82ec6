"""The loop every training worker runs, one process per GPU (or CPU slot).

Ray Train has already set up the process group (gloo on CPU, NCCL on GPU).
Read top to bottom: build the model the same way on every rank, wrap it in
DDP, resume if there is a checkpoint, then per epoch: train on this rank's
shard, validate over all ranks, let rank zero checkpoint, report.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import numpy as np
import ray
import ray.train
import ray.train.torch
import torch
from torch import nn

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.pipeline import DataSpec, epoch_batches
from raytrain_ddp.models import build_model
from raytrain_ddp.worker import checkpoint as ckpt
from raytrain_ddp.worker.metrics import (EpochMeter, Heartbeat, check_finite, evaluate, parameter_checksum,
                                         sync_buffers)

log = logging.getLogger("raytrain_ddp.worker")

NAN_CHECK_EVERY = 100  # steps between loss checks: each one waits for the device


def make_optimizer(config: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    if config.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                           weight_decay=config.weight_decay)


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


def train_loop_per_worker(loop_config: dict) -> None:
    config = TrainConfig(**loop_config["config"])
    spec = DataSpec(**loop_config["spec"])
    monitor = loop_config["monitor"]
    context = ray.train.get_context()
    rank = context.get_world_rank()
    device = ray.train.torch.get_device()
    monitor.worker_started.remote(rank, {
        "rank": rank, "hostname": socket.gethostname(), "node_ip": ray.util.get_node_ip_address(),
        "device": str(device), "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
    })
    _label_worker_logs(rank)
    heartbeat = Heartbeat(monitor, rank)
    delays = loop_config.get("test_delays", {})  # test-only switches, see driver/fit.py
    stall, slow_data = delays.get("stall"), delays.get("slow_data")

    # The same seed on every rank gives the same initial weights (DDP also
    # broadcasts rank zero's at wrap time); the data order comes from Ray Data.
    torch.manual_seed(config.seed)
    model = ray.train.torch.prepare_model(build_model(config.model, spec.input_shape, spec.num_classes))
    optimizer = make_optimizer(config, model)
    loss_fn = nn.CrossEntropyLoss()

    epochs_done = 0
    resume_from = ray.train.get_checkpoint()
    if resume_from is not None:
        epochs_done = ckpt.restore(resume_from, model, optimizer)
        log.info("rank %d resumed from %s after epoch %d", rank, resume_from.path, epochs_done)

    log.info("training on %s from epoch %d", device, epochs_done + 1)
    train_shard = ray.train.get_dataset_shard("train")
    val_shard = ray.train.get_dataset_shard("val")
    for epoch in range(epochs_done + 1, config.epochs + 1):  # epochs count from 1
        model.train()
        meter = EpochMeter()
        heartbeat.at("training", epoch, meter)
        seen_ids = []
        batches = iter(epoch_batches(train_shard, config, epoch, device))
        while True:
            waited_from = time.perf_counter()
            batch = next(batches, None)
            if slow_data and rank == slow_data[0]:
                time.sleep(slow_data[1])
            meter.data_wait_s += time.perf_counter() - waited_from
            if batch is None:
                break
            meter.steps_started += 1
            loss = loss_fn(model(batch["x"]), batch["y"])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) gradients here
            optimizer.step()
            meter.add(loss, len(batch["y"]))
            if config.record_sample_ids:
                seen_ids.append(batch["id"].cpu().numpy())
            if meter.steps % NAN_CHECK_EVERY == 0:
                check_finite(meter.mean_loss(), rank, epoch, meter.steps)
            if stall and [rank, epoch, meter.steps] == stall[:3]:
                time.sleep(stall[3])

        train_seconds = meter.seconds()
        check_finite(meter.mean_loss(), rank, epoch, meter.steps)
        if config.record_sample_ids:
            save_sample_ids(config, epoch, rank, seen_ids)
        heartbeat.at("validating", epoch, meter)
        sync_buffers(model)
        # The bare module, not the DDP wrapper: a DDP forward is itself a collective
        # (buffer broadcast), and ranks may hold different numbers of val batches.
        val_batches = val_shard.iter_torch_batches(batch_size=config.batch_size, device=device)
        val_metrics = evaluate(ckpt.unwrap(model), val_batches, loss_fn)
        rank_metrics = {
            "epoch": epoch, "rank": rank, "train_loss": meter.mean_loss(), "samples": meter.samples,
            "steps": meter.steps, "train_seconds": train_seconds, "data_wait_seconds": meter.data_wait_s,
            "step_seconds": (train_seconds - meter.data_wait_s) / max(meter.steps, 1), **val_metrics,
        }
        if device.type == "cuda":
            rank_metrics["gpu_memory_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        ray.get(monitor.epoch_finished.remote(rank, rank_metrics))

        # Rank zero alone writes the checkpoint; every rank reports, so Ray
        # Train sees the whole group finish the epoch and keeps the best one.
        report = {"epoch": epoch, **val_metrics}
        heartbeat.at("checkpointing", epoch, meter)
        if rank == 0:
            with ckpt.scratch_dir() as directory:
                checkpoint = ckpt.save(directory, model, optimizer, epoch, report,
                                       {"config": loop_config["config"], "data_spec": loop_config["spec"]})
                ray.train.report(report, checkpoint=checkpoint)
        else:
            ray.train.report(report, checkpoint=None)

    ray.get(monitor.worker_finished.remote(rank, parameter_checksum(ckpt.unwrap(model))))
