"""`python -m raytrain_ddp.cluster slurm [trainer args]`: one Slurm job = one Ray cluster = one training run.

The batch part of cluster/start_ray_slurm.sh (which `exec`s this, so Slurm's USR1 reaches Python
directly). On the job's first node: plan the cluster from Slurm's environment (raytrain_ddp.cluster.plan),
start a Ray head here and one Ray worker per other node (one background `srun` step per node, running
raytrain_ddp.cluster.node; each first checks its network to the others), wait until every node has
joined, run the trainer against it, forward USR1 to the trainer, stop exactly this job's Ray processes
however the job ends, and requeue the job when the trainer stopped after a checkpoint on USR1, or
without the node(s) a failed network check or a failed run names (raytrain_ddp.cluster.health). The
exit code is the trainer's; 3 means the Ray cluster could not be brought up. A run that failed for a full (or
read-only) disk (74) is not requeued: it would fail again.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from raytrain_ddp import storage
from raytrain_ddp.cluster import health
from raytrain_ddp.cluster import plan as planning
from raytrain_ddp.cluster.node import (
    LaunchError,
    Stop,
    catches,
    gcs_listens,
    log,
    node_ip,
    port_busy,
    setup_logging,
    sweep,
    tagged_pids,
)
from raytrain_ddp.cluster.paths import UnsafePath, create_secret, private_dir
from raytrain_ddp.cluster.plan import (
    EXIT_BRINGUP,
    RAY_START_TRIES,
    JobPlan,
    hostport,
    join_failure,
    join_progress,
    missing_from,
    nodes_to_start_again,
    some_names,
)
from raytrain_ddp.errors import EXIT_STORAGE_FULL, ConfigError, plural
from raytrain_ddp.storage import RunPath
from raytrain_ddp.summary import RunSummary

JOIN_PROGRESS_EVERY_S = 10.0  # how often the join wait says how many nodes joined, and which it waits on
EXIT_BAD_INPUT, EXIT_STOPPED = 2, 75  # as raytrain_ddp.run; 75: stopped after a checkpoint, run again to resume


def head_address(env: Mapping[str, str], nodes: list[str]) -> str:
    """RAYTRAIN_HEAD_ADDR, else this node's address; preferring the one that reaches the other nodes."""
    if env.get("RAYTRAIN_HEAD_ADDR"):
        return env["RAYTRAIN_HEAD_ADDR"]
    if not env.get("RAYTRAIN_NET_IFACE") and len(nodes) > 1:
        try:
            peer = str(socket.getaddrinfo(nodes[1], None, socket.AF_INET)[0][4][0])
        except (OSError, IndexError):
            peer = None
        if peer and not peer.startswith("127."):
            return node_ip(peer)
    return node_ip(None)


def prepare_job_dir(job_dir: str, token_path: str, plan_json: str) -> None:
    """The job's private dir (0700), with a fresh token (0600) and the plan. Raises UnsafePath.

    Its base is created if missing but never chmodded: RAYTRAIN_JOB_DIR_BASE may be a group's directory."""
    private_dir(job_dir)  # a stale one of ours (an earlier run of this job id) is replaced
    create_secret(token_path, secrets.token_hex(32))
    Path(job_dir, "plan.json").write_text(plan_json)


def free_port_block(job_id: int, head: str) -> planning.Ports:
    for ports in planning.port_blocks(job_id):
        busy = [p for p in ports.all() if port_busy(p)]
        if not busy:
            return ports
        log.info("ports busy on %s: %s (block %d); trying the next block", head, " ".join(map(str, busy)), ports.gcs)
    raise LaunchError(f"no free port block in 20000-29999 on {head}", EXIT_BRINGUP)


def show_job(job_id: str) -> str:
    """`scontrol show job JOB`'s text (health.job_field reads its fields)."""
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout


class Launcher:
    def __init__(self, trainer_args: list[str]) -> None:
        self.args = list(trainer_args)
        self.steps: list[subprocess.Popen] = []  # node index -> its srun step (the latest, where started again)
        self.starts: dict[int, int] = {}  # node index -> how often its step was started
        self.readers: list[threading.Thread] = []  # copy each step's output into the job log
        self.trainer: subprocess.Popen | None = None
        self.got_usr1 = self.got_term = False
        self.usr1_told = False  # whether the log says what the USR1 was: a preemption or the time limit
        self.term_at = 0.0
        self.pending: list[int] = []  # stop signals the trainer has not been sent yet
        self.requeue = False
        self.exclude: list[str] = []  # nodes the requeued job must not get again
        self.plan: JobPlan | None = None
        self.reported: dict[int, tuple[str, str]] = {}  # node index -> (host, address) its ray start reported
        self.name = ""

    # ---------------------------------------------------------------- signals
    def on_usr1(self, signum, frame) -> None:
        """The job's --signal (B:USR1@300): before the time limit, or at a preemption under Slurm's
        preempt_send_user_signal. The trainer checkpoints at its next step and exits 75."""
        self.got_usr1 = True
        self.keep(signal.SIGUSR1, "USR1 (time limit or preemption)")

    def on_term(self, signum, frame) -> None:
        """scancel, preemption or the time limit: like USR1 (no requeue: that is Slurm's to decide);
        a second TERM ends the job at once."""
        if self.got_term:
            log.info("got TERM again: shutting down")
            raise Stop(143)
        self.got_term, self.term_at = True, time.monotonic()
        self.keep(signal.SIGTERM, "TERM (scancel, preemption or time limit)")

    def keep(self, signum: int, what: str) -> None:
        """A stop signal for the trainer: sent once it is running and handles it (`deliver`), so that one
        that came while the Ray cluster was starting is honoured instead of dropped."""
        self.pending.append(signum)
        if self.trainer and self.trainer.poll() is None:
            log.info("got %s: forwarding to the trainer (pid %d)", what, self.trainer.pid)
        else:
            log.info("got %s while the Ray cluster starts: kept for the trainer, which stops at its first step", what)

    def deliver(self) -> None:
        # Before the trainer's Python has its handler, USR1 or TERM would kill it without a checkpoint.
        while self.pending and self.trainer and catches(self.trainer.pid, self.pending[0]):
            signum = self.pending.pop(0)
            self.trainer.send_signal(signum)
            if signum == signal.SIGTERM:
                self.term_at = time.monotonic()  # the grace counts from when the trainer heard it

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGUSR1, self.on_usr1)
        signal.signal(signal.SIGTERM, self.on_term)
        signal.signal(signal.SIGINT, Launcher.on_stop("INT", 130))

    @staticmethod
    def on_stop(what: str, code: int):
        def handler(signum, frame):
            log.info("got %s: shutting down", what)
            raise Stop(code)

        return handler

    def wait_for_trainer(self) -> int:
        """The trainer's exit code; after a TERM it gets RAYTRAIN_STOP_GRACE_S to checkpoint and exit."""
        grace = float(os.environ.get("RAYTRAIN_STOP_GRACE_S", "60"))
        margin = float(os.environ.get("RAYTRAIN_STOP_BEFORE_END_S", "300"))
        end = planning.job_end_time(os.environ, "" if "SLURM_JOB_END_TIME" in os.environ else self.squeue_end_time())
        stop_at = end - margin if end is not None else None
        started = time.monotonic()
        while (rc := self.trainer.poll()) is None:
            if stop_at is not None and time.time() >= stop_at and not self.got_usr1:
                # as if Slurm's USR1 had come: a job submitted without --signal, or a signal lost, still
                # ends with a checkpoint and is requeued
                log.info("the time limit is %.0fs away and no USR1 came", margin)
                self.usr1_told = True
                self.on_usr1(signal.SIGUSR1, None)
            if self.got_usr1 and not self.usr1_told:
                self.usr1_told = True
                log.info("%s", self.usr1_meaning())
            self.deliver()
            if self.got_term and time.monotonic() > max(self.term_at, started) + grace:
                log.info("the trainer did not stop within %.0fs of TERM (RAYTRAIN_STOP_GRACE_S)", grace)
                raise Stop(143)
            time.sleep(0.2)
        return rc

    @staticmethod
    def usr1_meaning() -> str:
        try:
            shown = show_job(os.environ["SLURM_JOB_ID"])
        except (OSError, subprocess.TimeoutExpired):
            return "scontrol did not say whether Slurm is preempting this job"
        return health.preemption(shown) or "no preemption is pending: the USR1 is the time-limit warning (or by hand)"

    @staticmethod
    def squeue_end_time() -> str:
        """The job's end time as squeue prints it in Unix seconds (Slurm before 23.02 sets no SLURM_JOB_END_TIME);
        "" when squeue does not answer."""
        try:
            return subprocess.run(
                ["squeue", "-h", "-j", os.environ["SLURM_JOB_ID"], "-o", "%e"],
                env={**os.environ, "SLURM_TIME_FORMAT": "%s"},
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""

    # ---------------------------------------------------------------- the job
    def run(self) -> int:
        chosen = self.check_environment()
        where = self.plan_job(chosen, self.job_nodes())
        self.announce(where)
        if os.environ.get("RAYTRAIN_DRY_RUN") == "1":
            self.say_dry_run()
            return 0
        return self.bring_up_train_and_clean_up(chosen)

    def check_environment(self) -> dict:
        """Inside a Slurm job, with trainer flags that parse and Ray importable (with this job's token): the
        settings the flags choose; else LaunchError."""
        env = os.environ
        if not env.get("SLURM_JOB_ID"):
            raise LaunchError(
                "not inside a Slurm job; submit with: sbatch cluster/start_ray_slurm.sh [trainer args]", EXIT_BAD_INPUT
            )
        try:
            chosen = planning.chosen_settings(self.args, env.get("RAYTRAIN_MODULE") or "raytrain_ddp.run")
        except ConfigError as err:
            raise LaunchError(str(err), EXIT_BAD_INPUT) from None
        if "address" in chosen:
            raise LaunchError(
                "do not pass --address: the script points the trainer at this job's Ray cluster", EXIT_BAD_INPUT
            )
        # Before Ray is imported: one fresh token per job, in a file every node reads.
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = f"{planning.job_dir(env, str(Path.home()))}/auth_token"
        os.environ.pop("RAY_AUTH_TOKEN", None)  # it would take precedence over the file
        try:
            import ray  # noqa: F401  (whether it imports, once the token is set: announce reads it)
        except ImportError:
            raise LaunchError(
                f"'{sys.executable}' cannot import ray; install the project into that environment", EXIT_BAD_INPUT
            ) from None
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # compute nodes rarely reach the internet
        return chosen

    @staticmethod
    def job_nodes() -> list[str]:
        """The job's nodes, as scontrol names them; the first is the head."""
        nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
        listed = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True)
        nodes = listed.stdout.split()
        if listed.returncode or not nodes:
            raise LaunchError(
                f"scontrol show hostnames {nodelist!r} failed: {listed.stderr.strip() or 'no nodes'}", EXIT_BRINGUP
            )
        return nodes

    def plan_job(self, chosen: dict, nodes: list[str]) -> planning.RunLocation:
        """The job's plan (self.plan: head, ports, resources per node) and its run's location, with the run's
        request checked against the nodes where it can be (RAYTRAIN_PRECHECK)."""
        env = os.environ
        try:
            head_ip = head_address(env, nodes)
        except LaunchError as err:
            raise LaunchError(str(err), EXIT_BRINGUP) from None
        job_id = int(env["SLURM_JOB_ID"])
        ports = free_port_block(job_id, nodes[0])
        try:
            plan = self.plan = planning.job_plan(
                env,
                nodes,
                head_ip=head_ip,
                ports=ports,
                python=sys.executable,
                home=str(Path.home()),
                fallback_cpus=os.cpu_count() or 1,
            )
        except ValueError as err:
            raise LaunchError(str(err), EXIT_BAD_INPUT) from None
        if ports != plan.derived_ports:
            log.info("derived port block %d was busy; using port block %d", plan.derived_ports.gcs, ports.gcs)

        where = planning.run_location(
            chosen, env.get("SLURM_SUBMIT_DIR") or os.getcwd(), env.get("SLURM_JOB_NAME"), job_id
        )
        self.name = where.name
        self.args = where.extra_args + self.args  # before a launched script's name: after it they would be its own
        if len(nodes) > 1:
            self.warn_node_local(where.storage, len(nodes))
        if "num_workers" in chosen and env.get("RAYTRAIN_PRECHECK", "1") == "1":
            shape = planning.worker_shape(chosen, len(nodes), plan.gpus * len(nodes), min(plan.cpus))
            try:
                planning.precheck(chosen, shape, nodes, plan.cpus, plan.gpus, plan.gpus_known)
            except ConfigError as err:
                raise LaunchError(str(err), EXIT_BAD_INPUT) from None
        return where

    def announce(self, where: planning.RunLocation) -> None:
        """The job's plan in the job's log: what a failed job's first lines must tell."""
        import ray

        import raytrain_ddp

        plan = self.plan
        log.info(
            "job %d (restart count %d): %s: %s; head %s (%s); ray %s; python %s (raytrain_ddp from %s)",
            plan.job_id,
            plan.restart_count,
            plural(len(plan.nodes), "node"),
            " ".join(plan.nodes),
            plan.head,
            plan.head_ip,
            ray.__version__,
            sys.executable,
            Path(raytrain_ddp.__file__).parent,
        )
        log.info(
            "per node: cpus %s; gpus ~%d (each node re-reads its own allocation)",
            " ".join(map(str, plan.cpus)),
            plan.gpus,
        )
        log.info("ports: gcs %d, dashboard %d, client %d, agent %d", *plan.ports.all())
        log.info("run directory: %s/%s", where.storage, where.name)

    def say_dry_run(self) -> None:
        """RAYTRAIN_DRY_RUN=1: what the job would run, and on how many workers, with nothing started."""
        plan = self.plan
        gpu = " --use-gpu" if plan.gpus > 0 else ""
        log.info(
            "dry run: would run %s -u -m %s --address %s [--num-workers from cluster]%s %s",
            sys.executable,
            plan.module,
            plan.head_address,
            gpu,
            " ".join(self.args),
        )
        nodes = len(plan.nodes)
        log.info("dry run: expected workers %d", plan.gpus * nodes if plan.gpus > 0 else nodes)

    def bring_up_train_and_clean_up(self, chosen: dict) -> int:
        """The job's exit code: the trainer's, or the launcher's own for a failed bring-up or a stop; every
        node's Ray stopped whichever it is."""
        rc = 1
        try:
            rc = self.bring_up_and_train(chosen)
        except LaunchError as err:
            log.error("%s", err)
            rc = err.code
        except Stop as stopped:
            rc = stopped.code
        finally:
            self.cleanup(rc)
        return rc

    def warn_node_local(self, storage: str, nnodes: int) -> None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            mounts = ""
        fstype = planning.fstype_of(os.path.realpath(storage), mounts)
        if planning.looks_node_local(storage, fstype):
            for _ in range(3):
                log.warning(
                    "!!!!!! WARNING: --storage-path %s looks node-local (%s), but this job spans %d nodes.",
                    storage,
                    fstype,
                    nnodes,
                )
            log.warning(
                "!!!!!! Checkpoints written by other nodes will not be visible on %s; use shared storage.",
                self.plan.head,
            )

    def bring_up_and_train(self, chosen: dict) -> int:
        plan = self.plan
        try:
            prepare_job_dir(plan.job_dir, os.environ["RAY_AUTH_TOKEN_PATH"], plan.to_json())
        except UnsafePath as err:
            raise LaunchError(
                f"{err}; remove it or set RAYTRAIN_JOB_DIR_BASE to a directory of yours", EXIT_BRINGUP
            ) from None

        # All nodes' steps at once: their network check first; the workers' `ray start` waits for the head.
        log.info("starting Ray head on %s", plan.head)
        self.start_node(0)
        for i in range(1, len(plan.nodes)):
            log.info("starting Ray worker on %s", plan.nodes[i])
            self.start_node(i)
        if plan.netcheck_timeout_s and len(plan.nodes) > 1:
            self.check_network(plan.netcheck_timeout_s)
        self.wait_for_head(float(os.environ.get("RAYTRAIN_HEAD_TIMEOUT", "120")))
        cluster_cpus, cluster_gpus = self.wait_for_nodes(float(os.environ.get("RAYTRAIN_JOIN_TIMEOUT", "180")))
        log.info("cluster resources: %s, %s", plural(cluster_cpus, "CPU"), plural(cluster_gpus, "GPU"))
        if plan.dashboard:
            dash = hostport(plan.head_ip, plan.ports.dashboard)
            user = os.environ.get("USER") or os.environ.get("LOGNAME") or "you"
            log.info("Ray dashboard: http://%s", dash)
            log.info(
                "from your laptop: ssh -N -L 8265:%s %s@%s   then open http://localhost:8265",
                dash,
                user,
                os.environ.get("SLURM_SUBMIT_HOST", "LOGIN_NODE"),
            )
            log.info(
                "log in with this job's token: the contents of %s (readable only by you; deleted when the job ends)",
                os.environ["RAY_AUTH_TOKEN_PATH"],
            )

        shape = planning.worker_shape(chosen, len(plan.nodes), cluster_gpus, min(plan.cpus))
        if shape.note:
            log.info("%s", shape.note)
        cmd = [sys.executable, "-u", "-m", plan.module, "--address", plan.head_address, *shape.extra_args, *self.args]
        run_dir = self.run_dir(chosen)  # opens the storage (on object storage, a connection): once
        summary_before = self.summary(run_dir)  # a requeued run's is its last incarnation's
        log.info("trainer: %s", " ".join(cmd))
        self.trainer = subprocess.Popen(cmd)
        rc = self.wait_for_trainer()
        self.trainer = None
        self.after_trainer(rc, run_dir, summary_before)
        return rc

    def after_trainer(self, rc: int, run_dir: RunPath, summary_before: RunSummary) -> None:
        """What the trainer's exit code (and its summary) says of the job: requeue it (without nodes it failed
        on), or not, each said in one line."""
        log.info("trainer exited with code %d; run directory: %s", rc, run_dir)
        # read only when it has a failure to explain
        summary = self.summary(run_dir) if rc != 0 else RunSummary.missing()
        if unexplained := health.ended_without_summary(rc, summary_before, summary):
            log.error("%s", unexplained)
        failed_on = health.nodes_the_run_failed_on(summary, self.plan.nodes) if rc != 0 else []
        if rc == EXIT_STOPPED and self.got_usr1:
            log.info("the trainer stopped after a checkpoint on USR1: requeueing the job once Ray is stopped")
            self.requeue = True
        elif rc == EXIT_STORAGE_FULL:
            log.error(
                "the run's storage is full, read-only or failed: not requeued (it would fail again); free space (or "
                "make it writable, or bring its object store back), then submit the same command again: it resumes "
                "from the latest checkpoint"
            )
        elif rc == 1 and failed_on:
            if why_not := self.why_not_requeued():
                log.error("the run failed on %s; %s", ", ".join(failed_on), why_not)
            else:
                log.info(
                    "the run failed on %s: requeueing the job without it once Ray is stopped; it resumes from the "
                    "latest checkpoint",
                    ", ".join(failed_on),
                )
                self.requeue = True
        self.exclude += failed_on if self.requeue else []

    def why_not_requeued(self) -> str | None:
        """Why the job is not requeued without the nodes its failure is blamed on (None: it is)."""
        return health.why_not_requeued(self.plan.restart_count, self.plan.max_excluding_requeues)

    @staticmethod
    def summary(run_dir: RunPath) -> RunSummary:
        """The run's summary.json, local or on object storage (RunSummary.missing() when there is none, or it does
        not read)."""
        try:
            return RunSummary.from_json(json.loads((run_dir / "summary.json").read_text()))
        except (OSError, ValueError):
            return RunSummary.missing()

    def check_network(self, timeout: float) -> None:
        """Every node reaches every other (raytrain_ddp.cluster.node.network_check) within `timeout`, or
        LaunchError naming the node(s) whose network does not work, and the job requeued without them."""
        plan, job_dir = self.plan, Path(self.plan.job_dir)
        log.info(
            "network check: every node connects to every other within %.0fs (RAYTRAIN_NETCHECK_TIMEOUT_S)", timeout
        )
        deadline = time.monotonic() + timeout + 60  # the nodes' steps start (srun, python) before their check
        reports: dict[str, dict | None] = {}
        while len(reports) < len(plan.nodes) and time.monotonic() < deadline:
            for i, node in enumerate(plan.nodes):
                if node not in reports and Path(job_dir, f"netcheck.{i}.json").exists():
                    reports[node] = json.loads(Path(job_dir, f"netcheck.{i}.json").read_text())
                elif node not in reports and self.steps[i].poll() is not None:
                    raise LaunchError(
                        self.node_error(i) or f"the step on {node} exited before its network check (see its lines)",
                        EXIT_BRINGUP,
                    )
            time.sleep(0.2)
        bad, reasons = health.blame(plan.nodes, reports)
        if bad:
            named = "; ".join(f"{n} ({why})" for n, why in zip(bad, reasons))
            if why_not := self.why_not_requeued():
                raise LaunchError(f"network check failed: {named}; {why_not}", EXIT_BRINGUP)
            self.requeue, self.exclude = True, bad
            raise LaunchError(
                f"network check failed: {named}; requeueing the job without {'it' if len(bad) == 1 else 'them'}",
                EXIT_BRINGUP,
            )
        Path(job_dir, "netcheck.ok").touch()
        log.info("network check passed: all %s reach each other", plural(len(plan.nodes), "node"))

    def run_dir(self, chosen: dict) -> RunPath:
        where = planning.run_location(
            chosen,
            os.environ.get("SLURM_SUBMIT_DIR") or os.getcwd(),
            os.environ.get("SLURM_JOB_NAME"),
            self.plan.job_id,
        )
        return storage.location(where.storage, "--storage-path") / where.name

    def start_node(self, index: int) -> None:
        """One background srun step per node: its Ray node, given the node's CPUs and GPUs."""
        plan, node = self.plan, self.plan.nodes[index]
        role = "head" if index == 0 else "worker"
        # --overlap: the cleanup step later shares these nodes; --mem=0: all of the job's memory on the node.
        cmd = [
            "srun",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={node}",
            f"--cpus-per-task={plan.cpus[index]}",
            "--mem=0",
            "--kill-on-bad-exit=0",
            f"--job-name=ray-{role}",
        ]
        if plan.step_gpus:
            cmd.append(f"--gpus-per-node={plan.step_gpus}")  # with cgroup device limits, a step without them sees none
        cmd += [sys.executable, "-m", "raytrain_ddp.cluster", "node", plan.job_dir, str(index)]
        step = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        reader = threading.Thread(target=_prefix_lines, args=(step.stdout, f"[{node}] "), daemon=True)
        reader.start()
        if index < len(self.steps):
            self.steps[index] = step
        else:
            self.steps.append(step)
        self.starts[index] = self.starts.get(index, 0) + 1
        self.readers.append(reader)

    def wait_for_head(self, timeout: float) -> None:
        plan = self.plan
        deadline = time.monotonic() + timeout
        while True:
            if gcs_listens(plan):
                return
            if self.steps[0].poll() is not None:
                raise LaunchError(
                    self.node_error(0)
                    or f"Ray head on {plan.head} exited during start-up (see the [{plan.head}] lines above)",
                    EXIT_BRINGUP,
                )
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"Ray head on {plan.head} did not open {plan.head_address} within {timeout:.0f}s", EXIT_BRINGUP
                )
            time.sleep(0.5)

    def node_error(self, index: int) -> str | None:
        path = Path(self.plan.job_dir, f"node.{index}.error")
        return path.read_text().strip() if path.exists() else None

    def wait_for_nodes(self, timeout: float) -> tuple[int, int]:
        """Until every node is in the Ray cluster (never silently): through the node table preflight uses.

        Returns the cluster's CPUs and GPUs; LaunchError naming the missing nodes on timeout or when a
        node's `ray start` exited."""
        import ray

        from raytrain_ddp.driver import preflight

        plan = self.plan
        want = len(plan.nodes)
        log.info("waiting up to %.0fs for %s to join %s", timeout, plural(want, "node"), plan.head_address)
        deadline = time.monotonic() + timeout
        self._connect_to_head(deadline)
        try:
            said = time.monotonic()
            while True:
                table = preflight.node_table()
                if len(table) >= want:
                    joined = some_names(sorted(n["hostname"] for n in table))
                    log.info("all %s joined: %s", plural(want, "node"), joined)
                    return int(sum(n["cpus"] for n in table)), int(sum(n["gpus"] for n in table))
                missing = self.missing_nodes(table)
                dead = [i for i, step in enumerate(self.steps) if step.poll() is not None and plan.nodes[i] in missing]
                if dead and time.monotonic() < deadline:
                    dead = self._start_again(dead)
                if dead or time.monotonic() > deadline:
                    errors = [e for e in map(self.node_error, dead) if e]
                    why = (
                        some_names(errors, sep="; ")
                        if errors
                        else f"ray start exited on {some_names([plan.nodes[i] for i in dead])}"
                        if dead
                        else f"timeout after {timeout:.0f}s"
                    )
                    raise LaunchError(join_failure(len(table), want, why, list(missing.values())), EXIT_BRINGUP)
                if time.monotonic() - said >= JOIN_PROGRESS_EVERY_S:
                    log.info("%s", join_progress(len(table), want, list(missing)))
                    said = time.monotonic()
                time.sleep(1)
        finally:
            ray.shutdown()
            # ray.init replaced SIGTERM's handler, and after shutdown a TERM (scancel) ended this process
            # at once, with no cleanup: take the launcher's back.
            self.install_signal_handlers()

    def _connect_to_head(self, deadline: float) -> None:
        """This process joins the Ray head as a driver, trying until `deadline` (the head may still be starting)."""
        from raytrain_ddp.driver import preflight

        while True:
            try:
                preflight.init_ray(self.plan.head_address, logging_level=logging.ERROR, log_to_driver=False)
                self.install_signal_handlers()  # ray.init replaced TERM's: a TERM while nodes join is kept too
                return
            except ConfigError as err:
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"cannot connect to the Ray head at {self.plan.head_address}: {err}", EXIT_BRINGUP
                    ) from None
                time.sleep(1)

    def _start_again(self, exited: list[int]) -> list[int]:
        """Start again the exited nodes' `ray start` that may be (plan.nodes_to_start_again); the rest: still exited."""
        refused = {i for i in exited if self.node_error(i)}
        again = nodes_to_start_again(exited, refused, self.starts)
        for i in again:
            log.info(
                "ray start exited on %s before the node joined; starting it again (try %d of %d)",
                self.plan.nodes[i],
                self.starts[i] + 1,
                RAY_START_TRIES,
            )
            self.start_node(i)
        return [i for i in exited if i not in again]

    def missing_nodes(self, table: list[dict]) -> dict[str, str]:
        """{slurm node: description} of the nodes not (yet) in the Ray cluster."""
        for i in range(len(self.plan.nodes)):
            if i not in self.reported:  # a node's report is written once: read until it is there
                try:
                    _, host, ip = Path(self.plan.job_dir, f"node.{i}").read_text().split()
                except (OSError, ValueError):
                    continue
                self.reported[i] = (host, ip)
        return missing_from(self.plan.nodes, self.reported, table)

    # ---------------------------------------------------------------- however the job ends
    def cleanup(self, rc: int) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_IGN)
        plan = self.plan
        if self.trainer and self.trainer.poll() is None:
            log.info("stopping the trainer (pid %d)", self.trainer.pid)
            self.trainer.terminate()
            try:
                self.trainer.wait(10)
            except subprocess.TimeoutExpired:
                self.trainer.kill()
        if self.steps:
            log.info("stopping Ray on %s", plural(len(plan.nodes), "node"))
            Path(plan.job_dir, "stop").touch()  # each node's step watches for it, stops its Ray and exits
            deadline = time.monotonic() + 15  # (Slurm's KillWait, 30 s by default, bounds the whole cleanup)
            while any(s.poll() is None for s in self.steps) and time.monotonic() < deadline:
                time.sleep(0.2)
            for step in self.steps:  # srun turns TERM into a cancel of its step, which Slurm enforces
                if step.poll() is None:
                    step.terminate()
            for reader in self.readers:  # the steps' last lines, before this process writes its own
                reader.join(timeout=5)
            # Belt and braces: sweep every node for this job's tagged processes (fails harmlessly when
            # Slurm is already tearing the job down).
            try:
                subprocess.run(
                    [
                        "srun",
                        "--overlap",
                        f"--nodes={len(plan.nodes)}",
                        "--ntasks-per-node=1",
                        "--cpus-per-task=1",
                        "--mem=0",
                        sys.executable,
                        "-m",
                        "raytrain_ddp.cluster",
                        "sweep",
                        str(plan.job_id),
                        plan.tmp_base,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    timeout=60,
                )
            except (OSError, subprocess.TimeoutExpired):
                pass
        prefix = f"rt-{plan.job_id}-"
        sweep(prefix, *map(str, Path(plan.tmp_base).glob(f"rt{plan.job_id}.[0-9]*")), plan.job_dir)
        left = tagged_pids(prefix)
        if left:
            log.error(
                "some Ray processes of job %d survived cleanup on %s: %s",
                plan.job_id,
                plan.head,
                " ".join(map(str, left)),
            )
        else:
            log.info("cleanup done: no Ray process of job %d left on %s; exit code %d", plan.job_id, plan.head, rc)

    def requeue_job(self) -> bool:
        """Only once Ray is stopped on every node: requeueing ends this job at once (its TERM is ignored by
        now: cleanup), so an exclusion goes on while it is held, pending, and then it is released."""
        plan = self.plan
        if self.exclude:
            return self.requeue_without(self.exclude)
        if subprocess.run(["scontrol", "requeue", str(plan.job_id)]).returncode == 0:
            log.info(
                "requeued job %d (restart %d): it resumes run %s from its checkpoint",
                plan.job_id,
                plan.restart_count + 1,
                self.name,
            )
            return True
        log.error("scontrol requeue %d failed; submit the same command again to resume run %s", plan.job_id, self.name)
        return False

    def requeue_without(self, bad: list[str]) -> bool:
        job = str(self.plan.job_id)
        if subprocess.run(["scontrol", "requeuehold", job]).returncode != 0:
            log.error("scontrol requeuehold %s failed; submit again with --exclude=%s", job, ",".join(bad))
            return False
        excluded = health.job_field(show_job(job), "ExcNodeList")
        if excluded:
            excluded = subprocess.run(
                ["scontrol", "show", "hostnames", excluded], capture_output=True, text=True
            ).stdout
        merged = ",".join(health.merged_exclusion(excluded.split(), bad))
        updated = subprocess.run(["scontrol", "update", f"JobId={job}", f"ExcNodeList={merged}"]).returncode == 0
        released = subprocess.run(["scontrol", "release", job]).returncode == 0
        if updated and released:
            log.info(
                "requeued job %s (restart %d) without %s (ExcNodeList=%s): it resumes run %s on other nodes",
                job,
                self.plan.restart_count + 1,
                ", ".join(bad),
                merged,
                self.name,
            )
            return True
        log.error(
            "excluding %s from requeued job %s failed (see above); it stays held: scontrol release %s", merged, job, job
        )
        return False


def _prefix_lines(stream, prefix: str) -> None:
    for line in stream:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


HELP = """\
usage: {prog} [TRAINER FLAGS]
       {prog} launch [RUN FLAGS] SCRIPT.py [SCRIPT ARGS]

The batch part of a Slurm job: a Ray cluster on the job's nodes, then the trainer on it; on the time
limit (USR1) a checkpoint, a requeue and a resume. Run inside a job, as cluster/start_ray_slurm.sh does.
TRAINER FLAGS are the trainer's (python -m raytrain_ddp.run --help), less --address; with `launch`, your own
torchrun-style script runs once per worker (python -m raytrain_ddp.launch --help).

examples:
  sbatch --nodes=2 --gpus-per-node=3 cluster/start_ray_slurm.sh --epochs 10 --data /shared/ds
  {prog} --epochs 10 --data /shared/ds     # the last line of your own sbatch script
  sbatch --nodes=2 --gpus-per-node=8 cluster/start_ray_slurm.sh launch train.py --epochs 3
"""


def main(argv: list[str], prog: str = "python -m raytrain_ddp.cluster slurm") -> int:
    """prog: the command's name in --help (`raytrain-ddp slurm` calls this too)."""
    if "-h" in argv or "--help" in argv:
        print(HELP.format(prog=prog), end="")
        return 0
    setup_logging()
    if argv[:1] == ["launch"]:  # a script of one's own: the trainer module is launch's (see RAYTRAIN_MODULE)
        os.environ["RAYTRAIN_MODULE"], argv = planning.LAUNCH_MODULE, argv[1:]
    launcher = Launcher(argv)
    launcher.install_signal_handlers()
    try:
        rc = launcher.run()
    except LaunchError as err:
        log.error("%s", err)
        rc = err.code
    except Stop as stopped:
        rc = stopped.code
    if launcher.requeue and launcher.requeue_job() and not launcher.exclude:
        return 0  # not a failure: the job runs again
    return rc
