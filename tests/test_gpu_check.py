"""The GPU check's CUDA-free parts on a CPU: its refusal, its environment step, unpacking the carried Ray."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile

import pytest
import torch
from support import REPO, run_cli

from bench.gpu_check import environment, unpack_carried

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals a CPU-only machine gives")


def test_gpu_check_refuses_without_cuda_in_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    result = run_cli("bench.gpu_check", "--out", str(out), timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: the GPU check needs a CUDA GPU; torch {torch.__version__} sees none"
    ]
    assert not out.exists()


def test_evaluate_refuses_cuda_without_cuda_before_reading_the_checkpoint(tmp_path):
    result = run_cli("raytrain_ddp.evaluate", str(tmp_path / "missing.pt"), "--device", "cuda", timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --device cuda, but torch sees no CUDA GPU; use --device cpu"]


def test_environment_names_the_versions_without_a_gpu():
    found = environment()
    assert found["torch"] == torch.__version__
    assert found["python"] == sys.version.split()[0]
    assert "nccl" not in found and "gpus" not in found


def test_carried_parts_unpack_into_an_importable_site(tmp_path):
    parts = []
    for number, (name, text) in enumerate(
        [("carried_a/__init__.py", "VALUE = 1\n"), ("carried_b/__init__.py", "from carried_a import VALUE\n")]
    ):
        part = tmp_path / f"part-{number}.tar.xz"
        with tarfile.open(part, "w:xz") as tar:
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        parts.append(part)
    site = tmp_path / "site"
    assert unpack_carried(parts, site) == ["carried_a", "carried_b"]
    done = subprocess.run(
        [sys.executable, "-c", "import carried_b; print(carried_b.VALUE)"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(site)},
        timeout=60,
    )
    assert done.stdout.strip() == "1", done.stderr
