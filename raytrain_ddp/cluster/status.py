"""`python -m raytrain_ddp.cluster status [--address HOST:PORT]`: what the Ray cluster can hold.

Prints the table preflight checks a training request against: each alive
node's CPUs, GPUs and memory, and how many training workers of the default
shape (``--cpus-per-worker`` 1, plus one GPU each with ``--use-gpu``) fit on it.
"""

from __future__ import annotations

import argparse
import logging
import os

from raytrain_ddp.config import TrainConfig
from raytrain_ddp.errors import ConfigError, OneLineErrorParser, bad_input, plural


def build_parser(prog: str = "python -m raytrain_ddp.cluster") -> argparse.ArgumentParser:
    """prog: the command's name in --help (`raytrain-ddp` for `raytrain-ddp status`)."""
    parser = OneLineErrorParser(prog=prog, description="Look at the Ray cluster a training run would use.")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser(
        "status",
        help="per-node CPUs, GPUs, memory and how many workers fit",
        description="Per-node CPUs, GPUs, memory and how many training workers fit on each.",
        epilog="examples:\n  %(prog)s                          # $RAY_ADDRESS, else the local cluster"
        "\n  %(prog)s --address 10.0.0.1:6379",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    status.add_argument(
        "--address",
        help="Ray cluster, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else the cluster started on this machine)",
    )
    return parser


def status_table(nodes: list[dict]) -> str:
    from raytrain_ddp.driver import preflight

    cpu_shape, gpu_shape = TrainConfig(), TrainConfig(use_gpu=True)
    rows = [
        (
            "node",
            "CPUs",
            "GPUs",
            "memory GiB",
            f"workers ({cpu_shape.cpus_per_worker:g} CPU)",
            f"GPU workers ({gpu_shape.cpus_per_worker:g} CPU + 1 GPU)",
        )
    ]
    for node in nodes:
        rows.append(
            (
                node["node_ip"],
                f"{node['cpus']:g}",
                f"{node['gpus']:g}",
                f"{node['memory_gib']:.1f}",
                str(preflight.workers_that_fit(node, cpu_shape)),
                str(preflight.workers_that_fit(node, gpu_shape)),
            )
        )
    rows.append(
        (
            "total",
            f"{sum(n['cpus'] for n in nodes):g}",
            f"{sum(n['gpus'] for n in nodes):g}",
            f"{sum(n['memory_gib'] for n in nodes):.1f}",
            f"{preflight.most_workers(cpu_shape, nodes)} (1 CPU left for data loading)",
            str(preflight.most_workers(gpu_shape, nodes)),
        )
    )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def status(address: str | None) -> str:
    from raytrain_ddp.driver import preflight

    preflight.init_ray(
        address or os.environ.get("RAY_ADDRESS") or "auto", logging_level=logging.ERROR, log_to_driver=False
    )
    nodes = preflight.node_table()
    return f"Ray cluster: {plural(len(nodes), 'alive node')}\n{status_table(nodes)}"


def main(argv: list[str] | None = None, prog: str = "python -m raytrain_ddp.cluster") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        print(status(args.address))
    except ConfigError as err:
        return bad_input(err)
    return 0
