"""Ours, exactly as a user runs it, with a probe: `python -m bench.ours_cli --probe-out FILE -- CLI ARGS`.

Calls `raytrain_ddp.run.main(CLI ARGS)` (the `python -m raytrain_ddp.run`
entry point, in this process) after swapping the worker loop Ray Train ships
to the workers for a wrapper that records, on rank 0, when each epoch's loop
starts and when each optimizer step ends (one
time.time() and a list append per step, hooked on RankTrainer.optimizer_step's
return: the same event plain_ddp.py records, right after optimizer.step();
EpochMeter.add only counts the rows since the last step; nothing else in the
loop changes).
"""

from __future__ import annotations

import sys


def probed(loop, probe_out: str):
    """The worker loop, recording step events on rank 0 into `probe_out` (JSON)."""

    def probed_loop(loop_config: dict) -> None:
        import json
        import os
        import time

        import ray.train
        import torch

        import raytrain_ddp.worker.loop as loop_module
        from raytrain_ddp.worker.args import WorkerArgs

        events: list = []
        rows = [0]  # rows trained since the last optimizer step
        epoch_meter, optimizer_step = loop_module.EpochMeter, loop_module.RankTrainer.optimizer_step

        def recording_meter(*args, **kwargs):
            events.append(("e", time.time()))
            meter = epoch_meter(*args, **kwargs)
            add = meter.add  # the loop calls meter.add(loss, rows) after each micro-batch's backward

            def counting_add(loss, batch_size):
                add(loss, batch_size)
                rows[0] += batch_size

            meter.add = counting_add
            return meter

        def recording_step(self):
            stepped = optimizer_step(self)
            events.append(("s", time.time(), rows[0]))
            rows[0] = 0
            return stepped

        loop_module.EpochMeter, loop_module.RankTrainer.optimizer_step = recording_meter, recording_step
        try:
            loop(loop_config)
        finally:
            loop_module.EpochMeter, loop_module.RankTrainer.optimizer_step = epoch_meter, optimizer_step
            if ray.train.get_context().get_world_rank() == 0:
                with open(probe_out, "w") as f:
                    json.dump(
                        {
                            "events": events,
                            "world_size": ray.train.get_context().get_world_size(),
                            "batch_size": WorkerArgs.from_loop_config(loop_config).config.batch_size,
                            "torch_threads": torch.get_num_threads(),
                            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                        },
                        f,
                    )

    return probed_loop


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] != "--probe-out" or argv[2] != "--":
        print("usage: python -m bench.ours_cli --probe-out FILE -- [raytrain_ddp.run args]", file=sys.stderr)
        return 2
    import ray.cloudpickle

    import raytrain_ddp.driver.fit as fit_module
    from raytrain_ddp import run

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    fit_module.train_loop_per_worker = probed(fit_module.train_loop_per_worker, argv[1])
    return run.main(argv[3:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
