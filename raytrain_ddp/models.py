"""Models by name. Each takes the input shape and the number of classes."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from raytrain_ddp.errors import ConfigError


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head: the built-in default, quick on a CPU."""

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(64 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


class MLP(nn.Module):
    """Two hidden layers for tabular features."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 128):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def check_model_fits_data(name: str, input_shape: Sequence[int]) -> None:
    """Raise ConfigError when the model cannot take this kind of input."""
    is_image = len(input_shape) == 3
    if name == "mlp" and is_image:
        raise ConfigError(f"--model mlp takes tabular data, but the data holds images {tuple(input_shape)}; "
                          "use --model cnn or resnet18")
    if name != "mlp" and not is_image:
        raise ConfigError(f"--model {name} takes images, but the data is tabular; use --model mlp")


def build_model(name: str, input_shape: Sequence[int], num_classes: int) -> nn.Module:
    """The model called `name` for inputs of `input_shape` (without the batch)."""
    check_model_fits_data(name, input_shape)
    if name == "mlp":
        return MLP(input_shape[0], num_classes)
    if name == "cnn":
        return SmallCNN(input_shape[0], num_classes)
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=num_classes)
