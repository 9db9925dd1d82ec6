"""A torchrun-style script that trains until Ctrl-C, which it catches as KeyboardInterrupt: each rank takes a
moment to save (a marker file, interrupted-rank-N, in the working directory) and exits."""

import time
from pathlib import Path

import torch.distributed as dist

from raytrain_ddp import session

dist.init_process_group("gloo")
rank = dist.get_rank()
step = 0
try:
    while True:
        step += 1
        session.report({"loss": 1.0 / step}, step=step)
        time.sleep(0.2)
except KeyboardInterrupt:
    time.sleep(2)  # a save that takes a while: the launcher must wait for it
    Path(f"interrupted-rank-{rank}").write_text(f"{step}\n")
    print(f"rank {rank}: interrupted at step {step}, saved", flush=True)
