"""GPUs on the Slurm testbed: each node advertises 3 GPUs through GRES (device files CUDA never sees).

A `--use-gpu` job on these GPU-less nodes proves the counting and propagation (Slurm -> each node's
srun step -> `ray start --num-gpus` -> the trainer's defaults) by getting as far as the trainer's CUDA
probe, which refuses in one line.
"""

from __future__ import annotations

import re

import pytest
from slurm_testbed import NODES, Testbed
from test_start_ray_slurm import SMALL_RUN, assert_no_leftovers, show

pytestmark = pytest.mark.slurm

TWO_GPUS_EACH = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=3", "--gpus-per-node=2", "--time=30"]


def test_gpu_job_reaches_the_cuda_probe(testbed: Testbed) -> None:
    job = testbed.sbatch(TWO_GPUS_EACH, SMALL_RUN, name="gpu", timeout=600)
    assert job.returncode == 2, show(job)
    for node in NODES:  # each node's step was given its 2 of the node's 3 GPUs, and says so
        assert f"[{node}] [raytrain {node}] CUDA_VISIBLE_DEVICES=0,1; Ray will advertise 2 GPUs" in job.log, show(job)
        assert f"[{node}] [raytrain {node}] ray start" in job.log and "NCCL_SOCKET_IFNAME=eth0" in job.log, show(job)
    assert "cluster resources: 6 CPUs, 4 GPUs" in job.log, show(job)
    trainer = next(line for line in job.log.splitlines() if "trainer: " in line)
    assert "--use-gpu --num-workers 4" in trainer and "--cpus-per-worker" not in trainer, show(job)
    refusals = [line for line in job.log.splitlines() if "CUDA sees none in a Ray worker" in line]
    assert len(refusals) == 1 and refusals[0].startswith("error: --use-gpu: Ray counts GPUs on rtnode"), show(job)
    assert "trainer exited with code 2" in job.log, show(job)
    assert_no_leftovers(job)


def test_gpus_that_cuda_visible_devices_does_not_list_fail_the_job_in_one_line(testbed: Testbed) -> None:
    job = testbed.sbatch(
        TWO_GPUS_EACH, SMALL_RUN, name="gpu-mismatch", timeout=300, env=testbed.env(RAYTRAIN_GPUS_PER_NODE="3")
    )
    assert job.returncode == 3, show(job)
    errors = [line for line in job.log.splitlines() if "ERROR" in line and "[rtnode" not in line]
    assert len(errors) == 1, show(job)
    # both nodes refuse; the line names the one whose step the launcher saw end first
    assert re.search(r"\brtnode[12]: Slurm gives this node 3 GPUs", errors[0]) and "lists 2" in errors[0], show(job)
    assert "trainer:" not in job.log, show(job)
    assert_no_leftovers(job)
