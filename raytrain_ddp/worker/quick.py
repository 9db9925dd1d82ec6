"""`python -m raytrain_ddp.worker.quick`: one rank of a --quick-start run, started by the driver
(driver/quick.py) with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and its :class:`QuickRank` pickled on stdin (the monitor's key never touches a disk).

It runs the built-in loop (worker/loop.py) under Ray Train's local mode (``ScalingConfig(num_workers=0)``), which
sets up the process group from that environment and answers ``ray.train.get_context()``: no Ray cluster, no
``ray.init``. What local mode leaves out the project supplies: the data (each rank reads its shards itself,
data.pipeline.LocalSources), the checkpoint a run resumes from (handed over here), checkpoints into the run
directory (recorded by the driver), and every message to the driver (over the loopback channel).
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass

from raytrain_ddp.worker.script_runner import end_with_parent

RESUME_KEY = "resume_from"  # in the training function's config: the checkpoint directory to resume from


@dataclass(frozen=True)
class QuickRank:
    """What the driver hands every rank: the built-in loop's arguments, and the checkpoint to resume from."""

    args: object  # worker.args.WorkerArgs (imported by the rank only once it runs: torch is slow to import)
    resume_from: str | None


def quick_loop(loop_config: dict) -> None:
    """Ray Train's (local mode's) training function: the resume checkpoint handed over, then the built-in loop."""
    from ray.train import Checkpoint

    from raytrain_ddp import _ray_compat
    from raytrain_ddp.worker.loop import train_loop_per_worker

    if loop_config.get(RESUME_KEY):
        _ray_compat.set_local_checkpoint(Checkpoint(loop_config[RESUME_KEY]))
    train_loop_per_worker(loop_config)


def main() -> None:
    end_with_parent()  # a driver that dies (SIGKILL) takes its ranks with it: none is left training alone
    rank: QuickRank = pickle.load(sys.stdin.buffer)
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = rank.args.config  # type: ignore[attr-defined]  # a WorkerArgs
    trainer = TorchTrainer(
        quick_loop,
        train_loop_config={**rank.args.to_loop_config(), RESUME_KEY: rank.resume_from},  # type: ignore[attr-defined]
        scaling_config=ScalingConfig(num_workers=0),  # local mode: this process is the worker
        run_config=RunConfig(name=config.name, storage_path=config.storage_path),
    )
    trainer.fit()


if __name__ == "__main__":
    main()
