"""Synthetic images that are nobody's training images: the out-of-distribution check's
counter-examples.

Two classic models of natural-image statistics, drawn at random, owned by no domain:

* dead leaves (Lee, Mumford and Huang, "Occlusion models for natural images", 2001):
  opaque disks and rectangles of random colour, radii drawn from a power law (density
  ∝ r^-3, the scale-invariant choice), each new shape occluding those before;
* 1/f^α noise: random phases under a power-law amplitude spectrum (α from 1.5 to 3),
  the spectrum of natural photographs, with channels partly shared.

Some are made gray, some blurred, contrast and brightness vary. They let the check learn
what "not like the training images" looks like in the model's own features without a
download and without any photograph the evaluation uses (:mod:`krypton.registry.ood`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from scipy.ndimage import gaussian_filter
from skimage.draw import disk, polygon

__all__ = ["dead_leaves", "power_law_noise", "synthetic_outliers"]

_RECTANGLE = np.array([[1, 1], [-1, 1], [-1, -1], [1, -1]])  # corners, before scaling


def dead_leaves(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """(height, width, 3) float image in [0, 1]: 200-800 opaque shapes, the later on top.
    Drawn for 224 x 224; smaller images get as many per area (at least 20), larger ones
    the same shapes scaled up (dead leaves are scale-invariant; the time stays ~15 ms)."""
    image = np.empty((height, width, 3))
    image[:] = rng.uniform(0, 1, 3)
    scale = max(height, width) / 224
    smallest, largest = rng.uniform(1, 4) * max(scale, 1.0), rng.uniform(20, 100) * scale
    shapes = max(int(rng.integers(200, 800) * min(height * width / 224**2, 1.0)), 20)
    for _ in range(shapes):
        # inverse CDF of the density r^-3 on [smallest, largest]
        share = rng.uniform()
        radius = (smallest**-2 - share * (smallest**-2 - largest**-2)) ** -0.5
        centre = rng.uniform(0, 1, 2) * (height, width)
        if rng.uniform() < 0.5:
            rows, cols = disk(centre, radius, shape=(height, width))
        else:
            angle, half_width = rng.uniform(0, np.pi), radius * rng.uniform(0.2, 1)
            turn = np.array([[np.cos(angle), np.sin(angle)], [-np.sin(angle), np.cos(angle)]])
            corners = turn @ (_RECTANGLE * (radius, half_width)).T
            rows, cols = polygon(corners[0] + centre[0], corners[1] + centre[1], (height, width))
        image[rows, cols] = rng.uniform(0, 1, 3)
    return image


def power_law_noise(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """(height, width, 3) float image in [0, 1]: 1/f^α noise, channels partly shared."""
    frequency_sq = np.fft.fftfreq(height)[:, None] ** 2 + np.fft.fftfreq(width)[None, :] ** 2
    frequency_sq[0, 0] = 1.0
    amplitude = frequency_sq ** (-rng.uniform(1.5, 3.0) / 2)

    def field() -> np.ndarray:
        phases = np.exp(2j * np.pi * rng.uniform(size=(height, width)))
        values = np.fft.ifft2(phases * amplitude).real
        return values / values.std()

    shared = field()
    weights = rng.uniform(0.5, 1.0, 3)
    image = np.stack([w * shared + (1 - w) * field() for w in weights], -1)
    return (image - image.min()) / max(image.max() - image.min(), 1e-12)


def synthetic_outliers(
    count: int, height: int, width: int, seed: int = 100
) -> Iterator[np.ndarray]:
    """``count`` seeded (height, width, 3) uint8 images: half dead leaves, half 1/f noise
    on average; 40% gray, 40% blurred, random brightness and contrast."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        draw = dead_leaves if rng.uniform() < 0.5 else power_law_noise
        image = draw(rng, height, width)
        if rng.uniform() < 0.4:
            image = np.repeat(image.mean(-1, keepdims=True), 3, -1)
        if rng.uniform() < 0.4:
            image = gaussian_filter(image, (rng.uniform(0.5, 3), rng.uniform(0.5, 3), 0))
        low, high = np.sort(rng.uniform(0, 1, 2))
        image = low + (high - low + 0.2) * image
        yield (np.clip(image, 0, 1) * 255).astype(np.uint8)
