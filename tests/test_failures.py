"""Failures that every attempt would repeat end the run at once; a lost process is still restarted."""

from __future__ import annotations

import errno
import pickle
import re
import traceback

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray.exceptions
from ray.train import WorkerGroupError
from support import corrupt_row_group

from raytrain_ddp.driver.failures import describe_failure, is_deterministic, may_retry, storage_full_in
from raytrain_ddp.errors import DataReadError, StorageFull, full_storage_error


@pytest.mark.parametrize(
    "error, deterministic",
    [
        (FloatingPointError("training loss is nan on rank 0"), True),
        (pa.ArrowInvalid("Parquet magic bytes not found in footer"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (64x3072 and 32x64)"), True),
        (ValueError("Invalid momentum value: -1"), True),
        (RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"), False),
        (ray.exceptions.ActorDiedError(), False),
        (OSError("Stale file handle"), False),
        (OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (OSError(errno.EROFS, "Read-only file system"), True),
    ],
    ids=[
        "nan-loss",
        "corrupt-parquet",
        "model-data-mismatch",
        "bad-hyperparameter",
        "collective-broken",
        "process-killed",
        "storage-glitch",
        "disk-full",
        "over-quota",
        "read-only",
    ],
)
def test_which_errors_are_deterministic(error, deterministic):
    assert is_deterministic(error) is deterministic


def test_a_wrapped_cause_counts():
    try:
        try:
            raise pa.ArrowInvalid("Corrupt row group")
        except pa.ArrowInvalid as inner:
            raise RuntimeError("reading batch failed") from inner
    except RuntimeError as outer:
        assert is_deterministic(outer)


def test_a_corrupt_row_group_names_the_file_and_the_row_group(tmp_path):
    """Read as a Ray Data task reads it: the error says which row group of which file, the reader's error type
    and first line; it survives pickling (Ray's way between processes) and is not retried."""
    from raytrain_ddp.data.sources import RowGroupSource
    from raytrain_ddp.data.spec import DataSpec

    path = tmp_path / "part-0.parquet"
    pq.write_table(pa.table({"x": np.arange(300.0), "y": np.arange(300) % 3}), path, row_group_size=100)
    corrupt_row_group(path, 1)
    source = RowGroupSource(
        DataSpec("tabular", (1,), 3, 300, 0), (100, 100, 100), ((str(path), 0), (str(path), 1)), ("x", "y")
    )
    assert len(source.read(0, 0, 100)["y"]) == 100  # the row group before it reads
    with pytest.raises(DataReadError) as raised:
        source.read(1, 0, 100)
    error = pickle.loads(pickle.dumps(raised.value))
    assert str(error).startswith(f"row group 1 of {path}: OSError: Couldn't deserialize thrift"), str(error)
    assert "\n" not in str(error) and "\x0f" not in str(error)  # its first line, control characters escaped
    assert isinstance(error.cause, OSError) and is_deterministic(error)
    # as a rank's failure reaches the driver: inside Ray's task error, whose text ends with Ray Data's advice
    advice = "To change retry attempts, backoff, or which errors are retried, configure ..."
    task_error = ray.exceptions.RayTaskError(
        "MapBatches(_task_inputs)",
        "".join(traceback.format_exception(raised.value)) + advice,
        error,
        pid=1,
        ip="127.0.0.1",
    ).as_instanceof_cause()
    failed = WorkerGroupError(f"[Rank 0 Error Snippet]:\n{task_error}", {0: task_error})
    assert describe_failure(failed) == f"rank 0: DataReadError: {error}" and not may_retry(failed)


def test_a_worker_error_is_its_type_and_first_line():
    """Per rank, the type and first line of what the worker raised, not the last line of Ray's traceback."""
    try:
        raise ValueError("Error(s) in loading state_dict for Net:\n\tsize mismatch for fc.weight\n\tand more")
    except ValueError as err:
        mismatch = err
    advised = OSError("disk gone\nTo change retry attempts, backoff, ... if you believe this to be transient.")
    failed = WorkerGroupError("traceback text", {1: advised, 0: mismatch})
    assert describe_failure(failed) == (
        "rank 0: ValueError: Error(s) in loading state_dict for Net: size mismatch for fc.weight; "
        "rank 1: OSError: disk gone"
    )


def test_a_full_disk_on_a_rank_is_not_retried_and_told_alone():
    """A rank's StorageFull crosses to the driver whole (pickled, as Ray sends it): the run is not retried, and its
    line is the storage's, not a rank's. torch.save's full disk is a RuntimeError over the file's OSError."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None
    except RuntimeError as err:
        cause = full_storage_error(err)
        assert cause is not None
        full = pickle.loads(pickle.dumps(StorageFull.of(cause, "the checkpoint of epoch 2", "/no/such/x")))
    said = str(full)
    assert said.startswith("storage full: no space left on device writing the checkpoint of epoch 2 to /no/such/x (")
    assert " free of " in said and said.endswith("); free space and run the same command again to resume"), said
    failed = WorkerGroupError("traceback text", {0: full, 1: RuntimeError("[gloo] Connection closed by peer")})
    assert not may_retry(failed) and storage_full_in(failed, "/runs/x") is full


@pytest.mark.ray
def test_nonfinite_loss_fails_once_despite_max_failures(ray_address, tmp_path):
    from raytrain_ddp import TrainConfig, fit

    result = fit(
        TrainConfig(
            num_workers=2,
            epochs=1,
            dataset="synthetic-tabular",
            model="mlp",
            train_size=512,
            val_size=64,
            lr=1e12,
            storage_path=str(tmp_path),
            name="diverged",
            report=False,
            tensorboard=False,
            max_failures=2,
        )
    )
    assert result.summary["status"] == "failed" and result.summary["restarts"] == 0, result.summary
    # the error says where: the epoch and the optimizer step of the check that saw it
    assert "training loss is" in result.summary["error"] and "at epoch 1, micro-batch" in result.summary["error"]
    # as the worker raised it: its type, then its message
    assert re.match(r"rank \d: FloatingPointError: training loss is ", result.summary["error"]), result.summary["error"]
