"""`--storage-path s3://...` end to end, against a real S3-compatible server on 127.0.0.1 (moto's server mode).

Every run file, the checkpoints, the resume, retention and the corrupt-checkpoint fallback go through
pyarrow.fs to that server, and nothing lands in a local folder named after the scheme. Two Ray runs, each shared
by the tests that read it (DDP's full checkpoints from the CLI, its driver killed: `s3_run`; FSDP's sharded ones
from the FSDP example: `fsdp_run`), each with its resume; the bad inputs fail before Ray starts.
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
from dataclasses import dataclass
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


@dataclass
class BucketRun:
    """A run whose every file is on the bucket, and what was done to it (see `s3_run`)."""

    fs: pafs.S3FileSystem
    run: str  # bucket/prefix of the run directory
    cwd: Path
    train: list[str]  # the command, without `python -m`
    corrupted: str  # the checkpoint folder cut short on the server
    first_stderr: str
    second: subprocess.CompletedProcess  # the same command again

    def read(self, name: str) -> str:
        return _read(self.fs, f"{self.run}/{name}")

    def summary(self) -> dict:
        return json.loads(self.read("summary.json"))


@pytest.fixture(scope="module")
def s3_run(ray_address, s3_server, tmp_path_factory) -> BucketRun:
    """Everything on the bucket. The driver dies mid-run (a crash, an OOM kill, a lost login node) after epoch 2's
    checkpoint, which is then cut short on the server; then the same command again."""
    tmp_path = tmp_path_factory.mktemp("s3-run")
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
            first.kill()
            first.wait()
    corrupt = f"{run}/{latest}/checkpoint.pt"
    with fs.open_input_stream(corrupt) as stream:
        head = stream.read(1000)
    with fs.open_output_stream(corrupt) as stream:
        stream.write(head)
    second = _cli(tmp_path, *train)
    assert second.returncode == 0, second.stderr[-3000:]
    return BucketRun(fs, run, tmp_path, train, latest, (tmp_path / "first.err").read_text(), second)


@pytest.mark.ray
def test_the_lock_on_object_storage_says_its_limit_once(s3_run):
    assert s3_run.first_stderr.count("driver.lock is on object storage") == 1, s3_run.first_stderr[-3000:]


@pytest.mark.ray
def test_the_same_command_sets_a_corrupt_checkpoint_aside_naming_it_and_resumes_from_the_one_before(s3_run):
    stderr = s3_run.second.stderr
    named = [line for line in stderr.splitlines() if "is corrupt" in line]
    assert len(named) == 1 and f"s3://{s3_run.run}/{s3_run.corrupted}/checkpoint.pt" in named[0], stderr[-3000:]
    kept = s3_run.fs.get_file_info(f"{s3_run.run}/corrupt/{s3_run.corrupted}/checkpoint.pt")
    assert kept.type == pafs.FileType.File  # kept, never loaded
    # epoch 3 may have been recorded too: the kill lands while the run goes on
    assert re.search(r"Resuming run on-s3: epochs 1(, 2)?(, 3)? already recorded", stderr), stderr[-3000:]
    assert "Resuming from checkpoint " in stderr and ", at the start of epoch 2" in stderr, stderr[-3000:]
    assert [json.loads(line)["epoch"] for line in s3_run.read("metrics.jsonl").splitlines()] == [1, 2, 3]


@pytest.mark.ray
def test_what_the_workers_write_goes_to_the_bucket(s3_run):
    """The profile's files and the ids each rank trained on."""
    for rank in (0, 1):
        assert json.loads(s3_run.read(f"profile/rank-{rank}.top_ops.json"))["steps"] == [2, 3]
        assert '"traceEvents"' in s3_run.read(f"profile/rank-{rank}.trace.json")
    with s3_run.fs.open_input_stream(f"{s3_run.run}/sample_ids/epoch-1-rank-0.npy") as stream:
        ids = np.load(io.BytesIO(stream.read()))
    assert len(ids) == 1024  # rank 0's half of the 2048 training rows


@pytest.mark.ray
def test_every_run_file_is_in_the_bucket_none_in_a_local_scheme_folder_and_no_lock_is_left(s3_run):
    names = {info.base_name: info for info in s3_run.fs.get_file_info(pafs.FileSelector(s3_run.run))}
    for name in ("config.toml", "metrics.jsonl", "steps.jsonl", "summary.json", "driver.log"):
        assert names.get(name) and names[name].type == pafs.FileType.File, (name, sorted(names))
    assert "driver.lock" not in names  # the dead driver's, taken over, and the second's, released
    assert json.loads(s3_run.read("steps.jsonl").splitlines()[0])["step"] == 4
    assert "Run directory: s3://raytrain/runs/on-s3" in s3_run.read("driver.log")
    summary = s3_run.summary()
    assert summary["status"] == "finished" and summary["epochs_completed"] == 3, summary
    assert summary["latest_checkpoint"].startswith(f"s3://{s3_run.run}/checkpoint_"), summary["latest_checkpoint"]
    assert "<html" in s3_run.read("report/index.html")
    assert s3_run.fs.get_file_info(pafs.FileSelector(f"{s3_run.run}/tensorboard"))  # uploaded at the end
    assert _scheme_folders(s3_run.cwd, REPO) == []


@pytest.mark.ray
def test_retention_goes_through_the_server(s3_run):
    """What is left is what Ray Train's snapshot keeps (best 2 + latest); the corrupt one is not among them."""
    snapshot = json.loads(s3_run.read("checkpoint_manager_snapshot.json"))
    kept = {result["checkpoint_dir_name"] for result in snapshot["checkpoint_results"]}
    listed = s3_run.fs.get_file_info(pafs.FileSelector(s3_run.run))
    left = {info.base_name for info in listed if info.base_name.startswith("checkp")}
    assert left - {"checkpoint_manager_snapshot.json"} == kept and 1 < len(kept) <= 3, (left, kept)
    assert s3_run.corrupted not in kept


@pytest.mark.ray
def test_report_and_evaluate_read_the_run_straight_from_the_bucket_without_ray(s3_run):
    summary = s3_run.summary()
    rebuilt = _cli(s3_run.cwd, "raytrain_ddp.report", summary["run_dir"])
    assert rebuilt.returncode == 0 and rebuilt.stdout.strip() == f"s3://{s3_run.run}/report/index.html", rebuilt.stderr
    scored = _cli(s3_run.cwd, "raytrain_ddp.evaluate", summary["best_checkpoint"], "--device", "cpu", "--json")
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert json.loads(scored.stdout)["val_accuracy"] == pytest.approx(summary["best_metrics"]["val_accuracy"])


@pytest.mark.ray
def test_a_bucket_runs_best_checkpoint_seeds_a_new_run_on_local_disk(s3_run, ray_address, tmp_path):
    """--resume-from: the new run starts from it and trains the epochs after it, from the trained weights."""
    summary = s3_run.summary()
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
    assert f"s3://{s3_run.run}/" in said and f", at the start of epoch {epoch + 1}" in said, said
    continued_records = [json.loads(line) for line in (local / "continued" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in continued_records] == [epoch + 1]  # the epochs up to the checkpoint came with it
    first_loss = json.loads(s3_run.read("metrics.jsonl").splitlines()[0])["val_loss"]
    assert continued_records[0]["val_loss"] < first_loss  # it really carried on from the trained weights


FSDP_SETTINGS = dict(  # the FSDP example's, with the sizes and the schedule FSDP_FLAGS give it
    model="transformer",
    dataset="synthetic-tokens",
    strategy="fsdp",
    optimizer="adamw",
    lr=0.003,
    train_size=1024,
    val_size=128,
    clip_grad_norm=1.0,
    name="fsdp-lm",
    report=False,
    tensorboard=False,
)
FSDP_FLAGS = ["--train-size", "1024", "--val-size", "128", "--lr-schedule", "constant", "--warmup-epochs", "0"]
FSDP_FLAGS += ["--no-tensorboard", "--log-every-steps", "4", "--peak-tflops", "2.0"]


@dataclass
class FsdpRun:
    fs: pafs.S3FileSystem
    run: str
    storage: str
    cwd: Path
    stdout: str
    stderr: str

    def read(self, name: str) -> str:
        return _read(self.fs, f"{self.run}/{name}")

    def records(self, name: str) -> list[dict]:
        return [json.loads(line) for line in self.read(name).splitlines()]

    def checkpoints(self) -> list[str]:
        listed = self.fs.get_file_info(pafs.FileSelector(self.run))
        return sorted(info.base_name for info in listed if info.base_name.startswith("checkpoint_2"))


@pytest.fixture(scope="module")
def fsdp_run(ray_address, s3_server, tmp_path_factory) -> FsdpRun:
    """FSDP with the run directory in a bucket: the FSDP example (examples/fsdp_transformer_lm.py), run as a user
    runs it, its flags overriding its settings. fp32: this CPU has no bf16 units (emulated bf16 is several times
    slower); bf16 x FSDP runs in the flag matrix (tests/test_flag_matrix.py)."""
    storage, cwd = _storage(s3_server, "sharded"), tmp_path_factory.mktemp("fsdp")
    example = run_python_file(
        REPO / "examples" / "fsdp_transformer_lm.py",
        cwd=cwd,
        env={"RAY_ADDRESS": ray_address},
        args=["--storage-path", storage, *FSDP_FLAGS],
    )
    assert example.returncode == 0, example.stderr[-3000:]
    return FsdpRun(_fs(s3_server), f"{BUCKET}/sharded/fsdp-lm", storage, cwd, example.stdout, example.stderr)


@pytest.mark.ray
def test_the_fsdp_example_trains_the_transformer_below_a_uniform_guess_with_identical_replicas(fsdp_run):
    assert "status: finished" in fsdp_run.stdout and "FSDP, fp32" in fsdp_run.stderr, fsdp_run.stderr[-3000:]
    first, last = fsdp_run.records("metrics.jsonl")
    assert first["train_loss"] < math.log(64)  # below a uniform guess over the vocabulary...
    assert last["val_loss"] < 0.75 * math.log(64)  # ...and clearly below it after two epochs
    assert last["val_identical_across_ranks"]
    assert json.loads(fsdp_run.read("summary.json"))["replicas_identical"]


@pytest.mark.ray
def test_fsdp_mfu_counts_the_model_flops_before_sharding_and_clipping_records_the_global_norm(fsdp_run):
    """Each rank's MFU is its achieved TFLOP/s over the peak given; the global gradient norm is over both ranks'
    shards."""
    epochs = fsdp_run.records("metrics.jsonl")
    for epoch in epochs:
        assert all(tflops > 0 for tflops in epoch["model_tflops_per_second_per_rank"])
        assert epoch["mfu_per_rank"] == pytest.approx([t / 2.0 for t in epoch["model_tflops_per_second_per_rank"]])
    assert json.loads(fsdp_run.read("summary.json"))["mfu"] == pytest.approx(sum(e["mfu"] for e in epochs) / 2)
    steps = fsdp_run.records("steps.jsonl")
    assert steps and all(math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0 for s in steps)


@pytest.mark.ray
def test_a_language_models_checkpoints_are_ranked_by_validation_loss_lowest_best(fsdp_run):
    """Its token accuracy is no goal."""
    summary, (first, last) = json.loads(fsdp_run.read("summary.json")), fsdp_run.records("metrics.jsonl")
    assert summary["checkpoints_ranked_by"] == "val_loss (min)"
    assert summary["best_metrics"]["val_loss"] == min(first["val_loss"], last["val_loss"])


@pytest.mark.ray
def test_fsdp_checkpoints_are_each_ranks_shards_in_one_bucket_folder_none_gathered(fsdp_run):
    """Sharded (FSDP's default, as config.toml records); both epochs' checkpoints counted by Ray Train, the last
    one waited for before the run ended."""
    assert 'checkpoint_format = "sharded"' in fsdp_run.read("config.toml")
    latest, names = json.loads(fsdp_run.read("summary.json"))["latest_checkpoint"], fsdp_run.checkpoints()
    assert len(names) == 2 and latest.split("?")[0].rsplit("/", 1)[1] == names[-1], (names, latest)
    for name in names:
        stored = fsdp_run.fs.get_file_info(pafs.FileSelector(f"{fsdp_run.run}/{name}", recursive=True))
        files = {
            info.path.removeprefix(f"{fsdp_run.run}/{name}/") for info in stored if info.type == pafs.FileType.File
        }
        assert {"training_state.pt", "shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp"} <= files
        assert "checkpoint.pt" not in files


@pytest.mark.ray
def test_one_process_scores_the_shards_in_the_bucket_and_their_consolidated_file_alike(fsdp_run, tmp_path):
    import torch

    from raytrain_ddp.checkpoint.consolidate import consolidate
    from raytrain_ddp.evaluate import evaluate_checkpoint

    summary, last = json.loads(fsdp_run.read("summary.json")), fsdp_run.records("metrics.jsonl")[-1]
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        scored = evaluate_checkpoint(summary["best_checkpoint"])
    assert not [str(w.message) for w in warned if "torch.distributed" in str(w.message)]  # a quiet console
    assert scored["val_loss"] == pytest.approx(last["val_loss"], rel=1e-3)
    assert scored["val_rows"] == 128
    consolidated = consolidate(summary["latest_checkpoint"], tmp_path / "consolidated")
    full = torch.load(consolidated, weights_only=True)
    assert full["epoch"] == 2 and "token_embedding.weight" in full["model"]  # the built-in transformer's, whole
    assert (
        evaluate_checkpoint(str(consolidated))["val_loss"]
        == evaluate_checkpoint(summary["latest_checkpoint"])["val_loss"]
    )


@pytest.mark.ray
def test_the_fsdp_run_goes_on_with_one_worker_resharding_past_a_truncated_shard(fsdp_run):
    """Its latest checkpoint's shard truncated on the server: set aside, and the one before (epoch 1's, written by
    2 ranks) reshards onto 1. (Last in this file: it changes the run the tests above read.)"""
    from raytrain_ddp import TrainConfig, fit

    last, names = fsdp_run.records("metrics.jsonl")[-1], fsdp_run.checkpoints()
    shard = f"{fsdp_run.run}/{names[-1]}/shards/__1_0.distcp"
    with fsdp_run.fs.open_input_stream(shard) as stream:
        head = stream.read(1000)
    with fsdp_run.fs.open_output_stream(shard) as stream:
        stream.write(head)
    resumed = fit(TrainConfig(num_workers=1, epochs=3, storage_path=fsdp_run.storage, **FSDP_SETTINGS))
    assert resumed.ok, resumed.summary["error"]
    kept = fsdp_run.fs.get_file_info(f"{fsdp_run.run}/corrupt/{names[-1]}/shards/__1_0.distcp")
    assert kept.type == pafs.FileType.File
    assert [record["epoch"] for record in fsdp_run.records("metrics.jsonl")] == [1, 2, 3]
    assert resumed.epochs[-1]["samples_per_rank"] == [1024]
    assert resumed.epochs[-1]["val_loss"] < last["val_loss"]
    assert _scheme_folders(fsdp_run.cwd, REPO) == []


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
