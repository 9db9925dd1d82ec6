"""Bad nodes: which node a failed network check or a failed run points at, and the job's exclusion list.

Pure functions of what the nodes and the trainer reported (no processes, no Slurm), unit-tested with
fake reports in milliseconds; raytrain_ddp.cluster.node runs the check, the launcher acts on the verdict.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping

from raytrain_ddp.errors import plural
from raytrain_ddp.summary import RunSummary

NETCHECK_TIMEOUT_S = 30.0  # default of RAYTRAIN_NETCHECK_TIMEOUT_S: a few connections, seconds on a sane network
# default of RAYTRAIN_MAX_EXCLUDING_REQUEUES: a failure that follows the job from node to node is not the nodes'
MAX_EXCLUDING_REQUEUES = 3
# how the trainer's summary error begins when CUDA saw no GPU on some nodes but did on others (driver/preflight)
GPU_CHECK_FAILED = "GPU check failed on "


def env_number(env: Mapping[str, str], name: str, default: float, high: float, meaning: str, low: float = 0) -> float:
    """The number in env[name] (default when unset or blank), low..high. ValueError naming the variable."""
    raw = env.get(name, "")
    try:
        value = float(raw) if raw.strip() else default
    except ValueError:
        value = low - 1
    if not low <= value <= high:  # also NaN
        raise ValueError(f"{name}={raw!r}: give {meaning} between {low:g} and {high:g}")
    return value


def netcheck_timeout(env: Mapping[str, str]) -> float:
    """RAYTRAIN_NETCHECK_TIMEOUT_S (0 turns the check off). ValueError naming the variable for a bad value."""
    return env_number(env, "RAYTRAIN_NETCHECK_TIMEOUT_S", NETCHECK_TIMEOUT_S, 3600, "seconds (0: no check)")


def max_excluding_requeues(env: Mapping[str, str]) -> int:
    """RAYTRAIN_MAX_EXCLUDING_REQUEUES: how often a job may be requeued without nodes it failed on."""
    value = env_number(env, "RAYTRAIN_MAX_EXCLUDING_REQUEUES", MAX_EXCLUDING_REQUEUES, 100, "a whole number")
    if value != int(value):
        raise ValueError(f"RAYTRAIN_MAX_EXCLUDING_REQUEUES={env['RAYTRAIN_MAX_EXCLUDING_REQUEUES']!r}: a whole number")
    return int(value)


def why_not_requeued(restart_count: int, limit: int) -> str | None:
    """None when the job may be requeued without the nodes blamed for its failure, else why not: after `limit`
    requeues (SLURM_RESTART_COUNT counts every requeue, preemptions too) the failure is taken to be the run's
    own (a collective deadlock, data that hangs a rank, a network broken everywhere), which more nodes
    would not mend, and each requeue would take one node fewer."""
    if restart_count < limit:
        return None
    return (
        f"not requeued: the job has been requeued {plural(restart_count, 'time')} already "
        f"(RAYTRAIN_MAX_EXCLUDING_REQUEUES={limit}); a failure that follows it to other nodes is the run's own"
    )


def blame(nodes: list[str], reports: Mapping[str, Mapping[str, str] | None]) -> tuple[list[str], list[str]]:
    """(bad nodes, why each is bad) from each node's network check.

    reports: node -> {peer it could not reach: why} ({} when it reached every peer), None when the node
    never reported (it is bad). A failed connection a->b is explained by one of a and b: the node in
    the most failed pairs is blamed first and its pairs dropped, until none is left unexplained. A tie goes
    to the later node: with two nodes a failure cannot tell which side is broken, and the first node,
    the Ray head, is the one every node's Ray must reach (the reason names the other side too)."""
    bad = [n for n in nodes if reports.get(n) is None]
    reasons = {n: "its network check did not report" for n in bad}
    pairs = {
        (a, b): why
        for a in nodes
        if a not in bad
        for b, why in (reports.get(a) or {}).items()
        if b in nodes and b not in bad
    }
    while pairs:
        weights = {n: _weight(n, pairs, nodes) for pair in pairs for n in pair}
        worst = max(weights, key=weights.__getitem__)
        failed = sorted(
            {
                (f"{a} could not reach it ({why})" if b == worst else f"it could not reach {b} ({why})")
                for (a, b), why in pairs.items()
                if worst in (a, b)
            }
        )
        bad.append(worst)
        reasons[worst] = "; ".join(failed)
        pairs = {pair: why for pair, why in pairs.items() if worst not in pair}
    return bad, [reasons[n] for n in bad]


def _weight(node: str, pairs: Mapping[tuple[str, str], str], nodes: list[str]) -> tuple[int, int]:
    """How many peers `node` failed with (either way), then its place (the later is blamed first)."""
    peers = {b for a, b in pairs if a == node} | {a for a, b in pairs if b == node}
    return len(peers), nodes.index(node)


def nodes_the_run_failed_on(summary: RunSummary, nodes: list[str]) -> list[str]:
    """The job's nodes a run failed on, from its summary: the lost nodes when a lost node ended it, the
    nodes of the ranks the watchdog ended when a hang did, the nodes whose GPUs CUDA did not see when
    others' it did (lost_nodes / stuck_nodes / gpu_failed_nodes; Ray's host names may carry a domain).
    None for any other failure: a NaN or a bad flag fails on every node alike."""
    error = str(summary.error or "")
    if error.startswith(GPU_CHECK_FAILED):
        named = list(summary.gpu_failed_nodes or [])
    elif error.startswith(("lost node ", "watchdog: ")):
        named = [n.get("hostname", "") for n in summary.lost_nodes or []]
        named += list(summary.stuck_nodes or [])
    else:
        return []
    short = {str(h).split(".")[0] for h in named if h}
    return [n for n in nodes if n.split(".")[0] in short]


# Who most likely sent a signal that ended a process, beside someone who sent it by hand
LIKELY_SENDER = {
    signal.SIGKILL: "the OOM killer",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a crash in native code",
    signal.SIGABRT: "an abort in native code",
}


def ended_without_summary(returncode: int, before: RunSummary, after: RunSummary) -> str | None:
    """The launcher's line for a trainer cut short before it wrote its summary (`before`: the run's summary
    when the trainer started, RunSummary.missing() for none), else None. Ray ends a driver at once, with exit
    code 1 and no word of why, when the Ray of its node goes (its raylet killed, `ray stop`, a step cancelled);
    the OOM killer sends a SIGKILL. A bad input (exit code 2) has said its one line already."""
    if not (returncode == 1 or returncode < 0) or after != before:
        return None
    if returncode < 0:
        killer = signal.Signals(-returncode)
        likely = LIKELY_SENDER.get(killer)
        how = f"was killed by {killer.name} ({f'{likely}, or ' if likely else ''}a process that sent it)"
    else:
        how = (
            "exited with code 1: a crash (its traceback above), or Ray ending it because the Ray of its node went away"
        )
    return (
        f"the trainer {how} before writing its summary; its driver.log and ray-logs are in the run directory, "
        "what it recorded stays there, and the same command resumes from the latest checkpoint"
    )


def job_field(scontrol_show_job: str, field: str) -> str:
    """A field of `scontrol show job` output ('' for Slurm's (null))."""
    for word in scontrol_show_job.split():
        key, _, value = word.partition("=")
        if key == field:
            return "" if value == "(null)" else value
    return ""


def preemption(scontrol_show_job: str) -> str | None:
    """What a USR1 meant, from `scontrol show job`: Slurm preempting the job (a PreemptTime is set; under
    GraceTime the job's EndTime is moved up to when the grace ends), or None (no preemption pending)."""
    since = job_field(scontrol_show_job, "PreemptTime")
    if since in ("", "None", "Unknown"):
        return None
    return f"Slurm is preempting this job (since {since}; it ends by {job_field(scontrol_show_job, 'EndTime')})"


def merged_exclusion(excluded: list[str], bad: list[str]) -> list[str]:
    """The job's ExcNodeList after excluding `bad` too: the old entries first, none twice."""
    return list(dict.fromkeys([*excluded, *bad]))
