"""A torchrun-style script whose rank 1 waits on something that never comes, while rank 0 waits for it in an
all-reduce: a hang in code the project did not write."""

import threading

import torch
import torch.distributed as dist


def wait_for_the_lock() -> None:
    threading.Event().wait()  # never set


dist.init_process_group("gloo")
print(f"rank {dist.get_rank()} started", flush=True)
if dist.get_rank() == 1:
    wait_for_the_lock()
dist.all_reduce(torch.ones(1))
