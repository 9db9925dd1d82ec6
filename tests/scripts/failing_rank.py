"""A torchrun-style script whose rank 1 raises while rank 0 waits for it in an all-reduce. Every rank prints
RUN_TAG, an environment variable the caller set, and its session folder (unset under torchrun)."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
session = os.environ.get("RAYTRAIN_DDP_SESSION")
print(f"rank {rank} sees RUN_TAG={os.environ.get('RUN_TAG')} and the session folder {session}", flush=True)
if rank == 1:
    raise ValueError(f"bad shard on rank 1 (RUN_TAG={os.environ['RUN_TAG']})")
dist.all_reduce(torch.ones(1))  # waits for rank 1, which is gone
