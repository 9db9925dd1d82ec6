"""Failures that every attempt would repeat end the run at once; a lost process is still restarted."""

from __future__ import annotations

import pyarrow as pa
import pytest
import ray.exceptions

from raytrain_ddp.driver.failures import is_deterministic


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
    ],
    ids=[
        "nan-loss",
        "corrupt-parquet",
        "model-data-mismatch",
        "bad-hyperparameter",
        "collective-broken",
        "process-killed",
        "storage-glitch",
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
    assert "training loss is" in result.summary["error"] and "at epoch 1, by step" in result.summary["error"]
