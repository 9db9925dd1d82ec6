"""`--storage-path s3://...` end to end, against a real S3-compatible server on 127.0.0.1 (moto's server mode).

Every run file, the checkpoints, the resume, retention and the corrupt-checkpoint fallback go through
pyarrow.fs to that server, and nothing lands in a local folder named after the scheme. Two Ray runs (DDP's
full checkpoints from the CLI, its driver killed, FSDP's sharded ones from the FSDP example), each with its resume;
the bad inputs fail before Ray starts.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pytest
from support import REPO, run_python_file

from raytrain_ddp.errors import ConfigError

BUCKET = "raytrain"


def _storage(endpoint: str, prefix: str) -> str:
    return f"s3://{BUCKET}/{prefix}?endpoint_override={endpoint}&scheme=http"


def _fs(endpoint: str) -> pafs.S3FileSystem:
    return pafs.S3FileSystem(endpoint_override=endpoint, scheme="http")


def _read(fs: pafs.FileSystem, path: str) -> str:
    with fs.open_input_stream(path) as stream:
        return stream.read().decode()


def _scheme_folders(*roots: Path) -> list[Path]:
    """Local folders named after the scheme (`s3:`), the old bug: `Path("s3://b/p")` is `s3:/b/p`."""
    return [found for root in roots for found in root.rglob("s3:*")]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}  # run from another directory: nothing lands in the repo


def _cli(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=_env()
    )


def _latest_checkpoint_of_epoch(fs: pafs.FileSystem, run: str, epoch: int, driver: subprocess.Popen) -> str:
    """The checkpoint folder Ray Train would resume from, once its snapshot in the bucket records one of `epoch`.
    Ray Train rewrites the snapshot in place: a read that finds it missing or cut short is a moment too early."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and driver.poll() is None:
        try:
            latest = json.loads(_read(fs, f"{run}/checkpoint_manager_snapshot.json"))["latest_checkpoint_result"]
        except (OSError, ValueError):
            latest = None
        if latest and latest["metrics"].get("epoch") == epoch:
            return latest["checkpoint_dir_name"]
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint of epoch {epoch} in s3://{run} (the driver's exit code: {driver.poll()})")


@pytest.mark.ray
def test_a_run_on_s3_whose_driver_died_resumes_past_a_corrupt_checkpoint_and_seeds_a_new_run(
    ray_address, s3_server, tmp_path
):
    """Everything on the bucket. The driver dies mid-run (a crash, an OOM kill, a lost login node) and its newest
    checkpoint is then cut short on the server: the same command takes the dead driver's lock over, sets the
    corrupt checkpoint aside (naming it) and resumes from the one before. Report and evaluate read the run from
    the bucket, and its best checkpoint seeds a new run on local disk (--resume-from)."""
    storage, fs = _storage(s3_server, "runs"), _fs(s3_server)
    run = f"{BUCKET}/runs/on-s3"
    train = ["raytrain_ddp.run", "--address", ray_address, "--storage-path", storage, "--name", "on-s3"]
    train += ["--epochs", "3", "--train-size", "2048", "--val-size", "256", "--log-every-steps", "4"]
    train += ["--profile-steps", "2:3", "--record-sample-ids"]
    with open(tmp_path / "first.err", "w") as first_err:
        first = subprocess.Popen(
            [sys.executable, "-m", *train], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=first_err, env=_env()
        )
        try:
            latest = _latest_checkpoint_of_epoch(fs, run, 2, first)
        finally:
            first.kill()  # the driver dies after epoch 2's checkpoint...
            first.wait()
    assert "driver.lock is on object storage" in (tmp_path / "first.err").read_text()  # the lock's limit, said once
    corrupt = f"{run}/{latest}/checkpoint.pt"
    with fs.open_input_stream(corrupt) as stream:
        head = stream.read(1000)
    with fs.open_output_stream(corrupt) as stream:  # ...which is then cut short on the server
        stream.write(head)

    second = _cli(tmp_path, *train)  # the same command
    assert second.returncode == 0, second.stderr[-3000:]
    named = [line for line in second.stderr.splitlines() if "is corrupt" in line]
    assert len(named) == 1 and f"s3://{corrupt}" in named[0], second.stderr[-3000:]
    assert fs.get_file_info(f"{run}/corrupt/{latest}/checkpoint.pt").type == pafs.FileType.File  # kept, never loaded
    # epoch 3 may have been recorded too: the kill lands while the run goes on
    assert re.search(r"Resuming run on-s3: epochs 1(, 2)?(, 3)? already recorded", second.stderr), second.stderr
    assert "Resuming from checkpoint " in second.stderr and ", at the start of epoch 2" in second.stderr, second.stderr[
        -3000:
    ]
    assert [json.loads(line)["epoch"] for line in _read(fs, f"{run}/metrics.jsonl").splitlines()] == [1, 2, 3]

    # what the workers wrote went to the bucket too: the profile's files, the ids each rank trained on
    for rank in (0, 1):
        assert json.loads(_read(fs, f"{run}/profile/rank-{rank}.top_ops.json"))["steps"] == [2, 3]
        assert '"traceEvents"' in _read(fs, f"{run}/profile/rank-{rank}.trace.json")
    with fs.open_input_stream(f"{run}/sample_ids/epoch-1-rank-0.npy") as stream:
        ids = np.load(io.BytesIO(stream.read()))
    assert len(ids) == 1024  # rank 0's half of the 2048 training rows
    names = {info.base_name: info for info in fs.get_file_info(pafs.FileSelector(run))}
    for name in ("config.toml", "metrics.jsonl", "steps.jsonl", "summary.json", "driver.log"):
        assert names.get(name) and names[name].type == pafs.FileType.File, (name, sorted(names))
    assert "driver.lock" not in names  # the dead driver's, taken over, and the second's, released
    assert json.loads(_read(fs, f"{run}/steps.jsonl").splitlines()[0])["step"] == 4
    assert "Run directory: s3://raytrain/runs/on-s3" in _read(fs, f"{run}/driver.log")
    summary = json.loads(_read(fs, f"{run}/summary.json"))
    assert summary["status"] == "finished" and summary["epochs_completed"] == 3, summary
    assert summary["latest_checkpoint"].startswith(f"s3://{run}/checkpoint_"), summary["latest_checkpoint"]
    assert "<html" in _read(fs, f"{run}/report/index.html")
    assert fs.get_file_info(pafs.FileSelector(f"{run}/tensorboard"))  # event files, uploaded at the end
    # retention went through the server too: what is left is what Ray Train's snapshot keeps (best 2 + latest)
    snapshot = json.loads(_read(fs, f"{run}/checkpoint_manager_snapshot.json"))
    kept = {result["checkpoint_dir_name"] for result in snapshot["checkpoint_results"]}
    left = {info.base_name for info in fs.get_file_info(pafs.FileSelector(run)) if info.base_name.startswith("checkp")}
    assert left - {"checkpoint_manager_snapshot.json"} == kept and 1 < len(kept) <= 3, (left, kept)
    assert latest not in kept
    assert _scheme_folders(tmp_path, REPO) == []

    # the report and evaluate read the run straight from the bucket, without Ray
    rebuilt = _cli(tmp_path, "raytrain_ddp.report", summary["run_dir"])
    assert rebuilt.returncode == 0 and rebuilt.stdout.strip() == f"s3://{run}/report/index.html", rebuilt.stderr
    scored = _cli(tmp_path, "raytrain_ddp.evaluate", summary["best_checkpoint"], "--device", "cpu", "--json")
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert json.loads(scored.stdout)["val_accuracy"] == pytest.approx(summary["best_metrics"]["val_accuracy"])

    # --resume-from: a new run on local disk starts from the bucket run's best checkpoint, trains the epochs after it
    checkpoint, epoch = summary["best_checkpoint"], summary["best_metrics"]["epoch"]
    local = tmp_path / "local-runs"
    continued = _cli(
        tmp_path,
        *("raytrain_ddp.run", "--address", ray_address, "--storage-path", str(local), "--name", "continued"),
        *("--resume-from", checkpoint, "--epochs", str(epoch + 1), "--train-size", "2048", "--val-size", "256"),
        *("--no-report", "--no-tensorboard"),
    )
    assert continued.returncode == 0, continued.stderr[-3000:]
    said = next(line for line in continued.stderr.splitlines() if "Starting from run on-s3's checkpoint " in line)
    assert f"s3://{run}/" in said and f", at the start of epoch {epoch + 1}" in said, said
    continued_records = [json.loads(line) for line in (local / "continued" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in continued_records] == [epoch + 1]  # the epochs up to the checkpoint came with it
    first_loss = json.loads(_read(fs, f"{run}/metrics.jsonl").splitlines()[0])["val_loss"]
    assert continued_records[0]["val_loss"] < first_loss  # it really carried on from the trained weights


@pytest.mark.ray
def test_fsdp_trains_the_transformer_into_a_bucket_and_its_sharded_checkpoint_reshards_and_consolidates(
    ray_address, s3_server, tmp_path
):
    """FSDP with the run directory in a bucket: the FSDP example (examples/fsdp_transformer_lm.py), run as a user
    runs it, its flags overriding its settings. fp32: this CPU has no bf16 units (emulated bf16 is several times
    slower); bf16 x FSDP runs in the flag matrix (tests/test_flag_matrix.py). FSDP's checkpoints are sharded by
    default, written in the background: every rank's shards are uploaded into one checkpoint directory there,
    none gathered on rank zero; evaluate and consolidate take the checkpoint's URI; the run continues on 1
    worker from 2 workers' shards read back from the bucket."""
    import torch

    from raytrain_ddp import TrainConfig, fit
    from raytrain_ddp.evaluate import evaluate_checkpoint
    from raytrain_ddp.worker.checkpoint import consolidate

    fs, run = _fs(s3_server), f"{BUCKET}/sharded/fsdp-lm"
    settings = dict(  # the example's, with the sizes and the schedule these flags give it
        model="transformer",
        dataset="synthetic-tokens",
        strategy="fsdp",
        optimizer="adamw",
        lr=0.003,
        train_size=1024,
        val_size=128,
        clip_grad_norm=1.0,
        storage_path=_storage(s3_server, "sharded"),
        name="fsdp-lm",
        report=False,
        tensorboard=False,
    )
    flags = ["--storage-path", settings["storage_path"], "--train-size", "1024", "--val-size", "128"]
    flags += ["--lr-schedule", "constant", "--warmup-epochs", "0", "--no-tensorboard"]
    flags += ["--log-every-steps", "4", "--peak-tflops", "2.0"]
    example = run_python_file(
        REPO / "examples" / "fsdp_transformer_lm.py", cwd=tmp_path, env={"RAY_ADDRESS": ray_address}, args=flags
    )
    assert example.returncode == 0, example.stderr[-3000:]
    assert "status: finished" in example.stdout and "FSDP, fp32" in example.stderr, example.stderr[-3000:]
    summary = json.loads(_read(fs, f"{run}/summary.json"))
    epochs = [json.loads(line) for line in _read(fs, f"{run}/metrics.jsonl").splitlines()]
    first, last = epochs
    # Model FLOPs, counted before sharding: each rank's MFU is its achieved TFLOP/s over the peak given
    for epoch in epochs:
        assert all(tflops > 0 for tflops in epoch["model_tflops_per_second_per_rank"])
        assert epoch["mfu_per_rank"] == pytest.approx([t / 2.0 for t in epoch["model_tflops_per_second_per_rank"]])
    assert summary["mfu"] == pytest.approx(sum(e["mfu"] for e in epochs) / 2)
    # Clipping computes the global gradient norm (over both ranks' shards): steps.jsonl records it
    steps = [json.loads(line) for line in _read(fs, f"{run}/steps.jsonl").splitlines()]
    assert steps and all(math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0 for s in steps)
    assert first["train_loss"] < math.log(64)  # below a uniform guess over the vocabulary...
    assert last["val_loss"] < 0.75 * math.log(64)  # ...and clearly below it after two epochs
    assert last["val_identical_across_ranks"]
    assert summary["replicas_identical"]
    # A language model's checkpoints are ranked by validation loss, lowest best (its token accuracy is no goal)
    assert summary["checkpoints_ranked_by"] == "val_loss (min)"
    assert summary["best_metrics"]["val_loss"] == min(first["val_loss"], last["val_loss"])

    # Sharded (the default for FSDP, as config.toml records): each rank wrote its shards, none gathered them;
    # both epochs' checkpoints counted by Ray Train, the last one waited for before the run ended.
    assert 'checkpoint_format = "sharded"' in _read(fs, f"{run}/config.toml")
    best, latest = summary["best_checkpoint"], summary["latest_checkpoint"]
    listed = fs.get_file_info(pafs.FileSelector(run))
    names = sorted(info.base_name for info in listed if info.base_name.startswith("checkpoint_2"))
    assert len(names) == 2 and latest.split("?")[0].rsplit("/", 1)[1] == names[-1], (names, latest)
    for name in names:
        stored = fs.get_file_info(pafs.FileSelector(f"{run}/{name}", recursive=True))
        files = {info.path.removeprefix(f"{run}/{name}/") for info in stored if info.type == pafs.FileType.File}
        assert {"training_state.pt", "shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"} <= files
        assert "checkpoint.pt" not in files  # nothing gathered on rank zero
    # A single-process model gives the same numbers, from the shards in the bucket or their consolidated file.
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        scored = evaluate_checkpoint(best)
    assert not [str(w.message) for w in warned if "torch.distributed" in str(w.message)]  # a quiet console
    assert scored["val_loss"] == pytest.approx(last["val_loss"], rel=1e-3)
    assert scored["val_rows"] == 128
    consolidated = consolidate(latest, tmp_path / "consolidated")
    full = torch.load(consolidated, weights_only=True)
    assert full["epoch"] == 2 and "token_embedding.weight" in full["model"]  # the built-in transformer's, whole
    assert evaluate_checkpoint(str(consolidated))["val_loss"] == evaluate_checkpoint(latest)["val_loss"]

    # Continue the same run on ONE worker, its latest checkpoint's shard truncated on the server: set aside,
    # the one before (epoch 1's, written by 2 ranks) reshards onto 1.
    shard = f"{run}/{names[-1]}/shards/__1_0.distcp"
    with fs.open_input_stream(shard) as stream:
        head = stream.read(1000)
    with fs.open_output_stream(shard) as stream:
        stream.write(head)
    resumed = fit(TrainConfig(num_workers=1, epochs=3, **settings))
    assert resumed.ok, resumed.summary["error"]
    assert fs.get_file_info(f"{run}/corrupt/{names[-1]}/shards/__1_0.distcp").type == pafs.FileType.File
    assert [json.loads(line)["epoch"] for line in _read(fs, f"{run}/metrics.jsonl").splitlines()] == [1, 2, 3]
    assert resumed.epochs[-1]["samples_per_rank"] == [1024]
    assert resumed.epochs[-1]["val_loss"] < last["val_loss"]
    assert _scheme_folders(tmp_path, REPO) == []


def test_the_run_lock_is_an_object_in_the_bucket(s3_server, tmp_path, monkeypatch):
    """A second driver on the same run directory is refused; the lock lives in the bucket, not in a local `s3:`."""
    from raytrain_ddp.driver import run_lock
    from raytrain_ddp.storage import location

    monkeypatch.chdir(tmp_path)
    run_dir = location(_storage(s3_server, "locks")) / "locked"
    with run_lock.hold(run_dir):
        holder = json.loads(_read(_fs(s3_server), f"{BUCKET}/locks/locked/driver.lock"))
        assert holder["token"] and isinstance(holder["beat"], float)
        with pytest.raises(ConfigError, match=r"is in use by process \d+ on host"):
            run_lock.hold(run_dir).__enter__()
    assert _fs(s3_server).get_file_info(f"{BUCKET}/locks/locked/driver.lock").type == pafs.FileType.NotFound
    assert _scheme_folders(tmp_path) == []


def test_steps_jsonl_in_a_bucket_is_uploaded_per_flush_not_per_record(s3_server, monkeypatch):
    """Object storage cannot append: steps.jsonl is rewritten whole, so once per record would upload a long
    run's file thousands of times; it goes up at most every REMOTE_WRITE_EVERY_S and at each flush."""
    from raytrain_ddp.driver.run_files import StepsFile
    from raytrain_ddp.storage import location

    steps = StepsFile(location(_storage(s3_server, "steps")) / "run")
    where = f"{BUCKET}/steps/run/steps.jsonl"
    for step in range(1, 201):
        steps.add({"step": step, "loss": 1.0 / step})
    assert _fs(s3_server).get_file_info(where).type == pafs.FileType.NotFound  # 200 records, no upload yet
    steps.flush()
    assert [json.loads(line)["step"] for line in _read(_fs(s3_server), where).splitlines()] == list(range(1, 201))
    monkeypatch.setattr(StepsFile, "REMOTE_WRITE_EVERY_S", 0.0)  # past the interval: the next record goes up
    steps.add({"step": 150, "loss": 0.5})  # trained again after a restart: it and the later ones replaced
    assert [json.loads(line)["step"] for line in _read(_fs(s3_server), where).splitlines()] == list(range(1, 151))
    again = StepsFile(location(_storage(s3_server, "steps")) / "run")  # a resumed run's driver reads it back
    assert len(again.records) == 150 and again.records[-1]["loss"] == 0.5


def test_the_slurm_launcher_reads_a_summary_on_object_storage(s3_server, tmp_path):
    """After the trainer exits, the launcher reads summary.json (lost or stuck nodes: requeue without them) where
    the run wrote it, also in a bucket, options such as endpoint_override included."""
    from raytrain_ddp.cluster import plan
    from raytrain_ddp.cluster.slurm import Launcher

    summary = {"status": "failed", "error": "lost node n2 (...)", "lost_nodes": [{"hostname": "n2"}]}
    with _fs(s3_server).open_output_stream(f"{BUCKET}/launcher/run-1/summary.json") as out:
        out.write(json.dumps(summary).encode())
    launcher = Launcher([])
    env = {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "3"}
    kwargs = dict(head_ip="10.0.0.1", ports=plan.port_blocks(7, 1)[0], python="py", home="/h", fallback_cpus=1)
    launcher.plan = plan.job_plan(env, ["n1", "n2"], **kwargs)
    storage_path = _storage(s3_server, "launcher")
    assert launcher.summary(launcher.run_dir({"storage_path": storage_path, "name": "run-1"})).to_json() == summary
    assert launcher.summary(launcher.run_dir({"storage_path": storage_path, "name": "run-2"})).to_json() == {}  # none
    (tmp_path / "run-1").mkdir()
    (tmp_path / "run-1" / "summary.json").write_text(json.dumps(summary))
    assert launcher.summary(launcher.run_dir({"storage_path": str(tmp_path), "name": "run-1"})).to_json() == summary


def test_a_run_lock_taken_over_is_not_beaten_over(s3_server, tmp_path, monkeypatch, caplog):
    """A driver whose lock another driver took over (it hung past the stale limit) stops beating: its beat would
    overwrite the other's lock object (or, locally, keep it looking fresh). It says so in one error line."""
    from raytrain_ddp.driver import run_lock
    from raytrain_ddp.storage import location

    monkeypatch.setattr(run_lock, "HEARTBEAT_S", 0.1)  # the cadence only: the lock's files are real
    for where in (tmp_path / "local", location(_storage(s3_server, "takeover"))):
        run_dir = where / "run"
        with caplog.at_level(logging.ERROR, logger="raytrain_ddp"), run_lock.hold(run_dir) as lock:
            theirs = {**lock._holder(), "token": "f" * 16, "pid": 1, "beat": time.time()}
            lock.path.write_bytes(json.dumps(theirs).encode() + b"\n")
            written = lock.path.read_bytes()
            when = lock.path.stat().st_mtime if isinstance(lock.path, Path) else None
            time.sleep(1.0)  # ten beats
            assert lock.path.read_bytes() == written, where
            assert when is None or lock.path.stat().st_mtime == when, where
        assert f"{lock.path} was taken over by process 1 on host" in caplog.text, where
        assert json.loads(lock.path.read_bytes())["token"] == "f" * 16, where  # release leaves the other's lock
        caplog.clear()


@pytest.mark.parametrize(
    "storage, says",
    [
        ("foo://bucket/runs", "--storage-path 'foo://bucket/runs': pyarrow.fs cannot open it"),
        ("s3://no-such-bucket/runs?endpoint_override={endpoint}&scheme=http", "bucket 'no-such-bucket' does not exist"),
        ("s3://raytrain/runs?endpoint_override=http://127.0.0.1:9&scheme=http", "the storage cannot be reached"),
    ],
)
def test_bad_storage_fails_in_one_line_before_ray(s3_server, tmp_path, storage, says):
    given = storage.format(endpoint=s3_server)
    # an address where no Ray listens: connecting to Ray would fail too, but the storage is refused before that
    args = ["--address", "127.0.0.1:9", "--storage-path", given, "--name", "bad", "--epochs", "1"]
    done = _cli(tmp_path, "raytrain_ddp.run", *args, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr[-3000:]
    assert _scheme_folders(tmp_path) == []
