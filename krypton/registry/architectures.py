"""Krypton's own architectures, which registry entries may name beside torchvision's.

``ct3d-small``: the 3-D demo model's CNN (demo.chestct.train), plain modules as in
torchvision: four stages of 3x3x3 convolution, batch norm and ReLU, each but the last
halving the volume with a 2x2x2 max pool, then global max pooling (a finding anywhere
counts, as in multiple-instance detection) and one linear layer.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["ARCHITECTURES", "SmallCT3d", "build"]


def _block(inputs: int, outputs: int) -> list[nn.Module]:
    return [
        nn.Conv3d(inputs, outputs, 3, padding=1, bias=False),
        nn.BatchNorm3d(outputs),
        nn.ReLU(inplace=True),
    ]


class SmallCT3d(nn.Module):
    """A small 3-D CNN for (1, D, H, W) volumes; ``widths`` per stage."""

    def __init__(
        self, num_classes: int = 2, in_channels: int = 1, widths: tuple = (16, 32, 48, 96)
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for index, width in enumerate(widths):
            layers += _block(channels, width)
            if index >= 2:  # the deeper stages get a second convolution
                layers += _block(width, width)
            if index < len(widths) - 1:
                layers.append(nn.MaxPool3d(2))
            channels = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveMaxPool3d(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)).flatten(1))


ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {"ct3d-small": SmallCT3d}


def build(name: str, num_classes: int) -> nn.Module:
    """An architecture of :data:`ARCHITECTURES` with random weights."""
    return ARCHITECTURES[name](num_classes=num_classes)
