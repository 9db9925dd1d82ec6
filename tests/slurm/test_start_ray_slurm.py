"""Real jobs on the local Slurm testbed: cluster/start_ray_slurm.sh (raytrain_ddp.cluster.slurm) end to end.

Run as root after cluster/testbed/install.sh:
    pytest -m slurm tests/slurm -v
Ray-starting tests take ~15-60 s each on 2 cores.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_testbed import HEAD_NETNS, NODES, REPO, Job, Testbed, in_queue, job_processes, wait_for_line
from support import train_api_run
from test_data_prepare import write_fake_cifar10  # the converter tests' CIFAR-10 layout

from raytrain_ddp.driver.dashboard import TRAIN_RUNS_API

pytestmark = pytest.mark.slurm

# Two 3-CPU nodes (all the testbed has), no GPUs: one CPU training worker per node.
TWO_NODES = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=3", "--gpus-per-node=0", "--time=30"]
ONE_NODE = ["--nodes=1", *TWO_NODES[1:]]  # both workers on it, where a second node would only add its Ray start
SMALL_RUN = ["--epochs", "1", "--train-size", "512", "--val-size", "256"]
TOKEN_RE = re.compile(r"\b[0-9a-f]{64}\b")  # the per-job token is 32 random bytes in hex


def derived_port(job_id: int) -> int:
    """The GCS port the launcher derives from a job id (see raytrain_ddp/cluster/plan.py)."""
    return 20000 + (job_id % 1000) * 10


def assert_no_leftovers(job: Job, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (left := job_processes(job.job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes of job {job.job_id} left running:\n" + "\n".join(left)
    stale = list(Path("/tmp").glob(f"rt{job.job_id}.*"))
    assert not stale, f"per-job Ray temp dirs not removed: {stale}"
    assert not (Path.home() / ".raytrain" / f"job-{job.job_id}").exists(), "per-job token dir not removed"


def _run_in_train_api(job_log: Path, job_id: int, name: str) -> dict | None:
    """The job's run NAME as its dashboard's Train API lists it; None before (or no dashboard yet).

    Read as a user would: the dashboard port from the job log, the token from the file the log names."""
    ports = re.search(r"ports: gcs \d+, dashboard (\d+)", job_log.read_text() if job_log.exists() else "")
    token_file = Path.home() / ".raytrain" / f"job-{job_id}" / "auth_token"
    if not ports or not token_file.exists():
        return None
    try:
        return train_api_run(f"http://198.18.0.11:{ports.group(1)}", token_file.read_text().strip(), name)
    except OSError:  # the token file went with the job's end
        return None


def show(job: Job) -> str:
    return f"job {job.job_id} rc={job.returncode} after {job.elapsed:.1f}s; log:\n{job.log}"


def test_srun_hostname_two_nodes(testbed: Testbed) -> None:
    p = subprocess.run(
        ["srun", "--nodes=2", "--ntasks-per-node=1", "hostname"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=testbed.shared,
    )
    assert p.returncode == 0, p.stderr
    hosts = sorted(p.stdout.split())
    assert hosts == NODES, f"expected one task on each of {NODES}, got {hosts}"


def test_dry_run_plan(testbed: Testbed) -> None:
    """The plan alone (no Ray): resources from Slurm, ports from the job id,
    default storage, loud warning for node-local storage, GPU worker count."""
    job = testbed.sbatch(
        TWO_NODES, ["--storage-path", "/tmp/not-shared"], name="dry", env=testbed.env(RAYTRAIN_DRY_RUN="1")
    )
    assert job.returncode == 0, show(job)
    base = derived_port(job.job_id)
    assert f"gcs {base}, dashboard {base + 1}" in job.log, show(job)
    assert "per node: cpus 3 3" in job.log, show(job)
    # this checkout's raytrain_ddp (the nodes' steps inherit the environment)
    assert f"(raytrain_ddp from {REPO / 'raytrain_ddp'})" in job.log, show(job)
    assert "expected workers 2" in job.log and "--use-gpu" not in job.log, show(job)
    assert "WARNING: --storage-path /tmp/not-shared looks node-local" in job.log, show(job)

    job = testbed.sbatch(
        TWO_NODES, [], name="dry-gpu", env=testbed.env(RAYTRAIN_DRY_RUN="1", RAYTRAIN_GPUS_PER_NODE="3")
    )
    assert job.returncode == 0, show(job)
    assert "--use-gpu" in job.log and "expected workers 6" in job.log, show(job)
    assert f"run directory: {job.workdir}/runs/raytrain-{job.job_id}" in job.log, show(job)
    assert "WARNING" not in job.log, show(job)

    # The trainer's flags are read by the trainer's parser: an abbreviation it accepts is the user's
    # storage (not overridden by SUBMIT_DIR/runs), or refused by it before anything starts.
    shared = testbed.workdir("dry-storage")
    job = testbed.sbatch(
        TWO_NODES, ["--storage", str(shared)], name="dry-storage", env=testbed.env(RAYTRAIN_DRY_RUN="1")
    )
    if job.returncode == 0:
        assert f"run directory: {shared}/raytrain-{job.job_id}" in job.log, show(job)
        assert "--storage-path" not in job.log, show(job)
    else:
        assert job.returncode == 2 and "--storage" in job.log and "run directory" not in job.log, show(job)
    # ...and packed by its preflight: 4 workers x 1.5 CPUs do not fit 2 x 3 CPUs beside a CPU for loading.
    job = testbed.sbatch(
        TWO_NODES,
        ["--num-workers", "4", "--cpus-per-worker", "1.5"],
        name="dry-cpus",
        env=testbed.env(RAYTRAIN_DRY_RUN="1"),
    )
    assert job.returncode == 2 and "ERROR: asked for 4 workers x 1.5 CPU" in job.log, show(job)


def test_infeasible_worker_count_fails_fast(testbed: Testbed) -> None:
    job = testbed.sbatch(TWO_NODES, ["--num-workers", "8", *SMALL_RUN], name="infeasible", timeout=120)
    assert job.returncode != 0, show(job)
    assert job.elapsed < 30, show(job)
    line = next((l for l in job.log.splitlines() if "ERROR" in l), "")
    assert "8" in line and "2" in line, f"error should say what was asked (8) and what exists (2 nodes):\n{show(job)}"
    assert_no_leftovers(job)


def test_a_temp_dir_planted_by_someone_else_is_refused_in_one_line(testbed: Testbed) -> None:
    """The worker node's /tmp/rtJOBID.1, planted before the job as a symlink to a directory Ray would make
    0777: refused in one ERROR line naming it, exit 3, the target untouched, nothing of the job left."""
    wd = testbed.workdir("planted")
    job_id = testbed.submit(wd, ["--hold", *TWO_NODES], SMALL_RUN)
    target, planted = wd / "target", Path(f"/tmp/rt{job_id}.1")
    target.mkdir(mode=0o755)
    planted.symlink_to(target)
    try:
        t0 = time.monotonic()
        subprocess.run(["scontrol", "release", str(job_id)], check=True, timeout=30)
        while in_queue(job_id):
            assert time.monotonic() - t0 < 300, "job did not finish"
            time.sleep(0.5)
        job = Job(job_id, -1, (wd / "job.out").read_text(), time.monotonic() - t0, wd)
        errors = [line for line in job.log.splitlines() if "ERROR" in line]
        assert len(errors) == 1, show(job)
        assert f"rtnode2: {planted} is a symlink (to {target}); refusing to follow it" in errors[0], show(job)
        assert "exit code 3" in job.log, show(job)
        assert planted.is_symlink() and target.stat().st_mode & 0o777 == 0o755 and not list(target.iterdir())
    finally:
        planted.unlink(missing_ok=True)
    assert_no_leftovers(job)


def test_the_cifar10_example_prepares_and_trains_on_two_nodes_after_a_port_collision(testbed: Testbed) -> None:
    """examples/cifar10_resnet_slurm.sh end to end (a tiny fake CIFAR-10 copy): it prepares the data and submits a
    2-node training run, one worker per node, on shared storage. The job's derived Ray port is taken on the head
    node, so it moves to the next free block; the dashboard's Train API lists the run while it trains. (One job
    for all of it: a Ray bring-up on two nodes costs ~30 s.)"""
    wd = testbed.workdir("cifar-example")
    write_fake_cifar10(wd / "cifar-10-batches-py", per_batch=16)
    log_path = wd / "job.out"
    sbatch = f"--parsable --hold --output={log_path} {' '.join(TWO_NODES)}"
    submitted = subprocess.run(
        [str(REPO / "examples" / "cifar10_resnet_slurm.sh"), str(wd / "cifar-10-batches-py"), str(wd / "cifar10")]
        + ["--epochs", "1", "--precision", "fp32", "--name", "cifar-example"],
        cwd=wd,
        env=testbed.env(SBATCH_ARGS=sbatch),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert submitted.returncode == 0, f"{submitted.stdout}\n{submitted.stderr}"
    assert re.search(r"^train\s+80\s", submitted.stdout, re.M), submitted.stdout  # `inspect` of the prepared data
    job_id = int(submitted.stdout.strip().splitlines()[-1].split(";")[0])
    port = derived_port(job_id)
    # Occupy the derived GCS port on rtnode1 (the head) from inside its namespace.
    squatter = subprocess.Popen(
        [
            "nsenter",
            f"--net={HEAD_NETNS}",
            sys.executable,
            "-c",
            "import socket,sys,time; s=socket.socket(); s.bind(('0.0.0.0', int(sys.argv[1]))); s.listen();"
            "print('listening', flush=True); time.sleep(900)",
            str(port),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout.readline().strip() == "listening"
        t0 = time.monotonic()
        subprocess.run(["scontrol", "release", str(job_id)], check=True, timeout=30)
        # the run as the dashboard's Train API listed it while training (it is SCHEDULING before, and the
        # job's Ray goes down with the job), and every status it was seen in
        seen_in_train_api, statuses_seen = None, []
        while in_queue(job_id):
            assert time.monotonic() - t0 < 900, "job did not finish"
            listed = _run_in_train_api(log_path, job_id, "cifar-example")
            if listed and (not statuses_seen or statuses_seen[-1] != listed["status"]):
                statuses_seen.append(listed["status"])
            if listed and listed["status"] == "RUNNING" and listed["attempts"] and listed["attempts"][-1]["workers"]:
                seen_in_train_api = listed
            time.sleep(1)
        assert squatter.poll() is None, "the process holding the port must be left alone"
    finally:
        squatter.kill()
        squatter.wait()
    log = log_path.read_text()
    job = Job(job_id, 0, log, time.monotonic() - t0, wd)
    assert f"derived port block {port} was busy" in log, show(job)
    m = re.search(r"ports: gcs (\d+)", log)
    assert m and int(m.group(1)) != port, show(job)
    assert re.search(rf"trainer: .* --address 198\.18\.0\.11:{m.group(1)} ", log), show(job)  # the moved port
    assert "--scale-lr" in log and "resnet18" in log, show(job)  # the example's settings reached the trainer
    assert "all 2 nodes joined" in log, show(job)
    assert re.search(r"ssh -N -L 8265:198\.18\.0\.11:\d+ ", log), "ssh tunnel command missing"
    assert "auth_token" in log and not TOKEN_RE.search(log), "token file must be named, the token never printed"
    assert "trainer exited with code 0" in log, show(job)

    run_dir = wd / "runs" / "cifar-example"
    assert f"run directory: {run_dir}" in log, show(job)
    assert seen_in_train_api, f"never RUNNING with workers in {TRAIN_RUNS_API} (seen: {statuses_seen}); " + show(job)
    workers = seen_in_train_api["attempts"][-1]["workers"]
    assert sorted(w["world_rank"] for w in workers) == [0, 1], seen_in_train_api
    assert len({w["node_ip"] for w in workers}) == 2, f"the Train API's workers share a node: {workers}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs_completed"] == 1, summary
    assert summary["world_size"] == 2, summary
    workers = summary["workers"]
    assert len({w["node_ip"] for w in workers}) == 2, f"workers share a node: {workers}"
    assert len({w["hostname"] for w in workers}) == 2, f"workers share a host: {workers}"
    checksums = summary["param_checksums"]
    assert len(checksums) == 2 and len(set(map(str, checksums))) == 1, f"DDP replicas diverged: {checksums}"
    best = Path(summary["best_checkpoint"])
    assert best.exists() and run_dir in best.parents, f"checkpoint {best} not in the shared run dir {run_dir}"
    assert_no_leftovers(job)


def _wait_for_usr1(run_dir: Path, log_path: Path, within_s: float, what: str) -> None:
    """Until the probe (tests/slurm/ray_probe.py) has recorded a USR1."""
    deadline = time.monotonic() + within_s
    while not (run_dir / "got_usr1").exists():
        assert time.monotonic() < deadline, f"{what}:\n" + log_path.read_text()
        time.sleep(0.5)


def _cancel_and_wait(job_id: int, wd: Path, t0: float) -> Job:
    """scancel the job, wait for it to leave the queue; the job as it ended."""
    subprocess.run(["scancel", str(job_id)], timeout=30)
    deadline = time.monotonic() + 120
    while in_queue(job_id):
        assert time.monotonic() < deadline, "cancelled job did not end"
        time.sleep(0.5)
    return Job(job_id, -1, (wd / "job.out").read_text(), time.monotonic() - t0, wd)


def test_the_launcher_stops_the_trainer_ahead_of_the_time_limit_and_scancel_cleans_up(testbed: Testbed) -> None:
    """Slurm 22.05 (the testbed's) sets no SLURM_JOB_END_TIME: the launcher reads the job's end time from
    squeue and, RAYTRAIN_STOP_BEFORE_END_S before it, forwards to the running trainer the USR1 that Slurm's own
    warning (here 5 s before the 3-minute limit) would send too late; scancel then stops every Ray process of
    the job on both nodes. The stop is due 15 s into the job, just after the trainer starts: the launcher checks
    the time limit while the trainer runs, so a trainer that starts later gets it at once (Slurm's own USR1
    still comes only at 175 s)."""
    wd = testbed.workdir("end-time")
    sbatch_args = [*(arg for arg in TWO_NODES if not arg.startswith("--time")), "--time=3", "--signal=B:USR1@5"]
    env = {"RAYTRAIN_MODULE": "ray_probe", "RAYTRAIN_STOP_BEFORE_END_S": "165"}
    job_id = testbed.submit(wd, sbatch_args, ["--hold-seconds", "600"], **env)
    t0, log_path = time.monotonic(), wd / "job.out"
    try:
        wait_for_line(log_path, "probe: holding", t0, 120, "probe never started")
        assert job_processes(job_id), "Ray processes of the running job should be visible"
        # the stop is due 15 s into the job, sent to the trainer once it runs; Slurm's USR1 only at 175 s
        _wait_for_usr1(wd / "runs" / f"raytrain-{job_id}", log_path, 120, "no stop ahead of the time limit")
    finally:
        job = _cancel_and_wait(job_id, wd, t0)
    assert "the time limit is 165s away and no USR1 came" in job.log, show(job)
    before, _, after = job.log.partition("the time limit is 165s away")
    assert "got USR1" not in before, show(job)  # not Slurm's own warning
    assert "forwarding to the trainer" in after, show(job)
    assert_no_leftovers(job, timeout=40)


def _log_time(log: str, needle: str) -> float:
    """Seconds of the day of the first `[raytrain HH:MM:SS]` line containing `needle`."""
    line = next(l for l in log.splitlines() if needle in l)
    h, m, s = map(int, re.search(r"\[raytrain (\d\d):(\d\d):(\d\d)\]", line).groups())
    return h * 3600 + m * 60 + s


def _preempt(job_id: int, wd: Path) -> int:
    """Submit to the testbed's higher partition a job that needs the nodes `job_id` holds: Slurm preempts it
    (PreemptMode=REQUEUE, GraceTime=90, preempt_send_user_signal: its --signal, B:USR1, comes now; TERM only
    after the grace). Returns the preempting job's id; its log is wd/urgent.out."""
    nodes = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%N"], capture_output=True, text=True).stdout
    urgent = subprocess.run(
        ["sbatch", "--parsable", "--partition=urgent", f"--nodelist={nodes.strip()}", "--cpus-per-task=3"]
        + ["--output", str(wd / "urgent.out"), "--wrap", "echo urgent job ran on $(hostname)"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return int(urgent.stdout.strip().split(";")[0])


def test_preemption_while_ray_starts_checkpoints_requeues_and_the_requeued_job_resumes(testbed: Testbed) -> None:
    """Slurm's own preemption end to end, while the Ray cluster is still starting (before the trainer exists):
    a job of a higher partition needs the node, Slurm sends the job's USR1 at once (preempt_send_user_signal),
    which is kept and sent to the trainer once it handles it -> checkpoint at its first step -> exit 75 ->
    requeue -> the preempting job runs -> the same job id runs again in the same run directory, resumes from
    that checkpoint and finishes the requested epochs."""
    epochs = 2
    wd = testbed.workdir("preempt")
    log_path = wd / "job.out"
    run_args = ["--epochs", str(epochs), "--train-size", "2048", "--val-size", "256", "--no-report", "--no-tensorboard"]
    job_id = testbed.submit(wd, ONE_NODE, run_args)
    run_dir = wd / "runs" / f"raytrain-{job_id}"
    t0 = time.monotonic()
    urgent_id = None
    try:
        wait_for_line(log_path, "starting Ray head", t0, 300, "the job never started", poll_s=0.2)
        urgent_id = _preempt(job_id, wd)
        while in_queue(job_id):
            assert time.monotonic() - t0 < 600, "the job (or its requeued run) did not finish:\n" + log_path.read_text()
            time.sleep(0.5)
    finally:
        subprocess.run(["scancel", str(job_id), *([str(urgent_id)] if urgent_id else [])], timeout=30)
    log = log_path.read_text()
    job = Job(job_id, -1, log, time.monotonic() - t0, wd)
    first, _, again = log.partition(f"job {job_id} (restart count 1)")
    assert "got USR1 (time limit or preemption) while the Ray cluster starts: kept for the trainer" in first, show(job)
    assert first.index("got USR1") < first.index("trainer: "), show(job)  # before the trainer existed
    assert "Slurm is preempting this job (since " in first, show(job)  # told apart from the time limit
    assert "Got SIGUSR1 (Slurm's warning: time limit or preemption)" in first, show(job)
    assert "trainer exited with code 75" in first, show(job)
    assert f"requeued job {job_id} (restart 1)" in first, show(job)
    assert (wd / "urgent.out").read_text().startswith("urgent job ran on "), show(job)  # what preempted it
    assert again, show(job)  # the same job id ran again...
    assert f"run directory: {run_dir}" in again, show(job)  # ...in the same run dir
    # ...on the same ports (its dashboard URL stays), though its first run's connections are still in TIME_WAIT
    first_ports, again_ports = (re.findall(r"ports: gcs \d+.*", part) for part in (first, again))
    assert len(first_ports) == 1 and again_ports == first_ports, show(job)
    assert "Resuming from checkpoint " in again, show(job)
    assert "trainer exited with code 0" in again, show(job)
    assert [json.loads(l)["epoch"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, epochs + 1)
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["epochs_completed"] == epochs, summary
    print(
        f"USR1 -> trainer exit 75: {_log_time(log, 'trainer exited with code 75') - _log_time(log, 'got USR1'):.0f}s; "
        f"requeue -> trainer start again: "
        f"{_log_time(again, 'trainer: ') - _log_time(log, 'requeued job'):.0f}s; "
        f"whole test {job.elapsed:.0f}s"
    )
    assert_no_leftovers(job)
