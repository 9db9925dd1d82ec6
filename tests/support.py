"""Helpers the tests share (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from raytrain_ddp.driver.dashboard import TRAIN_RUNS_API

REPO = Path(__file__).resolve().parents[1]


def run_cli(module: str, *args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python -m MODULE ARGS` the way a user would, capturing its output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=full_env
    )


def run_python_file(
    path: Path, cwd: Path, env: dict | None = None, args: list[str] = (), timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run a script as a user would (`python path ARGS`), with the repo importable."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env
    )


def processes_with(needle: bytes) -> list[int]:
    """Pids of the processes whose command line holds `needle`, found in the process table as an operator would."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def dashboard_get(url: str, token: str, timeout: float = 30) -> tuple[int, str]:
    """GET a dashboard URL with the cluster's token: (HTTP status, body); status 0 while nothing listens."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError as err:  # not listening yet
        return 0, str(err)


def train_api_run(dashboard: str, token: str, name: str) -> dict | None:
    """The run named NAME as the dashboard's Train API lists it; None while the dashboard is not up or
    Ray Train's state actor does not exist yet (a 500), or before the run is listed."""
    status, body = dashboard_get(dashboard + TRAIN_RUNS_API, token, timeout=10)
    if status in (0, 500):
        return None
    assert status == 200, f"{TRAIN_RUNS_API} answered {status}: {body[:300]}"
    return next((run for run in json.loads(body)["train_runs"] if run["name"] == name), None)
