"""Ctrl-C, for real: the CLI in a pseudo-terminal (the terminal sends the SIGINT), and fit() in a real
Jupyter kernel; and the CLI's Ray going away under it (its GCS SIGKILLed). Each ends promptly, says so, writes
its summary and leaves no worker; later interrupts work."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from support import REPO, descendants, kill_tree, processes_left

pytestmark = pytest.mark.ray

SMALL_LONG_RUN = dict(num_workers=2, epochs=50, train_size=1024, val_size=128, report=False, tensorboard=False)


def _wait_for_epoch_1(run_dir: Path, timeout: float = 300, alive=lambda: True) -> None:
    deadline = time.monotonic() + timeout
    while not (run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline, f"no epoch recorded in {run_dir} within {timeout:.0f}s"
        assert alive(), "the run ended before its first epoch"
        time.sleep(0.2)


def _cli(tmp_path: Path, name: str) -> list[str]:
    """`python -m raytrain_ddp.run` with SMALL_LONG_RUN, on a local Ray it starts itself."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL_LONG_RUN.items() if not isinstance(v, bool)]
    command = [sys.executable, "-m", "raytrain_ddp.run", *flags, "--no-report", "--no-tensorboard"]
    return [*command, "--storage-path", str(tmp_path), "--name", name]


def _in_a_terminal() -> None:
    """In the child: its own session, whose controlling terminal is the pty on stdin, and SIGINT as a shell's
    foreground job has it (a suite started in the background inherits it ignored, and exec keeps that)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_a_terminal_exits_130_with_one_line_and_a_summary(tmp_path):
    run_dir = tmp_path / "ctrl-c"
    master, terminal = pty.openpty()
    proc = subprocess.Popen(
        _cli(tmp_path, "ctrl-c"),
        cwd=REPO,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
        preexec_fn=_in_a_terminal,
    )
    os.close(terminal)
    screen = bytearray()

    def read_screen():
        try:
            while chunk := os.read(master, 4096):
                screen.extend(chunk)
        except OSError:  # the terminal closed: the command and everything it started are gone
            pass

    reader = threading.Thread(target=read_screen, daemon=True)
    reader.start()
    try:
        _wait_for_epoch_1(run_dir, alive=lambda: proc.poll() is None)
        os.write(master, b"\x03")  # Ctrl-C: the terminal sends SIGINT to its foreground process group
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
        reader.join(timeout=10)
        os.close(master)
    text = screen.decode(errors="replace")
    assert code == 130, text[-3000:]
    # the screen as a person reads it: without colour and line-clearing sequences, \r starting a line anew
    plain = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text).replace("\r", "\n")
    last = [line.strip() for line in plain.splitlines() if line.strip()][-1]
    assert last.startswith("interrupted (Ctrl-C) after ") and "run the same command again to resume" in last, text
    assert "Traceback" not in text, text[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["epochs_completed"] >= 1, summary
    # the Ray the command started, and its workers, went with it
    session = os.readlink(run_dir / "ray-logs").removesuffix("/logs").encode()
    assert not processes_left(session), "processes of the command's Ray left running"


def test_interrupting_a_jupyter_kernel_ends_the_run_and_later_interrupts_still_work(tmp_path):
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    manager, client = start_new_kernel(kernel_name="python3", cwd=str(REPO), env=env)
    try:
        setup = f"from raytrain_ddp import TrainConfig, fit\nsettings = {SMALL_LONG_RUN!r}\n"
        assert _execute(client, setup, timeout=120)["status"] == "ok"
        # stop_on_error=False: after a cell's error ipykernel aborts requests that arrive while it is still
        # clearing its queue (reply status "aborted"), a race with the next cell that is not what is tested here.
        # Twice in the same kernel: the first run leaves nothing behind (workers, placement group, a signal
        # handler of its own) that would keep the second from starting or its interrupt from landing
        for name in ("notebook", "notebook-again"):
            message_id = client.execute(
                f"fit(TrainConfig(name={name!r}, storage_path={str(tmp_path)!r}, **settings))", stop_on_error=False
            )
            _wait_for_epoch_1(tmp_path / name)
            interrupted_at = time.monotonic()
            manager.interrupt_kernel()
            reply = _reply(client, message_id, timeout=120)
            assert reply["status"] == "error" and reply["ename"] == "Interrupted", (name, reply)
            assert time.monotonic() - interrupted_at < 60, f"{name}: the cell did not end promptly"
            summary = json.loads((tmp_path / name / "summary.json").read_text())
            assert summary["status"] == "interrupted", summary
            assert not processes_left(b"RayTrainWorker"), f"{name}: workers of the run left running"
        # Ctrl-C still works in a cell that is no run: no handler of the runs' is left behind to swallow it
        message_id = client.execute("import time\nprint('sleeping', flush=True)\ntime.sleep(300)", stop_on_error=False)
        _message(client.get_iopub_msg, message_id, 60, "output of the cell", kind="stream")  # the cell runs
        interrupted_at = time.monotonic()
        manager.interrupt_kernel()
        reply = _reply(client, message_id, timeout=60)
        assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
        assert time.monotonic() - interrupted_at < 30
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def _execute(client, code: str, timeout: float) -> dict:
    return _reply(client, client.execute(code), timeout)


def _reply(client, message_id: str, timeout: float) -> dict:
    return _message(client.get_shell_msg, message_id, timeout, "reply")["content"]


def _message(channel, message_id: str, timeout: float, what: str, kind: str | None = None) -> dict:
    """The next message on `channel` about the request `message_id` (of this `kind`, if given)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            message = channel(timeout=1)
        except Exception:  # queue.Empty: nothing yet
            continue
        if message["parent_header"].get("msg_id") == message_id and kind in (None, message["msg_type"]):
            return message
    pytest.fail(f"no {what} within {timeout:.0f}s")


def test_a_cluster_whose_gcs_dies_ends_the_run_in_one_line_with_a_summary(tmp_path):
    """The head node's Ray goes (here its GCS is SIGKILLed; on Slurm a cancelled step or a lost head node):
    Ray's core worker would wait 60 s, then end the driver with no summary and no word of why. The watcher
    calls the cluster gone first (at its next check: the GCS of a Ray the command started cannot come back, so
    the 15 s that a remote one gets are not waited): exit 1, the reason in one line, summary.json with the epochs
    done."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own, started by the command
    run_dir, command = tmp_path / "headless", _cli(tmp_path, "headless")
    run = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_epoch_1(run_dir, alive=lambda: run.poll() is None)
        gcs = [pid for pid in descendants(run.pid) if b"gcs_server" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(gcs) == 1, gcs
        os.kill(gcs[0], signal.SIGKILL)
        output = run.communicate(timeout=300)[0]
    finally:
        if run.poll() is None:
            kill_tree(run)
    assert run.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    said = [line for line in output.splitlines() if line.startswith("Training failed: ")]
    assert len(said) == 1 and "the Ray cluster went away: its GCS at " in said[0], output[-3000:]
    assert " ended (the Ray this command started; exit code -9)" in said[0], said
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["error"].startswith("the Ray cluster went away"), summary
    assert 1 <= summary["epochs_completed"] < 30, summary
