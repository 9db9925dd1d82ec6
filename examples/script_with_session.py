"""A torchrun-style script that uses raytrain_ddp.session, the optional API: its reports reach steps.jsonl, the
console and TensorBoard; it keeps its snapshot in session.checkpoint_dir(); it stops cleanly when the run is
asked to (Slurm's time-limit warning, a preemption). It runs unchanged under all three:

    torchrun --nproc-per-node 2 examples/script_with_session.py --epochs 4
    raytrain-ddp launch --num-workers 2 examples/script_with_session.py --epochs 4
    sbatch cluster/start_ray_slurm.sh launch examples/script_with_session.py --epochs 4
"""

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raytrain_ddp import session


def main(epochs: int, micro_batch_seconds: float) -> None:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=generator)
    y = x @ torch.arange(1.0, 9.0) + 0.1 * torch.randn(1024, generator=generator)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(TensorDataset(x, y))
    batches = DataLoader(TensorDataset(x, y), batch_size=32, sampler=sampler)

    snapshot, start = session.checkpoint_dir() / "snapshot.pt", 0
    if snapshot.exists():
        state = torch.load(snapshot)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"]
        print(f"rank {rank}: resuming after epoch {start}", flush=True)
    for epoch in range(start, epochs):
        sampler.set_epoch(epoch)
        total, rows = 0.0, 0
        for inputs, targets in batches:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs).squeeze(1), targets)
            loss.backward()
            optimizer.step()
            total, rows = total + loss.item() * len(targets), rows + len(targets)
            time.sleep(micro_batch_seconds)
        session.report({"loss": total / rows}, step=epoch + 1)
        if rank == 0:
            torch.save(
                {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1}, snapshot
            )
        dist.barrier()
        stop = torch.tensor([session.should_stop()], dtype=torch.int)  # every rank stops at the same epoch
        dist.all_reduce(stop)
        if stop.item():
            print(f"rank {rank}: stopping after epoch {epoch + 1}, as asked", flush=True)
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (a slow step, for tests)")
    args = parser.parse_args()
    main(args.epochs, args.micro_batch_seconds)
