"""The Slurm launcher's bring-up at scale, by simulation: `python -m bench.bringup --nodes 64 512 4096`.

The launcher's pure planning functions on a simulated allocation of N nodes of 64 CPUs and 8 GPUs, timed and
their peak of Python memory taken (tracemalloc), per part:

- plan: the job's plan from Slurm's environment (`plan.job_plan`), its pre-check against the requested workers
  (`plan.precheck`: preflight's packing), written as JSON;
- node start: each node reads the plan and makes its `ray start` command (`node.ray_start_args`), N times
  (reported per node: the nodes start at once, each on its own machine);
- join wait: JOIN_POLLS polls (one a second in a real wait) of a Ray node table growing to N, each finding the
  missing nodes (`plan.missing_from`) and saying the progress (`plan.join_progress`), and the give-up message
  (`plan.join_failure`);
- preflight: the node table of a `ray.nodes()` answer (`preflight.node_rows`: a plain list of dicts shaped as
  Ray's), the packing check (`preflight.check_fits`, `most_workers`) and the cluster's description.

Ray itself does not start: the table is data shaped as `ray.nodes()` answers. Linear or better is what to look
for: time per node flat as N grows.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from bench.common import ROOT, markdown_table, publish  # noqa: F401  (ROOT: the repository on sys.path)
from raytrain_ddp.cluster import node, plan
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.driver import preflight

log = logging.getLogger("bench.bringup")

CPUS, GPUS = 64, 8  # per simulated node
JOIN_POLLS = 60


def fake_ray_nodes(count: int, cpus: float = CPUS, gpus: float = GPUS) -> list[dict]:
    """`ray.nodes()` of a cluster of `count` nodes (data shaped as Ray answers it), plus one node that died."""
    alive = [
        {
            "NodeID": f"{i:056x}",
            "Alive": True,
            "NodeManagerAddress": f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
            "NodeManagerHostname": f"node-{i:03d}.cluster",
            "Resources": {"CPU": cpus, "GPU": gpus, "memory": 512 * 2**30},
        }
        for i in range(count)
    ]
    return [*alive, {**alive[0], "NodeID": "gone", "Alive": False}]


def slurm_env(count: int) -> dict[str, str]:
    return {"SLURM_JOB_ID": "4242", "SLURM_JOB_CPUS_PER_NODE": f"{CPUS}(x{count})", "SLURM_GPUS_PER_NODE": str(GPUS)}


def make_plan(count: int) -> str:
    """The job's plan, checked against one worker per GPU, as JSON (what every node reads)."""
    names = [f"node-{i:03d}" for i in range(count)]
    job = plan.job_plan(
        slurm_env(count),
        names,
        head_ip="10.0.0.0",
        ports=plan.Ports.block(6379),
        python="python",
        home="/home/u",
        fallback_cpus=CPUS,
    )
    shape = plan.worker_shape({}, count, GPUS * count, min(job.cpus))
    plan.precheck({}, shape, job.nodes, job.cpus, job.gpus, job.gpus_known)
    return job.to_json()


def start_nodes(plan_json: str) -> int:
    """Each node's start: the plan read, its `ray start` command made; the commands' total length."""
    total = 0
    for index in range(len(json.loads(plan_json)["nodes"])):
        job = plan.JobPlan.from_json(plan_json)
        role = "head" if index == 0 else "worker"
        args = node.ray_start_args(job, role, f"10.0.0.{index % 256}", job.ray_tmp(index), GPUS, CPUS, 52365)
        total += len(" ".join(args))
    return total


def join_wait(count: int) -> str:
    """JOIN_POLLS polls of a cluster whose nodes join evenly over the wait, the last 10% never; the give-up."""
    names = [f"node-{i:03d}" for i in range(count)]
    reported = {i: (names[i], f"10.{i // 65536}.{i // 256 % 256}.{i % 256}") for i in range(count)}
    ray_nodes = fake_ray_nodes(count)[:count]
    missing: dict[str, str] = {}
    for poll in range(1, JOIN_POLLS + 1):
        table = preflight.node_rows(ray_nodes[: count * 9 // 10 * poll // JOIN_POLLS])
        missing = plan.missing_from(names, reported, table)
        plan.join_progress(len(table), count, list(missing))
    return plan.join_failure(len(table), count, "timeout after 180s", list(missing.values()))


def check_cluster(count: int) -> str:
    table = preflight.node_rows(fake_ray_nodes(count))
    config = TrainConfig(num_workers=GPUS * count, use_gpu=True, cpus_per_worker=CPUS // GPUS)
    try:
        preflight.check_fits(config, table)  # every CPU taken: one worker too many
    except Exception as err:
        return str(err)
    return preflight.describe(table)


def timed(part: Callable, *args) -> tuple[object, float, float]:
    """(its answer, seconds, peak MiB of Python memory while it ran): run twice, since tracing every allocation
    slows it down."""
    started = time.perf_counter()
    part(*args)
    seconds = time.perf_counter() - started
    tracemalloc.start()
    answer = part(*args)
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return answer, seconds, peak


def measure(count: int) -> dict:
    plan_json, plan_s, plan_mib = timed(make_plan, count)
    _, start_s, start_mib = timed(start_nodes, plan_json)
    failure, join_s, join_mib = timed(join_wait, count)
    checked, check_s, check_mib = timed(check_cluster, count)
    return {
        "nodes": count,
        "plan_s": round(plan_s, 4),
        "plan_peak_mib": round(plan_mib, 2),
        "plan_json_bytes": len(plan_json),  # type: ignore[arg-type]
        "node_start_ms_per_node": round(start_s / count * 1000, 3),  # each node's own start: they run at once
        "node_start_peak_mib": round(start_mib, 2),
        "join_poll_s": round(join_s / JOIN_POLLS, 5),
        "join_peak_mib": round(join_mib, 2),
        "join_failure_chars": len(failure),  # type: ignore[arg-type]
        "preflight_s": round(check_s, 4),
        "preflight_peak_mib": round(check_mib, 2),
        "preflight_message_chars": len(checked),  # type: ignore[arg-type]
    }


def table(results: list[dict]) -> str:
    header = (
        "| Nodes | Plan + pre-check (s) | Plan JSON (bytes) | A node's start (ms) | Join-wait poll (ms) "
        "| Preflight (s) | Peak Python memory (MiB) | Give-up message (chars) | Preflight message (chars) |"
    )
    rows = [
        f"| {r['nodes']:,} | {r['plan_s']} | {r['plan_json_bytes']:,} | {r['node_start_ms_per_node']} "
        f"| {r['join_poll_s'] * 1000:.2f} | {r['preflight_s']} "
        f"| {max(r[k] for k in r if k.endswith('_peak_mib')):.1f} | {r['join_failure_chars']} "
        f"| {r['preflight_message_chars']} |"
        for r in results
    ]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--json", type=Path, help="write the figures per size here")
    args = parser.parse_args(argv)
    if min(args.nodes) < 2:
        parser.error("--nodes: each size must be 2 or more")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = [measure(count) for count in args.nodes]
    for result in results:
        log.info("%s", json.dumps(result))
    publish(results, table(results), args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
