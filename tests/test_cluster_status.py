"""`python -m raytrain_ddp.cluster status`: the per-node table preflight checks requests against."""

from __future__ import annotations

import pytest
from support import run_cli


@pytest.mark.ray
def test_status_prints_each_node_and_what_fits(ray_address):
    result = run_cli("raytrain_ddp.cluster", "status", "--address", ray_address, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "Ray cluster: 1 alive node(s)"
    assert lines[1].split()[:4] == ["node", "CPUs", "GPUs", "memory"]
    node = lines[2].split()
    assert node[1:3] == ["3", "0"] and node[4:6] == ["3", "0"], lines  # 3 CPUs: 3 one-CPU workers, no GPU ones
    assert lines[3].startswith("total") and "2 (1 CPU left for data loading)" in lines[3], lines


def test_status_without_a_cluster_is_one_line_and_exit_2():
    result = run_cli("raytrain_ddp.cluster", "status", "--address", "127.0.0.1:1", timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: cannot connect to the Ray cluster at 127.0.0.1:1: Connection refused"
