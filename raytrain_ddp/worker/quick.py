"""`python -m raytrain_ddp.worker.quick`: one rank of a --quick-start run, started by the driver
(driver/rank_processes.py) with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); its :class:`QuickRank` comes pickled on stdin (the monitor's key never touches a disk).

It runs the built-in loop (worker/loop.py) under Ray Train's local mode (``ScalingConfig(num_workers=0)``), which
sets up the process group from that environment and answers ``ray.train.get_context()``: no Ray cluster, no
``ray.init``. The imports and the process group come first, before the arguments: the command line starts the
ranks before the driver imports torch, so both happen while the driver prepares the run. What local mode leaves
out the project supplies: the data (each rank reads its shards itself, data.pipeline.LocalSources), the checkpoint
a run resumes from (handed over here), checkpoints into the run directory (recorded by the driver), and every
message to the driver (over the loopback channel).
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass

from raytrain_ddp.worker.args import WorkerArgs
from raytrain_ddp.worker.script_runner import end_with_parent


@dataclass(frozen=True)
class QuickRank:
    """What the driver hands every rank: the built-in loop's arguments, and the checkpoint to resume from."""

    args: WorkerArgs
    resume_from: str | None


def quick_loop() -> None:
    """Ray Train's (local mode's) training function, the process group up: the driver's arguments, the resume
    checkpoint handed over, then the built-in loop. No arguments (stdin closed): the driver did not go on."""
    from ray.train import Checkpoint

    from raytrain_ddp import _ray_compat
    from raytrain_ddp.worker.loop import train_loop_per_worker

    try:
        rank: QuickRank = pickle.load(sys.stdin.buffer)
    except EOFError:
        return
    if rank.resume_from:
        _ray_compat.set_local_checkpoint(Checkpoint(rank.resume_from))
    train_loop_per_worker(rank.args.to_loop_config())


def main() -> None:
    end_with_parent()  # a driver that dies (SIGKILL) takes its ranks with it: none is left training alone
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import raytrain_ddp.worker.loop  # noqa: F401  (torch and the loop imported while the driver prepares)

    # local mode: this process is the worker; the run's name and storage are the driver's business (no report here
    # reaches Ray Train's storage)
    local_mode = ScalingConfig(num_workers=0)
    TorchTrainer(quick_loop, scaling_config=local_mode, run_config=RunConfig(name="quick-start")).fit()


if __name__ == "__main__":
    main()
