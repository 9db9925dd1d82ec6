"""Never hang, never lose work: real SIGKILLs, a real stalled rank, a real resumed run (a worker SIGKILLed
mid-run: test_dashboard, whose run it is; a driver SIGKILLed mid-run: test_object_storage, whose run is on a
bucket; the cluster's GCS SIGKILLed: test_interrupt, on the Ray its command starts)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import REPO, processes_left
from worker_hooks import SlowValidation, command_hooks

pytestmark = pytest.mark.ray


def _wait_for_epoch(run_dir: Path, epoch: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and any(json.loads(l)["epoch"] >= epoch for l in metrics.read_text().splitlines()):
            return
        time.sleep(0.2)
    raise TimeoutError(f"epoch {epoch} never recorded in {metrics}")


def _epochs(run_dir: Path) -> list[int]:
    return [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _config(tmp_path: Path, name: str, **overrides):
    from raytrain_ddp import TrainConfig

    values = dict(
        num_workers=2,
        epochs=3,
        train_size=4096,
        val_size=512,
        storage_path=str(tmp_path),
        name=name,
        report=False,
        tensorboard=False,
    )  # not read here: seconds a run on this machine
    return TrainConfig(**{**values, **overrides})


def test_watchdog_lets_a_long_validation_run_and_names_the_rank_stuck_in_one(ray_address, tmp_path):
    """Epoch 1's validation takes longer than the hang timeout but moves batch by batch: no hang. In epoch 2's,
    rank 1 stops after its second batch: the watchdog names it, its phase and progress, long before the
    collective timeout."""
    from raytrain_ddp import fit

    # 6 batches x 3 s per rank in epoch 1: an 18 s pass. The first batch may wait up to the whole hang timeout
    # (its Ray Data pipeline starting; 8 s was not enough on a CI machine whose other lane was busy)
    slow_validation = SlowValidation(seconds=3, stall_at=(1, 2, 2))
    started = time.monotonic()
    config = _config(
        tmp_path,
        "stalled",
        epochs=2,
        train_size=1024,
        val_size=768,
        hang_timeout_s=15,
        max_failures=0,
        collective_timeout_s=900,
    )
    result = fit(config, hooks=slow_validation)
    elapsed = time.monotonic() - started
    assert not result.ok
    assert _epochs(tmp_path / "stalled") == [1]  # the slow validation pass was no hang
    [verdict] = result.summary["hangs"]  # a start a busy machine slowed is no hang (a warning says so)
    # the stuck rank leads, named with where it stopped...
    assert verdict.startswith("no rank made progress for 15s; last seen: rank 1 on ")
    assert ": validating (2 batches done), epoch 2 micro-batch " in verdict
    assert "rank 0 on " in verdict  # ...and the others are listed with where they wait
    # the node of the rank it ended, for the Slurm launcher's exclusion
    assert result.summary["stuck_nodes"] == [w["hostname"] for w in result.summary["workers"] if w["rank"] == 1]
    assert result.summary["error"].startswith("watchdog: ")
    assert elapsed < 600  # the collective timeout alone would take 900 s after the stall


def _cli(tmp_path: Path, name: str, *extra: str, address: str, epochs: int = 3) -> list[str]:
    """The CLI on the cluster at `address`."""
    return [
        sys.executable,
        "-m",
        "raytrain_ddp.run",
        "--address",
        address,
        "--epochs",
        str(epochs),
        "--train-size",
        "2048",
        "--val-size",
        "256",
        "--storage-path",
        str(tmp_path),
        "--name",
        name,
        "--no-report",
        "--no-tensorboard",
        *extra,
    ]


def test_usr1_in_start_up_or_mid_run_stops_at_a_checkpoint_and_the_same_command_resumes(ray_address, tmp_path):
    """USR1 (Slurm's warning: time limit or preemption) before any worker runs (here: while the CLI imports torch
    and Ray) neither kills the driver nor gets lost: the workers stop at their first step check with a
    checkpoint, and the command exits 75 (Slurm requeues it). The same command resumes from that checkpoint;
    a USR1 in its epoch 2 stops it again at a checkpoint, and a TERM while it stops is logged, not fatal."""
    command = _cli(tmp_path, "preempted", address=ray_address)
    run_dir = tmp_path / "preempted"
    early = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1)  # the imports take seconds more
    early.send_signal(signal.SIGUSR1)
    output = early.communicate(timeout=300)[0]
    assert early.returncode == 75, output[-3000:]
    assert "Got SIGUSR1 (Slurm's warning: time limit or preemption)" in output, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["epochs_completed"] == 0, summary
    assert Path(summary["resume_checkpoint"]).exists(), summary

    # Epochs of >= 3 s however idle the machine: the stop request (heartbeats
    # every second, checked every 10 steps) must land before the last epoch.
    slowed = {**os.environ, **command_hooks("SlowData", rank=0, seconds=0.2)}
    again = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=slowed)
    _wait_for_epoch(run_dir, 1)
    time.sleep(1)  # into epoch 2
    again.send_signal(signal.SIGUSR1)
    seen = []
    for line in again.stdout:  # the driver has taken the first signal...
        seen.append(line)
        if "Got SIGUSR1" in line:
            break
    # ...and a second one, stopping or just stopped, is logged, not fatal: a TERM too, though ray.init set its own
    again.send_signal(signal.SIGTERM)
    output = "".join(seen) + again.communicate(timeout=300)[0]
    assert again.returncode == 75, output[-3000:]
    assert f"Resuming from checkpoint {Path(summary['resume_checkpoint']).parent}" in output, output[-3000:]
    assert "Got SIGUSR1 (Slurm's warning: time limit or preemption): every rank checkpoints" in output
    assert "while already stopping" in output or "after training ended" in output, output[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["stop_reason"].startswith("SIGUSR1"), summary
    assert summary["epochs_completed"] == 1 and Path(summary["resume_checkpoint"]).exists(), summary
    assert _epochs(run_dir) == [1]  # epoch 1 once, though it began in the first command


def test_a_rank_that_starts_after_a_stop_request_knows_it_before_its_first_beat(ray_address):
    """A USR1 during start-up reaches each rank with its link to the driver, not one beat and one node message
    later: its first step check stops it, however quickly a loaded machine's first epoch goes by."""
    import ray

    from raytrain_ddp.driver.monitor import start_monitor
    from raytrain_ddp.worker.channel import RayChannel
    from raytrain_ddp.worker.metrics import DriverLink, Heartbeat

    monitor = start_monitor()
    try:
        ray.get(monitor.request_stop.remote("SIGUSR1 (Slurm's warning: time limit or preemption)"))
        link = DriverLink(RayChannel(monitor), rank=0)
        assert Heartbeat(link.post, 0, link.stop_reason).stop_reason.startswith("SIGUSR1")
    finally:
        ray.kill(monitor)


def test_a_driver_whose_lock_is_taken_over_stops_its_run_and_writes_nothing_more(ray_address, tmp_path, monkeypatch):
    """A driver hung past the lock's stale limit (a frozen login node) while a driver on another host took the run
    directory over: at its next heartbeat it ends its run and raises, writing no summary, metrics or report over
    the other driver's, and leaves the other driver's lock alone."""
    from raytrain_ddp import RunTakenOver, fit
    from raytrain_ddp.driver import run_lock

    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.2)  # the cadence only: the lock file and the run are real
    run_dir = tmp_path / "taken"
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["result"] = fit(_config(tmp_path, "taken", epochs=50, train_size=512, val_size=64))
        except RunTakenOver as err:
            outcome["error"] = err

    run = threading.Thread(target=train)
    run.start()
    _wait_for_epoch(run_dir, 1)
    # what the other driver's take-over leaves: its own lock, written in place of this driver's
    theirs = {"host": "login2", "pid": 4242, "started": "2026-12-04T00:00:00Z", "slurm_job": None, "token": "f" * 16}
    (run_dir / "driver.lock").write_text(json.dumps(theirs) + "\n")
    metrics_then = (run_dir / "metrics.jsonl").read_text()
    run.join(timeout=120)
    assert not run.is_alive(), "the run went on after its lock was taken over"
    assert "result" not in outcome, outcome["result"].summary
    assert "taken over by process 4242 on host login2" in str(outcome["error"]), outcome
    assert json.loads((run_dir / "driver.lock").read_text()) == theirs  # the other driver's lock is left alone
    assert not (run_dir / "summary.json").exists() and not (run_dir / "report").exists()
    # the epoch under way when the lock went may have been recorded before the next heartbeat; no more than that
    assert len(_epochs(run_dir)) <= len(metrics_then.splitlines()) + 1
    assert not processes_left(b"RayTrainWorker"), "the run's workers outlived it"


def test_the_watchdog_ends_a_stalled_attempts_rank_once_while_ray_train_is_slow_to_end_it(
    ray_address, tmp_path, caplog
):
    """On a busy node Ray Train may notice the ended rank after another hang timeout: the watchdog says its verdict
    and ends the rank once per attempt (a second verdict, and a SIGKILL to a process already gone, were said)."""
    import logging

    import ray

    from raytrain_ddp import TrainConfig
    from raytrain_ddp.driver.monitor import RunRecorder
    from raytrain_ddp.driver.watchdog import _end_stalled_attempt

    config = TrainConfig(num_workers=2, storage_path=str(tmp_path), name="stalled", max_failures=0)
    config.run_dir.mkdir(parents=True)
    recorder = RunRecorder(config.run_dir, config, train_rows=512, world_size=2, sinks=[])
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    node_id = ray.get_runtime_context().get_node_id()
    for rank, pid in ((0, os.getpid()), (1, stuck.pid)):
        info = {"rank": rank, "world_size": 2, "hostname": "here", "node_id": node_id, "pid": pid}
        recorder.consume([("started", rank, info)])
    for rank, micro_batches in ((0, 5), (1, 2)):  # rank 1 furthest behind
        where = dict(epoch=1, micro_batches=micro_batches, samples=64 * micro_batches, loss=1.0, phase="training")
        recorder.consume([("progress", rank, {**where, "phase_done": 0, "time": time.monotonic()})])
    try:
        with caplog.at_level(logging.ERROR, logger="raytrain_ddp"):
            _end_stalled_attempt(recorder, 4)
            assert stuck.wait(timeout=30) == -signal.SIGKILL
            _end_stalled_attempt(recorder, 4)  # a timeout later, Ray Train not yet done with the attempt
    finally:
        stuck.kill()
    verdicts = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Watchdog: no rank made progress")]
    assert len(verdicts) == 1 and "rank 1 on here" in verdicts[0], verdicts
    assert recorder.liveness.stuck_nodes == ["here"]
