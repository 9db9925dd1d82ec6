"""Fail in seconds, in plain words, when the cluster cannot hold the request.

Left alone, Ray Train waits for resources that will never come (and
``init_process_group`` would wait for ranks that never start). Here the
request is packed onto the live nodes first, node by node, before any worker
is created.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import math
import os
import socket

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ddp import _ray_compat
from raytrain_ddp.cluster.health import GPU_CHECK_FAILED
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.errors import ConfigError, first_line, plural

# Ray Data's decode/shuffle tasks need CPUs the training workers do not hold:
# without one left over, ingest waits for ever and so does training.
DATA_LOADING_CPUS = 1

log = logging.getLogger("raytrain_ddp")


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) as (host, port); ValueError for an address that is not one."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def connect(host: str, port: int, timeout: float) -> None:
    """Open and close a plain TCP connection; raises OSError. What answers in seconds where Ray's own clients
    retry for minutes."""
    socket.create_connection((host, port), timeout=timeout).close()


def init_ray(address: str, **options):
    """`ray.init`, with a cluster that cannot be reached as a one-line ConfigError.

    An address nothing listens on makes Ray retry for minutes: a plain TCP
    connection answers in seconds first.
    """
    private: contextlib.AbstractContextManager = contextlib.nullcontext()
    if address == "local":
        private = _ray_compat.private_local_start()
    elif address != "auto" and "://" not in address:
        try:
            host, port = split_address(address)
            connect(host, port, timeout=5)
        except (OSError, ValueError) as err:
            why = getattr(err, "strerror", None) or str(err) or type(err).__name__
            raise ConfigError(f"cannot connect to the Ray cluster at {address}: {why}") from None
        if _loopback_only(host, port):
            private = _ray_compat.loopback_only()
    try:
        with private, _ray_compat.workers_know_their_cluster(address, options):
            return ray.init(address=address, **options)
    except (ConnectionError, RuntimeError, ValueError) as err:
        where = {"local": "a new local instance", "auto": "this machine"}.get(address, address)
        raise ConfigError(
            f"cannot connect to the Ray cluster at {where}: {first_line(err) or type(err).__name__}"
        ) from None


def _loopback_only(host: str, port: int) -> bool:
    """A Ray of this machine that listens on loopback only (one this command or a test session started).

    Ray would connect to it at the machine's own address (it turns a loopback host into that one), where
    nothing listens: joined with the loopback node address instead, as it was started.
    """
    try:
        if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
            return False
    except (OSError, ValueError):
        return False
    try:
        connect(_ray_compat.machine_address(), port, timeout=5)
    except OSError:
        return True
    return False


def node_table() -> list[dict]:
    """Alive nodes: address, host name and Ray node id, with their total CPUs, GPUs and memory (GiB)."""
    return node_rows(ray.nodes())


def node_rows(ray_nodes: list[dict]) -> list[dict]:
    """`node_table` of a `ray.nodes()` answer."""
    rows = []
    for node in ray_nodes:
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        rows.append(
            {
                "node_ip": node.get("NodeManagerAddress", "?"),
                "hostname": node.get("NodeManagerHostname", "?"),
                "node_id": node.get("NodeID"),
                "cpus": resources.get("CPU", 0.0),
                "gpus": resources.get("GPU", 0.0),
                "memory_gib": resources.get("memory", 0.0) / 2**30,
            }
        )
    return sorted(rows, key=lambda r: r["node_ip"])


def workers_that_fit(node: dict, config: TrainConfig) -> int:
    """How many training workers of this shape one node can hold."""
    fits = math.floor(node["cpus"] / config.cpus_per_worker + 1e-9)
    if config.use_gpu:
        fits = min(fits, math.floor(node["gpus"] + 1e-9))
    return fits


NODES_DESCRIBED = 8  # a larger cluster is described by its node shapes: 512 nodes made a line of 30,000 characters


def describe(nodes: list[dict]) -> str:
    """Each node's address and size; beyond NODES_DESCRIBED nodes, each size with how many nodes have it."""
    if len(nodes) <= NODES_DESCRIBED:
        return "; ".join(f"{n['node_ip']}: {_size(n)}" for n in nodes)
    shapes = collections.Counter(_size(n) for n in nodes)
    return "; ".join(f"{plural(count, 'node')} of {size}" for size, count in shapes.most_common())


def _size(node: dict) -> str:
    return f"{node['cpus']:g} CPU, {node['gpus']:g} GPU, {node['memory_gib']:.1f} GiB"


def check_fits(config: TrainConfig, nodes: list[dict]) -> int:
    """How many workers the run starts with; ConfigError naming what was asked, what exists and what would fit.

    That is --num-workers, or with --min-workers (elastic) as many as fit, at least that many.
    """
    shape = f"{config.cpus_per_worker:g} CPU" + (" + 1 GPU" if config.use_gpu else "")
    needed = config.fewest_workers
    asked = f"asked for {'at least ' if config.min_workers else ''}{plural(needed, 'worker')} x {shape}"
    if config.use_gpu and not any(n["gpus"] for n in nodes):
        raise ConfigError(
            f"--use-gpu, but no GPU in the Ray cluster ({describe(nodes)}); drop --use-gpu to train on CPU"
        )
    most = most_workers(config, nodes)
    if most < needed:
        hint = (
            f"try --{'min' if config.min_workers else 'num'}-workers {most}"
            if most
            else "try a smaller --cpus-per-worker"
        )
        raise ConfigError(
            f"{asked}, but the {plural(len(nodes), 'node')} hold {most} beside {DATA_LOADING_CPUS} CPU "
            f"for Ray Data loading ({describe(nodes)}); {hint}"
        )
    return min(most, config.num_workers)


def most_workers(config: TrainConfig, nodes: list[dict]) -> int:
    """The most workers that fit, leaving some node a whole CPU for data loading."""
    packed = sum(workers_that_fit(n, config) for n in nodes)
    return next(
        (n for n in range(packed, 0, -1) if max(cpus_left_after_packing(config, nodes, n)) >= DATA_LOADING_CPUS), 0
    )


def cpus_left_after_packing(config: TrainConfig, nodes: list[dict], workers: int) -> list[float]:
    """CPUs each node keeps once `workers` are packed onto nodes, fullest first, as Ray's PACK does."""
    left = []
    for node in sorted(nodes, key=lambda n: -workers_that_fit(n, config)):
        placed = min(workers_that_fit(node, config), workers)
        workers -= placed
        left.append(node["cpus"] - placed * config.cpus_per_worker)
    return left


CUDA_PROBE_TIMEOUT_S = 60  # a node whose GPUs are all busy cannot run the probe: it is skipped


@ray.remote(num_cpus=0, num_gpus=0.01)
def _cuda_probe() -> dict:
    """What a Ray worker given a GPU on this node sees: what a training worker will see."""
    import torch

    return {
        "host": socket.gethostname(),
        "cuda": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
    }


class UnusableGPUNodes(Exception):
    """CUDA sees no GPU on some nodes while it does on others: a fault of those nodes (a broken driver),
    which a Slurm job mends by a requeue without them. `hosts`: their host names."""

    def __init__(self, message: str, hosts: list[str]) -> None:
        super().__init__(message)
        self.hosts = hosts


def check_gpus_usable(nodes: list[dict]) -> None:
    """Probe, in a Ray worker on each node where Ray counts GPUs, whether CUDA sees one (a CPU-only torch, a
    missing driver: NCCL would fail, or workers would train on CPU unnoticed); see :func:`judge_cuda_probes`."""
    probes = [
        _cuda_probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["node_id"], soft=False)).remote()
        for node in nodes
        if node["gpus"]
    ]
    ready, _ = ray.wait(probes, num_returns=len(probes), timeout=CUDA_PROBE_TIMEOUT_S)
    judge_cuda_probes(ray.get(ready))


def judge_cuda_probes(seen: list[dict]) -> None:
    """Nothing when CUDA sees GPUs on every node probed. ConfigError when it sees none on any: the environment
    (a CPU-only torch, no driver anywhere) is the same on every node, so other nodes would not help.
    UnusableGPUNodes when it sees none on some nodes but does on others: those nodes are at fault."""
    failed = [probe for probe in seen if not probe["cuda"]]
    if not failed:
        return
    hosts = [probe["host"] for probe in failed]
    build = f"CUDA {failed[0]['torch_cuda']}" if failed[0]["torch_cuda"] else "no CUDA (a CPU-only build)"
    what = f"CUDA_VISIBLE_DEVICES={failed[0]['visible']}, torch built for {build}"
    if len(failed) == len(seen):
        raise ConfigError(
            f"--use-gpu: Ray counts GPUs on {', '.join(hosts)}, but CUDA sees none in a Ray worker there ({what}); "
            "check the driver with nvidia-smi and that the cluster's environment has a CUDA build of torch"
        )
    raise UnusableGPUNodes(
        f"{GPU_CHECK_FAILED}{', '.join(hosts)}: Ray counts GPUs there, but CUDA sees none in a Ray worker ({what}), "
        f"while it does on the other {plural(len(seen) - len(failed), 'node')}; "
        "check that node's driver with nvidia-smi",
        hosts,
    )


# A Ray started here shares the cores among more CPU workers than there are (a laptop runs 2 workers + data
# on 2 cores); past this many logical CPUs per core, or the memory a torch + gloo process needs each, it cannot.
MAX_CPUS_PER_CORE = 4
MEMORY_PER_CPU_WORKER_GIB = 0.5


def check_local_capacity(config: TrainConfig) -> None:
    """For a Ray started on this machine: a warning when CPU workers outnumber the cores, a ConfigError
    naming the largest count that fits when the machine cannot hold them at all."""
    if config.use_gpu:
        return  # GPU workers are counted against the GPUs Ray finds (check_fits)
    cores = os.cpu_count() or 1
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    by_cores = math.floor((cores * MAX_CPUS_PER_CORE - DATA_LOADING_CPUS) / config.cpus_per_worker + 1e-9)
    most = max(0, min(by_cores, math.floor(memory_gib / MEMORY_PER_CPU_WORKER_GIB)))
    if config.fewest_workers > most:
        raise ConfigError(
            f"--num-workers {config.num_workers} x {config.cpus_per_worker:g} CPU does not fit this "
            f"machine ({plural(cores, 'core')}, {memory_gib:.1f} GiB): at most {plural(most, 'CPU worker')} can run "
            f"here (--num-workers {most}), or give --address of a larger Ray cluster"
        )
    if config.num_workers * config.cpus_per_worker > cores:
        log.warning(
            "%s x %g CPU on %s: they share the cores and train slower than %d would",
            plural(config.num_workers, "CPU worker"),
            config.cpus_per_worker,
            plural(cores, "core"),
            cores,
        )


def local_cpus(config: TrainConfig) -> int:
    """Logical CPUs for a Ray we start here: the cores, or enough for workers + data loading.

    A 2-core laptop still runs 2 workers and the input pipeline; the OS shares the cores.
    """
    needed = math.ceil(config.num_workers * config.cpus_per_worker) + DATA_LOADING_CPUS
    return max(os.cpu_count() or 1, needed)
