"""Bad nodes (raytrain_ddp/cluster/health.py): the network check's verdict and the job's exclusion list."""

from __future__ import annotations

import pytest

from raytrain_ddp.cluster import health, plan
from raytrain_ddp.summary import RunSummary

NODES = ["n1", "n2", "n3"]


def test_every_node_reached_every_other_blames_none():
    assert health.blame(NODES, {n: {} for n in NODES}) == ([], [])


def test_a_node_nobody_reaches_is_blamed_not_the_ones_that_tried():
    reports = {"n1": {"n3": "timed out"}, "n2": {"n3": "timed out"}, "n3": {}}
    bad, why = health.blame(NODES, reports)
    assert bad == ["n3"]
    assert why == ["n1 could not reach it (timed out); n2 could not reach it (timed out)"]


def test_a_node_that_reaches_nobody_is_blamed():
    reports = {"n1": {}, "n2": {}, "n3": {"n1": "refused", "n2": "refused"}}
    assert health.blame(NODES, reports)[0] == ["n3"]


def test_two_nodes_that_fail_each_other_blame_the_worker_and_name_the_other_side():
    # two nodes cannot tell which side is broken: not the head, which every node's Ray must reach
    assert health.blame(["n1", "n2"], {"n1": {"n2": "t"}, "n2": {"n1": "t"}})[0] == ["n2"]
    bad, why = health.blame(["n1", "n2"], {"n1": {}, "n2": {"n1": "timed out"}})
    assert bad == ["n2"] and why == ["it could not reach n1 (timed out)"]


def test_a_node_that_never_reported_is_blamed_and_its_pairs_explain_the_rest():
    bad, why = health.blame(NODES, {"n1": {"n2": "t"}, "n2": None, "n3": {"n2": "t"}})
    assert bad == ["n2"] and why == ["its network check did not report"]


def test_two_bad_nodes_are_both_named():
    nodes = ["n1", "n2", "n3", "n4", "n5"]
    reports = {n: {"n2": "t", "n3": "t"} for n in ("n1", "n4", "n5")} | {"n2": {}, "n3": {}}
    assert health.blame(nodes, reports)[0] == ["n3", "n2"]


@pytest.mark.parametrize(
    ("value", "seconds"), [(None, health.NETCHECK_TIMEOUT_S), ("", health.NETCHECK_TIMEOUT_S), ("0", 0.0), ("7.5", 7.5)]
)
def test_the_check_timeout(value, seconds):
    env = {} if value is None else {"RAYTRAIN_NETCHECK_TIMEOUT_S": value}
    assert health.netcheck_timeout(env) == seconds


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "1e9", "ten"])
def test_a_bad_check_timeout_is_one_line_naming_the_variable(value):
    with pytest.raises(ValueError, match=r"^RAYTRAIN_NETCHECK_TIMEOUT_S="):
        health.netcheck_timeout({"RAYTRAIN_NETCHECK_TIMEOUT_S": value})


def test_requeues_without_blamed_nodes_are_capped():
    """A hang that is the code's or the data's would otherwise be requeued again and again, a node fewer each
    time: after RAYTRAIN_MAX_EXCLUDING_REQUEUES requeues (3 by default) the job ends instead, saying why."""
    assert health.max_excluding_requeues({}) == health.MAX_EXCLUDING_REQUEUES == 3
    assert health.max_excluding_requeues({"RAYTRAIN_MAX_EXCLUDING_REQUEUES": "0"}) == 0
    limit = health.max_excluding_requeues({"RAYTRAIN_MAX_EXCLUDING_REQUEUES": "2"})
    assert [health.why_not_requeued(restarts, limit) is None for restarts in range(4)] == [True, True, False, False]
    assert health.why_not_requeued(2, 2) == (
        "not requeued: the job has been requeued 2 times already (RAYTRAIN_MAX_EXCLUDING_REQUEUES=2); "
        "a failure that follows it to other nodes is the run's own"
    )
    for bad in ("-1", "1.5", "many", "1000"):
        with pytest.raises(ValueError, match=r"^RAYTRAIN_MAX_EXCLUDING_REQUEUES="):
            health.max_excluding_requeues({"RAYTRAIN_MAX_EXCLUDING_REQUEUES": bad})


def test_the_plan_carries_the_check_timeout_and_the_requeue_cap():
    env = {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "3", "RAYTRAIN_NETCHECK_TIMEOUT_S": "12"}
    kwargs = dict(head_ip="10.0.0.1", ports=plan.port_blocks(7, 1)[0], python="py", home="/h", fallback_cpus=1)
    made = plan.job_plan({**env, "RAYTRAIN_MAX_EXCLUDING_REQUEUES": "1"}, ["a", "b"], **kwargs)
    assert made.netcheck_timeout_s == 12 and made.max_excluding_requeues == 1
    assert plan.JobPlan.from_json(made.to_json()) == made


def test_nodes_the_run_failed_on_come_from_the_summary():
    lost = {"lost_nodes": [{"hostname": "n2.cluster.local", "node_ip": "10.0.0.2"}], "stuck_nodes": ["n3"]}

    def failed_on(summary: dict) -> list[str]:
        return health.nodes_the_run_failed_on(RunSummary.from_json(summary), NODES)

    assert failed_on({**lost, "error": "lost node n2 (...) after 1 epoch"}) == ["n2", "n3"]
    assert failed_on({"stuck_nodes": ["n3"], "error": "watchdog: no rank ..."}) == ["n3"]
    # a failure of the run's own (it would fail on any node) names no node, whatever else the summary holds
    assert failed_on({**lost, "error": "non-finite loss at step 3"}) == []
    assert failed_on({"lost_nodes": [{"hostname": "elsewhere"}], "error": "lost node elsewhere"}) == []
    assert failed_on({}) == []


def _probe(host: str, cuda: bool) -> dict:
    """What preflight's CUDA probe returns from a Ray worker on `host`."""
    return {"host": host, "cuda": cuda, "torch_cuda": "13.0", "visible": "0,1"}


def test_gpus_cuda_sees_on_no_node_are_the_environments_fault_and_on_some_those_nodes():
    from raytrain_ddp.driver.preflight import UnusableGPUNodes, judge_cuda_probes
    from raytrain_ddp.errors import ConfigError

    judge_cuda_probes([_probe("n1", True), _probe("n2", True)])  # CUDA works everywhere
    with pytest.raises(ConfigError, match=r"^--use-gpu: Ray counts GPUs on n1, n2, but CUDA sees none in a Ray "):
        judge_cuda_probes([_probe("n1", False), _probe("n2", False)])  # a CPU-only torch, no driver anywhere
    with pytest.raises(UnusableGPUNodes) as faulty:  # one node's driver is broken
        judge_cuda_probes([_probe("n1", True), _probe("n2", False), _probe("n3", True)])
    assert faulty.value.hosts == ["n2"]
    assert str(faulty.value) == (
        "GPU check failed on n2: Ray counts GPUs there, but CUDA sees none in a Ray worker (CUDA_VISIBLE_DEVICES=0,1, "
        "torch built for CUDA 13.0), while it does on the other 2 nodes; check that node's driver with nvidia-smi"
    )


def test_nodes_whose_gpus_cuda_did_not_see_reach_the_launcher_through_the_summary(tmp_path):
    """The driver's summary of a run that failed on some nodes' GPUs, as the Slurm launcher reads it: those
    nodes, to requeue the job without them; what the summary said of earlier attempts stays."""
    import json

    from raytrain_ddp.cluster.slurm import Launcher
    from raytrain_ddp.config import TrainConfig
    from raytrain_ddp.driver.fit import _failed_before_start
    from raytrain_ddp.driver.preflight import UnusableGPUNodes, judge_cuda_probes

    config = TrainConfig(storage_path=str(tmp_path), name="gpus")
    config.run_dir.mkdir()
    (config.run_dir / "summary.json").write_text(json.dumps({"status": "stopped", "epochs_completed": 3}))
    with pytest.raises(UnusableGPUNodes) as faulty:
        judge_cuda_probes([_probe("n1.cluster.local", True), _probe("n3.cluster.local", False)])
    result = _failed_before_start(config, str(faulty.value), gpu_failed_nodes=faulty.value.hosts)
    assert not result.ok and not result.stopped
    summary = Launcher.summary(config.run_dir)
    assert summary == result.run_summary and summary.epochs_completed == 3 and summary.status == "failed"
    assert json.loads((config.run_dir / "summary.json").read_text()) == {
        "status": "failed",
        "epochs_completed": 3,
        "error": str(faulty.value),
        "gpu_failed_nodes": ["n3.cluster.local"],
    }
    assert health.nodes_the_run_failed_on(summary, NODES) == ["n3"]
    # a stale list of such nodes is not read when the run failed otherwise
    assert health.nodes_the_run_failed_on(summary.with_fields(error="non-finite loss at step 3"), NODES) == []


def test_the_exclusion_list_merges_with_the_jobs_own():
    shown = "JobId=5 JobName=raytrain\n   ReqNodeList=(null) ExcNodeList=n7 Features=(null)"
    assert health.job_field(shown, "ExcNodeList") == "n7"
    assert health.job_field(shown, "ReqNodeList") == ""
    assert health.merged_exclusion(["n7"], ["n2", "n7"]) == ["n7", "n2"]
    assert health.merged_exclusion([], ["n2"]) == ["n2"]


def test_a_usr1_is_told_apart_as_a_preemption_by_the_jobs_preempt_time():
    running = (
        "JobId=5 JobState=RUNNING EndTime=2026-12-04T12:01:06 PreemptEligibleTime=2026-12-04T11:31:06 PreemptTime=None"
    )
    assert health.preemption(running) is None  # the time-limit warning (or a USR1 sent by hand)
    preempted = running.replace("EndTime=2026-12-04T12:01:06", "EndTime=2026-12-04T11:32:39").replace(
        "PreemptTime=None", "PreemptTime=2026-12-04T11:31:09"
    )
    assert health.preemption(preempted) == (
        "Slurm is preempting this job (since 2026-12-04T11:31:09; it ends by 2026-12-04T11:32:39)"
    )


def test_a_trainer_that_failed_without_writing_its_summary_is_told_apart():
    none = RunSummary.missing()
    stopped = RunSummary.from_json({"status": "stopped", "epochs_completed": 1})  # the last incarnation's
    said = health.ended_without_summary(-9, stopped, stopped)
    assert said and said.startswith("the trainer was killed by SIGKILL (the OOM killer"), said
    assert said.endswith("the same command resumes from the latest checkpoint"), said
    assert health.ended_without_summary(-11, none, none).startswith(
        "the trainer was killed by SIGSEGV (a crash in native"
    )
    assert "Ray ending it because the Ray of its node went away" in health.ended_without_summary(1, none, none)
    failed = RunSummary.from_json({"status": "failed", "error": "non-finite loss at step 3"})
    assert health.ended_without_summary(1, stopped, failed) is None  # its own summary says why
    assert health.ended_without_summary(0, none, none) is None
    assert health.ended_without_summary(2, none, none) is None  # a bad input: its one line is out
