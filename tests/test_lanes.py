"""`make test`'s two lanes (tests/support.py): which tests share a process with the Slurm testbed's jobs."""

from __future__ import annotations

from pathlib import Path

from support import TESTBED_LANE_FILES, lane_of

TESTS = Path(__file__).parent


def test_every_file_named_for_the_testbed_lane_exists() -> None:
    # a renamed file would silently move to the local Ray's lane and run beside its tests
    assert sorted(name for name in TESTBED_LANE_FILES if not (TESTS / name).is_file()) == []


def test_slurm_tests_and_the_named_files_run_in_the_testbed_lane_and_the_rest_beside_it() -> None:
    assert lane_of("tests/slurm/test_gpu_slurm.py::test_gpu_job_reaches_the_cuda_probe") == "testbed"
    assert lane_of("tests/test_docs.py::test_readme[x::y]") == "testbed"
    assert lane_of("tests/test_train.py::test_python_api_elastic_start_on_uneven_data") == "local-ray"
    assert lane_of("tests/test_ray_compat.py::test_a_tested_ray_is_quiet[2.60.0]") == "local-ray"
