"""A Slurm allocation as a typed job plan: pure functions of the environment (no processes, no Ray).

Everything here is a function of a mapping of environment variables (and, for
the trainer's flags, of the trainer's own parser), so it is unit-tested with
fake environments in milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping

from raytrain_ddp.cluster.health import MAX_EXCLUDING_REQUEUES, max_excluding_requeues, netcheck_timeout
from raytrain_ddp.errors import bounded, plural

EXIT_BRINGUP = 3  # the Ray cluster could not be brought up (the log says which node and why)

# Per-job ports: a block of 4 (GCS, dashboard, Ray client server, dashboard agent HTTP) at
# 20000 + (job id % 1000) * 10, between Ray's worker ports (10002-19999) and the kernel's
# ephemeral range (32768+); a busy block moves to the next one.
PORT_BASE, PORT_STRIDE, PORT_BLOCKS = 20000, 10, 1000

NODE_LOCAL_RE = re.compile(r"^/(tmp|var/tmp|dev/shm|local|scratch/local|lscratch|localscratch)(/|$)")


@dataclasses.dataclass(frozen=True)
class Ports:
    gcs: int
    dashboard: int
    client: int
    agent: int

    @classmethod
    def block(cls, base: int) -> Ports:
        return cls(base, base + 1, base + 2, base + 3)

    def all(self) -> list[int]:
        return [self.gcs, self.dashboard, self.client, self.agent]


def port_blocks(job_id: int, tries: int = 100) -> list[Ports]:
    """The port blocks a job tries, in order: the one derived from its id first."""
    return [Ports.block(PORT_BASE + ((job_id + k) % PORT_BLOCKS) * PORT_STRIDE) for k in range(tries)]


def hostport(host: str, port: int) -> str:
    """host:port, bracketing an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def expand_cpu_list(spec: str) -> list[int]:
    """Slurm's per-node CPU list, e.g. SLURM_JOB_CPUS_PER_NODE="8(x2),4" -> [8, 8, 4]."""
    cpus: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"not a Slurm CPU list: {spec!r}")
        cpus += [int(m.group(1))] * int(m.group(2) or 1)
    return cpus


def gpu_count(spec: str | None) -> int:
    """GPUs in a Slurm GPU/GRES spec: "3", "gpu:3", "a100:3", "gpu:a100:2(IDX:0-1)", "gres/gpu:3",
    "gres:gpu:a100:2,gres/shard:1" (0 when there is no GPU part)."""
    for item in filter(None, (spec or "").split(",")):
        item = re.sub(r"^gres[/:]", "", item.strip())
        item = re.sub(r"\(.*\)$", "", item)  # (IDX:0-1), (S:0)
        if item.isdigit():
            return int(item)
        m = re.fullmatch(r"gpu(?::[^:]+)?:(\d+)", item)
        if m:
            return int(m.group(1))
        m = re.fullmatch(r"([^:]+):(\d+)", item)
        if m and not m.group(1).startswith(("gpu", "shard", "mps")):
            return int(m.group(2))  # "a100:3": a GPU type (--gpus-per-node=a100:3)
    return 0


def id_list_count(ids: str) -> int:
    """Entries in a list like SLURM_JOB_GPUS="0,1,2" or CUDA_VISIBLE_DEVICES="GPU-uuid,..." ("" -> 0)."""
    return len([i for i in ids.split(",") if i.strip()])


def cpus_per_node(env: Mapping[str, str], nnodes: int, fallback: int) -> list[int]:
    """CPUs Ray gets on each node: RAYTRAIN_CPUS_PER_NODE, else --cpus-per-task, else Slurm's per-node list."""
    for key in ("RAYTRAIN_CPUS_PER_NODE", "SLURM_CPUS_PER_TASK"):
        if env.get(key):
            return [int(env[key])] * nnodes
    cpus = expand_cpu_list(env["SLURM_JOB_CPUS_PER_NODE"]) if env.get("SLURM_JOB_CPUS_PER_NODE") else []
    return (cpus + [int(env.get("SLURM_CPUS_ON_NODE") or fallback)] * nnodes)[:nnodes]


def gpus_per_node(env: Mapping[str, str], nnodes: int) -> tuple[int, bool]:
    """GPUs per node as Slurm describes the job (each node re-reads its own), and whether Slurm
    states it per node (only then is the worker count checked before Ray starts)."""
    known = bool(env.get("RAYTRAIN_GPUS_PER_NODE") or env.get("SLURM_GPUS_PER_NODE"))
    if env.get("RAYTRAIN_GPUS_PER_NODE"):
        return int(env["RAYTRAIN_GPUS_PER_NODE"]), known
    if env.get("SLURM_GPUS_ON_NODE"):
        return int(env["SLURM_GPUS_ON_NODE"]), known
    if env.get("SLURM_JOB_GPUS"):
        return id_list_count(env["SLURM_JOB_GPUS"]), known
    if env.get("SLURM_GPUS_PER_NODE"):
        return gpu_count(env["SLURM_GPUS_PER_NODE"]), known
    if env.get("SLURM_TRES_PER_NODE") or env.get("SLURM_GRES"):
        return gpu_count(env.get("SLURM_TRES_PER_NODE") or env.get("SLURM_GRES")), known
    if env.get("SLURM_GPUS"):
        return gpu_count(env["SLURM_GPUS"]) // nnodes, known
    return 0, known


def node_gpus(env: Mapping[str, str], estimate: int) -> int:
    """GPUs on this node according to Slurm inside its step (`estimate`: the job-wide guess)."""
    if env.get("RAYTRAIN_GPUS_PER_NODE"):
        return int(env["RAYTRAIN_GPUS_PER_NODE"])
    if env.get("SLURM_GPUS_ON_NODE"):
        return int(env["SLURM_GPUS_ON_NODE"])
    ids = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS")
    return id_list_count(ids) if ids else estimate


def gpu_mismatch(node: str, visible: str | None, gpus: int) -> str | None:
    """One line when CUDA_VISIBLE_DEVICES disagrees with the GPUs Ray will advertise, else None.

    Ray hands each GPU worker one entry of CUDA_VISIBLE_DEVICES: fewer entries than advertised GPUs
    would put two workers on one GPU (or none on some)."""
    if gpus and visible is not None and id_list_count(visible) != gpus:
        return (
            f"{node}: Slurm gives this node {plural(gpus, 'GPU')} and Ray would advertise {gpus}, but "
            f"CUDA_VISIBLE_DEVICES={visible!r} lists {id_list_count(visible)}; check the job's --gpus-per-node "
            "(or RAYTRAIN_GPUS_PER_NODE) against the node's gres.conf"
        )
    return None


def job_end_time(env: Mapping[str, str], squeue_end: str = "") -> int | None:
    """The job's time limit in Unix seconds: SLURM_JOB_END_TIME (Slurm 23.02 and later set it), else what
    `SLURM_TIME_FORMAT=%s squeue -h -j JOB -o %e` printed (older Slurm). None for a job without one (unset,
    0, not a number, squeue's N/A)."""
    for text in (env.get("SLURM_JOB_END_TIME", ""), squeue_end.strip()):
        if text.isdigit() and int(text) > 0:
            return int(text)
    return None


def run_name(job_name: str | None, job_id: int) -> str:
    """Default run name JOBNAME-JOBID: a requeued job keeps its id, hence its run directory."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", job_name or "raytrain").lstrip("._-") or "raytrain"
    return f"{name}-{job_id}"


def looks_node_local(path: str, fstype: str) -> bool:
    return bool(NODE_LOCAL_RE.match(path)) or fstype == "tmpfs"


def fstype_of(path: str, mounts: str) -> str:
    """File system type of `path` from the text of /proc/mounts (the longest mount point above it)."""
    best, kind = "", "?"
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        inside = path == mount or path.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


# ------------------------------------------------------------------ the trainer's flags
LAUNCH_MODULE = "raytrain_ddp.launch"  # `start_ray_slurm.sh launch SCRIPT.py ARGS`: a script of one's own


def chosen_settings(trainer_args: list[str], module: str = "raytrain_ddp.run") -> dict:
    """The settings the user chose (flags and --config file), read by the trainer's own parser (launch's: its run
    flags before the script, not the script's own).

    Raises SystemExit(2) with the parser's one line for a bad flag, ConfigError for a bad --config.
    Another trainer module (RAYTRAIN_MODULE) may take flags of its own: those are left to it.
    """
    if module == LAUNCH_MODULE:
        from raytrain_ddp.launch import run_settings

        return run_settings(trainer_args)
    from raytrain_ddp.run import settings_from_args

    return settings_from_args(trainer_args, allow_unknown=module != "raytrain_ddp.run")


@dataclasses.dataclass(frozen=True)
class RunLocation:
    storage: str
    name: str
    extra_args: list[str]  # what the launcher adds to the trainer's command line


def run_location(chosen: Mapping, submit_dir: str, job_name: str | None, job_id: int) -> RunLocation:
    """Run directory: the user's --storage-path/--name, else SUBMIT_DIR/runs and JOBNAME-JOBID."""
    extra: list[str] = []
    storage = chosen.get("storage_path")
    if storage is None:
        storage = f"{submit_dir}/runs"
        extra += ["--storage-path", storage]
    name = chosen.get("name")
    if name is None:
        name = run_name(job_name, job_id)
        extra += ["--name", name]
    return RunLocation(str(storage), str(name), extra)


@dataclasses.dataclass(frozen=True)
class WorkerShape:
    use_gpu: bool
    num_workers: int
    cpus_per_worker: float
    extra_args: list[str]
    note: str | None = None


def worker_shape(chosen: Mapping, nnodes: int, cluster_gpus: int, min_cpus: int) -> WorkerShape:
    """The launcher's defaults for what the user left open: one worker per GPU (--use-gpu) when the job
    has GPUs, else one per node; and a CPU worker per node takes all CPUs of its node but one.

    That one CPU per node is left for Ray Data's loading tasks (a task needs 1 CPU on one node), and
    with 3+ CPUs per node Ray cannot pack two workers onto one node.
    """
    from raytrain_ddp.config import TrainConfig

    extra: list[str] = []
    use_gpu = chosen.get("use_gpu")
    if use_gpu is None:
        use_gpu = cluster_gpus > 0
        if use_gpu:
            extra.append("--use-gpu")
    workers = chosen.get("num_workers")
    if workers is None:
        workers = cluster_gpus if cluster_gpus > 0 else nnodes
        extra += ["--num-workers", str(workers)]
    cpus = chosen.get("cpus_per_worker")
    note = None
    if cpus is None:
        cpus = TrainConfig.cpus_per_worker
        if cluster_gpus == 0 and workers == nnodes:
            cpus = max(min_cpus - 1, 1)
            extra += ["--cpus-per-worker", str(cpus)]
            if nnodes > 1 and min_cpus < 3:
                note = (
                    f"note: with {plural(min_cpus, 'CPU')} per node Ray may place two workers on one node; "
                    "use --cpus-per-task=3 or more"
                )
    return WorkerShape(bool(use_gpu), int(workers), float(cpus), extra, note)


def precheck(
    chosen: Mapping, shape: WorkerShape, nodes: list[str], cpus: list[int], gpus: int, gpus_known: bool
) -> None:
    """ConfigError in a second, instead of after Ray's start-up, when the allocation cannot hold the
    requested workers: the trainer's own packing (preflight), applied to what Slurm states per node."""
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.driver import preflight

    if shape.use_gpu and not gpus_known:
        return  # GPUs per node not stated by Slurm: the trainer checks against the live cluster
    config = TrainConfig(
        **{
            **chosen,
            "use_gpu": shape.use_gpu,
            "num_workers": shape.num_workers,
            "cpus_per_worker": shape.cpus_per_worker,
        }
    )
    table = [{"node_ip": n, "cpus": float(c), "gpus": float(gpus), "memory_gib": 0.0} for n, c in zip(nodes, cpus)]
    preflight.check_fits(config, table)


@dataclasses.dataclass
class JobPlan:
    """What one Slurm job's Ray cluster and training run will be."""

    job_id: int
    restart_count: int
    nodes: list[str]
    cpus: list[int]  # per node
    gpus: int  # per node, as the job describes it (each node re-reads its own)
    gpus_known: bool
    step_gpus: int  # per node, as Slurm allocated them (RAYTRAIN_GPUS_PER_NODE aside): what each Ray step asks for
    head_ip: str
    ports: Ports
    derived_ports: Ports
    tmp_base: str
    job_dir: str
    python: str
    dashboard: bool
    module: str = "raytrain_ddp.run"
    netcheck_timeout_s: float = 0.0  # the nodes' network check before Ray starts (0: none)
    max_excluding_requeues: int = MAX_EXCLUDING_REQUEUES  # requeues without the nodes a failure is blamed on

    @property
    def head(self) -> str:
        return self.nodes[0]

    @property
    def head_address(self) -> str:
        return hostport(self.head_ip, self.ports.gcs)

    def tag(self, index: int) -> str:
        """RAYTRAIN_RAY_TAG of node `index`'s Ray processes: finds exactly them, even orphans."""
        return f"rt-{self.job_id}-{index}"

    def node_tmp(self, index: int) -> str:
        """Node `index`'s private (0700) dir: Ray's temp dir, which Ray makes 0777, lives inside it."""
        return f"{self.tmp_base}/rt{self.job_id}.{index}"  # short: Ray's socket paths must fit in 107 bytes

    def ray_tmp(self, index: int) -> str:
        return f"{self.node_tmp(index)}/r"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobPlan:
        values = json.loads(text)
        values["ports"], values["derived_ports"] = Ports(**values["ports"]), Ports(**values["derived_ports"])
        return cls(**values)


def job_dir(env: Mapping[str, str], home: str) -> str:
    """The job's private dir on storage every node sees (its auth token, the plan, what nodes report)."""
    return f"{env.get('RAYTRAIN_JOB_DIR_BASE') or f'{home}/.raytrain'}/job-{env['SLURM_JOB_ID']}"


def job_plan(
    env: Mapping[str, str], nodes: list[str], *, head_ip: str, ports: Ports, python: str, home: str, fallback_cpus: int
) -> JobPlan:
    job_id = int(env["SLURM_JOB_ID"])
    gpus, known = gpus_per_node(env, len(nodes))
    return JobPlan(
        job_id=job_id,
        restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
        nodes=list(nodes),
        cpus=cpus_per_node(env, len(nodes), fallback_cpus),
        gpus=gpus,
        gpus_known=known,
        step_gpus=gpus_per_node({k: v for k, v in env.items() if k != "RAYTRAIN_GPUS_PER_NODE"}, len(nodes))[0],
        head_ip=head_ip,
        ports=ports,
        derived_ports=port_blocks(job_id, 1)[0],
        tmp_base=env.get("RAYTRAIN_TMPDIR") or "/tmp",
        job_dir=job_dir(env, home),
        python=python,
        dashboard=env.get("RAYTRAIN_DASHBOARD", "1") == "1",
        module=env.get("RAYTRAIN_MODULE") or "raytrain_ddp.run",
        netcheck_timeout_s=netcheck_timeout(env),
        max_excluding_requeues=max_excluding_requeues(env),
    )


NODES_NAMED = 10  # a join wait's message names this many missing nodes, then counts the others
RAY_START_TRIES = 3  # a worker's `ray start` that exits before its node joins is run again, at most this often in all


def some_names(names: list[str], sep: str = ", ") -> str:
    """Nodes named in one log line: the first NODES_NAMED, then a count."""
    return bounded(names, NODES_NAMED, sep)


def missing_from(nodes: list[str], reported: Mapping[int, tuple[str, str]], table: list[dict]) -> dict[str, str]:
    """{slurm node: description} of the nodes not (yet) in the Ray cluster: `reported`, node index -> (host,
    address) its `ray start` reported; `table`, the Ray node table (preflight.node_table). One pass each."""
    ips = {n["node_ip"] for n in table}
    hosts = {n["hostname"].split(".")[0] for n in table}
    out = {}
    for i, node in enumerate(nodes):
        if i not in reported:
            out[node] = f"{node} (its ray start has not reported an address)"
            continue
        host, ip = reported[i]
        if ip not in ips and host not in hosts and node not in hosts:
            out[node] = f"{node} ({ip})"
    return out


def nodes_to_start_again(exited: list[int], refused: set[int], starts: Mapping[int, int]) -> list[int]:
    """Of the nodes whose `ray start` exited before they joined (`exited`, node indexes), those to start again: a
    worker's raylet that a busy GCS did not answer in time ("Failed to get node info: Deadline Exceeded") joins on a
    later try. Never the head (a new GCS is a new cluster), nor a node whose own checks refused it (`refused`: it
    would refuse again), nor one started RAY_START_TRIES times (`starts`, node index -> times started)."""
    return [i for i in exited if i > 0 and i not in refused and starts.get(i, 1) < RAY_START_TRIES]


def join_progress(joined: int, want: int, missing: list[str]) -> str:
    """The join wait's progress: '412 of 512 nodes joined, waiting on: node-a, node-b ... and 90 more'."""
    return f"{joined} of {plural(want, 'node')} joined, waiting on: {some_names(missing)}"


def join_failure(joined: int, want: int, why: str, missing: list[str]) -> str:
    """Why the join wait gave up, naming the missing nodes (a bounded list)."""
    return (
        f"only {joined}/{want} nodes joined ({why}); missing: {some_names(missing)}; the [node] lines above show "
        "each node's ray start output"
    )
