"""Your own step in the built-in loop: a two-view contrastive task (SimCLR's loss, InfoNCE), from Python.

    python examples/task_contrastive.py

Each row is one sample; the task makes two noisy views of it, embeds both, and asks each view to find its
twin among the batch's other views. Validation reports the loss and how often the twin is the nearest
(val_loss, val_top1), exactly over every rank's rows.
"""

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_ddp import TrainConfig, fit


class TwoViews:
    def __init__(self, config: TrainConfig):
        self.noise, self.temperature = 1.5, 0.2
        self.seed = config.seed

    def _embed_views(self, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        views = [x + self.noise * torch.randn_like(x) for _ in range(2)]
        return F.normalize(model(views[0]), dim=1), F.normalize(model(views[1]), dim=1)

    def _info_nce(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = a @ b.T / self.temperature
        twins = torch.arange(len(a), device=a.device)
        return F.cross_entropy(logits, twins, reduction="none"), (logits.argmax(dim=1) == twins).float()

    def training_step(self, model: nn.Module, batch: dict) -> torch.Tensor:
        losses, _ = self._info_nce(*self._embed_views(model, batch["x"]))
        return losses.mean()

    def validation_step(self, model: nn.Module, batch: dict) -> dict:
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)  # the same views whatever the rank and epoch: comparable epochs
        losses, found = self._info_nce(*self._embed_views(model, batch["x"]))
        torch.random.set_rng_state(generator_state)
        return {"loss": losses.sum(), "top1": found.sum(), "count": len(losses)}


def encoder(config: TrainConfig) -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


if __name__ == "__main__":
    config = TrainConfig(
        dataset="synthetic-tabular",  # x: 32 features (y is not read: the views are the supervision)
        num_workers=2,
        epochs=3,
        train_size=2048,
        val_size=512,
        optimizer="adamw",
        lr=0.003,
        checkpoint_metric="val_top1",
        checkpoint_mode="max",
        name="contrastive",
    )
    result = fit(config, model_fn=encoder, task=TwoViews)
    print(result.summary["status"], result.final_metrics["val_loss"], result.final_metrics["val_top1"])
