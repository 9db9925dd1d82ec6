"""The benchmark's training script, written as a torchrun user writes one: the same file runs under
`torchrun --nproc-per-node 2` and `raytrain-ddp launch --num-workers 2`. Rank 0 records bench.common's probe
events (("e", t) as each epoch's loop starts, ("s", t, rows) after each optimizer step) into --probe-out."""

import argparse
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def main(rows: int, epochs: int, batch_size: int, probe_out: str) -> None:
    dist.init_process_group("gloo")
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(rows, 3, 32, 32, generator=generator), torch.randint(0, 10, (rows,)))
    sampler = DistributedSampler(data, seed=0)
    batches = DataLoader(data, batch_size=batch_size, sampler=sampler)
    torch.manual_seed(0)
    model = DDP(small_cnn())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=5e-4)
    events: list = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        events.append(("e", time.time()))
        for x, y in batches:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            events.append(("s", time.time(), len(y)))
    if dist.get_rank() == 0:
        with open(probe_out, "w") as file:
            json.dump({"events": events}, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--probe-out", required=True)
    args = parser.parse_args()
    main(args.rows, args.epochs, args.batch_size, args.probe_out)
