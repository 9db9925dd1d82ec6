"""examples/hf_causal_lm.py: a transformers Llama on a datasets.Dataset through Ray Data, trained under FSDP (DDP
runs the same example code with the one strategy flag changed: its model, data, loss and checkpoints are those of
every other DDP run of the suite, so the example trains once).

Offline throughout (HF_HUB_OFFLINE=1): the model is built from a config, the tokenizer trained on the example's text.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
from support import REPO, run_python_file

from raytrain_ddp.worker.strategy import fsdp_units

EXAMPLE = REPO / "examples" / "hf_causal_lm.py"


@pytest.fixture(scope="module")
def example():
    """The example as a module, for its plug-ins (as `--model hf_causal_lm:build_model` imports it)."""
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import hf_causal_lm

        yield hf_causal_lm
    finally:
        sys.path.remove(str(EXAMPLE.parent))


def test_fsdp_units_of_a_transformers_model_are_its_blocks(example):
    """The blocks the model lists in `_no_split_modules`, found inside the example's wrapper (no Ray)."""
    model = example.build_model(None)
    units = fsdp_units(model)
    assert [type(unit).__name__ for unit in units] == ["LlamaDecoderLayer"] * 2
    assert units == list(model.lm.model.layers)


@pytest.mark.ray
def test_hf_example_trains_under_fsdp(ray_address, tmp_path):
    result = run_python_file(
        EXAMPLE,
        cwd=tmp_path,
        env={"RAY_ADDRESS": ray_address, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")},
        args=["--strategy", "fsdp", "--epochs", "1", "--train-size", "256", "--val-size", "64", "--batch-size", "16"]
        + ["--name", "hf-fsdp", "--no-report"],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "hf-fsdp"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["replicas_identical"]
    record = summary["final_metrics"]
    assert record["samples_per_rank"] == [128, 128]  # the datasets.Dataset's rows, sharded by the project
    assert record["val_rows"] == 64
    assert record["val_loss"] < math.log(128)  # below a uniform guess over the vocabulary: it learned
    assert summary["checkpoints_ranked_by"] == "val_loss (min)"
    assert 'dataset = "hf_causal_lm:build_datasets"' in (run_dir / "config.toml").read_text()
    # every rank sharded the two decoder layers, each as its own unit
    worker_lines = "".join(
        p.read_text(errors="replace") for p in (run_dir / "ray-logs").rglob("worker-*") if p.is_file()
    )
    assert worker_lines.count("FSDP units: 2 x LlamaDecoderLayer, then the root") >= 2
