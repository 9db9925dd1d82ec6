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


def listening_addresses(root_pid: int) -> dict[str, set[str]]:
    """Address -> ports that `root_pid` and its descendants listen on over TCP (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    pids, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        pids.add(pid)
        todo += children.get(pid, [])
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {link[8:-1] for link in links if link.startswith("socket:[")}
    listening: dict[str, set[str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state, inode = line.split()[1], line.split()[3], line.split()[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                listening.setdefault(_ip(address), set()).add(str(int(port, 16)))
    return listening


def _ip(hex_address: str) -> str:
    """/proc/net/tcp's little-endian hex address as text (IPv4, and IPv6 groups of 4 bytes each reversed)."""
    import ipaddress

    raw = bytes.fromhex(hex_address)
    return str(ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))))
