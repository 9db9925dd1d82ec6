"""`make test`'s two lanes (tests/support.py): which tests share a process with the Slurm testbed's jobs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support import EITHER_LANE_FILES, LANE_ENV, TESTBED_LANE_FILES, lane_of, processes_with, script_rank_pid

TESTS = Path(__file__).parent


def test_every_file_named_for_the_testbed_lane_exists() -> None:
    # a renamed file would silently move to the local Ray's lane and run beside its tests
    assert sorted(name for name in TESTBED_LANE_FILES | EITHER_LANE_FILES if not (TESTS / name).is_file()) == []
    assert not TESTBED_LANE_FILES & EITHER_LANE_FILES


def test_no_file_of_the_testbed_lane_or_for_either_lane_uses_the_session_ray() -> None:
    # run by the testbed's lane, it would start a second session Ray beside the local-Ray lane's
    named = sorted(TESTBED_LANE_FILES | EITHER_LANE_FILES)
    assert [name for name in named if "ray_address" in (TESTS / name).read_text()] == []


def test_slurm_tests_and_the_named_files_run_in_the_testbed_lane_and_the_rest_beside_it() -> None:
    assert lane_of("tests/slurm/test_gpu_slurm.py::test_gpu_job_reaches_the_cuda_probe") == "testbed"
    assert lane_of("tests/test_docs.py::test_readme[x::y]") == "testbed"
    assert lane_of("tests/test_train.py::test_default_run_learns") == "testbed"  # the shared run's own Ray
    assert lane_of("tests/test_cluster_status.py::test_python_api_elastic_start_on_uneven_data") == "local-ray"
    assert lane_of("tests/test_ray_compat.py::test_a_tested_ray_is_quiet[2.60.0]") == "local-ray"
    assert lane_of("tests/test_bench.py::test_smoke_bench_writes_the_three_figures") == "either"


def test_processes_the_other_lane_started_are_not_this_lanes() -> None:
    """The bench's training runs in the testbed lane while a local-Ray test looks for Ray Train workers left
    over: each sees only its own lane's processes (marked in their environment)."""
    needle = "lane-check-" + os.urandom(4).hex()
    sleeper = [sys.executable, "-c", "import sys, time; time.sleep(60)", needle]
    ours = subprocess.Popen(sleeper)
    theirs = subprocess.Popen(sleeper, env={**os.environ, LANE_ENV: "the-other-lane"})
    try:
        assert processes_with(needle.encode()) == [ours.pid]
    finally:
        for process in (ours, theirs):
            process.kill()
            process.wait()


def test_a_scripts_rank_is_found_in_this_lane_or_in_the_slurm_job_named_never_in_the_other_lane() -> None:
    """Both lanes SIGKILL rank 1 of the tutorial script (test_launch here, the Slurm job there): each finds only
    its own (the other lane's, or a job's, would be killed in its place)."""
    script = TESTS / f"rank-check-{os.urandom(4).hex()}.py"
    sleeper = [sys.executable, "-c", "import sys, time; time.sleep(60)", str(script)]
    rank_1 = {**os.environ, "RANK": "1"}
    started = [  # first in the process table: the other lane's, then a Slurm job's, then this lane's
        subprocess.Popen(sleeper, env={**rank_1, LANE_ENV: "the-other-lane"}),
        subprocess.Popen(sleeper, env={**rank_1, "SLURM_JOB_ID": "7"}),
        subprocess.Popen(sleeper, env=rank_1),
    ]
    try:
        assert script_rank_pid(script, rank=1, timeout=10) == started[2].pid
        assert script_rank_pid(script, rank=1, job_id=7, timeout=10) == started[1].pid
    finally:
        for process in started:
            process.kill()
            process.wait()
