"""Helpers for tests that submit real jobs to the local Slurm testbed.

conftest.py's session fixture brings up a 2-node testbed (cluster/testbed/up.sh) and tears it
down at the end (unless it was already up before the session, e.g. a
developer's, which is left running). Without root or Slurm the tests are
skipped -- except under CI=true, where a missing testbed is a failure.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTBED = REPO / "cluster" / "testbed"
SCRIPT = REPO / "cluster" / "start_ray_slurm.sh"
TESTBED_DIR = Path(os.environ.get("RAYTRAIN_TESTBED_DIR", "/var/lib/raytrain-testbed"))
NODES = ["rtnode1", "rtnode2"]
HEAD_NETNS = "/run/netns/rtns1"  # rtnode1 is the first node, hence the Ray head


def _unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm testbed needs root (network namespaces, slurmd)"
    if sys.platform != "linux":
        return "the Slurm testbed needs Linux"
    missing = [b for b in ("slurmctld", "slurmd", "munged", "sbatch", "nsenter", "ip") if not shutil.which(b)]
    if missing:
        return f"Slurm testbed tools missing ({', '.join(missing)}); run cluster/testbed/install.sh"
    return None


@dataclasses.dataclass
class Job:
    job_id: int
    returncode: int
    log: str
    elapsed: float
    workdir: Path


@dataclasses.dataclass
class Testbed:
    __test__ = False  # not a test class, despite the name

    shared: Path  # storage every node sees

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for sbatch: this interpreter's env first on PATH, as a
        user's activated venv would be; the repo importable without install."""
        env = dict(os.environ)
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), str(REPO / "tests" / "slurm")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        env.setdefault("RAY_OBJECT_STORE_MEMORY", str(100 * 1024 * 1024))
        for k in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "SLURM_JOB_ID"):
            env.pop(k, None)
        env.update(extra)
        return env

    def workdir(self, name: str) -> Path:
        d = self.shared / f"{name}-{time.time_ns()}"
        d.mkdir(parents=True)
        return d

    def submit(self, wd: Path, sbatch_args: list[str], script_args: list[str], **env: str) -> int:
        """Submit start_ray_slurm.sh without waiting (the job's log: wd/job.out); returns the job id."""
        sub = subprocess.run(
            ["sbatch", "--parsable", "--output", str(wd / "job.out"), *sbatch_args, str(SCRIPT), *script_args],
            cwd=wd,
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return int(sub.stdout.strip().split(";")[0])

    def sbatch(
        self,
        sbatch_args: list[str],
        script_args: list[str],
        *,
        name: str,
        env: dict[str, str] | None = None,
        timeout: float = 600,
    ) -> Job:
        """Submit start_ray_slurm.sh and wait for the job to end (polled: `sbatch --wait` looks only every 8 s)."""
        wd = self.workdir(name)
        cmd = ["sbatch", "--parsable", "--output", str(wd / "job.out"), *sbatch_args, str(SCRIPT), *script_args]
        t0 = time.monotonic()
        p = subprocess.run(cmd, cwd=wd, env=env or self.env(), capture_output=True, text=True, timeout=60)
        m = re.match(r"(\d+)", p.stdout.strip())
        assert m, f"sbatch did not submit: rc={p.returncode}\n{p.stdout}\n{p.stderr}"
        returncode = wait_for_end(int(m.group(1)), timeout)
        return Job(int(m.group(1)), returncode, log_text(wd / "job.out"), time.monotonic() - t0, wd)


def job_processes(job_id: int) -> list[str]:
    """Live processes of a job's Ray cluster: tagged by the script, or
    mentioning the job's Ray temp dirs. (All testbed nodes share one PID
    namespace, so the host sees every node's processes.)"""
    found = []
    tag = f"RAYTRAIN_RAY_TAG=rt-{job_id}-".encode()
    tmp = f"/tmp/rt{job_id}.".encode()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
            cmdline = (p / "cmdline").read_bytes()
            environ = (p / "environ").read_bytes()
        except (OSError, IndexError):
            continue
        if tag in environ or tmp in cmdline:
            shown = cmdline.replace(b"\0", b" ")[:200].decode(errors="replace")
            found.append(f"{p.name}: {shown}")
    return found


# A job's states once it is over. Slurm keeps an ended job's record (and squeue lists it) for MinJobAge and
# then until its next purge, ~5-15 s on the testbed: a poll that waited for the record to go waited that too.
ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}


def job_state(job_id: int) -> tuple[str, int] | None:
    """The job's state (COMPLETING while its processes end) and its script's exit code; None once Slurm has
    forgotten the job."""
    shown = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True).stdout
    state, code = re.search(r"\bJobState=(\S+)", shown), re.search(r"\bExitCode=(\d+):", shown)
    return (state.group(1), int(code.group(1)) if code else -1) if state else None


def in_queue(job_id: int) -> bool:
    """Whether the job is still in Slurm's queue (pending, running, ending, or requeued to run again)."""
    state = job_state(job_id)
    return state is not None and state[0] not in ENDED


def wait_for_end(job_id: int, limit_s: float, poll_s: float = 0.25) -> int:
    """Until the job has ended: its script's exit code (-1 where Slurm forgot the job before a look)."""
    deadline = time.monotonic() + limit_s
    while (state := job_state(job_id)) and state[0] not in ENDED:
        assert time.monotonic() < deadline, f"job {job_id} is still {state[0]} after {limit_s:.0f}s"
        time.sleep(poll_s)
    return state[1] if state else -1


def log_text(path: Path) -> str:
    """A job's log so far ('' before Slurm creates it)."""
    return path.read_text() if path.exists() else ""


def wait_for_line(
    log_path: Path,
    text: str,
    started: float,
    limit_s: float,
    what: str,
    poll_s: float = 1.0,
    job_log: Path | None = None,
    job_id: int | None = None,
) -> None:
    """Until `text` is in the log at `log_path`; fails with `what` and that log (and the job's, `job_log`, where the
    line is awaited in another file) past `limit_s` from `started`, or at once once job `job_id` has ended."""
    next_look = time.monotonic()  # Slurm is asked about the job once a second, not at every poll of the log
    while text not in log_text(log_path):
        ended = False
        if job_id is not None and time.monotonic() >= next_look:
            ended, next_look = not in_queue(job_id), time.monotonic() + 1
        if ended or time.monotonic() - started >= limit_s:
            job = f"\n--- the job's log:\n{log_text(job_log)[-6000:]}" if job_log else ""
            why = f"job {job_id} ended" if ended else f"{limit_s:.0f}s"
            raise AssertionError(f"{what} ({why}):\n{log_text(log_path)[-6000:]}{job}")
        time.sleep(poll_s)
