"""Synthetic fundus-lesion data from a real retina photograph (the demo model's task).

Backgrounds are crops of the real fundus photograph that scikit-image ships
(``skimage.data.retina()``): vessels, optic disc, texture and illumination are real. Onto
them we plant lesions at known positions:

* MICROANEURYSM — small dark-red dots (1.5-3 px radius at 128 px), soft-edged;
* EXUDATE — bright yellow irregular patches (a few merged blobs, 3-7 px radius);
* NORMAL — nothing planted.

Everything is seeded: the same seed gives the same images, lesions and labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

__all__ = ["CLASSES", "IMAGE_SIZE", "Lesion", "Sample", "FundusGenerator"]

CLASSES = ("NORMAL", "MICROANEURYSM", "EXUDATE")
IMAGE_SIZE = 128


@dataclass(frozen=True)
class Lesion:
    """A planted lesion: centre (x, y) and radius in output pixels."""

    kind: str
    x: float
    y: float
    radius: float

    def covered_by(self, x0: int, y0: int, size: int) -> bool:
        """True if a size x size occluder at (x0, y0) touches the lesion's disk."""
        nearest_x = min(max(self.x, x0), x0 + size - 1)
        nearest_y = min(max(self.y, y0), y0 + size - 1)
        return (nearest_x - self.x) ** 2 + (nearest_y - self.y) ** 2 <= self.radius**2


@dataclass
class Sample:
    image: np.ndarray  # (IMAGE_SIZE, IMAGE_SIZE, 3) uint8
    label: int
    lesions: list[Lesion]

    @property
    def class_name(self) -> str:
        return CLASSES[self.label]


@lru_cache(maxsize=1)
def _retina() -> tuple[np.ndarray, np.ndarray]:
    """The retina photograph as float RGB in [0, 1] and a mask of the fundus disk."""
    from scipy.ndimage import binary_erosion
    from skimage import data
    from skimage.morphology import disk

    photo = data.retina().astype(np.float32) / 255.0
    brightness = photo.mean(axis=2)
    mask = binary_erosion(brightness > 0.08, disk(15))  # stay clear of the dark rim
    return photo, mask


class FundusGenerator:
    """Seeded generator of fundus crops with planted lesions.

    Args:
        seed: random seed; each call to :meth:`sample` advances the same stream.
        size: output side in pixels.
    """

    def __init__(self, seed: int = 0, size: int = IMAGE_SIZE):
        self.rng = np.random.default_rng(seed)
        self.size = size
        photo, mask = _retina()
        self.photo, self.mask = photo, mask
        # integral image of the mask: fraction of a crop inside the fundus disk in O(1)
        self._integral = np.pad(mask.astype(np.int64).cumsum(0).cumsum(1), ((1, 0), (1, 0)))

    def _inside_fraction(self, y: int, x: int, side: int) -> float:
        s = self._integral
        total = s[y + side, x + side] - s[y, x + side] - s[y + side, x] + s[y, x]
        return total / float(side * side)

    def background(self) -> np.ndarray:
        """A random crop of the real fundus, resized, flipped/rotated and colour-jittered."""
        from skimage.transform import resize

        height, width = self.mask.shape
        for _ in range(200):
            side = int(self.rng.integers(180, 480))
            y = int(self.rng.integers(0, height - side))
            x = int(self.rng.integers(0, width - side))
            if self._inside_fraction(y, x, side) > 0.97:
                break
        crop = self.photo[y : y + side, x : x + side]
        crop = resize(crop, (self.size, self.size), order=1, anti_aliasing=True)
        crop = np.rot90(crop, int(self.rng.integers(0, 4)))
        if self.rng.random() < 0.5:
            crop = crop[:, ::-1]
        gain = self.rng.uniform(0.8, 1.25)
        gamma = self.rng.uniform(0.8, 1.25)
        tint = self.rng.uniform(0.92, 1.08, size=3)
        crop = np.clip(crop * gain * tint, 0, 1) ** gamma
        noise = self.rng.normal(0, 0.01, crop.shape)
        return np.clip(crop + noise, 0, 1).astype(np.float32)

    def _place(self, radius: float, taken: list[Lesion]) -> tuple[float, float]:
        margin = radius + 4
        for _ in range(100):
            x = float(self.rng.uniform(margin, self.size - margin))
            y = float(self.rng.uniform(margin, self.size - margin))
            if all((x - o.x) ** 2 + (y - o.y) ** 2 > (radius + o.radius + 8) ** 2 for o in taken):
                return x, y
        return x, y

    def _microaneurysm(self, image: np.ndarray, taken: list[Lesion]) -> Lesion:
        radius = float(self.rng.uniform(1.5, 3.0))
        x, y = self._place(radius, taken)
        yy, xx = np.mgrid[0 : self.size, 0 : self.size]
        profile = np.exp(-(((xx - x) ** 2 + (yy - y) ** 2) / (2 * (radius * 0.75) ** 2)))
        darkness = self.rng.uniform(0.55, 0.8)
        colour = np.array([0.42, 0.06, 0.05]) * self.rng.uniform(0.7, 1.2)
        alpha = (profile * darkness)[..., None]
        image[:] = image * (1 - alpha) + colour * alpha
        return Lesion("MICROANEURYSM", x, y, radius)

    def _exudate(self, image: np.ndarray, taken: list[Lesion]) -> Lesion:
        radius = float(self.rng.uniform(3.0, 7.0))
        x, y = self._place(radius, taken)
        yy, xx = np.mgrid[0 : self.size, 0 : self.size]
        blob = np.zeros((self.size, self.size))
        for _ in range(int(self.rng.integers(2, 5))):
            bx = x + self.rng.normal(0, radius * 0.35)
            by = y + self.rng.normal(0, radius * 0.35)
            br = radius * self.rng.uniform(0.45, 0.8)
            blob = np.maximum(
                blob, np.exp(-((((xx - bx) ** 2 + (yy - by) ** 2) / (2 * br**2)) ** 2))
            )
        colour = np.array([1.0, 0.88, 0.45]) * self.rng.uniform(0.85, 1.0)
        alpha = (np.clip(blob * 1.3, 0, 1) * self.rng.uniform(0.6, 0.9))[..., None]
        image[:] = image * (1 - alpha) + colour * alpha
        return Lesion("EXUDATE", x, y, radius)

    def sample(self, label: int | None = None, lesions: int | None = None) -> Sample:
        """One image. ``label`` picks the class (random if None); ``lesions`` how many
        lesions a non-NORMAL image gets (1-3 at random if None)."""
        if label is None:
            label = int(self.rng.integers(0, len(CLASSES)))
        image = self.background()
        planted: list[Lesion] = []
        if label != 0:
            count = lesions if lesions is not None else int(self.rng.integers(1, 4))
            plant = self._microaneurysm if CLASSES[label] == "MICROANEURYSM" else self._exudate
            for _ in range(count):
                planted.append(plant(image, planted))
        pixels = np.round(np.clip(image, 0, 1) * 255).astype(np.uint8)
        return Sample(pixels, label, planted)

    def gray_box(self, sample: Sample, max_side: int = 32) -> np.ndarray:
        """The sample with one mid-gray box that avoids every lesion (augmentation that
        teaches the model gray occluders alone mean nothing)."""
        image = sample.image.copy()
        for _ in range(50):
            side = int(self.rng.integers(8, max_side + 1))
            x0 = int(self.rng.integers(0, self.size - side + 1))
            y0 = int(self.rng.integers(0, self.size - side + 1))
            if not any(lesion.covered_by(x0, y0, side) for lesion in sample.lesions):
                image[y0 : y0 + side, x0 : x0 + side] = 128
                break
        return image
