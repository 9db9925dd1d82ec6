"""A torchrun-style script whose rank 0 saves a snapshot into session.checkpoint_dir() and reports: with object
storage the report uploads the snapshot, which the test's store refuses; rank 1 waits for rank 0."""

import torch.distributed as dist

from raytrain_ddp import session

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    (session.checkpoint_dir() / "snapshot.txt").write_text("step 1")
session.report({"loss": 1.0}, step=1)
dist.barrier()
