"""Models by name (each takes the input shape and the number of classes), or the user's by import path."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_ddp.config import TrainConfig, is_import_path
from raytrain_ddp.errors import ConfigError
from raytrain_ddp.plugins import call_plugin, describe, load_object

if TYPE_CHECKING:
    from raytrain_ddp.data.spec import DataSpec

MODEL_KINDS = {"mlp": "tabular", "transformer": "tokens"}  # every other built-in model takes images


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head: the built-in default, quick on a CPU."""

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(2),
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
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, length, dim))


class TransformerBlock(nn.Module):
    """Pre-norm attention and MLP: the unit FSDP shards (one all-gather per block)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(dim), CausalSelfAttention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """A small decoder-only language model: tokens [batch, length] -> next-token logits [batch, length, vocab]."""

    def __init__(self, vocab_size: int, max_length: int, dim: int = 128, depth: int = 4, heads: int = 4):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, dim)
        self.position_embedding = nn.Embedding(max_length, dim)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size)  # not tied to the embedding: FSDP shards them apart

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def check_model_fits_data(name: str, data_kind: str) -> None:
    """Raise ConfigError when a built-in model cannot take this kind of input."""
    if is_import_path(name) or data_kind == "custom":
        return  # the user's model, or the user's data: they know what fits
    wants = MODEL_KINDS.get(name, "image")
    if wants != data_kind:
        fitting = [m for m in ("cnn", "resnet18", "mlp", "transformer") if MODEL_KINDS.get(m, "image") == data_kind]
        raise ConfigError(
            f"--model {name} takes {wants} data, but the data holds {data_kind}; use --model {' or '.join(fitting)}"
        )


def build_model(config: TrainConfig, spec: DataSpec, model_fn: Callable | None = None) -> nn.Module:
    """The model `config.model` names (or `model_fn` builds) for the data `spec` describes."""
    if config.channels_last and spec.kind in ("tabular", "tokens"):
        raise ConfigError(
            f"--channels-last is for 4-D image inputs, but the data holds {spec.kind}; drop --channels-last"
        )
    if model_fn is not None or is_import_path(config.model):
        label = repr(config.model) if model_fn is None else describe(model_fn)
        model = call_plugin(model_fn or load_object(config.model, "--model"), "--model", label, config)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"--model {label} returned {type(model).__name__}, expected a torch.nn.Module")
        return model
    check_model_fits_data(config.model, spec.kind)
    if config.model == "mlp":
        return MLP(spec.input_shape[0], spec.num_classes)
    if config.model == "transformer":
        return TransformerLM(spec.num_classes, spec.input_shape[0])
    if config.model == "cnn":
        return SmallCNN(spec.input_shape[0], spec.num_classes)
    import torchvision

    return getattr(torchvision.models, config.model)(weights=None, num_classes=spec.num_classes)
