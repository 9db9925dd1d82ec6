"""Plug-ins by import path (a module written into the test's temp dir) and as Python callables."""

from __future__ import annotations

import json

import pytest
from support import run_cli

pytestmark = pytest.mark.ray

PLUGIN_MODULE = """
import ray.data
import torch.nn.functional as F
from torch import nn


class Tiny(nn.Module):  # defined here: the workers must import this module to build it
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, x):
        return self.net(x)


def build(config):
    return Tiny()


def offset_loss(outputs, targets):
    return F.cross_entropy(outputs, targets) + 10.0  # shifts every recorded loss: proof it was used


def list_of_data(config):
    return [1, 2]


def data_without_y(config):
    return {"train": ray.data.range(8).map_batches(lambda b: {"x": b["id"]}), "val": ray.data.range(4)}
"""


@pytest.fixture
def plugin_dir(tmp_path):
    (tmp_path / "myplugins.py").write_text(PLUGIN_MODULE)
    return tmp_path


@pytest.mark.parametrize(
    "dataset, message",
    [
        (
            "myplugins:list_of_data",
            "--dataset 'myplugins:list_of_data' returned list, expected {'train': ray.data.Dataset",
        ),
        ("myplugins:data_without_y", "--dataset 'myplugins:data_without_y': training rows lack column y"),
    ],
)
def test_dataset_plugin_errors_are_one_line(ray_address, plugin_dir, tmp_path, dataset, message):
    result = run_cli(
        "raytrain_ddp.run",
        "--address",
        ray_address,
        "--storage-path",
        str(tmp_path / "runs"),
        "--name",
        "bad",
        "--dataset",
        dataset,
        "--model",
        "myplugins:build",
        env={"PYTHONPATH": str(plugin_dir)},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and message in lines[-1], result.stderr
    assert not (tmp_path / "runs" / "bad").exists()


def test_python_api_takes_callables_beside_an_import_path(ray_address, plugin_dir, tmp_path, monkeypatch):
    """fit(config, model_fn=..., dataset_fn=...): closures are shipped to the workers by value; the loss comes by
    import path, from a module in the test's temp dir that the workers import (the CLI's --model/--dataset/--loss
    import paths: examples/custom_plugins.py in test_examples)."""
    import numpy as np
    import ray.data
    from torch import nn

    from raytrain_ddp import TrainConfig, fit

    monkeypatch.syspath_prepend(str(plugin_dir))  # as a notebook beside its module has it

    def dataset_fn(config):
        def rows(batch):
            x = np.random.default_rng(int(batch["id"][0])).standard_normal((len(batch["id"]), 4)).astype(np.float32)
            return {"x": x, "y": (x[:, 0] > 0).astype(np.int64)}

        return {"train": ray.data.range(512).map_batches(rows), "val": ray.data.range(128).map_batches(rows)}

    settings = dict(num_workers=2, storage_path=str(tmp_path), name="api", report=False, lr=0.1)
    config = TrainConfig(epochs=2, loss="myplugins:offset_loss", **settings)
    result = fit(config, model_fn=lambda config: nn.Linear(4, 2), dataset_fn=dataset_fn)
    assert result.ok, result.summary["error"]
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    assert all(r["train_loss"] > 10 and r["val_loss"] > 10 for r in records)  # the plug-in loss ran
    assert records[-1]["val_accuracy"] > 0.9  # the closure's model learned the closure's data
    assert records[-1]["samples_per_rank"] == [256, 256]  # still sharded by the project
    assert result.summary["replicas_identical"]
    assert "test_python_api_takes_callables_beside_an_import_path.<locals>.<lambda>" in config.model
    assert 'loss = "myplugins:offset_loss"' in (result.run_dir / "config.toml").read_text()

    # continued with a model whose code changed since (its tensors have other shapes): one line before any
    # worker starts, and the run as it was
    from raytrain_ddp.errors import ConfigError

    before = (result.run_dir / "metrics.jsonl").read_text()
    more = TrainConfig(epochs=3, loss="myplugins:offset_loss", **settings)
    with pytest.raises(ConfigError) as refused:
        fit(more, model_fn=lambda config: nn.Linear(4, 3), dataset_fn=dataset_fn)
    assert str(refused.value).startswith(f"run 'api''s latest checkpoint {result.run_dir}/checkpoint_"), refused
    assert str(refused.value).endswith(
        " holds another model than this run's (weight is [2, 4] there, [3, 4] here, bias is [2] there, [3] here); "
        "build the model it was trained with, or choose another --name"
    ), refused
    assert (result.run_dir / "metrics.jsonl").read_text() == before
