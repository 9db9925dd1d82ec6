"""The run directory against other drivers, reused names, files cut short and leaked credentials.

Everything here is decided before Ray starts: real files, real processes, no training. Where `fit()`
is called, --address points at a port nothing listens on, so a check that came too late would end
in "cannot connect" instead of the refusal asserted.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch
from support import REPO, run_cli

from raytrain_ddp.config import TrainConfig, to_toml
from raytrain_ddp.errors import ConfigError
from raytrain_ddp.summary import RunSummary

NOWHERE = "127.0.0.1:1"  # a Ray address nothing listens on: a check after connect() would fail with it


def _config(tmp_path, **changes) -> TrainConfig:
    values = dict(storage_path=str(tmp_path / "runs"), name="reused", address=NOWHERE, epochs=2, report=False)
    return TrainConfig(**{**values, **changes}).validate()


def _fit(config: TrainConfig):
    from raytrain_ddp.driver.fit import fit

    return fit(config)


def _listing(directory) -> dict:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ------------------------------------------------------------------ 16.5 one driver per run directory
HOLDER = textwrap.dedent(
    """
    import pathlib, sys
    from raytrain_ddp.driver.run_lock import hold
    with hold(pathlib.Path(sys.argv[1])):
        print("held", flush=True)
        sys.stdin.readline()
    """
)


def test_a_second_driver_on_a_run_directory_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "runs" / "busy"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run_cli(
            "raytrain_ddp.run", "--storage-path", str(tmp_path / "runs"), "--name", "busy", "--address", NOWHERE
        )
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: run directory "), lines
        assert f"in use by process {holder.pid} on host {socket.gethostname()}" in lines[0]
        assert os.listdir(run_dir) == ["driver.lock"]  # the refused command wrote nothing
    finally:
        holder.communicate("\n", timeout=30)
    assert holder.returncode == 0
    assert not run_dir.exists()  # released: the lock, and the directory made only to hold it


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _leave_lock(run_dir, age_s: float = 0, **holder) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "driver.lock"
    path.write_text(json.dumps({"started": "2026-01-01T00:00:00Z", **holder}))
    os.utime(path, (path.stat().st_mtime - age_s,) * 2)


@pytest.mark.parametrize(
    "holder, age_s, stale",
    [
        ({"host": socket.gethostname(), "pid": "dead"}, 0, True),
        ({"host": socket.gethostname(), "pid": os.getpid(), "pid_start": "1"}, 0, True),  # pid reused since
        ({"host": socket.gethostname(), "pid": os.getpid()}, 10_000, False),  # alive on this host: never stale
        ({"host": "node-elsewhere", "pid": 4242}, 60, False),
        ({"host": "node-elsewhere", "pid": 4242}, 10_000, True),  # no heartbeat for hours
        ({"host": "node-elsewhere", "pid": 4242, "slurm_job": [777, 0]}, 60, True),  # this job, before its requeue
        ({"host": "node-elsewhere", "pid": 4242, "slurm_job": [778, 0]}, 60, False),  # another job
    ],
    ids=["dead-pid", "reused-pid", "live-pid", "other-host-beating", "other-host-silent", "requeued", "other-job"],
)
def test_a_lock_is_taken_over_only_when_stale(tmp_path, caplog, monkeypatch, holder, age_s, stale):
    from raytrain_ddp.driver.run_lock import RunLock

    monkeypatch.setenv("SLURM_JOB_ID", "777")  # a requeued job keeps its id and counts its restarts
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    run_dir = tmp_path / "run"
    holder = {**holder, "pid": _dead_pid() if holder["pid"] == "dead" else holder["pid"]}
    _leave_lock(run_dir, age_s, **holder)
    lock = RunLock(run_dir)
    if not stale:
        with pytest.raises(ConfigError, match=f"in use by process {holder['pid']} on host {holder['host']}"):
            lock.acquire()
        assert json.loads((run_dir / "driver.lock").read_text())["pid"] == holder["pid"]  # left alone
        return
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp"):
        lock.acquire()
    assert f"left by process {holder['pid']} on host {holder['host']}" in caplog.text
    assert json.loads((run_dir / "driver.lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert os.listdir(run_dir) == []


def test_an_empty_lock_file_is_taken_over_only_once_old(tmp_path):
    from raytrain_ddp.driver.run_lock import STALE_AFTER_S, RunLock

    path = tmp_path / "driver.lock"
    path.write_text("")  # a driver between creating the file and writing it, or one that died there
    with pytest.raises(ConfigError, match="in use by a driver whose lock file is empty or unreadable"):
        RunLock(tmp_path).acquire()
    os.utime(path, (path.stat().st_mtime - STALE_AFTER_S - 60,) * 2)
    lock = RunLock(tmp_path)
    lock.acquire()
    assert json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()


# ------------------------------------------------------------------ 16.6 a name reused for other work
def _finished_run(tmp_path, **changes) -> TrainConfig:
    config = _config(tmp_path, **changes)
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "config.toml").write_text(to_toml(config))
    (config.run_dir / "summary.json").write_text(json.dumps({"status": "finished", "epochs_completed": 2}))
    return config


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"model": "mlp", "dataset": "synthetic-tabular"},
            "made with model 'cnn', dataset 'synthetic', not model 'mlp'",
        ),
        ({"strategy": "fsdp"}, "made with strategy 'ddp', not strategy 'fsdp'"),
        ({"optimizer": "adamw"}, "made with optimizer 'sgd', not optimizer 'adamw'"),
        ({"data": "/data/other"}, "made with data None, not data '/data/other'"),
    ],
    ids=["model", "strategy", "optimizer", "data"],
)
def test_a_name_reused_for_other_work_is_refused_before_anything_is_written(tmp_path, changes, message):
    first = _finished_run(tmp_path)
    before = _listing(first.run_dir)
    with pytest.raises(ConfigError, match="its checkpoints do not fit") as refused:
        _fit(_config(tmp_path, epochs=4, **changes))
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert _listing(first.run_dir) == before


# The check after the run directory's: Ray's address when this process has no Ray, else (the session's Ray
# is up) the capacity check, for 3 workers on its 3 CPUs.
PAST_THE_RUN_DIRECTORY = "cannot connect to the Ray cluster|asked for 3 workers"


@pytest.mark.parametrize(
    "first, again, next_check",
    [
        ({}, {"num_workers": 3, "lr": 0.1, "batch_size": 32}, PAST_THE_RUN_DIRECTORY),
        ({"data": "/data/ds/"}, {"data": "/data/ds"}, "dataset path does not exist"),  # one path, two spellings
    ],
    ids=["other-shape-of-job", "same-data-path"],
)
def test_the_same_work_with_more_epochs_goes_on(tmp_path, first, again, next_check):
    _finished_run(tmp_path, **first)
    with pytest.raises(ConfigError, match=next_check):  # the check after the run directory's: those passed
        _fit(_config(tmp_path, epochs=4, **again))


# ------------------------------------------------------------------ 16.7 files cut short
def test_a_summary_cut_short_is_named_and_written_anew(tmp_path, caplog):
    config = _finished_run(tmp_path)
    (config.run_dir / "summary.json").write_text('{"status": "fini')
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp"):
        with pytest.raises(ConfigError, match=PAST_THE_RUN_DIRECTORY):
            _fit(_config(tmp_path, num_workers=3))
    assert f"{config.run_dir / 'summary.json'} is unreadable (Unterminated string" in caplog.text


def test_a_config_cut_short_is_refused_while_checkpoints_depend_on_it(tmp_path):
    config = _finished_run(tmp_path)
    (config.run_dir / "config.toml").write_text('model = "cn')
    (config.run_dir / "checkpoint_manager_snapshot.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"config.toml is unreadable \(.*\): cannot tell whether run 'reused'"):
        _fit(_config(tmp_path, epochs=4))


def test_a_metrics_file_cut_short_keeps_its_whole_lines(tmp_path, caplog):
    from raytrain_ddp.driver import run_directory
    from raytrain_ddp.driver.monitor import RunRecorder

    config = _config(tmp_path)
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "metrics.jsonl").write_text('{"epoch": 1, "val_accuracy": 0.5}\n{"epoch": 2, "val_acc')
    (config.run_dir / "steps.jsonl").write_text('{"step": 10, "train_loss": 0.5}\n{"step": 20, "tr')
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp"):
        run_directory.prepare(config)
    assert "metrics.jsonl: dropped line 2: no epoch record (cut short?); 1 epoch record kept" in caplog.text
    assert "steps.jsonl: dropped line 2: no step record (cut short?); 1 step record kept" in caplog.text
    recorder = RunRecorder(config.run_dir, config, 64, 2, [])
    assert list(recorder.epochs) == [1] and [r["step"] for r in recorder.steps_file.records] == [10]


def test_a_checkpoint_snapshot_cut_short_is_one_line(tmp_path):
    from raytrain_ddp.checkpoint.registry import read_snapshot

    (tmp_path / "checkpoint_manager_snapshot.json").write_text('{"checkpoint_results": [')
    with pytest.raises(ConfigError, match="checkpoint_manager_snapshot.json is unreadable"):
        read_snapshot(tmp_path)


def test_checkpoints_ray_train_never_recorded_are_removed_when_unfinished_and_named_when_whole(tmp_path, caplog):
    """A run that ended while a checkpoint was written leaves a directory Ray Train's snapshot does not list (and
    its retention never deletes): when the run starts again, an unfinished one is removed, a whole one kept."""
    from raytrain_ddp import _ray_compat
    from raytrain_ddp.checkpoint.registry import clear_unrecorded
    from raytrain_ddp.checkpoint.saver import save
    from raytrain_ddp.checkpoint.state import Position

    config = _config(tmp_path)
    run_info = {"config": config.to_dict(), "data_spec": {"kind": "images"}}

    def whole(name: str) -> Path:
        (tmp_path / name).mkdir()
        training_state = {"scheduler": {}, "scaler": {}, "world_size": 1}
        save(str(tmp_path / name), {}, {}, training_state, Position(1, 0, 4), {}, run_info)
        return tmp_path / name

    recorded, unreported = whole("checkpoint_2026-12-01_10-00-00.000000"), whole("checkpoint_2026-12-01_11-00-00.0")
    _ray_compat.write_snapshot(tmp_path, _ray_compat.new_snapshot(recorded.name, {"epoch": 1}))
    unfinished = tmp_path / "checkpoint_2026-12-01_12-00-00.000000"  # a sharded one whose ranks were writing
    (unfinished / "shards").mkdir(parents=True)
    (unfinished / "shards" / "__0_0.distcp").write_bytes(b"\0" * 64)
    torch.save({"format": "sharded"}, unfinished / "training_state.pt")
    (tmp_path / "checkpoint_notes.txt").write_text("a user's file, not a checkpoint directory")
    with caplog.at_level(logging.WARNING, logger="raytrain_ddp"):
        clear_unrecorded(tmp_path, _ray_compat.read_snapshot(tmp_path))
    assert recorded.exists() and unreported.exists() and not unfinished.exists()
    assert (tmp_path / "checkpoint_notes.txt").exists()
    assert f"Removed unfinished checkpoint {unfinished} (" in caplog.text
    assert f"Checkpoint {unreported} was written but never recorded" in caplog.text
    assert str(recorded) not in caplog.text
    snapshot = _ray_compat.read_snapshot(tmp_path)
    assert _ray_compat.checkpoints_newest_first(snapshot) == [recorded.name]  # the snapshot is left as it was


def test_atomic_write_leaves_the_old_file_when_the_write_fails(tmp_path):
    from raytrain_ddp.files import write_atomic

    target = tmp_path / "summary.json"
    write_atomic(target, "old\n")
    with pytest.raises(TypeError):
        write_atomic(target, 42)  # type: ignore[arg-type]  # fails mid-write
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["summary.json"]


def test_a_failing_report_leaves_a_finished_run_finished(tmp_path, caplog):
    from raytrain_ddp.driver.fit import _finish

    config = _config(tmp_path, report=True)
    config.run_dir.mkdir(parents=True)
    (config.run_dir / "report").write_text("a file where the report directory goes")
    with caplog.at_level(logging.ERROR, logger="raytrain_ddp"):
        _finish(config, config.run_dir, RunSummary(status="finished", epochs_completed=2), report=True)
    assert "The report could not be written (FileExistsError" in caplog.text
    assert json.loads((config.run_dir / "summary.json").read_text())["status"] == "finished"


# ------------------------------------------------------------------ 16.12 credentials stay secret
@pytest.mark.parametrize(
    "text, shown",
    [
        ("https://alice:s3cr3t@mlflow.example.com/api", "https://***@mlflow.example.com/api"),
        ("s3://AKIAXYZ:wJalrXUtnFEMI@bucket/runs", "s3://***@bucket/runs"),
        ("logging to http://tok@host:5000 now", "logging to http://***@host:5000 now"),
        ("https://h/x?token=abc&page=2", "https://h/x?token=***&page=2"),
        ("gs://b/d?access_key=A1&secret=B2", "gs://b/d?access_key=***&secret=***"),
        (
            "https://s3/x?X-Amz-Signature=ff00&X-Amz-Credential=k",
            "https://s3/x?X-Amz-Signature=***&X-Amz-Credential=***",
        ),
        ("file:///tmp/mlruns", "file:///tmp/mlruns"),
        ("user@example.com wrote 10.0.0.1:6379?x=1", "user@example.com wrote 10.0.0.1:6379?x=1"),
    ],
)
def test_redact_masks_credentials_in_uris_only(text, shown):
    from raytrain_ddp.redact import redact

    assert redact(text) == shown


SECRET_URI = "https://alice:s3cr3t@mlflow.example.com/?token=t0k3n"


def test_config_toml_report_and_logs_hold_no_credentials(tmp_path, caplog):
    from raytrain_ddp.driver import run_directory
    from raytrain_ddp.driver.fit import log
    from raytrain_ddp.report import write_report

    config = _config(tmp_path, mlflow_uri=SECRET_URI, data="s3://AKIAXYZ:wJalrXUtnFEMI@bucket/ds")
    run_dir = run_directory.prepare(config)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "val_accuracy": 0.5}) + "\n")
    with caplog.at_level(logging.INFO, logger="raytrain_ddp"):
        log.info("MLflow at %s", SECRET_URI)
    page = write_report(run_dir).read_text()
    for text in ((run_dir / "config.toml").read_text(), page, caplog.text):
        assert "s3cr3t" not in text and "t0k3n" not in text and "wJalrXUtnFEMI" not in text
    assert 'mlflow_uri = "https://***@mlflow.example.com/?token=***"' in (run_dir / "config.toml").read_text()


def test_a_checkpoint_holds_no_credentials(tmp_path):
    """The config inside checkpoint.pt (and a sharded checkpoint's training_state.pt) is masked as config.toml is."""
    from raytrain_ddp.checkpoint.layout import CHECKPOINT_FILE, load_file
    from raytrain_ddp.checkpoint.saver import save
    from raytrain_ddp.checkpoint.state import Position

    config = _config(tmp_path, mlflow_uri=SECRET_URI, data="s3://AKIAXYZ:wJalrXUtnFEMI@bucket/ds")
    run_info = {"config": config.to_dict(), "data_spec": {"kind": "images"}}
    save(str(tmp_path), {}, {}, {"scheduler": {}, "scaler": {}, "world_size": 1}, Position(1, 0, 4), {}, run_info)
    written = (tmp_path / CHECKPOINT_FILE).read_bytes()
    assert b"s3cr3t" not in written and b"t0k3n" not in written and b"wJalrXUtnFEMI" not in written
    state = load_file(tmp_path)
    assert state["config"]["data"] == "s3://***@bucket/ds" and state["config"]["epochs"] == 2
    assert run_info["config"]["data"] == config.data  # the run's own config is left as it is


def test_mlflow_params_hold_no_credentials(tmp_path):
    from mlflow.tracking import MlflowClient

    from raytrain_ddp.driver.mlflow_log import EXPERIMENT, MlflowLog

    uri = f"file://{tmp_path}/mlruns"
    MlflowLog(uri, _config(tmp_path, data="s3://AKIAXYZ:wJalrXUtnFEMI@bucket/ds")).close(RunSummary(status="finished"))
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT).experiment_id])
    assert run.data.params["data"] == "s3://***@bucket/ds" and run.info.status == "FINISHED"


class _Refusing(BaseHTTPRequestHandler):
    def _refuse(self):
        self.send_response(403)
        self.end_headers()

    do_GET = do_POST = _refuse

    def log_message(self, *args):
        pass


def test_a_failing_tracking_server_is_logged_and_the_run_goes_on(tmp_path, caplog):
    from raytrain_ddp.driver.mlflow_log import MlflowLog

    server = HTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        uri = f"http://user:s3cr3t@127.0.0.1:{server.server_port}"
        with caplog.at_level(logging.ERROR, logger="raytrain_ddp"):
            sink = MlflowLog(uri, _config(tmp_path))
            sink.write_epoch({"epoch": 1, "train_loss": 1.0})
            sink.close()
    finally:
        server.shutdown()
    assert f"MLflow at http://***@127.0.0.1:{server.server_port} failed (" in caplog.text
    assert "the run goes on without MLflow" in caplog.text and "s3cr3t" not in caplog.text


# ------------------------------------------------------------------ Weights & Biases (issue 18.2), offline
def test_a_resumed_run_continues_its_wandb_run_under_the_same_id(tmp_path, monkeypatch):
    """Two starts of one run directory (a run and its resume), without Ray: one W&B id, the config masked."""
    from support import WANDB_OFFLINE, wandb_offline_runs

    from raytrain_ddp.driver.wandb_log import ID_FILE, WandbLog

    for key, value in WANDB_OFFLINE.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    config = _config(tmp_path, wandb_project="p", data="s3://AKIAXYZ:wJalrXUtnFEMI@bucket/ds")
    config.run_dir.mkdir(parents=True)
    for status in ("stopped", "finished"):
        sink = WandbLog(config, config.run_dir)
        sink.close(RunSummary(status=status))
    first, resumed = wandb_offline_runs(config.run_dir)
    kept = (config.run_dir / ID_FILE).read_text().strip()
    assert [run["run"][0]["run_id"] for run in (first, resumed)] == [kept, kept] == [sink.run_id, sink.run_id]
    assert [run["exit"][0].get("exit_code", 0) for run in (first, resumed)] == [1, 0]
    assert resumed["run"][0]["config"]["update"]["data"] == "s3://***@bucket/ds"


def test_a_failing_wandb_is_logged_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    from support import WANDB_OFFLINE

    from raytrain_ddp.driver.wandb_log import ID_FILE, WandbLog

    for key, value in WANDB_OFFLINE.items():
        monkeypatch.setenv(key, value)
    config = _config(tmp_path, wandb_project="p", wandb_entity="team")
    config.run_dir.mkdir(parents=True)
    (config.run_dir / ID_FILE).write_text("not/an:id\n")  # a damaged id file: wandb.init itself refuses it
    with caplog.at_level(logging.ERROR, logger="raytrain_ddp"):
        sink = WandbLog(config, config.run_dir)
        sink.write_epoch({"epoch": 1, "train_loss": 1.0})
        sink.close(RunSummary(status="finished"))
    (line,) = [r.getMessage() for r in caplog.records if "W&B" in r.getMessage()]
    assert line.startswith("W&B at team/p failed (") and line.endswith("the run goes on without W&B")
