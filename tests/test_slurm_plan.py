"""The Slurm launcher's plan from fake Slurm environments: pure functions, no Slurm, no Ray, no root."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from raytrain_ddp.cluster import plan
from raytrain_ddp.cluster.node import catches, port_busy
from raytrain_ddp.cluster.plan import Ports
from raytrain_ddp.errors import ConfigError


@pytest.mark.parametrize(
    "spec, cpus",
    [
        ("8(x2),4", [8, 8, 4]),
        ("3", [3]),
        ("3(x2)", [3, 3]),
        ("16,8(x3)", [16, 8, 8, 8]),
    ],
)
def test_cpu_lists(spec, cpus):
    assert plan.expand_cpu_list(spec) == cpus


def test_a_cpu_list_that_is_not_one_is_refused():
    with pytest.raises(ValueError):
        plan.expand_cpu_list("8(y2)")


@pytest.mark.parametrize(
    "spec, gpus",
    [
        ("3", 3),
        ("gpu:3", 3),
        ("a100:3", 3),
        ("gpu:a100:3", 3),
        ("gpu:a100:2(IDX:0-1)", 2),
        ("gres/gpu:3", 3),
        ("gres:gpu:4", 4),
        ("gres/gpu:a100:2,gres/shard:1", 2),
        ("gres/shard:1,gres/gpu:2", 2),
        ("", 0),
        (None, 0),
        ("gres/shard:4", 0),
        ("0", 0),
    ],
)
def test_gpu_counts(spec, gpus):
    assert plan.gpu_count(spec) == gpus


def test_cpus_per_node_prefers_the_override_then_cpus_per_task_then_slurms_list():
    env = {"SLURM_JOB_CPUS_PER_NODE": "8(x2),4"}
    assert plan.cpus_per_node(env, 3, fallback=2) == [8, 8, 4]
    assert plan.cpus_per_node({**env, "SLURM_CPUS_PER_TASK": "6"}, 3, fallback=2) == [6, 6, 6]
    assert plan.cpus_per_node({**env, "RAYTRAIN_CPUS_PER_NODE": "5", "SLURM_CPUS_PER_TASK": "6"}, 3, 2) == [5, 5, 5]
    assert plan.cpus_per_node({"SLURM_JOB_CPUS_PER_NODE": "8"}, 2, fallback=2) == [8, 2]  # short list: fallback
    assert plan.cpus_per_node({}, 2, fallback=4) == [4, 4]


@pytest.mark.parametrize(
    "env, gpus, known",
    [
        ({}, 0, False),
        ({"SLURM_GPUS_PER_NODE": "gpu:a100:2(IDX:0-1)"}, 2, True),
        ({"SLURM_GPUS_PER_NODE": "3", "SLURM_GPUS_ON_NODE": "3"}, 3, True),
        ({"SLURM_JOB_GPUS": "0,1,2,3"}, 4, False),
        ({"SLURM_TRES_PER_NODE": "gres/gpu:2"}, 2, False),
        ({"SLURM_GPUS": "6"}, 3, False),  # --gpus=6 over 2 nodes
        ({"RAYTRAIN_GPUS_PER_NODE": "3", "SLURM_GPUS_PER_NODE": "1"}, 3, True),
    ],
)
def test_gpus_per_node(env, gpus, known):
    assert plan.gpus_per_node(env, 2) == (gpus, known)


def test_each_node_reads_its_own_gpus():
    assert plan.node_gpus({"SLURM_GPUS_ON_NODE": "2"}, estimate=3) == 2
    assert plan.node_gpus({"SLURM_STEP_GPUS": "0,1"}, estimate=3) == 2
    assert plan.node_gpus({}, estimate=3) == 3


def test_gpu_mismatch_is_one_line_naming_the_node():
    assert plan.gpu_mismatch("n1", "0,1,2", 3) is None
    assert plan.gpu_mismatch("n1", None, 3) is None  # Ray assigns the devices itself
    assert plan.gpu_mismatch("n1", "0", 0) is None
    line = plan.gpu_mismatch("n1", "0,1", 3)
    assert line and "\n" not in line and "n1" in line and "3 GPU" in line and "lists 2" in line


def _time_wait_only(reuse: bool) -> int:
    """A loopback port whose server closed its connection first and stopped listening: only TIME_WAIT is left
    (the server with SO_REUSEADDR, as Ray's gRPC and aiohttp servers listen, or without)."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    with socket.create_connection(("127.0.0.1", port)) as client:
        accepted, _ = server.accept()
        accepted.close()  # the server's side first: TIME_WAIT is on `port`
        client.recv(1)
    server.close()
    return port


def test_a_port_an_earlier_ray_left_in_time_wait_is_free_and_one_listened_on_is_busy():
    """A requeued job keeps its derived block (and its dashboard port) though the GCS it ran a minute ago left
    connections in TIME_WAIT; a listener, or what a server without SO_REUSEADDR left, still moves it on."""
    port = _time_wait_only(reuse=True)
    assert not port_busy(port)
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert port_busy(port)
    assert port_busy(_time_wait_only(reuse=False))


def test_ports_derive_from_the_job_id_and_wrap():
    blocks = plan.port_blocks(1234, tries=3)
    assert blocks[0] == Ports(22340, 22341, 22342, 22343)
    assert [b.gcs for b in blocks] == [22340, 22350, 22360]
    assert plan.port_blocks(999, tries=2)[1].gcs == 20000  # wraps inside 20000-29999
    assert plan.hostport("10.0.0.1", 1) == "10.0.0.1:1" and plan.hostport("fe80::1", 1) == "[fe80::1]:1"


def test_run_name():
    assert plan.run_name("raytrain", 42) == "raytrain-42"
    assert plan.run_name("my job/1", 42) == "my_job_1-42"
    assert plan.run_name(".hidden", 7) == "hidden-7"
    assert plan.run_name(None, 7) == "raytrain-7"


def test_node_local_storage():
    mounts = "tmpfs /dev/shm tmpfs rw 0 0\n/dev/sda1 / ext4 rw 0 0\nnfs:/x /shared nfs4 rw 0 0\n"
    assert plan.fstype_of("/shared/runs", mounts) == "nfs4" and plan.fstype_of("/dev/shm/x", mounts) == "tmpfs"
    assert plan.fstype_of("/sharedx", mounts) == "ext4"
    assert plan.looks_node_local("/tmp/runs", "ext4") and plan.looks_node_local("/x", "tmpfs")
    assert not plan.looks_node_local("/shared/runs", "nfs4")


def test_job_plan_from_a_fake_slurm_environment():
    env = {
        "SLURM_JOB_ID": "1234",
        "SLURM_RESTART_COUNT": "1",
        "SLURM_JOB_CPUS_PER_NODE": "8(x2)",
        "SLURM_GPUS_PER_NODE": "gpu:3",
        "RAYTRAIN_TMPDIR": "/t",
    }
    p = plan.job_plan(
        env, ["a", "b"], head_ip="10.0.0.1", ports=Ports.block(22350), python="/py", home="/h", fallback_cpus=1
    )
    assert (p.head, p.cpus, p.gpus, p.gpus_known, p.restart_count) == ("a", [8, 8], 3, True, 1)
    assert p.step_gpus == 3
    assert (
        plan.job_plan(
            {**env, "RAYTRAIN_GPUS_PER_NODE": "4"},
            ["a"],
            head_ip="h",
            ports=Ports.block(22340),
            python="/py",
            home="/h",
            fallback_cpus=1,
        ).step_gpus
        == 3
    )  # the step asks what Slurm gave
    assert p.head_address == "10.0.0.1:22350" and p.derived_ports.gcs == 22340
    assert p.job_dir == "/h/.raytrain/job-1234" and p.node_tmp(1) == "/t/rt1234.1" and p.tag(1) == "rt-1234-1"
    assert plan.JobPlan.from_json(p.to_json()) == p


# ------------------------------------------------------------------ the trainer's flags, read by its parser
def test_the_storage_abbreviation_is_the_users_choice_not_a_second_default():
    """`--storage /shared/x` is the trainer's --storage-path (or refused by it): never overridden by SUBMIT/runs."""
    try:
        chosen = plan.chosen_settings(["--storage", "/shared/x"])
    except SystemExit as refused:  # a parser that refuses abbreviations: refused before anything starts
        assert refused.code == 2
        return
    where = plan.run_location(chosen, "/submit", "raytrain", 5)
    assert where.storage == "/shared/x" and "--storage-path" not in where.extra_args
    assert where.extra_args == ["--name", "raytrain-5"]


def test_run_location_defaults_and_config_file(tmp_path):
    where = plan.run_location(plan.chosen_settings([]), "/submit", "raytrain", 5)
    assert (where.storage, where.name) == ("/submit/runs", "raytrain-5")
    assert where.extra_args == ["--storage-path", "/submit/runs", "--name", "raytrain-5"]
    toml = tmp_path / "run.toml"
    toml.write_text('storage_path = "/from/toml"\nname = "n1"\nnum_workers = 4\n')
    chosen = plan.chosen_settings(["--config", str(toml)])
    where = plan.run_location(chosen, "/submit", "raytrain", 5)
    assert (where.storage, where.name, where.extra_args) == ("/from/toml", "n1", [])
    assert plan.worker_shape(chosen, 2, 0, 3).num_workers == 4


def test_flags_of_another_trainer_module_are_left_to_it():
    with pytest.raises(SystemExit) as refused:
        plan.chosen_settings(["--hold-seconds", "5"])
    assert refused.value.code == 2
    assert plan.chosen_settings(["--hold-seconds", "5", "--name", "x"], module="my_probe") == {"name": "x"}


def test_a_bad_config_file_is_a_config_error(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("nonsense = 1\n")
    with pytest.raises(ConfigError, match="unknown key"):
        plan.chosen_settings(["--config", str(toml)])


def test_worker_defaults():
    cpu = plan.worker_shape(plan.chosen_settings([]), nnodes=2, cluster_gpus=0, min_cpus=3)
    assert (cpu.use_gpu, cpu.num_workers, cpu.cpus_per_worker) == (False, 2, 2.0)
    assert cpu.extra_args == ["--num-workers", "2", "--cpus-per-worker", "2"] and cpu.note is None
    gpu = plan.worker_shape(plan.chosen_settings([]), nnodes=2, cluster_gpus=6, min_cpus=24)
    assert gpu.extra_args == ["--use-gpu", "--num-workers", "6"] and gpu.cpus_per_worker == 1.0
    assert plan.worker_shape(plan.chosen_settings(["--no-use-gpu"]), 2, 6, 24).extra_args == ["--num-workers", "6"]
    small = plan.worker_shape(plan.chosen_settings([]), nnodes=2, cluster_gpus=0, min_cpus=2)
    assert small.cpus_per_worker == 1.0 and "--cpus-per-task=3" in small.note
    chosen = plan.chosen_settings(["--num-workers", "4", "--cpus-per-worker", "1.5"])
    shape = plan.worker_shape(chosen, nnodes=2, cluster_gpus=0, min_cpus=3)
    assert (shape.num_workers, shape.cpus_per_worker, shape.extra_args) == (4, 1.5, [])


def test_precheck_packs_like_preflight_fractional_cpus_included():
    nodes, cpus = ["n1", "n2"], [3, 3]

    def check(*args, gpus=0, known=True):
        chosen = plan.chosen_settings(list(args))
        shape = plan.worker_shape(chosen, len(nodes), gpus * len(nodes), min(cpus))
        plan.precheck(chosen, shape, nodes, cpus, gpus, known)

    check("--num-workers", "2")
    check("--num-workers", "3", "--cpus-per-worker", "1.5")  # 2 + 1 fit beside a CPU for loading
    with pytest.raises(ConfigError, match="asked for 4 workers x 1.5 CPU"):  # read as 1, 4 would "fit"
        check("--num-workers", "4", "--cpus-per-worker", "1.5")
    with pytest.raises(ConfigError, match=r"asked for 8 workers .* 2 nodes hold"):
        check("--num-workers", "8")
    with pytest.raises(ConfigError, match="asked for 6 workers x 1 CPU \\+ 1 GPU"):  # no CPU left for loading
        check("--num-workers", "6", gpus=3)
    check("--num-workers", "6", gpus=3, known=False)  # GPUs per node not stated: the trainer checks


@pytest.mark.parametrize(
    "env, squeue, end",
    [
        ({"SLURM_JOB_END_TIME": "1800000000"}, "", 1800000000),
        ({"SLURM_JOB_END_TIME": "0"}, "", None),  # no time limit
        ({"SLURM_JOB_END_TIME": "soon"}, "", None),
        ({}, "", None),
        ({}, "1800000000\n", 1800000000),  # Slurm before 23.02: squeue's end time
        ({}, "N/A\n", None),
    ],
)
def test_the_jobs_end_time(env, squeue, end):
    assert plan.job_end_time(env, squeue) == end


def test_catches_reads_a_real_processes_signal_handlers():
    """A stop signal goes to the trainer only once its handler is in (before, USR1 would kill it)."""
    code = "import signal, sys, time; signal.signal(signal.SIGUSR1, print); print('ready', flush=True); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert catches(child.pid, signal.SIGUSR1) and not catches(child.pid, signal.SIGUSR2)
    finally:
        child.kill()
        child.wait()
    assert not catches(child.pid, signal.SIGUSR1)  # gone


def test_the_join_wait_names_a_bounded_list_of_the_nodes_it_waits_on_and_gives_up_naming_them():
    from bench.bringup import fake_ray_nodes
    from raytrain_ddp.cluster.plan import NODES_NAMED, join_failure, join_progress, missing_from
    from raytrain_ddp.driver.preflight import node_rows

    nodes = [f"node-{i:03d}" for i in range(512)]
    reported = {i: (f"node-{i:03d}", f"10.0.{i // 256}.{i % 256}") for i in range(500)}  # 12 never reported
    table = [row for row in node_rows(fake_ray_nodes(512)) if int(row["hostname"][5:8]) < 412]  # node-000..411 joined
    missing = missing_from(nodes, reported, table)
    assert len(missing) == 100 and missing["node-412"] == "node-412 (10.0.1.156)"
    assert missing["node-511"] == "node-511 (its ray start has not reported an address)"
    progress = join_progress(len(table), len(nodes), list(missing))
    assert progress == (
        "412 of 512 nodes joined, waiting on: node-412, node-413, node-414, node-415, node-416, node-417, "
        "node-418, node-419, node-420, node-421 and 90 more"
    )
    failure = join_failure(len(table), len(nodes), "timeout after 180s", list(missing.values()))
    assert failure.startswith("only 412/512 nodes joined (timeout after 180s); missing: node-412 (10.0.1.156), ")
    assert failure.count("node-") == NODES_NAMED and " and 90 more; the [node] lines above show" in failure
    assert join_progress(1, 2, ["b"]) == "1 of 2 nodes joined, waiting on: b"  # a small job: every name, no count


def test_a_workers_ray_start_that_exited_before_joining_is_started_again_but_not_the_heads_nor_a_refused_one():
    """Seen on the testbed under load: rtnode2's raylet asked the head's GCS for its config, got "Deadline Exceeded"
    and `ray start` exited; the job gave up (exit 3) though the head was up and a second try would join."""
    from raytrain_ddp.cluster.plan import RAY_START_TRIES, nodes_to_start_again

    assert nodes_to_start_again([1, 3], refused=set(), starts={0: 1, 1: 1, 2: 1, 3: 1}) == [1, 3]
    assert nodes_to_start_again([0], refused=set(), starts={0: 1}) == []  # a new GCS would be a new cluster
    assert nodes_to_start_again([1, 2], refused={2}, starts={1: 1, 2: 1}) == [1]  # its own check refused node 2
    assert nodes_to_start_again([1], refused=set(), starts={1: RAY_START_TRIES - 1}) == [1]
    assert nodes_to_start_again([1], refused=set(), starts={1: RAY_START_TRIES}) == []  # then the join wait fails


def test_preflight_describes_a_large_cluster_by_its_node_shapes_in_a_bounded_line():
    from bench.bringup import fake_ray_nodes
    from raytrain_ddp import TrainConfig
    from raytrain_ddp.driver.preflight import check_fits, describe, most_workers, node_rows

    table = node_rows(fake_ray_nodes(511) + fake_ray_nodes(1, cpus=32.0, gpus=4.0)[:1])
    assert len(table) == 512
    assert describe(table) == "511 nodes of 64 CPU, 8 GPU, 512.0 GiB; 1 node of 32 CPU, 4 GPU, 512.0 GiB"
    small = "10.0.0.0: 64 CPU, 8 GPU, 512.0 GiB; 10.0.0.1: 64 CPU, 8 GPU, 512.0 GiB"
    assert describe(node_rows(fake_ray_nodes(2))) == small  # a few nodes: each by its address

    # every node full but the small one, packed last: one worker fewer there leaves it a CPU for data loading
    assert most_workers(TrainConfig(cpus_per_worker=8, use_gpu=True), table) == 511 * 8 + 3
    with pytest.raises(ConfigError) as refused:  # one worker per GPU takes every CPU: none left for data loading
        check_fits(TrainConfig(num_workers=511 * 8 + 4, cpus_per_worker=8, use_gpu=True), table)
    assert str(refused.value).startswith("asked for 4092 workers x 8 CPU + 1 GPU, but the 512 nodes hold 4091 ")
    assert str(refused.value).endswith(
        "(511 nodes of 64 CPU, 8 GPU, 512.0 GiB; 1 node of 32 CPU, 4 GPU, 512.0 GiB); try --num-workers 4091"
    )
