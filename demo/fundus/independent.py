"""A second fundus-lesion generator, written separately from :mod:`krypton.synthetic.fundus` to
check that the demo model learned the task and not the first generator's quirks.

Same spec (dark-red round soft-edged microaneurysms of radius 1.2-6 px and bright
yellow-white irregular exudates of radius 1.5-12 px at 224 px, 1-4 lesions, any
exudate: EXUDATE), different code: backgrounds cut with scikit-image's geometric
transforms instead of PIL affine maps, lesions painted with PIL's ImageDraw on a 4x
supersampled layer and blurred, instead of analytic profiles; its own colour ranges,
illumination model and placement. Nothing here is used for training.

``distractors=True`` is the harder generator: every eye, normal ones too, also carries
look-alikes as conspicuous as the lesions that never decide the class
(:data:`krypton.synthetic.fundus.DISTRACTORS`: drusen, light reflexes, pigment), drawn
here with PIL polygons and lines, not the training generator's profiles.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from krypton.synthetic.fundus import CLASSES, DISTRACTOR_CLEARANCE, Lesion, Sample

__all__ = ["IndependentFundusGenerator"]

SUPERSAMPLE = 4


class IndependentFundusGenerator:
    """Seeded; ``sample()`` returns the same :class:`krypton.synthetic.fundus.Sample` records."""

    def __init__(self, seed: int = 0, size: int = 224, distractors: bool = False):
        from skimage import data

        self.rng = np.random.default_rng(seed + 10_000)
        self.size = size
        self.distractors = distractors
        self.photo = data.retina().astype(np.float64) / 255.0
        gray = self.photo.mean(axis=2)
        self.retina = gray > 0.1
        rows, cols = np.nonzero(self.retina)
        self.centre = np.array([cols.mean(), rows.mean()])
        self.radius = 0.5 * (cols.max() - cols.min())

    def _background(self, whole: bool) -> tuple[np.ndarray, np.ndarray]:
        from skimage.transform import AffineTransform, warp

        if whole:
            side = 2 * self.radius * self.rng.uniform(1.02, 1.1)
            centre = self.centre
        else:
            side = self.rng.uniform(200, 650)
            limit = self.radius - side / np.sqrt(2)
            offset = self.rng.uniform(-1, 1, 2) * max(limit, 0) / np.sqrt(2)
            centre = self.centre + offset
        scale = side / self.size
        rotation = self.rng.choice([0, np.pi / 2, np.pi, 3 * np.pi / 2]) + self.rng.normal(0, 0.2)
        # warp takes the map from output coordinates to photo coordinates
        shift = AffineTransform(translation=(-self.size / 2, -self.size / 2))
        mapping = AffineTransform(
            matrix=AffineTransform(translation=centre).params
            @ AffineTransform(rotation=rotation).params
            @ AffineTransform(scale=scale).params
            @ shift.params
        )
        view = warp(self.photo, mapping, output_shape=(self.size, self.size), order=1)
        if scale > 1.5:  # smooth like a lens would, against aliasing of fine vessels
            from scipy.ndimage import gaussian_filter

            view = gaussian_filter(view, sigma=(scale / 3, scale / 3, 0))
        retina = warp(self.retina.astype(float), mapping, output_shape=(self.size,) * 2, order=0)
        return view, retina > 0.5

    def _spot(self, radius: float, placed: list[Lesion], retina: np.ndarray):
        for _ in range(300):
            x, y = self.rng.uniform(radius + 4, self.size - radius - 4, 2)
            r = int(radius) + 1
            patch = retina[int(y) - r : int(y) + r + 1, int(x) - r : int(x) + r + 1]
            if patch.size and patch.all():
                if all(np.hypot(x - p.x, y - p.y) > radius + p.radius + 7 for p in placed):
                    return float(x), float(y)
        return None

    def _layer(self) -> tuple[Image.Image, ImageDraw.ImageDraw]:
        """An empty supersampled alpha layer and a pen on it."""
        big = self.size * SUPERSAMPLE
        layer = Image.new("L", (big, big), 0)
        return layer, ImageDraw.Draw(layer)

    def _alpha(self, layer: Image.Image, blur: float, strength: float) -> np.ndarray:
        """The layer blurred (``blur`` supersampled pixels), brought to the image's size and
        scaled to ``strength``: (H, W, 1) in [0, 1]."""
        layer = layer.filter(ImageFilter.GaussianBlur(blur)).resize(
            (self.size, self.size), Image.BOX
        )
        return (np.asarray(layer, dtype=np.float64) / 255.0 * strength)[..., None]

    def _paint(self, kind: str, radius: float, x: float, y: float):
        """An RGBA layer (float) with one lesion painted on it."""
        layer, draw = self._layer()
        s = SUPERSAMPLE
        if kind == "MICROANEURYSM":
            rx, ry = radius * self.rng.uniform(0.9, 1.1), radius * self.rng.uniform(0.9, 1.1)
            draw.ellipse(((x - rx) * s, (y - ry) * s, (x + rx) * s, (y + ry) * s), fill=255)
            blur = self.rng.uniform(0.2, 0.45) * radius * s
            colour = (self.rng.uniform(0.3, 0.48), self.rng.uniform(0.03, 0.09), 0.05)
            strength = self.rng.uniform(0.4, 0.85)
        else:
            points = []
            count = 7 if radius < 3 else int(self.rng.integers(9, 16))
            for k in range(count):  # an irregular star-shaped polygon
                angle = 2 * np.pi * k / count + self.rng.normal(0, 0.15)
                reach = radius * self.rng.uniform(0.55, 1.0)
                points.append(((x + reach * np.cos(angle)) * s, (y + reach * np.sin(angle)) * s))
            draw.polygon(points, fill=255)
            if radius > 4:
                for _ in range(int(self.rng.integers(1, 4))):  # satellite flecks
                    fx = x + self.rng.normal(0, radius * 0.5)
                    fy = y + self.rng.normal(0, radius * 0.5)
                    fr = radius * self.rng.uniform(0.15, 0.35)
                    draw.ellipse(((fx - fr) * s, (fy - fr) * s, (fx + fr) * s, (fy + fr) * s), 255)
            blur = self.rng.uniform(0.1, 0.25) * radius * s
            colour = (
                self.rng.uniform(0.95, 1.0),
                self.rng.uniform(0.83, 0.95),
                self.rng.uniform(0.4, 0.75),
            )
            strength = self.rng.uniform(0.6, 0.95)
        return self._alpha(layer, blur, strength), np.array(colour)

    # -- the harder generator's look-alikes ------------------------------------------------

    def _free(self, reach: float, lesions: list[Lesion], others: list[Lesion], retina):
        """A place for a look-alike of ``reach`` px on the retina, DISTRACTOR_CLEARANCE px
        beyond every lesion and 3 px beyond the other look-alikes; None if none fits."""
        for _ in range(300):
            x, y = self.rng.uniform(reach + 3, self.size - reach - 3, 2)
            r = int(reach) + 1
            patch = retina[int(y) - r : int(y) + r + 1, int(x) - r : int(x) + r + 1]
            if not (patch.size and patch.all()):
                continue
            if all(
                np.hypot(x - o.x, y - o.y) > reach + o.radius + DISTRACTOR_CLEARANCE
                for o in lesions
            ) and all(np.hypot(x - o.x, y - o.y) > reach + o.radius + 3 for o in others):
                return float(x), float(y)
        return None

    def _reflex(self, x: float, y: float, length: float):
        """A thin bluish-white streak, straight or a shallow arc, centred on (x, y)."""
        layer, draw = self._layer()
        s = SUPERSAMPLE
        angle = self.rng.uniform(0, np.pi)
        along, across = (
            np.array([np.cos(angle), np.sin(angle)]),
            np.array([-np.sin(angle), np.cos(angle)]),
        )
        bend = self.rng.uniform(-0.3, 0.3) * length
        centre = np.array([x, y])
        t = np.linspace(-0.5, 0.5, 9)[:, None]  # a parabola through the centre's offset
        points = centre + t * length * along + (1 - 4 * t**2) * bend * across
        width = self.rng.uniform(1.5, 4.0)
        draw.line([tuple(p * s) for p in points], fill=255, width=int(width * s), joint="curve")
        colour = (self.rng.uniform(0.88, 0.97), self.rng.uniform(0.94, 1.0), 1.0)
        return self._alpha(layer, 0.4 * width * s, self.rng.uniform(0.7, 0.95)), np.array(colour)

    def _pigment(self, x: float, y: float, radius: float):
        """A near-black irregular clump with sharp edges."""
        layer, draw = self._layer()
        s = SUPERSAMPLE
        count = int(self.rng.integers(5, 9))
        points = []
        for k in range(count):
            angle = 2 * np.pi * k / count + self.rng.normal(0, 0.2)
            reach = radius * self.rng.uniform(0.5, 1.0)
            points.append(((x + reach * np.cos(angle)) * s, (y + reach * np.sin(angle)) * s))
        draw.polygon(points, fill=255)
        colour = (
            self.rng.uniform(0.06, 0.16),
            self.rng.uniform(0.05, 0.11),
            self.rng.uniform(0.03, 0.08),
        )
        return self._alpha(layer, 0.06 * radius * s, self.rng.uniform(0.8, 0.97)), np.array(colour)

    def _drusen(self, x: float, y: float, radius: float):
        """One pale yellow soft round spot."""
        layer, draw = self._layer()
        s = SUPERSAMPLE
        draw.ellipse(((x - radius) * s, (y - radius) * s, (x + radius) * s, (y + radius) * s), 255)
        colour = (
            self.rng.uniform(0.8, 0.9),
            self.rng.uniform(0.68, 0.8),
            self.rng.uniform(0.3, 0.45),
        )
        return self._alpha(layer, 0.45 * radius * s, self.rng.uniform(0.6, 0.9)), np.array(colour)

    def _glare(self, x: float, y: float, radius: float):
        """A large soft bluish-white glare: a reflection off the lens or the cornea."""
        layer, draw = self._layer()
        s = SUPERSAMPLE
        rx, ry = radius * self.rng.uniform(0.8, 1.0), radius * self.rng.uniform(0.8, 1.0)
        draw.ellipse(((x - rx) * s, (y - ry) * s, (x + rx) * s, (y + ry) * s), 255)
        colour = (self.rng.uniform(0.9, 0.98), self.rng.uniform(0.94, 1.0), 1.0)
        return self._alpha(layer, 0.35 * radius * s, self.rng.uniform(0.65, 0.9)), np.array(colour)

    def _look_alikes(self, image, retina, lesions: list[Lesion]):
        """The image with 1-3 glares, 1-3 reflexes, 1-3 pigment clumps and 0-2 drusen
        clusters painted away from the ``lesions``, and the look-alikes as Lesion records."""
        kinds = (
            ["GLARE"] * int(self.rng.integers(1, 4))
            + ["REFLEX"] * int(self.rng.integers(1, 4))
            + ["PIGMENT"] * int(self.rng.integers(1, 4))
            + ["DRUSEN"] * int(self.rng.integers(0, 3))
        )
        found: list[Lesion] = []
        for kind in kinds:
            if kind == "REFLEX":
                length = self.rng.uniform(12, 40)
                spots = [(length / 2, lambda x, y, r: self._reflex(x, y, 2 * r))]
            elif kind == "GLARE":
                spots = [(float(np.exp(self.rng.uniform(np.log(6.0), np.log(14.0)))), self._glare)]
            elif kind == "PIGMENT":
                radius = float(np.exp(self.rng.uniform(np.log(1.5), np.log(5.0))))
                spots = [(radius, self._pigment)]
            else:
                spots = [
                    (float(np.exp(self.rng.uniform(np.log(2.0), np.log(7.0)))), self._drusen)
                    for _ in range(int(self.rng.integers(2, 6)))
                ]
            for reach, paint in spots:
                spot = self._free(reach, lesions, found, retina)
                if spot is None:
                    continue
                alpha, colour = paint(spot[0], spot[1], reach)
                image = image * (1 - alpha) + colour * alpha
                found.append(Lesion(kind, spot[0], spot[1], reach))
        return image, found

    def sample(self, label: int | None = None) -> Sample:
        """One image; ``label`` chooses the class (random if None)."""
        if label is None:
            label = int(self.rng.integers(0, 3))
        whole = self.rng.random() < 0.15
        image, retina = self._background(whole)
        kinds: list[str] = []
        if label:
            count = int(self.rng.integers(1, 5))
            if CLASSES[label] == "MICROANEURYSM":
                kinds = ["MICROANEURYSM"] * count
            else:
                mixed = int(self.rng.integers(0, count)) if self.rng.random() < 0.3 else 0
                kinds = ["EXUDATE"] * (count - mixed) + ["MICROANEURYSM"] * mixed
        placed: list[Lesion] = []
        for kind in kinds:
            low, high = (1.2, 6.0) if kind == "MICROANEURYSM" else (1.5, 12.0)
            radius = float(np.exp(self.rng.uniform(np.log(low), np.log(high))))
            spot = self._spot(radius, placed, retina)
            if spot is None:
                continue
            alpha, colour = self._paint(kind, radius, *spot)
            image = image * (1 - alpha) + colour * alpha
            placed.append(Lesion(kind, spot[0], spot[1], radius))
        look_alikes: list[Lesion] = []
        if self.distractors:
            image, look_alikes = self._look_alikes(image, retina, placed)
        # illumination: a radial falloff, exposure and white balance
        yy, xx = np.mgrid[0 : self.size, 0 : self.size] / self.size - 0.5
        falloff = 1 - self.rng.uniform(0, 0.3) * (xx**2 + yy**2) * 2
        image = image * falloff[..., None] * self.rng.uniform(0.75, 1.25)
        image = image * self.rng.uniform(0.88, 1.12, 3)
        rendering = "colour"
        if self.rng.random() < 0.25:
            rendering = "gray"
            gray = image[..., 1] if self.rng.random() < 0.5 else image.mean(axis=2)
            values = gray[retina] if retina.any() else gray
            gray = (gray - values.mean()) / (values.std() + 1e-6) * self.rng.uniform(
                0.07, 0.15
            ) + self.rng.uniform(0.4, 0.58)
            gray = np.where(retina, gray, 0.04)
            image = np.stack([gray] * 3, axis=2)
        image = image + self.rng.normal(0, 0.01, image.shape)
        label_now = 2 if any(p.kind == "EXUDATE" for p in placed) else 1 if placed else 0
        pixels = np.round(np.clip(image, 0, 1) * 255).astype(np.uint8)
        view = "whole" if whole else "crop"
        return Sample(pixels, label_now, placed, view, rendering, look_alikes)
