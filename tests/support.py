"""Helpers the tests share (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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


def corrupt_row_group(path: Path, row_group: int) -> None:
    """Overwrite the first page header of a row group's first column: the footer stays valid (the checks
    before a run pass), reading that row group fails as a damaged disk or an interrupted copy makes it fail."""
    import pyarrow.parquet as pq

    column = pq.ParquetFile(path).metadata.row_group(row_group).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start : start + 16] = b"\xff" * 16
    path.write_bytes(bytes(data))
