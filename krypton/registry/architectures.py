"""Krypton's own architectures, which registry entries may name beside torchvision's.

``ct3d-small``: the 3-D demo model's CNN (demo.chestct.train), plain modules as in
torchvision: four stages of 3x3x3 convolution, batch norm and ReLU, each but the last
halving the volume with a 2x2x2 max pool, then global max pooling (a finding anywhere
counts, as in multiple-instance detection) and one linear layer. ``ct2d-small``: the same
network over one axial slice (demo.chestct.slices), taking the image panel's RGB picture.
One class serves both: the number of spatial dimensions is a parameter (MONAI's way).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

__all__ = ["ARCHITECTURES", "SmallCT", "SmallCT3d", "build"]

_LAYERS = {  # spatial dims -> (convolution, batch norm, max pool, global max pool)
    2: (nn.Conv2d, nn.BatchNorm2d, nn.MaxPool2d, nn.AdaptiveMaxPool2d),
    3: (nn.Conv3d, nn.BatchNorm3d, nn.MaxPool3d, nn.AdaptiveMaxPool3d),
}


class SmallCT(nn.Module):
    """A small CNN for (C, H, W) slices or (C, D, H, W) volumes (``spatial_dims`` 2 or
    3); ``widths`` per stage."""

    def __init__(
        self,
        num_classes: int = 2,
        in_channels: int = 1,
        widths: tuple = (16, 32, 48, 96),
        spatial_dims: int = 3,
    ) -> None:
        super().__init__()
        if spatial_dims not in _LAYERS:
            raise ValueError(f"spatial_dims must be 2 or 3, got {spatial_dims}")
        convolution, norm, pool, global_pool = _LAYERS[spatial_dims]

        def block(inputs: int, outputs: int) -> list[nn.Module]:
            return [
                convolution(inputs, outputs, 3, padding=1, bias=False),
                norm(outputs),
                nn.ReLU(inplace=True),
            ]

        layers: list[nn.Module] = []
        channels = in_channels
        for index, width in enumerate(widths):
            layers += block(channels, width)
            if index >= 2:  # the deeper stages get a second convolution
                layers += block(width, width)
            if index < len(widths) - 1:
                layers.append(pool(2))
            channels = width
        self.features = nn.Sequential(*layers)
        self.pool = global_pool(1)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.classifier(self.pool(self.features(x)).flatten(1))


class SmallCT3d(SmallCT):
    """:class:`SmallCT` over (1, D, H, W) volumes (the name ``ct3d-small`` builds)."""

    def __init__(
        self, num_classes: int = 2, in_channels: int = 1, widths: tuple = (16, 32, 48, 96)
    ):
        super().__init__(num_classes, in_channels, widths, spatial_dims=3)


ARCHITECTURES: dict[str, Callable[..., nn.Module]] = {
    "ct3d-small": SmallCT3d,
    "ct2d-small": partial(SmallCT, in_channels=3, spatial_dims=2),
}


def build(name: str, num_classes: int) -> nn.Module:
    """An architecture of :data:`ARCHITECTURES` with random weights."""
    return ARCHITECTURES[name](num_classes=num_classes)
