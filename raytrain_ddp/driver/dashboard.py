"""What the Ray dashboard needs to show the run, and how to log in to it.

Ray Train V2 (the default since Ray 2.43, and the only Train of Ray >= 2.60 here) records runs in a
`TrainStateActor` only when the *driver* has RAY_TRAIN_ENABLE_STATE_TRACKING=1: the driver builds the
callback that feeds it. The dashboard reads that actor by name, so neither the dashboard nor any
`ray start` needs the variable. Its endpoint is TRAIN_RUNS_API; `/api/train/v2/runs`, despite the
name, serves Train V1's runs and answers 500 under V2.
"""

from __future__ import annotations

import os
from pathlib import Path

import ray

from raytrain_ddp import _ray_compat

TRAIN_STATE_ENV = {_ray_compat.STATE_TRACKING_ENV: "1"}
TRAIN_RUNS_API = "/api/train/v2/runs/v1"


def token_location() -> str | None:
    """Where this process's Ray token is, in words, or None without token auth.

    Ray's own order: $RAY_AUTH_TOKEN, then the file $RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token.
    """
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "the value of $RAY_AUTH_TOKEN"
    return f"the contents of {os.environ.get('RAY_AUTH_TOKEN_PATH') or Path.home() / '.ray' / 'auth_token'}"


def login_hint() -> str:
    """The words after the dashboard URL on the console."""
    where = token_location()
    return f" (log in with the token: {where})" if where else ""


def where_the_run_shows(dashboard_url: str, run_name: str) -> str:
    """The console line after the dashboard's: where in it this run is.

    No open-source Ray dashboard of the tested versions has a Train page (Anyscale's console has one):
    the run is its driver's job, named after it, and the Train API lists it with attempts and workers.
    """
    return (
        f"  this run in the dashboard: the job named {run_name!r} on the Jobs page; Ray {ray.__version__}'s "
        f"dashboard has no Train page, its Train API lists the run: {dashboard_url}{TRAIN_RUNS_API}"
    )
