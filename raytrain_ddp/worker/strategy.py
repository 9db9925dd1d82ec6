"""How the model is spread over the workers: DDP replicas or FSDP shards.

``--strategy ddp`` (``DistributedDataParallel``): every rank holds the whole
model; gradients are all-reduced in buckets during ``backward``.
``--strategy fsdp`` (FSDP2, ``torch.distributed.fsdp.fully_shard``): every rank
holds 1/world_size of each parameter, gradient and optimizer state; a block's
parameters are all-gathered just before it runs and freed after. The same
code runs on CPU with gloo and on GPUs with NCCL (Ray Train's own FSDP option
refuses CPU training, so it is not used). FSDP shards each unit on the host and
moves only the shard to the device, so the whole model never sits on one GPU.

Checkpoints (raytrain_ddp/checkpoint/saver.py) hold either a full state dict,
gathered on rank zero (``full_state``), or each rank's own shards, written by
``torch.distributed.checkpoint`` (``sharded_state``; with DDP, whose
parameters are replicated, DCP has rank zero write each tensor once). Either
resumes on any number of workers.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from raytrain_ddp.config import TrainConfig

log = logging.getLogger("raytrain_ddp.worker")

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class GradSyncCounter:
    """Gradient all-reduces DDP has launched (one per bucket per synchronising backward), and the seconds
    from each launch to its completion: long on a rank whose peers arrive late, short on the latest one."""

    calls: int = 0
    wait_s: float = 0.0


def _counting_allreduce(counter: GradSyncCounter, bucket):  # no annotations: DDP checks them, and ours are strings
    counter.calls += 1
    launched = time.perf_counter()

    def completed(future):
        counter.wait_s += time.perf_counter() - launched
        return future.value()

    return default_hooks.allreduce_hook(None, bucket).then(completed)  # None: the default process group


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """What FSDP shards as one unit, before the root.

    A model may say (``fsdp_units()``); otherwise, when a Hugging Face
    ``transformers`` model is or is inside it, every module of a class listed
    in its ``_no_split_modules`` (its blocks, which Accelerate and transformers'
    own FSDP wrap too); else each entry of a top-level ModuleList (a
    transformer's layers), else each top-level child with parameters. One
    unit = one all-gather in forward, one reduce-scatter in backward.
    """
    if hasattr(model, "fsdp_units"):
        return list(model.fsdp_units())
    block_classes = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    blocks = [module for module in model.modules() if type(module).__name__ in block_classes]
    inside = {id(sub) for block in blocks for sub in block.modules() if sub is not block}
    if outermost := [block for block in blocks if id(block) not in inside]:  # a listed class inside a block: not a unit
        return outermost
    layer_lists = [child for child in model.children() if isinstance(child, nn.ModuleList)]
    if layer_lists:
        return [layer for layers in layer_lists for layer in layers]
    return [child for child in model.children() if any(True for _ in child.parameters())]


def _count_classes(modules: list[nn.Module]) -> str:
    """'2 x LlamaDecoderLayer, 1 x Linear': what a list of modules holds, by class, in order of appearance."""
    counts = collections.Counter(type(module).__name__ for module in modules)
    return ", ".join(f"{count} x {name}" for name, count in counts.items())


def setup_device(config: TrainConfig, device: torch.device) -> None:
    """Once per worker, before the model is built: the process's GPU and its speed settings.

    cudnn.benchmark picks the fastest convolution algorithm per input shape
    (shapes are fixed here: one batch size, the last partial batch aside);
    TF32 runs fp32 matmuls and convolutions on tensor cores with a 10-bit
    mantissa (``--no-tf32`` for full fp32). Both are no-ops on a CPU.
    """
    if device.type != "cuda":
        return
    torch.cuda.set_device(device)  # FSDP's default mesh and NCCL use the current device
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = config.tf32
    torch.backends.cudnn.allow_tf32 = config.tf32


def distribute(model: nn.Module, config: TrainConfig, device: torch.device) -> tuple[nn.Module, GradSyncCounter]:
    """Wrap the model (built on the host) for data-parallel training; count DDP's gradient all-reduces."""
    counter = GradSyncCounter()
    if config.strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # see _state_dict_api: FSDP only

        # bf16 all-gathers and compute, fp32 gradient reduction (bf16 sums lose precision over many ranks).
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if config.precision == "bf16"
            else MixedPrecisionPolicy()
        )
        # FSDP moves each unit to the device as it shards it: one unit at a time is ever whole there.
        # Parameters stay contiguous (FSDP2 refuses others); with --channels-last the inputs carry the
        # format, and a convolution with a channels-last input runs channels-last.
        for norm in (m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)):
            fully_shard(norm)  # fp32 weights beside fp32 running statistics (batch_norm takes one dtype)
        units = fsdp_units(model)
        log.info("FSDP units: %s, then the root", _count_classes(units) or "none")  # before FSDP renames them
        for unit in units:
            fully_shard(unit, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        model.to(device)  # anything FSDP does not manage
    else:
        if config.channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
        model.register_comm_hook(counter, _counting_allreduce)
    if config.compile:
        model = torch.compile(model)
    return model, counter


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside torch.compile's and DDP's wrappers."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model) if isinstance(model, DistributedDataParallel) else model


def no_grad_sync(model: nn.Module, config: TrainConfig) -> contextlib.AbstractContextManager:
    """Accumulate this micro-step's gradients locally: no all-reduce / reduce-scatter."""
    inner = getattr(model, "_orig_mod", model)
    if isinstance(inner, DistributedDataParallel):
        return inner.no_sync()
    if config.strategy == "fsdp":
        inner.set_requires_gradient_sync(False)
        return _resume_fsdp_sync(inner)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _resume_fsdp_sync(model):
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def autocast(config: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    if config.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[config.precision])


def grad_scaler(config: TrainConfig, device: torch.device) -> torch.amp.GradScaler:
    """fp16 gradients underflow without loss scaling; bf16 and fp32 need none (a disabled scaler)."""
    return torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")


def gradient_norm(model: nn.Module, max_norm: float | None) -> torch.Tensor:
    """The global gradient norm (over all shards), clipping to `max_norm` when given."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Unsharded model and optimizer state on rank zero's CPU (empty elsewhere). Every rank must call it."""
    api = _state_dict_api()
    return api.get_state_dict(
        unwrap(model), optimizer, options=api.StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_full_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict
) -> None:
    """Load a full state dict on every rank; FSDP keeps each rank's shard of it."""
    api = _state_dict_api()
    api.set_state_dict(
        unwrap(model),
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optimizer_state,
        options=api.StateDictOptions(full_state_dict=True),
    )


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """This rank's model and optimizer state as DCP saves and loads it (FSDP: DTensor shards), keyed as
    `full_state`'s. Every rank must call it; the optimizer's state exists after the first step (before
    it, get_state_dict creates it, zeros, for a load to fill in)."""
    return _state_dict_api().get_state_dict(unwrap(model), optimizer)


def load_sharded_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, shards: str, group: dist.ProcessGroup | None
) -> None:
    """Load a DCP checkpoint written at any world size: every rank reads the pieces of its own shards."""
    import torch.distributed.checkpoint as dcp

    model_state, optimizer_state = sharded_state(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=shards, process_group=group)
    _state_dict_api().set_state_dict(
        unwrap(model), optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )


def _state_dict_api():
    """torch.distributed.checkpoint.state_dict, imported on first use: it and fsdp take about a second of CPU
    to import, which Ray Train's controller (it unpickles the worker loop) and every worker would otherwise pay
    before the first step."""
    import torch.distributed.checkpoint.state_dict as api

    return api
