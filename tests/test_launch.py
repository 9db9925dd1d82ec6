"""Bring your own training: scripts written as users write them for torchrun run unchanged under
`raytrain-ddp launch` on a real local Ray (each first under torchrun itself), and a training function runs
through `raytrain_ddp.launch`. Real processes, real gloo process groups, real signals and SIGKILLs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
from support import REPO, script_rank_pid

pytestmark = pytest.mark.ray

TUTORIAL = REPO / "examples" / "ddp_tutorial.py"
SESSION_SCRIPT = REPO / "examples" / "script_with_session.py"
SCRIPTS = REPO / "tests" / "scripts"
EPOCHS = 12  # the session script's, stopped and resumed on object storage


def _torchrun(script: Path, *args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300)


def _launch_command(address: str, storage: Path, name: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "raytrain_ddp.launch",
        "--address",
        address,
        "--num-workers",
        "2",
        "--storage-path",
        str(storage),
        "--name",
        name,
        *args,
    ]


def _launch(address: str, storage: Path, name: str, *args: str, env: dict | None = None):
    return subprocess.run(
        _launch_command(address, storage, name, *args),
        cwd=storage,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _wait_for_line(path: Path, text: str, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{text!r} never appeared in {path}")


# ------------------------------------------------------------------ the tutorial script, a rank killed mid-run
@pytest.fixture(scope="module")
def tutorial(ray_address, tmp_path_factory):
    """PyTorch's DDP tutorial shape, 4 epochs, a snapshot each: once under torchrun, once under launch with rank 1
    SIGKILLed after its epoch 1 and --max-restarts 1."""
    storage = tmp_path_factory.mktemp("tutorial")
    plain = _torchrun(TUTORIAL, "4", "1", "--snapshot", "plain.pt", "--out", "plain-out.pt", cwd=storage)
    assert plain.returncode == 0, plain.stderr[-3000:]
    command = _launch_command(
        ray_address, storage, "tutorial", "--max-restarts", "1",
        str(TUTORIAL), "4", "1", "--snapshot", "ours.pt", "--out", "ours-out.pt", "--pause-s", "1",
    )  # fmt: skip
    run = subprocess.Popen(command, cwd=storage, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_line(storage / "tutorial" / "logs" / "rank-1.log", "Epoch 1 |")
        os.kill(script_rank_pid(TUTORIAL, rank=1), signal.SIGKILL)
        output = run.communicate(timeout=300)[0]
    finally:
        run.kill()
    return storage, run.returncode, output


def test_the_tutorial_script_trains_the_same_weights_as_under_torchrun_though_a_rank_was_killed(tutorial):
    storage, returncode, output = tutorial
    assert returncode == 0, output[-3000:]
    plain, ours = torch.load(storage / "plain-out.pt"), torch.load(storage / "ours-out.pt")
    assert plain.keys() == ours.keys() and all(torch.equal(plain[key], ours[key]) for key in plain)


def test_the_killed_rank_restarts_every_rank_which_resume_from_the_scripts_snapshot(tutorial):
    storage, _, output = tutorial
    summary = _summary(storage / "tutorial")
    assert summary["status"] == "finished" and summary["restarts"] == 1, summary
    assert "Ray Train restarted the workers: every rank's script runs again (restart 1)" in output, output[-3000:]
    rank_0 = (storage / "tutorial" / "logs" / "rank-0.log").read_text()
    assert rank_0.count("--- rank 0 on ") == 2 and "Resuming training from snapshot at Epoch " in rank_0, rank_0


def test_rank_zeros_output_is_on_the_console_and_every_ranks_in_its_log(tutorial):
    storage, _, output = tutorial
    assert "[rank 0] [GPU0] Epoch 3 | Steps: 32" in output, output[-3000:]
    assert "[GPU1]" not in output  # rank 1's lines only in its log (--tee all shows them)
    assert "[GPU1] Epoch 3 | Steps: 32" in (storage / "tutorial" / "logs" / "rank-1.log").read_text()
    config = (storage / "tutorial" / "config.toml").read_text()
    assert "max_failures = 1" in config and "epochs" not in config  # the launch's settings, not the built-in loop's


# ------------------------------------------------------------------ failures, each one line
def test_a_failing_rank_is_named_with_its_error_and_the_callers_environment_reached_every_rank(ray_address, tmp_path):
    script, env = SCRIPTS / "failing_rank.py", {"RUN_TAG": "blue-42"}
    plain = _torchrun(script, cwd=tmp_path, env=env)
    assert plain.returncode == 1 and "ValueError: bad shard on rank 1 (RUN_TAG=blue-42)" in plain.stderr
    result = _launch(ray_address, tmp_path, "failing", str(script), env=env)
    run_dir = tmp_path / "failing"
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Training failed: rank 1: ValueError: bad shard on rank 1 (RUN_TAG=blue-42) (exit code 1;")
    assert str(run_dir / "logs" / "rank-1.log") in last
    ours = [line for line in result.stderr.splitlines() if not line.startswith("[rank 0] ")]  # not the script's
    assert not any("Traceback" in line for line in ours), result.stderr[-3000:]
    assert "rank 0 sees RUN_TAG=blue-42" in (run_dir / "logs" / "rank-0.log").read_text()
    # the failed rank's temporary session folder is gone with it
    (session,) = re.findall(r"the session folder (\S+)", (run_dir / "logs" / "rank-1.log").read_text())
    assert "raytrain-session-" in session and not Path(session).exists(), session
    summary = _summary(run_dir)
    assert summary["status"] == "failed" and summary["restarts"] == 0 and "rank 1: ValueError" in summary["error"]


def test_a_script_that_never_joins_the_process_group_is_named(ray_address, tmp_path):
    result = _launch(ray_address, tmp_path, "alone", str(SCRIPTS / "no_process_group.py"))
    assert result.returncode == 1, result.stderr[-3000:]
    # which ranks the line names is whose failure Ray Train had seen when it ended the group: both, or the first
    says = (
        ": the script never called torch.distributed.init_process_group: the 2 ranks each ran it alone; call it "
        "once at the start (docs/launch.md)"
    )
    named = {f"Training failed: {ranks}{says}" for ranks in ("ranks 0, 1", "rank 0", "rank 1")}
    assert result.stderr.strip().splitlines()[-1] in named, result.stderr[-3000:]


@pytest.mark.parametrize("target, says", [("missing.py", "no such file"), (".", "is not a file")])
def test_a_script_that_is_not_a_file_is_one_line_and_exit_2(tmp_path, target, says):
    result = subprocess.run(
        [sys.executable, "-m", "raytrain_ddp.launch", "--storage-path", str(tmp_path), target],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: {target}") and says in result.stderr
    assert not any(tmp_path.iterdir())  # nothing written


# ------------------------------------------------------------------ the session API; stop and resume
def test_a_session_script_runs_under_torchrun_with_local_defaults(tmp_path):
    result = _torchrun(SESSION_SCRIPT, "--epochs", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step 1: loss " in result.stdout and "step 2: loss " in result.stdout
    assert (tmp_path / "checkpoints" / "snapshot.pt").exists()


def test_ctrl_c_reaches_every_ranks_script_as_sigint_and_the_launcher_waits_for_it_to_save(ray_address, tmp_path):
    """Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) reaches every rank's script as
    SIGINT, as torchrun passes it on: each catches KeyboardInterrupt and saves before the launcher ends, with
    exit 130, its one line and summary.json."""
    script = SCRIPTS / "saves_on_ctrl_c.py"
    run = subprocess.Popen(
        _launch_command(ray_address, tmp_path, "ctrl-c", str(script)),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a shell's job
        # Ctrl-C as a shell's foreground job has it (a suite started in the background inherits it ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        _wait_for_line(tmp_path / "ctrl-c" / "steps.jsonl", '"step": 2,')
        os.killpg(run.pid, signal.SIGINT)
        output = run.communicate(timeout=300)[0]
    finally:
        run.kill()
    assert run.returncode == 130, output[-3000:]
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"interrupted (Ctrl-C): every rank of {script} is stopped"), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert _summary(tmp_path / "ctrl-c")["status"] == "interrupted"
    saved = sorted(path.name for path in tmp_path.glob("interrupted-rank-*"))
    assert saved == ["interrupted-rank-0", "interrupted-rank-1"], output[-3000:]


# ------------------------------------------------------------------ a training function
def test_a_training_function_runs_in_the_process_group_with_the_session(ray_address, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    from launch_function import train_fn

    from raytrain_ddp import launch

    result = launch(train_fn, num_workers=2, args={"epochs": 3, "lr": 0.05}, storage_path=str(tmp_path), name="fn")
    assert result.ok and result.summary["launched"] == {"function": "train_fn"}, result.summary
    steps = [json.loads(line) for line in (result.run_dir / "steps.jsonl").read_text().splitlines()]
    assert [record["step"] for record in steps] == [1, 2, 3] and steps[-1]["loss"] < steps[0]["loss"]
    assert result.final_metrics["loss"] == steps[-1]["loss"]
    # its print() output teed as a script's is: rank 0's on the console, each rank's in its log
    assert "[rank 0] rank 0 of 2 done" in (result.run_dir / "driver.log").read_text()  # the console's lines
    assert "rank 1 of 2 done" in (result.run_dir / "logs" / "rank-1.log").read_text()


def test_launch_refuses_a_setting_it_does_not_take(tmp_path):
    from raytrain_ddp import ConfigError, launch

    with pytest.raises(ConfigError, match="launch\\(\\) takes no setting epochs"):
        launch(print, epochs=3, storage_path=str(tmp_path))


def test_a_hung_rank_is_found_by_its_stack_and_named(ray_address, tmp_path):
    """Rank 1 waits on an event nobody sets, rank 0 for rank 1 in an all-reduce: no output, no CPU, no report.
    After --hang-timeout-s the watchdog reads every rank's stack with py-spy and names the one outside a
    collective, with its frames; with no restarts left the run ends there. 4 s: rank 0 enters the all-reduce
    right after its last line, so the stacks show the hang well before that."""
    result = _launch(ray_address, tmp_path, "hung", "--hang-timeout-s", "4", str(SCRIPTS / "hangs.py"))
    assert result.returncode == 1, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("Watchdog: no rank made progress for 4s")]
    assert len(said) == 1, result.stderr[-3000:]
    assert "; rank 1 on " in said[0] and " is not inside a collective; the others wait in one: " in said[0]
    assert "wait_for_the_lock (hangs.py:11) <- <module> (hangs.py:17)" in said[0], said
    assert "runpy" not in said[0] and "script_runner" not in said[0]  # the launcher's own frames left out
    assert "the run ends: no restarts are left (--max-restarts 0)" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("Training failed: watchdog: no rank made progress")
    driver_log = (tmp_path / "hung" / "driver.log").read_text()
    assert "rank 0's stack (py-spy dump)" in driver_log and "all_reduce (torch/distributed/" in driver_log


@dataclass
class StoppedOnObjectStorage:
    """The session script launched into a bucket, stopped by USR1 and launched again (see `stopped_on_s3`)."""

    fs: pafs.S3FileSystem
    run: str  # bucket/prefix of the run directory
    stopped_code: int  # the stopped launch's exit code
    stopped_output: str  # its stdout and stderr together
    stopped_summary: dict  # the stopped run's summary.json, read from the store
    kept_at: object  # the mtime of checkpoint/kept.txt, written into the store between the two runs
    again: subprocess.CompletedProcess  # the same command from a fresh working directory
    uninterrupted: dict  # the last steps.jsonl record of a launch that ran all EPOCHS unstopped (local storage)

    def read(self, name: str) -> str:
        with self.fs.open_input_stream(f"{self.run}/{name}") as stream:
            return stream.read().decode()


@pytest.fixture(scope="module")
def stopped_on_s3(ray_address, s3_server, tmp_path_factory) -> StoppedOnObjectStorage:
    """`--storage-path s3://...`, where checkpoint_dir() is a local folder uploaded to the store: the session script
    (EPOCHS epochs, 0.05 s a step) gets USR1 on the launcher (Slurm's time-limit warning) once its first snapshot is
    in the store; a file the script never writes is put into the store's checkpoint folder; then the same command
    runs from a fresh working directory. One stop and one resume for every rule below (each launch costs some
    20 s of Ray Train's start). The reference is launched, not torchrun'd: in `make test`'s lane (never alone, nor
    on its own machine) the torchrun'd script's rank 0 aborted at exit ("terminate called without an active
    exception") in two runs."""
    tmp_path, epochs = tmp_path_factory.mktemp("session-on-s3"), ("--epochs", str(EPOCHS))
    (tmp_path / "reference").mkdir()
    reference = _launch(ray_address, tmp_path / "reference", "reference", str(SESSION_SCRIPT), *epochs)
    assert reference.returncode == 0, reference.stderr[-3000:]
    uninterrupted = json.loads((tmp_path / "reference" / "reference" / "steps.jsonl").read_text().splitlines()[-1])
    storage = f"s3://raytrain/launched?endpoint_override={s3_server}&scheme=http"
    fs, run = pafs.S3FileSystem(endpoint_override=s3_server, scheme="http"), "raytrain/launched/session"
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    command = [*_launch_command(ray_address, first, "session", str(SESSION_SCRIPT), *epochs, "--step-seconds", "0.05")]
    command[command.index(str(first))] = storage
    stopping = subprocess.Popen(command, cwd=first, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while fs.get_file_info(f"{run}/checkpoint/snapshot.pt").type == pafs.FileType.NotFound:
            assert time.monotonic() < deadline and stopping.poll() is None, "no snapshot reached the store"
            time.sleep(0.2)
        stopping.send_signal(signal.SIGUSR1)
        output = stopping.communicate(timeout=300)[0]
    finally:
        stopping.kill()
    with fs.open_input_stream(f"{run}/summary.json") as stream:
        stopped_summary = json.loads(stream.read())
    with fs.open_output_stream(f"{run}/checkpoint/kept.txt") as stream:
        stream.write(b"written once\n")
    kept_at = fs.get_file_info(f"{run}/checkpoint/kept.txt").mtime
    again = subprocess.run(command, cwd=second, capture_output=True, text=True, timeout=300)
    return StoppedOnObjectStorage(fs, run, stopping.returncode, output, stopped_summary, kept_at, again, uninterrupted)


def test_usr1_reaches_every_rank_which_stops_at_its_check_with_exit_75(stopped_on_s3):
    """A stop signal on the launcher reaches every rank's script, which saves and returns: exit 75."""
    output, summary = stopped_on_s3.stopped_output, stopped_on_s3.stopped_summary
    assert stopped_on_s3.stopped_code == 75, output[-3000:]
    assert summary["status"] == "stopped" and summary["stop_reason"].startswith("SIGUSR1"), summary
    assert 1 <= summary["final_metrics"]["step"] < EPOCHS and "stopping after epoch" in output


def test_the_same_command_resumes_from_the_scripts_snapshot_and_records_every_step_once(stopped_on_s3):
    """Run again from a fresh working directory, the script resumes from the store's snapshot and finishes; every
    reported step is in steps.jsonl once, with its spread over the ranks."""
    again, done = stopped_on_s3.again, stopped_on_s3.stopped_summary["final_metrics"]["step"]
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"[rank 0] rank 0: resuming after epoch {done}" in again.stderr, again.stderr[-3000:]
    steps = [json.loads(line) for line in stopped_on_s3.read("steps.jsonl").splitlines()]
    assert [record["step"] for record in steps] == list(range(1, EPOCHS + 1))
    assert all(record["world_size"] == 2 and "loss_per_rank" in record for record in steps)
    assert json.loads(stopped_on_s3.read("summary.json"))["final_metrics"]["step"] == EPOCHS


def test_a_run_resumed_from_object_storage_ends_with_the_loss_of_an_uninterrupted_run(stopped_on_s3):
    """The resumed script carries on from the snapshot the store kept (on local storage a resumed script's weights
    equal torchrun's: the tutorial's tests above); every rank's log is in the store."""
    last, uninterrupted = json.loads(stopped_on_s3.read("steps.jsonl").splitlines()[-1]), stopped_on_s3.uninterrupted
    assert last["step"] == uninterrupted["step"] == EPOCHS and last["loss"] == uninterrupted["loss"], (
        last,
        uninterrupted,
    )
    assert stopped_on_s3.fs.get_file_info(f"{stopped_on_s3.run}/logs/rank-1.log").type == pafs.FileType.File


def test_what_a_resumed_script_restored_from_the_store_and_left_unchanged_is_not_uploaded_again(stopped_on_s3):
    assert stopped_on_s3.again.returncode == 0, stopped_on_s3.again.stderr[-3000:]
    kept = stopped_on_s3.fs.get_file_info(f"{stopped_on_s3.run}/checkpoint/kept.txt")
    assert kept.mtime == stopped_on_s3.kept_at
