"""Small reference models, selectable by name (`build_model("convnet", ...)`)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn


def _conv_bn(c_in: int, c_out: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.GELU()]


class ConvBlock(nn.Sequential):
    """airbench's block: conv, 2x2 max-pool, BN, GELU, conv, BN, GELU (pooling early halves the second conv's cost)."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.MaxPool2d(2), nn.BatchNorm2d(c_out),
                         nn.GELU(), *_conv_bn(c_out, c_out))


class ConvNet(nn.Module):
    """A small, fast ResNet-9 / airbench-style ConvNet: stride-2 stem, one block per width, pooled linear head."""

    def __init__(self, num_classes: int = 10, widths: Sequence[int] = (16, 32, 64, 128), in_channels: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = _conv_bn(in_channels, widths[0], stride=2)
        for c_in, c_out in itertools.pairwise(widths):
            layers.append(ConvBlock(c_in, c_out))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x).amax(dim=(2, 3)))
        return out


class MLP(nn.Module):
    """Flatten, then Linear-GELU layers: the cheapest model, for pipeline tests."""

    def __init__(self, num_classes: int = 10, in_features: int = 3 * 32 * 32, hidden: Sequence[int] = (256,)) -> None:
        super().__init__()
        dims = [in_features, *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for a, b in itertools.pairwise(dims):
            layers += [nn.Linear(a, b), nn.GELU()]
        layers.append(nn.Linear(dims[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


MODELS: dict[str, Callable[[int, int], nn.Module]] = {
    "convnet": lambda num_classes, image_size: ConvNet(num_classes),
    "mlp": lambda num_classes, image_size: MLP(num_classes, 3 * image_size * image_size),
}


def build_model(name: str, *, num_classes: int, image_size: int) -> nn.Module:
    """A reference model by name; see `MODELS` for the names."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")
    return MODELS[name](num_classes, image_size)
