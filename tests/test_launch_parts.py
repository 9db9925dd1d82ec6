"""The pieces of `raytrain-ddp launch` and --task that need no Ray: the session API with its local defaults,
how ranks' reports and failures are told, stacks read as the watchdog reads them, a task's validation sums."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from raytrain_ddp.driver.console import Console
from raytrain_ddp.driver.epochs import PER_RANK_LIMIT, aggregate_report, split_per_rank
from raytrain_ddp.driver.failures import describe_failure
from raytrain_ddp.driver.stacks import main_thread, outside_collectives
from raytrain_ddp.errors import ConfigError, ScriptFailed, ScriptKilled
from raytrain_ddp.plugins import make_task
from raytrain_ddp.worker.launched import exception_of
from raytrain_ddp.worker.metrics import evaluate


def _run_python(code: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("RAYTRAIN_DDP_")}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**environment, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_session_outside_a_launch_prints_on_rank_zero_and_keeps_checkpoints_in_the_working_directory(tmp_path):
    code = """
        from raytrain_ddp import session
        session.report({"loss": 0.5, "seen": 3})
        session.report({"loss": 0.25}, step=7)
        print(session.checkpoint_dir())
    """
    zero = _run_python(code, {"RANK": "0"}, cwd=tmp_path)
    assert zero.stdout.splitlines() == ["step 0: loss 0.5, seen 3", "step 7: loss 0.25", "checkpoints"]
    assert (tmp_path / "checkpoints").is_dir()
    one = _run_python(code, {"RANK": "1", "RAYTRAIN_DDP_CHECKPOINT_DIR": str(tmp_path / "snap")}, cwd=tmp_path)
    assert one.stdout.splitlines() == [str(tmp_path / "snap")]  # rank 1 prints no reports


def test_the_session_writes_whole_report_lines_to_its_channel_and_refuses_what_is_not_a_number(tmp_path):
    code = """
        import torch
        from raytrain_ddp import session
        session.report({"loss": torch.tensor(0.5), "n": 2}, step=1)
        session.report({"name": "x"}, step=2)
    """
    result = _run_python(code, {"RAYTRAIN_DDP_SESSION": str(tmp_path)})
    assert "TypeError: session.report: 'name' is str, not a number" in result.stderr
    assert [json.loads(line) for line in (tmp_path / "reports.jsonl").read_text().splitlines()] == [
        {"step": 1, "loss": 0.5, "n": 2}
    ]


def test_should_stop_turns_true_on_a_stop_signal_or_the_stop_flag_and_the_signal_does_not_kill(tmp_path):
    code = """
        import os, signal
        from raytrain_ddp import session
        print(session.should_stop())
        os.kill(os.getpid(), signal.SIGUSR1)
        print(session.should_stop())
    """
    result = _run_python(code)
    assert result.returncode == 0 and result.stdout.split() == ["False", "True"], result.stderr
    (tmp_path / "stop").touch()
    flagged = _run_python(
        "from raytrain_ddp import session; print(session.should_stop())", {"RAYTRAIN_DDP_SESSION": str(tmp_path)}
    )
    assert flagged.stdout.strip() == "True"


def test_importing_the_session_imports_nothing_the_script_did_not_ask_for():
    result = _run_python(
        "import sys; from raytrain_ddp import session; print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('numpy', 'pyarrow', 'torch', 'ray')))"
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_a_reported_step_is_the_mean_over_ranks_with_its_spread_where_they_differ(caplog):
    record = aggregate_report({1: {"step": 3, "loss": 1.0, "lr": 0.1}, 0: {"step": 3, "loss": 3.0, "lr": 0.1}})
    assert record == {
        "step": 3, "world_size": 2, "loss": 2.0, "loss_min": 1.0, "loss_max": 3.0, "loss_per_rank": [3.0, 1.0],
        "lr": 0.1,
    }  # fmt: skip
    with caplog.at_level("INFO", logger="raytrain_ddp"):
        Console(1).show_report(record)
    assert caplog.messages == ["step 3: loss 2 (1..3), lr 0.1"]


def test_a_large_worlds_reported_step_shows_its_spread_from_the_summary(caplog):
    ranks = range(PER_RANK_LIMIT + 1)
    record, _ = split_per_rank(aggregate_report({rank: {"step": 3, "loss": float(rank), "lr": 0.1} for rank in ranks}))
    with caplog.at_level("INFO", logger="raytrain_ddp"):
        Console(1).show_report(record)
    assert caplog.messages == [f"step 3: loss 32 (0..{PER_RANK_LIMIT}), lr 0.1"]


def test_a_failed_ranks_error_is_read_from_its_traceback_as_torch_prefixes_it():
    lines = collections.deque(
        [
            "rank 1 sees RUN_TAG=blue",
            "[rank1]: Traceback (most recent call last):",
            '[rank1]:   File "train.py", line 13, in <module>',
            "[rank1]:     raise mypkg.errors.BadShard('bad: shard 3')",
            "[rank1]: mypkg.errors.BadShard: bad: shard 3",
        ]
    )
    assert exception_of(lines) == "BadShard: bad: shard 3"
    assert exception_of(collections.deque(["Killed"])) is None


def test_the_first_rank_to_fail_is_named_and_ranks_that_failed_alike_are_named_together():
    from ray.train import WorkerGroupError

    cause = ScriptFailed("ValueError: bad shard (exit code 1; rank-1.log)", exited_at=10.0)
    after = ScriptFailed("RuntimeError: Connection closed by peer (exit code 1; rank-0.log)", exited_at=10.4)
    error = WorkerGroupError("failed", {0: after, 1: cause})
    assert describe_failure(error) == "rank 1: ValueError: bad shard (exit code 1; rank-1.log); then rank 0 too"
    alike = WorkerGroupError("failed", {0: ScriptKilled("killed by SIGKILL"), 1: ScriptKilled("killed by SIGKILL")})
    assert describe_failure(alike) == "ranks 0, 1: killed by SIGKILL"


PY_SPY_DUMP = """\
Process 101: python -m raytrain_ddp.worker.script_runner train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 101 (idle): "MainThread"
    {frames}
    _run_code (<frozen runpy>:88)
    main (script_runner.py:78)
Thread 140 (idle): "Thread-1"
    wait (threading.py:327)
"""


def test_the_rank_whose_main_thread_is_outside_a_collective_is_the_one_the_others_wait_for():
    waiting = PY_SPY_DUMP.format(
        frames="all_reduce (torch/distributed/distributed_c10d.py:3913)\n    <module> (t.py:9)"
    )
    backward = PY_SPY_DUMP.format(frames="backward (torch/autograd/__init__.py:347)\n    <module> (t.py:7)")
    stuck = PY_SPY_DUMP.format(frames="load (json/__init__.py:293)\n    read_rows (t.py:4)")
    workers = {rank: {"stack_pid": 101} for rank in range(3)}
    assert main_thread(stuck, 101) == ["load (json/__init__.py:293)", "read_rows (t.py:4)"]
    found = outside_collectives({0: waiting, 1: stuck, 2: backward}, workers)
    assert found == {1: ["load (json/__init__.py:293)", "read_rows (t.py:4)"]}
    assert outside_collectives({0: "no stack: py-spy is not installed"}, {0: {"stack_pid": 101}}) == {}


class _WithConfig:
    def __init__(self, config):
        self.config = config

    def training_step(self, model, batch):
        return model(batch["x"]).sum()

    def validation_step(self, model, batch):
        return {"loss": model(batch["x"]).sum(), "count": len(batch["x"])}


class _NoValidation:
    def training_step(self, model, batch):
        return 0.0


def test_a_task_class_is_made_with_the_config_when_it_takes_one_and_must_have_both_steps():
    assert make_task(_WithConfig, "the config", "'t'").config == "the config"
    with pytest.raises(ConfigError, match="--task 't': _NoValidation has no validation_step method"):
        make_task(_NoValidation, None, "'t'")


def test_a_tasks_validation_sums_become_means_over_all_rows():
    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    batches = [{"x": torch.ones(3, 2)}, {"x": 2 * torch.ones(1, 2)}]  # outputs 2, 2, 2 and 4

    def validation_step(model, batch):
        outputs = model(batch["x"]).squeeze(1)
        return {"total": outputs.sum(), "big": (outputs > 3).sum(), "count": len(outputs)}

    result = evaluate(model, iter(batches), validation_step, torch.device("cpu"), task=True)
    assert result == {"val_big": 0.25, "val_total": 2.5, "val_rows": 4}
    with pytest.raises(TypeError, match="with the batch's row count under 'count'"):
        evaluate(model, iter(batches), lambda m, b: {"total": 1.0}, torch.device("cpu"), task=True)
