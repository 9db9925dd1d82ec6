"""Node loss on the Slurm testbed: the Ray worker node's processes are killed mid-run.

Two nodes, one training worker on each. After epoch 1, every Ray process of
the second node (rtnode2) gets SIGKILL, as when a node dies (epoch 1's
checkpoint is written by then, so a restart resumes at epoch 2). Then either
there is no room for two workers and the run ends within --capacity-wait-s
with an error naming the lost node (never a hang), or, with --min-workers 1,
Ray Train restarts with the one worker that fits and the run finishes.

Ray's GCS checks each node's raylet every second here, not every 3 s, and
gives up after 3 failed checks, not 5: a killed raylet refuses the check at
once, so the node is declared dead in about 4 s instead of about 17 s (a busy
but live raylet still gets Ray's 10 s per check). A restart waits 5 s, not 30, to place the old number of
workers before Ray Train settles for the workers that fit (RAYTRAIN_PLACEMENT_WAIT_S). Nothing else changes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from slurm_testbed import SCRIPT, Job, Testbed, in_queue, log_text, wait_for_line
from test_start_ray_slurm import TWO_NODES, assert_no_leftovers, show

pytestmark = pytest.mark.slurm

LOST_NODE, LOST_NODE_INDEX = "rtnode2", 1  # the second node of the allocation: a Ray worker node
FAST_NODE_DEATH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAYTRAIN_PLACEMENT_WAIT_S": "5",
}
TRAIN = ["--epochs", "3", "--train-size", "2048", "--val-size", "256", "--no-report", "--no-tensorboard"]


def kill_node_ray(job_id: int, node_index: int) -> list[int]:
    """SIGKILL every Ray process the job started on one node (tagged by start_ray_slurm.sh)."""
    tag = f"RAYTRAIN_RAY_TAG=rt-{job_id}-{node_index}".encode()
    killed = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and tag in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
        except (OSError, ProcessLookupError):
            continue
    return killed


def run_and_lose_a_node(testbed: Testbed, name: str, train_args: list[str]) -> tuple[Job, Path, float, str]:
    """Submit, wait for epoch 1's checkpoint, kill rtnode2's Ray, wait for the job to end (or to be requeued
    without rtnode2: with two nodes, the requeued job waits, and is cancelled here).

    Returns the job, its run directory, the seconds from the kill to the job's end, and `scontrol show job`.
    """
    workdir = testbed.workdir(name)
    log_path = workdir / "job.out"
    sub = subprocess.run(
        ["sbatch", "--parsable", "--output", str(log_path), *TWO_NODES, str(SCRIPT), *train_args],
        cwd=workdir,
        env=testbed.env(**FAST_NODE_DEATH),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    job_id = int(sub.stdout.strip().split(";")[0])
    run_dir = workdir / "runs" / f"raytrain-{job_id}"
    started = time.monotonic()
    try:
        while not any(run_dir.glob("checkpoint_*/checkpoint.pt")):
            assert time.monotonic() - started < 300, "no checkpoint of epoch 1:\n" + (
                log_path.read_text() if log_path.exists() else ""
            )
            time.sleep(0.5)
        time.sleep(2)  # Ray Train registers it once every rank has reported
        assert kill_node_ray(job_id, LOST_NODE_INDEX), f"no Ray process of job {job_id} found on {LOST_NODE}"
        killed_at = time.monotonic()
        while in_queue(job_id):
            assert time.monotonic() - killed_at < 300, "the job hangs after the node loss:\n" + log_path.read_text()
            if "requeued job" in log_path.read_text():
                break
            time.sleep(0.5)
        ended_after = time.monotonic() - killed_at
        shown = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["scancel", str(job_id)], timeout=30)
    job = Job(job_id, -1, log_path.read_text(), time.monotonic() - started, workdir)
    print(f"{name}: node killed -> job ended {ended_after:.0f}s; whole job {job.elapsed:.0f}s")
    return job, run_dir, ended_after, shown


def test_lost_node_without_room_ends_with_an_error_naming_it(testbed: Testbed) -> None:
    job, run_dir, ended_after, shown = run_and_lose_a_node(testbed, "node-loss", [*TRAIN, "--capacity-wait-s", "4"])
    assert f"Lost node {LOST_NODE}" in job.log, show(job)
    assert re.search(r"rank [01] ran there", job.log), show(job)  # whichever rank Ray placed there
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed", summary
    assert summary["error"].startswith(f"lost node {LOST_NODE}"), summary["error"]
    assert "did not come back within 4s" in summary["error"] and "--min-workers 1" in summary["error"], summary
    assert [n["hostname"] for n in summary["lost_nodes"]] == [LOST_NODE], summary["lost_nodes"]
    error_line = next(line for line in job.log.splitlines() if "Training failed:" in line)
    assert LOST_NODE in error_line, show(job)
    assert "trainer exited with code 1" in job.log, show(job)
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["epoch"] == 1  # epoch 1 is kept
    # the job goes again from that checkpoint, never on the lost node
    assert f"requeued job {job.job_id} (restart 1) without {LOST_NODE} (ExcNodeList={LOST_NODE})" in job.log, show(job)
    assert re.search(rf"\bExcNodeList={LOST_NODE}\s", shown) and "Restarts=1" in shown, shown
    assert_no_leftovers(job, timeout=60)


def test_lost_node_with_min_workers_goes_on_with_fewer(testbed: Testbed) -> None:
    job, run_dir, _, _ = run_and_lose_a_node(testbed, "node-loss-elastic", [*TRAIN, "--min-workers", "1", "--scale-lr"])
    assert f"Lost node {LOST_NODE}" in job.log, show(job)
    assert "Ray Train restarted the workers from the latest checkpoint (restart 1)" in job.log, show(job)
    assert (
        "Training goes on with 1 worker (was 2): global batch now 64 per worker x 1 = 64, "
        "learning rate 0.02 (--scale-lr)"
    ) in job.log, show(job)
    assert "trainer exited with code 0" in job.log, show(job)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2, 3], records  # every epoch once, none lost or doubled
    assert records[0]["world_size"] == 2 and records[-1]["world_size"] == 1, records
    assert records[-1]["global_batch_size"] == 64 and records[-1]["samples_per_rank"] == [2048], records[-1]
    assert records[0]["lr"] == pytest.approx(0.04) and records[-1]["lr"] == pytest.approx(0.02), records  # --scale-lr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs_completed"] == 3, summary
    assert summary["world_size"] == 1 and summary["restarts"] >= 1, summary
    assert [n["hostname"] for n in summary["lost_nodes"]] == [LOST_NODE], summary["lost_nodes"]
    assert "requeued" not in job.log, show(job)  # a finished run is not requeued
    assert_no_leftovers(job, timeout=60)


# A second network between the two nodes, as the fast (NCCL) network of a real cluster: a veth pair
# rtfast1 (rtnode1, 198.19.0.11) -- rtfast2 (rtnode2, 198.19.0.12), another RFC 2544 benchmark range.
# The job's Ray head address is on it; Slurm keeps using the testbed's bridge (198.18.0.0/24).
FAST_NET = [
    "ip link add rtfast1 netns rtns1 type veth peer name rtfast2 netns rtns2",
    "ip -n rtns1 addr add 198.19.0.11/24 dev rtfast1",
    "ip -n rtns2 addr add 198.19.0.12/24 dev rtfast2",
    "ip -n rtns1 link set rtfast1 up",
    "ip -n rtns2 link set rtfast2 up",
]


def ip(command: str) -> None:
    done = subprocess.run(command.split(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"{command}: {done.stderr}"


def _job_on_a_broken_link(testbed: Testbed, name: str, requeued: bool, **env: str) -> tuple[Job, str]:
    """A two-node job whose network check fails (rtnode2's fast link is down): its log, and `scontrol show job`
    after it ended (and, where `requeued`, was requeued)."""
    workdir = testbed.workdir(name)
    log_path = workdir / "job.out"
    job_id = testbed.submit(
        workdir, TWO_NODES, TRAIN, RAYTRAIN_HEAD_ADDR="198.19.0.11", RAYTRAIN_NETCHECK_TIMEOUT_S="8", **env
    )
    started = time.monotonic()
    try:
        if requeued:  # the launcher's last line, once Ray is stopped
            wait_for_line(log_path, "requeued job", started, 300, "no requeue after the network check", poll_s=0.2)
        else:  # until its script has ended: the job leaves the queue
            while in_queue(job_id):
                assert time.monotonic() - started < 300, "the job did not end:\n" + log_text(log_path)
                time.sleep(0.5)
        shown = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["scancel", str(job_id)], timeout=30)
    return Job(job_id, -1, log_path.read_text(), time.monotonic() - started, workdir), shown


def test_a_node_whose_link_is_down_is_named_and_the_requeued_job_excludes_it(testbed: Testbed) -> None:
    """The network check before Ray starts: rtnode2's link to the fast network is down (inside its
    namespace), so it cannot reach the head's address there. The job ends in one ERROR line naming
    rtnode2 (exit 3, instead of a hang at the first all-reduce) and is requeued with rtnode2 in its
    ExcNodeList (where, with only two nodes, it waits: the test cancels it). With
    RAYTRAIN_MAX_EXCLUDING_REQUEUES=0 the same job ends, not requeued, and its line says why."""
    subprocess.run(["ip", "-n", "rtns1", "link", "del", "rtfast1"], capture_output=True, timeout=30)  # a stale one
    for command in FAST_NET:
        ip(command)
    try:
        ip("ip -n rtns2 link set rtfast2 down")  # the broken link
        job, shown = _job_on_a_broken_link(testbed, "netcheck", requeued=True)
        capped, capped_shown = _job_on_a_broken_link(
            testbed, "netcheck-capped", requeued=False, RAYTRAIN_MAX_EXCLUDING_REQUEUES="0"
        )
    finally:
        subprocess.run(["ip", "-n", "rtns1", "link", "del", "rtfast1"], capture_output=True, timeout=30)
    errors = [line for line in job.log.splitlines() if "ERROR" in line]
    assert len(errors) == 1, show(job)
    assert f"network check failed: {LOST_NODE} (it could not reach rtnode1 (198.19.0.11:" in errors[0], show(job)
    assert "rtnode1 (" not in errors[0].replace("reach rtnode1 (", ""), show(job)  # the head is not blamed
    assert "exit code 3" in job.log and "ray start (" not in job.log, show(job)  # Ray never started
    assert f"requeued job {job.job_id} (restart 1) without {LOST_NODE} (ExcNodeList={LOST_NODE})" in job.log, show(job)
    assert re.search(rf"\bExcNodeList={LOST_NODE}\s", shown) and "Restarts=1" in shown, shown
    print(f"network check: job start -> requeue {job.elapsed:.0f}s")
    assert_no_leftovers(job)
    [capped_error] = [line for line in capped.log.splitlines() if "ERROR" in line]
    assert f"network check failed: {LOST_NODE} (" in capped_error, show(capped)
    assert "; not requeued: the job has been requeued 0 times already (RAYTRAIN_MAX_EXCLUDING_REQUEUES=0)" in (
        capped_error
    ), show(capped)
    assert "requeued job" not in capped.log and "Restarts=0" in capped_shown, capped_shown
    assert not re.search(rf"\bExcNodeList={LOST_NODE}\s", capped_shown), capped_shown
    assert_no_leftovers(capped)
