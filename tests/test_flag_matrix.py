"""Every documented flag combination a CPU can run trains a few steps, or is refused up front.

One process, one single-rank gloo process group: each combination goes through
the real model builder, `strategy.distribute` (DDP or FSDP2) and the loop's own
`RankTrainer.micro_batch` / `optimizer_step`, with gradient accumulation; no Ray.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from support import one_process_group, run_cli

from raytrain_ddp import fit
from raytrain_ddp.config import TrainConfig
from raytrain_ddp.data.spec import synthetic_spec
from raytrain_ddp.errors import ConfigError
from raytrain_ddp.evaluate import evaluate_checkpoint
from raytrain_ddp.models import build_model
from raytrain_ddp.worker.args import UserCode
from raytrain_ddp.worker.loop import RankTrainer

DATASETS = {"cnn": "synthetic", "mlp": "synthetic-tabular", "transformer": "synthetic-tokens"}
BATCH = 4


@pytest.fixture(scope="module", autouse=True)
def process_group():
    with one_process_group():
        yield


def _batch(spec, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    if spec.kind == "tokens":
        tokens = torch.randint(spec.num_classes, (BATCH, *spec.input_shape), generator=generator)
        return {"x": tokens, "y": tokens.roll(-1, 1)}
    return {
        "x": torch.randn(BATCH, *spec.input_shape, generator=generator),
        "y": torch.randint(spec.num_classes, (BATCH,), generator=generator),
    }


def _config(model: str, **flags) -> TrainConfig:
    return TrainConfig(
        model=model,
        dataset=DATASETS[model],
        train_size=64,
        val_size=16,
        batch_size=BATCH,
        optimizer="adamw",
        lr=1e-3,
        clip_grad_norm=1.0,
        **flags,
    )


def _train(config: TrainConfig, optimizer_steps: int = 2) -> list[float]:
    spec = synthetic_spec(config)
    trainer = RankTrainer(config, spec, torch.device("cpu"), UserCode(), world_size=1)
    losses = []
    for micro in range(1, optimizer_steps * config.grad_accum + 1):
        synchronise = micro % config.grad_accum == 0
        losses.append(float(trainer.micro_batch(_batch(spec, micro), synchronise)))
        if synchronise:
            assert trainer.optimizer_step()
    return losses


def _runs(model: str, channels_last: bool) -> bool:
    return not channels_last or model == "cnn"


MATRIX = [
    (model, strategy, precision, channels_last, grad_accum)
    for model, strategy, precision, channels_last, grad_accum in itertools.product(
        DATASETS, ("ddp", "fsdp"), ("fp32", "bf16", "fp16"), (False, True), (1, 2)
    )
    if _runs(model, channels_last)
]


@pytest.mark.parametrize("model,strategy,precision,channels_last,grad_accum", MATRIX)
def test_combination_trains(model, strategy, precision, channels_last, grad_accum):
    losses = _train(
        _config(model, strategy=strategy, precision=precision, channels_last=channels_last, grad_accum=grad_accum)
    )
    assert all(torch.isfinite(torch.tensor(losses)))


def test_compile_with_every_other_flag():  # one case: compiling is slow on a CPU
    _train(_config("cnn", strategy="fsdp", precision="bf16", channels_last=True, grad_accum=2, compile=True), 1)


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_channels_last_refused_for_non_image_data(model):
    config = _config(model, channels_last=True)
    with torch.device("meta"), pytest.raises(ConfigError, match="--channels-last"):
        build_model(config, synthetic_spec(config))


def test_cli_refuses_channels_last_for_tokens_before_ray_starts(tmp_path):
    result = run_cli(
        "raytrain_ddp.run",
        "--model",
        "transformer",
        "--dataset",
        "synthetic-tokens",
        "--channels-last",
        "--storage-path",
        str(tmp_path),
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: --channels-last is for 4-D image inputs, but the data holds tokens; drop --channels-last"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.ray
def test_most_exotic_combination_in_a_real_ray_run(ray_address, tmp_path):
    """FSDP + bf16 (bf16 all-gathers, fp32 reduce-scatters) + channels-last + accumulation on 2 workers."""
    config = TrainConfig(
        model="cnn",
        strategy="fsdp",
        precision="bf16",
        channels_last=True,
        grad_accum=2,
        batch_size=16,
        train_size=256,
        val_size=64,
        epochs=1,
        num_workers=2,
        storage_path=str(tmp_path),
        name="exotic",
        report=False,
        tensorboard=False,
    )
    result = fit(config)
    assert result.ok, result.summary["error"]
    scored = evaluate_checkpoint(result.best_checkpoint)
    assert scored["val_accuracy"] == pytest.approx(scored["recorded"]["val_accuracy"])
