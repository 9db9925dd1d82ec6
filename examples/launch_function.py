"""Your own training function on every worker, from a script or a notebook (where hand-rolled mp.spawn DDP is
known to hang): the process group is set up before it is called, as Ray Train's train_func is.

    python examples/launch_function.py
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from raytrain_ddp import launch, session


def train_fn(args: dict) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)  # each rank its own rows
    x = torch.randn(512, 4, generator=generator)
    y = x @ torch.tensor([1.0, -2.0, 3.0, 0.5])
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args["lr"])
    for epoch in range(args["epochs"]):
        for start in range(0, len(x), 64):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[start : start + 64]).squeeze(1), y[start : start + 64])
            loss.backward()
            optimizer.step()
        session.report({"loss": loss.item()}, step=epoch + 1)
        if session.should_stop():
            break
    print(f"rank {rank} of {world_size} done", flush=True)


if __name__ == "__main__":
    result = launch(train_fn, num_workers=2, args={"epochs": 5, "lr": 0.05}, name="launch-function")
    print(result.summary["status"], result.final_metrics["loss"])
