"""examples/cifar10_resnet_slurm.sh end to end on the testbed: prepare CIFAR-10 (a tiny fake copy), submit, train."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from slurm_testbed import REPO, Testbed

sys.path.insert(0, str(REPO / "tests"))
from test_data_prepare import write_fake_cifar10  # noqa: E402  (the converter tests' CIFAR-10 layout)

pytestmark = pytest.mark.slurm


def test_cifar10_resnet_example_prepares_and_trains(testbed: Testbed) -> None:
    workdir = testbed.workdir("cifar-example")
    write_fake_cifar10(workdir / "cifar-10-batches-py", per_batch=16)
    job_log = workdir / "job.out"
    env = testbed.env(
        SBATCH_ARGS=f"--wait --output={job_log} --nodes=2 --ntasks-per-node=1 --cpus-per-task=3 "
        "--gpus-per-node=0 --time=30"
    )
    done = subprocess.run(
        [
            str(REPO / "examples" / "cifar10_resnet_slurm.sh"),
            str(workdir / "cifar-10-batches-py"),
            str(workdir / "cifar10"),
            "--epochs",
            "1",
            "--precision",
            "fp32",
            "--name",
            "cifar-example",
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = job_log.read_text() if job_log.exists() else ""
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{log}"
    assert re.search(r"^train\s+80\s", done.stdout, re.M), done.stdout  # `inspect` of the prepared dataset
    summary = json.loads((workdir / "runs" / "cifar-example" / "summary.json").read_text())
    assert summary["status"] == "finished", log
    assert summary["world_size"] == 2 and summary["epochs_completed"] == 1
    assert "--scale-lr" in log and "resnet18" in log
