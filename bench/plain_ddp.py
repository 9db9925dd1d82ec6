"""Plain PyTorch DDP, the baseline: `python -m torch.distributed.run --nproc-per-node 2 bench/plain_ddp.py ...`.

What a researcher would write by hand: gloo on CPU, DistributedSampler +
DataLoader, the project's model (built the same way), SGD(lr 0.02, momentum
0.9, weight decay 5e-4). Data is either the project's synthetic images held in
memory (`--data memory`, generated with raytrain_ddp.data.synthetic.image_rows
and normalised the same way), or the same Parquet files ours reads (`--data
DIR`), PNG-decoded and augmented in DataLoader workers by the project's own
transform (raytrain_ddp.data.spec.to_model_inputs). Rank 0 writes the
step events (see bench/common.py) to --out.
"""

from __future__ import annotations

import argparse
import os
import time

import bench_path  # noqa: F401  (repo root on sys.path)
import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from common import MODEL, NORM_MEAN, NORM_STD, SGD, write_json
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, TensorDataset

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data import synthetic
from raytrain_ddp.data.spec import DataSpec, plan_data, synthetic_spec, to_model_inputs
from raytrain_ddp.models import build_model


class ParquetImages(Dataset):
    """Encoded rows in memory; a *list* of indices -> one decoded, augmented, normalised batch."""

    def __init__(self, table, spec: DataSpec, seed: int):
        self.columns = {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}
        self.spec, self.seed = spec, seed

    def __len__(self) -> int:
        return len(self.columns[self.spec.label_column])

    def __getitem__(self, indices):
        rows = {name: values[indices] for name, values in self.columns.items()}
        out = to_model_inputs(rows, self.spec, augment_seed=self.seed)
        return torch.from_numpy(out["x"]), torch.from_numpy(out["y"])


def make_loader(args, rank: int, world: int):
    if args.data == "memory":
        rows = synthetic.image_rows(np.arange(args.train_size), args.seed)
        spec = DataSpec(
            "image", synthetic.IMAGE_SHAPE, synthetic.NUM_CLASSES, args.train_size, 0, mean=NORM_MEAN, std=NORM_STD
        )
        inputs = to_model_inputs(rows, spec)
        dataset = TensorDataset(torch.from_numpy(inputs["x"]), torch.from_numpy(inputs["y"]))
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
        return sampler, DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=0)
    plan = plan_data(TrainConfig(data=args.data))
    table = pq.ParquetDataset(list(plan.train_paths)).read(
        columns=["id", plan.spec.image_column, plan.spec.label_column]
    )
    dataset = ParquetImages(table, plan.spec, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    batches = BatchSampler(sampler, args.batch_size, drop_last=False)
    return sampler, DataLoader(
        dataset,
        sampler=batches,
        batch_size=None,
        num_workers=args.loader_workers,
        persistent_workers=args.loader_workers > 0,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="memory", help="'memory' or a Parquet dataset directory")
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--loader-workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = DDP(build_model(TrainConfig(model=MODEL), synthetic_spec(TrainConfig())))
    optimizer = torch.optim.SGD(model.parameters(), **SGD)
    loss_fn = nn.CrossEntropyLoss()
    sampler, loader = make_loader(args, rank, world)

    events: list = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        events.append(("e", time.time()))
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            events.append(("s", time.time(), len(y)))
    if rank == 0:
        write_json(
            args.out,
            {
                "events": events,
                "world_size": world,
                "torch_threads": torch.get_num_threads(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            },
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
