"""The Ray dashboard shows the run: its Train API lists it during and after the run, and a real headless
Chromium, logged in with the cluster's token, sees it by name.

One real Ray head (`ray start --head --block`, dashboard and token auth on, started without any
Train setting, as the Slurm job starts it) outlives the CLI run, so "after the run" can be checked.
The run loses a worker to a real SIGKILL mid-run: the dashboard shows both attempts, and what the
restart kept is checked here too (one run for both: each costs half a minute).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import REPO, dashboard_get, kill_tree, processes_with, train_api_run

from raytrain_ddp.driver.dashboard import TRAIN_RUNS_API, login_hint
from raytrain_ddp.files import create_private

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NAME = "dashboard-demo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(predicate, what: str, timeout: float, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if process is not None and process.poll() is not None:
            pytest.fail(f"the run ended before {what}:\n{process.stdout.read()[-3000:]}")
        time.sleep(1)
    pytest.fail(f"no {what} within {timeout:.0f}s")


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A Ray head with the dashboard and token auth on; its token file; torn down with its processes."""
    token_path = tmp_path_factory.mktemp("ray-head") / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    token_path.chmod(0o600)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_TRAIN_ENABLE_STATE_TRACKING")
    }
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token_path))
    gcs_port, dashboard_port = _free_port(), _free_port()
    head = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--head",
            "--block",
            f"--port={gcs_port}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            "--num-cpus=3",
            f"--object-store-memory={300 * 2**20}",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        dashboard = f"http://127.0.0.1:{dashboard_port}"
        token = token_path.read_text()
        _wait_for(lambda: dashboard_get(dashboard + TRAIN_RUNS_API, token)[0] in (200, 500), "dashboard", 120)
        yield {
            "address": f"127.0.0.1:{gcs_port}",
            "dashboard": dashboard,
            "token": token,
            "env": env,
            "token_path": token_path,
        }
    finally:
        kill_tree(head)  # the processes it started, and only those


@pytest.fixture(scope="module")
def killed_run(ray_head, tmp_path_factory):
    """A CLI run on the head (3 epochs of 32 optimizer steps, a steps.jsonl record every 10th) whose Ray Train
    worker gets a SIGKILL from outside mid-epoch 2, after epoch 1's checkpoint; the run as the Train API
    listed it while RUNNING (before the kill) and after; the command's output and return code."""
    runs = tmp_path_factory.mktemp("runs")
    run_dir = runs / NAME
    run = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ddp.run", "--address", ray_head["address"], "--num-workers", "2"]
        + ["--epochs", "3", "--train-size", "4096", "--val-size", "512", "--storage-path", str(runs), "--name", NAME]
        + ["--no-report", "--no-tensorboard"],
        cwd=REPO,
        env=ray_head["env"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    dashboard, token = ray_head["dashboard"], ray_head["token"]
    try:

        def running_with_workers():
            found = train_api_run(dashboard, token, NAME)
            if found and found["status"] == "RUNNING" and found["attempts"] and found["attempts"][-1]["workers"]:
                return found

        during = _wait_for(running_with_workers, f"RUNNING run {NAME!r} with workers in {TRAIN_RUNS_API}", 300, run)
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text().strip(), "epoch 1's record", 300, run)
        time.sleep(1.5)  # into epoch 2, after epoch 1's checkpoint
        victims = processes_with(b"RayTrainWorker")  # Ray Train worker processes (of this lane: the head's)
        assert victims, "no Ray Train worker process found"
        os.kill(victims[-1], signal.SIGKILL)  # mid-epoch 2, from outside the training code
        output, _ = run.communicate(timeout=600)
    finally:
        run.kill()
    after = train_api_run(dashboard, token, NAME)
    return {"output": output, "returncode": run.returncode, "run_dir": run_dir, "during": during, "after": after}


@pytest.mark.ray
def test_a_sigkilled_worker_is_replaced_and_training_resumes(killed_run):
    assert killed_run["returncode"] == 0, killed_run["output"][-3000:]
    run_dir = killed_run["run_dir"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == 1, summary
    epochs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [1, 2, 3]  # every epoch exactly once
    steps = [json.loads(line) for line in (run_dir / "steps.jsonl").read_text().splitlines()]
    # every 10th of the 3 x 32 optimizer steps exactly once, the restart's included (--log-every-steps 10)
    assert [(r["step"], r["epoch"]) for r in steps] == [(s, (s - 1) // 32 + 1) for s in range(10, 97, 10)]
    assert summary["replicas_identical"]
    assert summary["final_metrics"]["val_accuracy"] > 0.8  # as an uninterrupted run of this size (0.9+; chance 0.1)


@pytest.mark.ray
@pytest.mark.skipif(
    CHROMIUM is None and os.environ.get("CI") != "true",  # in CI a missing browser fails
    reason="needs Debian's chromium (apt-get install chromium)",
)
def test_dashboard_lists_the_run_and_a_browser_shows_it(ray_head, killed_run, tmp_path):
    dashboard, token, output = ray_head["dashboard"], ray_head["token"], killed_run["output"]
    assert killed_run["returncode"] == 0, output[-3000:]
    workers = killed_run["during"]["attempts"][-1]["workers"]
    assert sorted(w["world_rank"] for w in workers) == [0, 1]
    assert all(w["node_ip"] and w["node_id"] for w in workers)
    assert f"Ray dashboard: {dashboard} (log in with the token: the contents of {ray_head['token_path']})" in output
    assert f"the job named {NAME!r} on the Jobs page" in output and f"{dashboard}{TRAIN_RUNS_API}" in output
    assert token not in output
    assert "restarted the workers from the latest checkpoint (restart 1)" in output, output[-3000:]

    after = killed_run["after"]
    assert after is not None, dashboard_get(dashboard + TRAIN_RUNS_API, token)
    assert after["status"] == "FINISHED", after
    statuses = [attempt["status"] for attempt in after["attempts"]]
    assert len(statuses) == 2 and statuses[-1] == "FINISHED" and statuses[0] != "FINISHED", after["attempts"]
    assert sorted(w["world_rank"] for w in after["attempts"][-1]["workers"]) == [0, 1], after["attempts"]

    text, png = _browse(dashboard, token, "/#/jobs", (NAME, "SUCCEEDED"), tmp_path / "chromium")
    (tmp_path / "dashboard.png").write_bytes(png)  # the artefact: docs/img/dashboard-jobs.png is one of these
    assert "Authentication Token Required" not in text, text[:2000]  # logged in: no token dialog


def test_login_hint_names_the_token_ray_uses(monkeypatch, tmp_path):
    """Ray's order: $RAY_AUTH_TOKEN, then the file $RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token."""
    for variable in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert login_hint() == ""  # no token auth: nothing to log in with
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert login_hint() == f" (log in with the token: the contents of {tmp_path / '.ray' / 'auth_token'})"
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/run/job/auth_token")
    assert login_hint() == " (log in with the token: the contents of /run/job/auth_token)"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    assert login_hint() == " (log in with the token: the value of $RAY_AUTH_TOKEN)"


def test_a_private_file_is_created_exclusively_never_through_a_link(tmp_path):
    """0600 whatever the umask; an existing file, or a link planted where it goes, is refused, not written
    through."""
    planted = tmp_path / "auth_token"
    planted.symlink_to(tmp_path / "where-they-read")
    with pytest.raises(FileExistsError):
        create_private(planted, "secret")
    assert not (tmp_path / "where-they-read").exists()
    umask = os.umask(0)
    try:
        made = create_private(tmp_path / "token", "secret")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(made.stat().st_mode) == 0o600 and made.read_text() == "secret"
    with pytest.raises(FileExistsError):
        create_private(made, "another")


def test_a_ray_on_loopback_only_is_told_from_one_on_every_interface():
    """Joined at 127.0.0.1:PORT, a Ray that listens on loopback only is joined as it was started (Ray would
    go to the machine's own address, where nothing listens); one on every interface, as `ray start` has it,
    the usual way. Real listening sockets, no Ray."""
    from raytrain_ddp.driver.preflight import _loopback_only

    with socket.create_server(("127.0.0.1", 0)) as private, socket.create_server(("0.0.0.0", 0)) as everywhere:
        assert _loopback_only("127.0.0.1", private.getsockname()[1])
        assert _loopback_only("localhost", private.getsockname()[1])
        assert not _loopback_only("127.0.0.1", everywhere.getsockname()[1])


def _browse(dashboard: str, token: str, page: str, expect: tuple[str, ...], profile: Path) -> tuple[str, bytes]:
    """Log in to the dashboard the way its token dialog does, open `page`, wait until it shows every string
    of `expect`: (page text, PNG)."""
    browser = subprocess.Popen(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=1400,800",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        _wait_for(lambda: port_file.exists() and port_file.read_text().count("\n") >= 1, "Chromium DevTools", 60)
        return asyncio.run(_devtools(port_file.read_text().split()[0], dashboard, token, page, expect))
    finally:
        browser.terminate()
        browser.wait(timeout=30)


async def _devtools(port: str, dashboard: str, token: str, page: str, expect: tuple[str, ...]) -> tuple[str, bytes]:
    import aiohttp  # Ray's own dependency

    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{port}/json/list") as response:
            target = next(t for t in await response.json() if t["type"] == "page")
        async with http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            ids = iter(range(1, 10**6))

            async def call(method: str, **params):
                sent = next(ids)
                await ws.send_json({"id": sent, "method": method, "params": params})
                async for message in ws:
                    reply = json.loads(message.data)
                    if reply.get("id") == sent:
                        assert "error" not in reply, reply
                        return reply["result"]

            async def evaluate(expression: str):
                result = await call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
                return result["result"].get("value")

            # Log in from a plain page of the dashboard's origin: the app, opened first, would keep its dialog.
            await call("Page.navigate", url=dashboard + "/api/authentication_mode")
            await _until(lambda: evaluate("document.readyState === 'complete'"))
            status = await evaluate(
                f"fetch('/api/authenticate', {{method: 'POST', headers: "
                f"{{Authorization: 'Bearer {token}'}}}}).then(r => r.status)"
            )
            assert status == 200, f"POST /api/authenticate answered {status}"
            await call("Page.navigate", url=dashboard + page)
            shows_all = " && ".join(f"document.body.innerText.includes({json.dumps(s)})" for s in expect)
            text = await _until(
                lambda: evaluate(f"({shows_all}) && document.body.innerText"),
                lambda: evaluate("document.body.innerText"),
            )
            png = base64.b64decode((await call("Page.captureScreenshot", format="png"))["data"])
            return text, png


async def _until(check, show=None, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.5)
    pytest.fail(f"the page did not get there within {timeout:.0f}s" + (f"; it shows:\n{await show()}" if show else ""))
