"""A torchrun-style script whose rank 0 saves a snapshot (torch.save, 16 MiB) too big for the disk that holds
session.checkpoint_dir(); rank 1 waits for it."""

import torch
import torch.distributed as dist

from raytrain_ddp import session

dist.init_process_group("gloo")
session.report({"loss": 1.0}, step=1)
if dist.get_rank() == 0:
    torch.save({"weights": torch.zeros(4 * 2**20)}, session.checkpoint_dir() / "snapshot.pt")
dist.barrier()
