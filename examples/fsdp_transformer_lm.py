"""FSDP with one flag: a decoder-only transformer language model, sharded across the workers.

    python examples/fsdp_transformer_lm.py                        # 2 CPU workers (gloo), fp32
    python examples/fsdp_transformer_lm.py --use-gpu --num-workers 4  # GPUs (NCCL): bf16
    python -m raytrain_ddp.run --model transformer --dataset synthetic-tokens --strategy fsdp --precision bf16

Any trainer flag after the script name overrides the settings below.

With --strategy fsdp every worker keeps 1/N of each parameter, gradient and
optimizer state, and gathers one transformer block's weights just before it
runs. For AdamW in fp32 that is 16 bytes per parameter (weights 4, gradients
4, two moments 8) divided by N, plus one block gathered at a time and the
activations; DDP keeps all 16 bytes on every worker. The checkpoint is sharded
(each worker writes its own shards, in the background): it resumes on any number
of workers, `python -m raytrain_ddp.evaluate` scores it on one process, and
`python -m raytrain_ddp.checkpoint consolidate` makes a plain state dict of it
(or train with --checkpoint-format full).
"""

import math
import sys

from raytrain_ddp import TrainConfig, fit
from raytrain_ddp.run import settings_from_args

flags = settings_from_args(sys.argv[1:])  # e.g. --use-gpu --num-workers 4 --epochs 5
settings = dict(
    num_workers=2,
    model="transformer",  # 4 blocks, width 128: FSDP shards each block, then the root
    dataset="synthetic-tokens",  # sequences with a per-sequence stride: learnable from context
    strategy="fsdp",
    # bf16 autocast on GPUs (FSDP all-gathers in bf16, reduces in fp32); CPUs without bf16 units emulate it, slowly
    precision="bf16" if flags.get("use_gpu") else "fp32",
    optimizer="adamw",
    lr=0.003,
    lr_schedule="cosine",
    warmup_epochs=0.5,
    clip_grad_norm=1.0,
    epochs=2,
    train_size=2048,
    val_size=512,
    storage_path="runs",
    name="fsdp-lm",
    report=False,
)
result = fit(TrainConfig(**{**settings, **flags}))

print("status:", result.summary["status"])
print(f"uniform guess: loss {math.log(64):.2f}")
for epoch in result.epochs:
    print(
        f"epoch {epoch['epoch']}: train loss {epoch['train_loss']:.3f}, val loss {epoch['val_loss']:.3f}, "
        f"next-token accuracy {epoch['val_accuracy']:.3f}, lr {epoch['lr']:.5f}"
    )
print("checkpoint (sharded):", result.best_checkpoint)
