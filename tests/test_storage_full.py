"""A full disk ends a run once, in one line, with exit code 74; what was written stays whole, and the same command
resumes once there is room. On real tmpfs mounts of the tests' own (root), filled at a known point."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from support import one_failure_line, rank_epoch_message, run_cli
from worker_hooks import command_hooks

from raytrain_ddp import TrainConfig, _ray_compat
from raytrain_ddp.driver import fit as fit_module
from raytrain_ddp.driver.monitor import RunRecorder
from raytrain_ddp.errors import EXIT_STORAGE_FULL
from raytrain_ddp.summary import RunSummary

BYTES_LEFT = 64 * 1024  # room for the driver's records, not for a checkpoint (~250 KiB: the CNN and its momentum)


@contextlib.contextmanager
def small_disk(where: Path, size: str):
    """A tmpfs of `size` mounted at `where` for the block. Skipped without root, except in CI."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("the storage-full tests mount a tmpfs: CI runs them as root")
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=True)


def fill(disk: Path, bytes_left: int = 0) -> Path:
    """Fill `disk` with a ballast file until `bytes_left` bytes are free."""
    ballast = disk / "ballast"
    usage = os.statvfs(disk)
    with open(ballast, "ab") as file:
        os.posix_fallocate(file.fileno(), 0, ballast.stat().st_size + usage.f_bavail * usage.f_frsize - bytes_left)
    return ballast


# ------------------------------------------------------------------ a run whose checkpoint fills the disk
def _command(ray_address: str, storage: Path) -> list[str]:
    """8 optimizer steps per epoch, a checkpoint every 4: epoch 1's mid-epoch and final ones, then epoch 2's at
    step 4, which meets the full disk (the driver writes nothing then, so the line is always the checkpoint's)."""
    return [
        *("--address", ray_address, "--storage-path", str(storage), "--name", "full"),
        *("--epochs", "2", "--train-size", "1024", "--val-size", "256", "--checkpoint-every-steps", "4"),
        *("--no-report", "--no-tensorboard"),
    ]


@pytest.fixture(scope="module")
def filled_run(ray_address, tmp_path_factory):
    """The command on a 16 MiB tmpfs that rank zero fills (but 64 KiB) as epoch 2 starts; then the ballast removed
    and the same command again: (first's output, its run directory's files then, the second's output)."""
    with small_disk(tmp_path_factory.mktemp("storage") / "small", "16m") as disk:
        hooks = command_hooks("FillDisk", ballast=str(disk / "ballast"), bytes_left=BYTES_LEFT, epoch=2)
        first = run_cli("raytrain_ddp.run", *_command(ray_address, disk), env=hooks)
        print(first.stderr)  # what the user saw, on failure
        run_dir = disk / "full"
        left = {str(path.relative_to(run_dir)): path for path in run_dir.rglob("*")}
        files = {
            "names": sorted(left),
            "summary": json.loads((run_dir / "summary.json").read_text()),
            "epochs": [json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()],
            "recorded": _ray_compat.checkpoints_newest_first(_ray_compat.read_snapshot(run_dir) or {}),
        }
        files["latest"] = torch.load(run_dir / files["recorded"][0] / "checkpoint.pt", weights_only=True)
        (disk / "ballast").unlink()
        again = run_cli("raytrain_ddp.run", *_command(ray_address, disk))
        files["epochs_after"] = [
            json.loads(line)["epoch"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        files["summary_after"] = json.loads((run_dir / "summary.json").read_text())
    return first, files, again


@pytest.mark.ray
def test_the_run_ends_at_once_in_one_line_with_exit_code_74(filled_run):
    first, files, _ = filled_run
    output, said = first.stderr, one_failure_line(first, EXIT_STORAGE_FULL)
    assert re.fullmatch(
        r"Training failed: storage full: no space left on device writing the checkpoint of epoch 2 at step 4 to "
        r"\S+/small/full \([^()]+ free of 16 MiB\); free space and run the same command again to resume",
        said,
    ), said
    assert "Traceback" not in output and "Error while reading worker news" not in output, output[-3000:]
    assert "restarted the workers" not in output and files["summary"]["restarts"] == 0, files["summary"]
    # the driver's records refused meanwhile (the workers run ahead of it): one warning at most
    assert len([line for line in output.splitlines() if " not written: no space left on device" in line]) <= 1


@pytest.mark.ray
def test_the_summary_says_what_was_written_where(filled_run):
    _, files, _ = filled_run
    summary = files["summary"]
    assert summary["status"] == "failed" and summary["error"].startswith("storage full: "), summary
    assert summary["storage_full"]["writing"] == "the checkpoint of epoch 2 at step 4", summary
    assert summary["storage_full"]["total_bytes"] == 16 * 2**20, summary
    assert summary["epochs_completed"] == 1 and files["epochs"] == [1], files


@pytest.mark.ray
def test_the_cut_checkpoint_is_gone_and_the_latest_whole_one_is_epoch_1s(filled_run):
    first, files, _ = filled_run
    assert re.search(r"Removed unfinished checkpoint \S+ \(.*\): the storage refused the rest of it", first.stderr)
    on_disk = {name for name in files["names"] if re.fullmatch(r"checkpoint_\d{4}-[^/]+", name)}
    assert on_disk == set(files["recorded"]), files["names"]  # the one cut short was removed
    assert not [name for name in files["names"] if name.endswith(".tmp")], files["names"]
    assert (files["latest"]["epoch"], files["latest"]["step_in_epoch"]) == (1, 0)


@pytest.mark.ray
def test_the_same_command_resumes_and_finishes_once_there_is_room(filled_run):
    _, files, again = filled_run
    assert again.returncode == 0, again.stderr[-3000:]
    assert "Resuming from checkpoint " in again.stderr, again.stderr[-3000:]
    assert files["epochs_after"] == [1, 2] and files["summary_after"]["status"] == "finished", files


# ------------------------------------------------------------------ a launched script's own checkpoint
@pytest.mark.ray
def test_a_launched_script_that_fills_its_checkpoint_disk_ends_the_run_as_a_full_disk_does(ray_address, tmp_path):
    """A script's torch.save into session.checkpoint_dir() on a full disk (a 1 MiB tmpfs mounted there): not a rank
    failure to restart (--max-restarts 2) but the storage line naming the folder and its free space, exit 74."""
    script = Path(__file__).parent / "scripts" / "fills_its_checkpoint_disk.py"
    with small_disk(tmp_path / "full" / "checkpoint", "1m") as disk:
        result = run_cli(
            "raytrain_ddp.launch",
            *("--address", ray_address, "--storage-path", str(tmp_path), "--name", "full", "--num-workers", "2"),
            *("--max-restarts", "2", str(script)),
        )
        summary = json.loads((tmp_path / "full" / "summary.json").read_text())
    output = result.stderr
    assert result.returncode == EXIT_STORAGE_FULL, output[-3000:]
    said = [line for line in output.splitlines() if line.startswith("Training failed: ")]
    assert said == [output.strip().splitlines()[-1]], output[-3000:]
    assert re.fullmatch(
        rf"Training failed: storage full: no space left on device writing rank 0's files to {disk}\S* "
        r"\([^()]+ free of 1 MiB\); free space and run the same command again to resume",
        said[0],
    ), said
    assert summary["restarts"] == 0 and summary["storage_full"]["total_bytes"] == 2**20, summary
    assert "restarted the workers" not in output, output[-3000:]


# ------------------------------------------------------------------ the driver's own files
def test_the_driver_keeps_the_records_a_full_disk_refused_and_writes_them_when_there_is_room(tmp_path, caplog, capsys):
    """metrics.jsonl and TensorBoard's events on a full disk: one warning, however many records it refuses, no
    traceback (TensorBoard's writer thread dies of it); the records are kept in memory and written at the next
    flush that finds room."""
    from raytrain_ddp.driver.tensorboard_log import TensorBoardLog

    with small_disk(tmp_path / "small", "1m") as disk:
        config = TrainConfig(num_workers=2, log_every_steps=1, storage_path=str(disk), name="driver")
        config.run_dir.mkdir()
        tensorboard = TensorBoardLog(config.run_dir)
        recorder = RunRecorder(config.run_dir, config, train_rows=512, world_size=2, sinks=[tensorboard])
        ballast = fill(disk)
        with caplog.at_level(logging.WARNING, logger="raytrain_ddp"):
            for epoch in range(1, 41):  # TensorBoard's events fill the page its file has
                recorder.consume([("epoch", rank, rank_epoch_message(rank, epoch=epoch)) for rank in (0, 1)])
        assert re.fullmatch(
            rf"storage full: no space left on device writing metrics.jsonl to {config.run_dir} \(\d+ B free of 1 MiB\)"
            r"; free space and run the same command again to resume",
            str(recorder.unwritten),
        ), recorder.unwritten
        assert [record.getMessage() for record in caplog.records] == [
            "metrics.jsonl not written: no space left on device; kept in memory until there is room"
        ]
        assert not (config.run_dir / "metrics.jsonl").exists()
        assert [path.name for path in config.run_dir.iterdir()] == ["tensorboard"], "a temporary file was left behind"
        tensorboard.close()
        assert "Traceback" not in capsys.readouterr().err
        ballast.unlink()
        recorder.flush_files()
        written = (config.run_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["epoch"] for line in written] == list(range(1, 41)) and recorder.unwritten is None


def test_a_summary_the_disk_refuses_goes_to_stderr_as_one_json_line(tmp_path, capsys):
    with small_disk(tmp_path / "small", "1m") as disk:
        ballast = fill(disk)
        summary = {"status": "failed", "error": "storage full: ...", "epochs_completed": 1}
        fit_module._write_summary(disk, RunSummary.from_json(summary))
        assert not (disk / "summary.json").exists()
        assert json.loads(capsys.readouterr().err.splitlines()[-1]) == summary
        ballast.unlink()
        fit_module._write_summary(disk, RunSummary.from_json(summary))
        assert json.loads((disk / "summary.json").read_text()) == summary


def test_a_sharded_checkpoint_on_a_full_disk_raises_storage_full_naming_it(tmp_path):
    """DCP's background write of the shards meets the full disk (rank zero's small training_state.pt fitted): the
    rank's flush raises StorageFull naming the checkpoint, and nothing is reported to Ray Train."""
    from support import one_process_group

    from raytrain_ddp.checkpoint.saver import ShardedSaver
    from raytrain_ddp.errors import StorageFull

    model = torch.nn.Linear(512, 512)  # 1 MiB of weights
    reported: list = []
    with small_disk(tmp_path / "small", "1m") as disk, one_process_group():
        saver = ShardedSaver(disk, 0, report=lambda metrics, where: reported.append(where))
        fill(disk, BYTES_LEFT)
        plain = {"epoch": 1, "step_in_epoch": 3, "global_step": 11}
        saver.save(model.state_dict(), {}, plain, {"epoch": 1})
        with pytest.raises(StorageFull) as raised:
            saver.flush()
    assert str(raised.value).startswith(
        f"storage full: no space left on device writing the checkpoint of epoch 2 at step 3 to {disk} ("
    )
    assert not reported and not saver.in_flight


def test_a_sharded_write_that_adds_nothing_for_the_retry_budget_ends_in_one_line_not_a_wait_for_ever(
    tmp_path, monkeypatch
):
    """DCP's background write blocked for good (its shard file a FIFO no one reads: the writer's open never
    returns, as on a hung mount): after RAYTRAIN_STORAGE_RETRY_S with nothing written the rank's flush raises
    StorageFull naming the checkpoint (the run ends, exit 74), and nothing is reported to Ray Train."""
    import threading

    import torch.distributed.checkpoint as dcp
    from support import one_process_group

    from raytrain_ddp.checkpoint.layout import SHARDS_DIR
    from raytrain_ddp.checkpoint.saver import ShardedSaver, _Pending
    from raytrain_ddp.errors import StorageFull

    monkeypatch.setenv("RAYTRAIN_STORAGE_RETRY_S", "1")
    directory = tmp_path / "checkpoint_2026-12-05_19-00-00.000000"
    (directory / SHARDS_DIR).mkdir(parents=True)
    os.mkfifo(blocked := directory / SHARDS_DIR / "__0_0.distcp")
    reported, ended = [], []
    with one_process_group():
        saver = ShardedSaver(tmp_path, 0, report=lambda metrics, where: reported.append(where))
        shards = str(directory / SHARDS_DIR)
        written = dcp.async_save({"model": torch.nn.Linear(4, 4).state_dict()}, checkpoint_id=shards)
        saver.pending = _Pending(written, directory, {"epoch": 1}, "the checkpoint of epoch 1")

        def flush() -> None:
            try:
                saver.flush()
                ended.append("flushed")
            except StorageFull as err:
                ended.append(err)

        waiter = threading.Thread(target=flush, daemon=True)
        waiter.start()
        waiter.join(timeout=30)  # a guard, not a timing: what is checked is how the wait ended
        with open(blocked, "rb") as reader:  # the write goes on now: DCP's thread ends, the test's process too
            reader.read()
        written.exception()
        waiter.join()
    assert [str(end) for end in ended] == [
        f"storage stalled: nothing written for 1 s writing the checkpoint of epoch 1 to {directory}; bring the "
        "storage back (RAYTRAIN_STORAGE_RETRY_S: how long a write may stall) and run the same command again to resume"
    ]
    assert not reported and not saver.in_flight


def test_help_lists_the_exit_code():
    from raytrain_ddp.run import build_parser

    assert "\n  74   the run's storage is full, over its quota or read-only, or its object store failed" in (
        build_parser().format_help()
    )


def test_a_mount_turned_read_only_is_told_as_such_and_the_records_wait_for_it(tmp_path):
    """A file system remounted read-only mid-run (as one with errors remounts itself): the same path as a full
    disk, in its own words."""
    with small_disk(tmp_path / "small", "1m") as disk:
        config = TrainConfig(num_workers=2, storage_path=str(disk), name="driver")
        config.run_dir.mkdir()
        recorder = RunRecorder(config.run_dir, config, train_rows=512, world_size=2, sinks=[])
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        recorder.consume([("epoch", rank, rank_epoch_message(rank)) for rank in (0, 1)])
        assert str(recorder.unwritten) == (
            f"storage read-only: read-only file system writing metrics.jsonl to {config.run_dir}; make it writable "
            "and run the same command again to resume"
        )
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        recorder.flush_files()
        assert recorder.unwritten is None and (config.run_dir / "metrics.jsonl").exists()


def test_driver_log_lines_a_full_disk_refuses_are_said_once_not_a_traceback_each(tmp_path, capsys):
    with small_disk(tmp_path / "small", "1m") as disk:
        handler = fit_module._RunLogFile(disk / "driver.log")
        logger = logging.getLogger("raytrain_ddp.test_storage_full")
        logger.addHandler(handler)
        try:
            fill(disk)
            for n in range(200):  # more than a page: the file needs another one
                logger.warning("line %d of the driver's log, long enough to fill a page soon: %s", n, "x" * 40)
        finally:
            logger.removeHandler(handler)
            handler.close()
    err = capsys.readouterr().err
    assert err.count("lines left out") == 1 and "Traceback" not in err, err[-2000:]


def test_a_disk_full_before_training_is_one_line_and_nothing_starts(tmp_path):
    """The lock file is the run's first write: refused, the run ends there, before Ray (the CLI: exit code 74)."""
    from raytrain_ddp import fit
    from raytrain_ddp.errors import StorageFull

    with small_disk(tmp_path / "small", "1m") as disk:
        fill(disk)
        with pytest.raises(StorageFull) as raised:
            fit(TrainConfig(storage_path=str(disk), name="x", epochs=1, train_size=256, val_size=64))
    assert str(raised.value) == (
        f"storage full: no space left on device writing the run directory to {disk / 'x'} (0 B free of 1 MiB); "
        "free space and run the same command again to resume"
    )


def test_sample_ids_on_a_full_disk_raise_storage_full_naming_them(tmp_path):
    import numpy as np

    from raytrain_ddp.errors import StorageFull
    from raytrain_ddp.worker.loop import save_sample_ids

    with small_disk(tmp_path / "small", "1m") as disk:
        config = TrainConfig(storage_path=str(disk), name="ids", record_sample_ids=True)
        fill(disk)
        with pytest.raises(StorageFull) as raised:
            save_sample_ids(config, 3, 1, [np.arange(4096)])
        assert str(raised.value).startswith("storage full: no space left on device writing the sample ids of epoch 3 ")
        assert not list(disk.rglob("*.tmp")) and not list(disk.rglob("*.npy"))  # nothing half-written
