"""Ingest, plain: `python -m torch.distributed.run --nproc-per-node 2 bench/plain_ingest.py --data DIR --out PREFIX`.

Each of the 2 processes reads the same Parquet files into memory (encoded)
and iterates a DataLoader over DistributedSampler(shuffle=True) batches, with
LOADER_WORKERS CPU worker processes, decoding PNG and augmenting/normalising
with the project's own transform (to_model_inputs -> decode_images), the same
per-row work as ours. A gloo process group only lines the ranks up before
pass 1 (torchrun starts them up to a second apart); nothing but loading runs
after it. Each rank records every pass (start, end, rows, first batch) and
every batch (time, rows), as bench/ours_ingest.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import bench_path  # noqa: F401  (repo root on sys.path)
import pyarrow.parquet as pq
import torch.distributed as dist
from plain_ddp import ParquetImages
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.spec import plan_data


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--loader-workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="prefix; rank R writes PREFIX.R.json")
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    plan = plan_data(TrainConfig(data=args.data))
    table = pq.ParquetDataset(list(plan.train_paths)).read(
        columns=["id", plan.spec.image_column, plan.spec.label_column]
    )
    dataset = ParquetImages(table, plan.spec, args.seed)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(
        dataset,
        sampler=BatchSampler(sampler, args.batch_size, drop_last=False),
        batch_size=None,
        num_workers=args.loader_workers,
        persistent_workers=args.loader_workers > 0,
    )
    dist.init_process_group("gloo")
    dist.barrier()
    passes, batches = [], []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        started, rows, first = time.time(), 0, None
        for _, y in loader:
            rows += len(y)
            batches.append((time.time(), len(y)))
            first = first or batches[-1][0]
        passes.append((started, time.time(), rows, first))
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump({"passes": passes, "batches": batches}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
