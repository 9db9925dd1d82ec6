"""Bring your own training on the Slurm testbed: PyTorch's DDP tutorial script, unchanged, one rank per node
through `sbatch cluster/start_ray_slurm.sh launch SCRIPT.py ARGS`; a rank's process SIGKILLed mid-run, the group
restarted, the script resuming from its own snapshot, and the weights equal to an uninterrupted torchrun run's."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from slurm_testbed import REPO, Testbed, in_queue, log_text, wait_for_line
from support import script_rank_pid

pytestmark = pytest.mark.slurm

TWO_NODES = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=3", "--gpus-per-node=0", "--time=30"]
TUTORIAL = REPO / "examples" / "ddp_tutorial.py"


def test_the_tutorial_script_runs_one_rank_per_node_and_a_killed_rank_resumes_from_its_snapshot(
    testbed: Testbed, tmp_path: Path
) -> None:
    wd = testbed.workdir("launch-tutorial")
    plain = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(TUTORIAL), "4", "1"]
        + ["--snapshot", str(tmp_path / "plain.pt"), "--out", str(tmp_path / "plain-out.pt")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    args = ["launch", "--max-restarts", "1", "--name", "tutorial", str(TUTORIAL), "4", "1"]
    args += ["--snapshot", str(wd / "snapshot.pt"), "--out", str(wd / "ours-out.pt"), "--pause-s", "1"]
    job_id = testbed.submit(wd, TWO_NODES, args)
    t0, log_path, logs = time.monotonic(), wd / "job.out", wd / "runs" / "tutorial" / "logs"
    try:
        wait_for_line(
            logs / "rank-1.log",
            "Epoch 1 |",
            t0,
            300,
            "rank 1 never finished epoch 1",
            poll_s=0.2,
            job_log=log_path,
            job_id=job_id,
        )
        os.kill(script_rank_pid(TUTORIAL, rank=1, job_id=job_id), signal.SIGKILL)
        while in_queue(job_id):
            assert time.monotonic() - t0 < 480, log_text(log_path)
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", str(job_id)], timeout=30)
    log = log_text(log_path)
    assert "-m raytrain_ddp.launch --address " in log and f"--name tutorial {TUTORIAL} 4 1" in log, log
    assert "Ray Train restarted the workers: every rank's script runs again (restart 1)" in log, log
    assert "trainer exited with code 0" in log, log
    rank_0, rank_1 = (logs / "rank-0.log").read_text(), (logs / "rank-1.log").read_text()
    hosts = {re.search(r"--- rank \d on (\S+?),", text).group(1) for text in (rank_0, rank_1)}
    assert hosts == {"rtnode1", "rtnode2"}, (rank_0[:200], rank_1[:200])  # one rank per node, in Ray's order
    assert "Resuming training from snapshot at Epoch " in rank_0, rank_0
    plain_weights, ours = torch.load(tmp_path / "plain-out.pt"), torch.load(wd / "ours-out.pt")
    assert all(torch.equal(plain_weights[key], ours[key]) for key in plain_weights)
