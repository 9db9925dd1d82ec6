"""What runs on each node of the job: its Ray node (one `srun` step per node), and the sweep of its processes.

`python -m raytrain_ddp.cluster node JOB_DIR INDEX` starts node INDEX's Ray (head or worker) with
--block and runs until Ray dies or the batch process asks it to stop (a `stop` file in the shared job
dir: a clean exit, where signalling the step would make Slurm report it cancelled and SIGKILL it);
on TERM, INT or any exit it stops exactly this node's Ray processes and removes its temp dir.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from raytrain_ddp.cluster.paths import UnsafePath, private_dir, remove_own_dir
from raytrain_ddp.cluster.plan import JobPlan, gpu_mismatch, node_gpus
from raytrain_ddp.errors import plural

log = logging.getLogger("raytrain_ddp.cluster")

RAY_STOP_WAIT_S = 10  # for `ray start --block` to stop its processes; the sweep ends what outlives it


class LaunchError(Exception):
    """One line for the job log, and the job's exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class Stop(BaseException):
    """A signal ends the process: unwind through every `finally` with this exit code."""

    def __init__(self, code: int) -> None:
        self.code = code


class _Format(logging.Formatter):
    def __init__(self, where: str | None) -> None:
        super().__init__()
        self.where = where

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.levelno >= logging.ERROR:
            message = "ERROR: " + message
        return f"[raytrain {self.where or time.strftime('%H:%M:%S')}] {message}"


def setup_logging(where: str | None = None) -> None:
    """`[raytrain HH:MM:SS] ...` (or `[raytrain HOST] ...` on a node): info to stdout, warnings and errors to stderr."""
    out, err = logging.StreamHandler(sys.stdout), logging.StreamHandler(sys.stderr)
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err.setLevel(logging.WARNING)
    for handler in (out, err):
        handler.setFormatter(_Format(where))
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


# ------------------------------------------------------------------ processes
def alive(pid: int) -> bool:
    """A live process (zombies of stopped Ray processes do not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next((line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), "0")
    return bool(int(mask, 16) >> (signum - 1) & 1)


def tagged_pids(prefix: str) -> list[int]:
    """Live processes with RAYTRAIN_RAY_TAG=<prefix...> in their environment.

    Every Ray process of a node inherits it from the `ray start` we launch, workers whose parent
    died included, so this finds exactly this job's Ray processes and nothing else.
    """
    needle = f"RAYTRAIN_RAY_TAG={prefix}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(entry.startswith(needle) for entry in environ) and alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def sweep(prefix: str, *dirs: str) -> None:
    """Stop the processes tagged `prefix` (TERM, 10 s grace, KILL); remove `dirs` that are ours."""
    pids = tagged_pids(prefix)
    if pids:
        _signal(pids, signal.SIGTERM)
        for _ in range(50):
            pids = tagged_pids(prefix)
            if not pids:
                break
            time.sleep(0.2)
        if pids:
            log.info(
                "killing Ray processes that ignored TERM on %s: %s", socket.gethostname(), " ".join(map(str, pids))
            )
            _signal(pids, signal.SIGKILL)
    for d in dirs:
        remove_own_dir(d)


def sweep_main(argv: list[str]) -> int:
    """`sweep JOB_ID TMP_BASE`: every Ray process of the job on this node, and its temp dirs."""
    job_id, tmp_base = argv
    sweep(f"rt-{job_id}-", *map(str, Path(tmp_base).glob(f"rt{job_id}.[0-9]*")))
    return 0


# ------------------------------------------------------------------ addresses
def global_addresses() -> list[tuple[str, str]]:
    """(interface, address) of this node's global addresses, IPv4 first (`ip -o addr show scope global`)."""
    out = subprocess.run(["ip", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("inet", "inet6"):
            found.append((fields[2], fields[1], fields[3].split("/")[0]))
    return [(iface, addr) for family, iface, addr in sorted(found, key=lambda f: f[0] != "inet")]


def route_source(towards: str) -> str | None:
    """This node's source address for packets to `towards` (a route lookup; no packet is sent)."""
    family = socket.AF_INET6 if ":" in towards else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((towards, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def node_ip(towards: str | None) -> str:
    """This node's address for Ray: RAYTRAIN_NET_IFACE's if set, else the source address of the route
    towards `towards` (the head), else the host name's address if configured here, else the first one."""
    host = socket.gethostname().split(".")[0]
    addresses = global_addresses()
    iface = os.environ.get("RAYTRAIN_NET_IFACE")
    if iface:
        for name, addr in addresses:
            if name == iface:
                return addr
        raise LaunchError(f"RAYTRAIN_NET_IFACE={iface} has no global address on {host}", 1)
    mine = [addr for _, addr in addresses]
    if towards and route_source(towards) in mine:
        return route_source(towards)
    try:
        resolved = sorted(
            {str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)}, key=lambda a: ":" in a
        )
    except OSError:
        resolved = []
    for addr in resolved:
        if addr in mine:
            return addr
    if mine:
        return mine[0]
    raise LaunchError(f"no usable IP address on {host}; set RAYTRAIN_NET_IFACE or RAYTRAIN_HEAD_ADDR", 1)


def interface_of(addr: str) -> str | None:
    return next((iface for iface, a in global_addresses() if a == addr), None)


def port_busy(port: int) -> bool:
    """Whether Ray could not listen on `port` here (IPv4, and IPv6 where the node has it).

    With SO_REUSEADDR, as Ray's servers (gRPC, aiohttp) bind: a listener makes a port busy, an earlier job's
    connections left in TIME_WAIT do not (else a requeued job, whose block is its job id's, would move off it)."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((addr, port))
            except OSError as err:
                if family == socket.AF_INET or err.errno == 98:  # no IPv6 stack: ignore
                    return True
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the node's Ray
def ray_start_args(plan: JobPlan, role: str, ip: str, tmp: str, gpus: int, cpus: int, agent_port: int) -> list[str]:
    args = [
        "start",
        "--block",
        "--disable-usage-stats",
        "--log-style=record",
        "--log-color=false",
        f"--node-ip-address={ip}",
        f"--temp-dir={tmp}",
        f"--num-cpus={cpus}",
        f"--num-gpus={gpus}",
        f"--dashboard-agent-listen-port={agent_port}",
    ]
    if os.environ.get("RAY_OBJECT_STORE_MEMORY"):
        args.append(f"--object-store-memory={os.environ['RAY_OBJECT_STORE_MEMORY']}")
    if role == "head":
        args += ["--head", f"--port={plan.ports.gcs}", f"--ray-client-server-port={plan.ports.client}"]
        args += (
            ["--include-dashboard=true", f"--dashboard-host={ip}", f"--dashboard-port={plan.ports.dashboard}"]
            if plan.dashboard
            else ["--include-dashboard=false"]
        )
    else:
        args.append(f"--address={plan.head_address}")
    return args


def _stop_in_order(ray: subprocess.Popen) -> None:
    """SIGINT to `ray start --block`: it stops its processes in Ray's own order (the raylet first, the GCS last),
    all gone in about 2 s. Not TERM: on TERM it first drains the node for up to 30 s (for Ray Serve) while a
    detached actor lives, and a TERM to every process at once leaves the GCS and the raylet up for 10 s."""
    if ray.poll() is None:
        ray.send_signal(signal.SIGINT)
        try:
            ray.wait(RAY_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            pass


def node_main(argv: list[str]) -> int:
    job_dir, index = argv[0], int(argv[1])
    host = socket.gethostname().split(".")[0]
    setup_logging(host)
    plan = JobPlan.from_json(Path(job_dir, "plan.json").read_text())
    role = "head" if index == 0 else "worker"
    tag, tmp = plan.tag(index), plan.node_tmp(index)

    terms: list[float] = []

    def on_term(signum, frame):
        # Slurm's TERM reaches every step: Ray stays up (while it lives) for the trainer's checkpoint, until
        # the batch's stop file or the grace; a second TERM stops it at once.
        if terms:
            raise Stop(143)
        terms.append(time.monotonic())

    def on_int(signum, frame):
        raise Stop(130)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_int)
    try:
        return _run_node(plan, index, role, host, tag, tmp, terms)
    except LaunchError as err:  # the batch's ERROR line says it (all of these come before `ray start`)
        log.info("not starting Ray: %s", err)
        Path(job_dir, f"node.{index}.error").write_text(f"{err}\n")
        return err.code
    except Stop as stopped:
        return stopped.code
    finally:
        sweep(tag, tmp)


def _run_node(plan: JobPlan, index: int, role: str, host: str, tag: str, tmp: str, terms: list[float]) -> int:
    _check_node(host, tmp)
    ip = plan.head_ip if role == "head" else node_ip(plan.head_ip)
    # The dashboard agent's HTTP port defaults to a fixed 52365: the job's own, else any free one.
    agent_port = plan.ports.agent
    if port_busy(agent_port):
        agent_port = free_port()
        log.info("port %d busy here; dashboard agent uses %d", plan.ports.agent, agent_port)
    gpus = _checked_gpus(plan, index)
    Path(plan.job_dir, f"node.{index}").write_text(f"{plan.nodes[index]} {host} {ip}\n")
    # A node started again (its first `ray start` exited before it joined) skips the check the job has passed.
    checked = Path(plan.job_dir, "netcheck.ok").exists()
    if plan.netcheck_timeout_s and len(plan.nodes) > 1 and not checked and not network_check(plan, index, ip, terms):
        return 0  # the launcher ends the job: this node's Ray is not started
    if role == "worker":
        wait_for_gcs(plan)
    ray = _start_ray(plan, index, role, ip, tag, gpus, agent_port)
    return _hold_ray(ray, plan, role, tag, tmp, terms)


def _check_node(host: str, tmp: str) -> None:
    """This node's temp dir is ours and the job's auth token readable here; raises LaunchError."""
    try:
        private_dir(tmp)  # a stale one of ours (a requeue) is replaced; anyone else's is refused
    except UnsafePath as err:
        raise LaunchError(f"{host}: {err}; remove it or set RAYTRAIN_TMPDIR to a directory of yours", 1) from None
    token = os.environ.get("RAY_AUTH_TOKEN_PATH", "")
    if not os.access(token, os.R_OK):
        raise LaunchError(
            f"auth token {token} is not readable on {host}; put RAYTRAIN_JOB_DIR_BASE on storage all nodes share", 1
        )


def _checked_gpus(plan: JobPlan, index: int) -> int:
    """The GPUs Ray will advertise here, said; raises LaunchError where CUDA_VISIBLE_DEVICES disagrees."""
    gpus = node_gpus(os.environ, plan.gpus)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    log.info(
        "CUDA_VISIBLE_DEVICES=%s; Ray will advertise %s", "unset" if visible is None else visible, plural(gpus, "GPU")
    )
    mismatch = gpu_mismatch(plan.nodes[index], visible, gpus)
    if mismatch:
        raise LaunchError(mismatch, 1)
    return gpus


def _start_ray(plan: JobPlan, index: int, role: str, ip: str, tag: str, gpus: int, agent_port: int) -> subprocess.Popen:
    env = dict(os.environ)  # the Train view needs nothing of `ray start`: the trainer turns on state tracking
    env["RAYTRAIN_RAY_TAG"] = tag  # only in Ray's environment, so the sweep finds Ray's processes, never this one
    nccl_iface = os.environ.get("RAYTRAIN_NET_IFACE") or interface_of(ip)
    if nccl_iface and "NCCL_SOCKET_IFNAME" not in os.environ:
        env["NCCL_SOCKET_IFNAME"] = nccl_iface
    cpus = plan.cpus[index]
    log.info(
        "ray start (%s) ip=%s cpus=%d gpus=%d temp-dir=%s NCCL_SOCKET_IFNAME=%s",
        role,
        ip,
        cpus,
        gpus,
        plan.ray_tmp(index),
        env.get("NCCL_SOCKET_IFNAME", "unset"),
    )
    start_args = ray_start_args(plan, role, ip, plan.ray_tmp(index), gpus, cpus, agent_port)
    return subprocess.Popen([plan.python, "-m", "ray.scripts.scripts", *start_args], env=env)


def _hold_ray(ray: subprocess.Popen, plan: JobPlan, role: str, tag: str, tmp: str, terms: list[float]) -> int:
    """Wait on this node's Ray until it exits, the launcher asks it to stop, or the batch's TERM grace is over."""
    stop_file = Path(plan.job_dir, "stop")
    grace = float(os.environ.get("RAYTRAIN_STOP_GRACE_S", "60")) + 10  # the batch's grace, then its cleanup
    try:
        while ray.poll() is None:
            if stop_file.exists() or (terms and time.monotonic() > terms[0] + grace):
                log.info("stopping Ray (%s)", role)
                _stop_in_order(ray)
                sweep(tag, tmp)  # what it left, if anything, and its temp dir
                ray.wait()
                return 0
            time.sleep(1)
    except Stop:
        _stop_in_order(ray)  # node_main's sweep then finds what it left
        raise
    log.info("ray (%s) exited with code %d", role, ray.returncode)
    return ray.returncode


# ------------------------------------------------------------------ the network check
def _write(path: Path, text: str) -> None:
    """Whole or not at all: the launcher and the other nodes read it as soon as it exists."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def _echo(server: socket.socket, done: threading.Event) -> None:
    while not done.is_set():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        except OSError:
            return
        with conn:
            try:
                conn.settimeout(5)
                conn.sendall(conn.recv(256))
            except OSError:
                pass


def _reach(addr: str, port: int, me: str, deadline: float) -> str | None:
    """None when `addr:port` answers `me`'s bytes with the same bytes before `deadline`, else why not."""
    why = "no attempt"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=max(deadline - time.monotonic(), 0.1)) as s:
                s.settimeout(max(deadline - time.monotonic(), 0.1))
                s.sendall(me.encode())
                if s.recv(256) == me.encode():
                    return None
                why = "a wrong answer"
        except OSError as err:
            why = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
        time.sleep(0.5)
    return f"{addr}:{port}: {why}"


def network_check(plan: JobPlan, index: int, ip: str, terms: list[float]) -> bool:
    """This node's part of the job's network check; True once the launcher says every node passed.

    It listens on a port of the dynamic range (where NCCL and gloo listen) on its Ray address, and
    connects to every other node's (addresses through the shared job dir), exchanging a few bytes,
    all within plan.netcheck_timeout_s; what failed goes to netcheck.INDEX.json for the launcher's
    verdict (raytrain_ddp.cluster.health.blame). Until then it keeps answering slower peers."""
    job_dir, me = Path(plan.job_dir), plan.nodes[index]
    deadline = time.monotonic() + plan.netcheck_timeout_s
    server = socket.create_server((ip, 0), family=socket.AF_INET6 if ":" in ip else socket.AF_INET)
    server.settimeout(0.5)
    done = threading.Event()
    threading.Thread(target=_echo, args=(server, done), daemon=True).start()
    _write(job_dir / f"netcheck.{index}.addr", f"{ip} {server.getsockname()[1]}\n")

    def check(peer: int) -> str | None:
        addr_file = job_dir / f"netcheck.{peer}.addr"
        while not addr_file.exists():
            if (job_dir / "stop").exists():  # the launcher gave up (that node's step failed)
                return "the job stops"
            if time.monotonic() > deadline:
                return f"its check did not start within {plan.netcheck_timeout_s:g}s"
            time.sleep(0.2)
        addr, port = addr_file.read_text().split()
        return _reach(addr, int(port), me, deadline)

    peers = [i for i in range(len(plan.nodes)) if i != index]
    try:
        with ThreadPoolExecutor(len(peers)) as pool:
            results = dict(zip(peers, pool.map(check, peers)))
        if (job_dir / "stop").exists():  # the launcher gave up on another node: nothing to report
            return False
        failed = {plan.nodes[i]: why for i, why in results.items() if why}
        for peer, why in failed.items():
            log.info("network check: cannot reach %s: %s", peer, why)
        _write(job_dir / f"netcheck.{index}.json", json.dumps(failed))
        while not (job_dir / "netcheck.ok").exists():
            if (job_dir / "stop").exists() or (terms and time.monotonic() > terms[0] + 10):
                return False
            time.sleep(0.2)
        return True
    finally:
        done.set()
        server.close()


def gcs_listens(plan: JobPlan) -> bool:
    """Whether the head's GCS port takes a TCP connection within a second."""
    try:
        socket.create_connection((plan.head_ip, plan.ports.gcs), 1).close()
        return True
    except OSError:
        return False


def wait_for_gcs(plan: JobPlan) -> None:
    """A worker's `ray start` only once the head's GCS listens (the nodes' steps start together)."""
    deadline = time.monotonic() + float(os.environ.get("RAYTRAIN_HEAD_TIMEOUT", "120"))
    while time.monotonic() < deadline and not (Path(plan.job_dir) / "stop").exists():
        if gcs_listens(plan):
            return
        time.sleep(0.5)
