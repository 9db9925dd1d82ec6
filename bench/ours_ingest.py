"""Ingest, ours: the project's Ray Data pipeline feeding 2 consumer actors.

`python -m bench.ours_ingest --data DIR --out FILE`. The train split is
laid out exactly as a run lays it out (raytrain_ddp.data.pipeline.build_datasets:
Parquet row groups) and handed out by the project's ShardingDataConfig. Two
actors of 1 CPU each (the training workers' shape) iterate their shard with
epoch_batches, as the worker loop does (per epoch: the rank's row groups in
the seed's order, read + PNG decode + crop/flip + normalise in Ray Data tasks,
shuffle window), and do nothing else. The local Ray gets 2 + DATA_CPUS
logical CPUs, so Ray Data has DATA_CPUS for its tasks. Each consumer records
every pass (start, end, rows, first batch) and every batch (time, rows), for
bench.suite's steady-state window.

epoch_batches reads a rank's coming epochs in one Ray Data execution, ahead of
the consumer. Before the recorded passes each consumer reads one warm-up pass
with a stream of its own that ends there: it starts Ray Data's worker
processes (what a DataLoader's first pass does for plain), and whatever their
uneven start lets a stream read ahead is left behind with it, not carried
into the recorded passes. Both consumers then start pass 1 together.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import ray

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.pipeline import ShardingDataConfig, build_datasets
from raytrain_ddp.data.spec import plan_data
from raytrain_ddp.worker.device_feed import epoch_batches

CONSUMERS = 2


@ray.remote(num_cpus=1)
class Consumer:
    def warm_up(self, shard, config: TrainConfig) -> None:
        for _ in epoch_batches(dataclasses.replace(shard), dataclasses.replace(config, epochs=1), 1, "cpu"):
            pass

    def run(self, shard, config: TrainConfig, epochs: int) -> dict:
        passes, batches = [], []
        for epoch in range(1, epochs + 1):
            started, rows, first = time.time(), 0, None
            for batch in epoch_batches(shard, config, epoch, "cpu"):
                rows += len(batch["y"])
                batches.append((time.time(), len(batch["y"])))
                first = first or batches[-1][0]
            passes.append((started, time.time(), rows, first))
        return {"passes": passes, "batches": batches}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--data-cpus", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    # address="local": a Ray of its own even where `ray start` left a cluster (or its address file) behind
    ray.init(
        address="local",
        num_cpus=CONSUMERS + args.data_cpus,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        object_store_memory=300 * 2**20,
        runtime_env={"env_vars": {"RAY_DATA_DISABLE_PROGRESS_BARS": "1"}},
    )
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        config = TrainConfig(data=args.data, batch_size=args.batch_size, epochs=args.epochs)
        plan = plan_data(config)
        datasets = build_datasets(config, plan)
        shards = ShardingDataConfig().configure(
            {"train": datasets["train"]}, world_size=CONSUMERS, worker_handles=None, worker_node_ids=None
        )
        consumers = [Consumer.remote() for _ in range(CONSUMERS)]
        ray.get([c.warm_up.remote(shards[i]["train"], config) for i, c in enumerate(consumers)])
        per_consumer = ray.get([c.run.remote(shards[i]["train"], config, args.epochs) for i, c in enumerate(consumers)])
    finally:
        ray.shutdown()
    with open(args.out, "w") as f:
        json.dump({"consumers": per_consumer}, f)


if __name__ == "__main__":
    main()
