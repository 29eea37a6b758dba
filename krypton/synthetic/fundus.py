"""Synthetic fundus-lesion data from a real retina photograph (the demo model's task).

Backgrounds are views of the real fundus photograph that scikit-image ships
(``skimage.data.retina()``): vessels, optic disc, macula, texture and illumination are
real. Onto the retina (never onto the black surround) we plant lesions at known
positions. The classes differ by appearance, not by size — both kinds span overlapping
size ranges — so a model has to look at colour and polarity:

* MICROANEURYSM — dark-red round dots with soft edges, radius 1.2-6 px at 224 px,
  contrast from faint to strong;
* EXUDATE — bright yellow-white irregular patches, from a single tiny fleck (radius
  1.5 px) to large clusters of merged blobs (12 px);
* NORMAL — nothing planted.

An image carries 1-4 lesions; an EXUDATE image may also carry microaneurysms. Label rule
(:data:`LABEL_RULE`): any exudate makes it EXUDATE, else any microaneurysm makes it
MICROANEURYSM, else NORMAL.

Views (:data:`VIEWS`): random crops at many zooms; crops centred on hard negatives — the
optic disc (bright, yellowish), the macula (dark), the dark border; and the whole
fundus, as the gallery's Retina sample shows it. Renderings (:data:`RENDERINGS`): colour
with illumination, tint, gamma and noise variation; gray (luminance) and green channel
(red-free photography), contrast-normalised, as in the Microaneurysms sample.

Everything is seeded: the same seed gives the same images, lesions and labels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from PIL import Image

__all__ = [
    "CLASSES",
    "IMAGE_SIZE",
    "LABEL_RULE",
    "VIEWS",
    "RENDERINGS",
    "DISTRACTORS",
    "Lesion",
    "Sample",
    "FundusGenerator",
    "label_for",
    "retina_landmarks",
]

CLASSES = ("NORMAL", "MICROANEURYSM", "EXUDATE")
IMAGE_SIZE = 224
LABEL_RULE = "any exudate: EXUDATE; else any microaneurysm: MICROANEURYSM; else NORMAL"
VIEWS = {"crop": 0.6, "anatomy": 0.25, "whole": 0.15}
RENDERINGS = {"colour": 0.7, "gray": 0.15, "green": 0.15}
MICROANEURYSM_RADIUS = (1.2, 6.0)  # px at IMAGE_SIZE
EXUDATE_RADIUS = (1.5, 12.0)
# The harder generators' look-alikes (``distractors=True``): structures as conspicuous as
# the lesions, or more, on every eye, that never decide the class. A map that follows
# brightness, edges or contrast finds them first; a model has to tell them apart by
# colour, shape and edge (drusen are paler and rounder than exudates, a reflex is a thin
# streak, pigment is black and sharp where a microaneurysm is red and soft).
DISTRACTORS = {
    "GLARE": "a large soft bluish-white reflection of the lens or cornea, radius 6-14 px",
    "DRUSEN": "pale yellow round spots with soft edges, in clusters of two to five",
    "REFLEX": "a thin bluish-white light reflex: a streak or a shallow arc, 12-36 px long",
    "PIGMENT": "a near-black irregular clump with sharp edges, radius 1.5-5 px",
}
# distractors keep at least this many pixels (beyond both radii) from every lesion, so a
# 12-px patch on one does not also touch a lesion
DISTRACTOR_CLEARANCE = 14
# the training generator's look-alikes: radius range in px (a reflex: half its length),
# opacity range, and RGB colour ranges (low, high)
LOOK_ALIKE_REACH = {"GLARE": (6.0, 14.0), "REFLEX": (6.0, 20.0), "PIGMENT": (1.5, 5.0),
                    "DRUSEN": (2.0, 7.0)}  # fmt: skip
LOOK_ALIKE_STRENGTH = {"GLARE": (0.65, 0.9), "REFLEX": (0.7, 0.95), "PIGMENT": (0.8, 0.97),
                       "DRUSEN": (0.6, 0.9)}  # fmt: skip
LOOK_ALIKE_COLOURS = {
    "GLARE": ((0.9, 0.94, 1.0), (0.98, 1.0, 1.0)),
    "REFLEX": ((0.88, 0.94, 1.0), (0.97, 1.0, 1.0)),
    "PIGMENT": ((0.05, 0.04, 0.03), (0.15, 0.1, 0.08)),
    "DRUSEN": ((0.8, 0.68, 0.3), (0.9, 0.8, 0.45)),
}


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
    image: np.ndarray  # (size, size, 3) uint8
    label: int
    lesions: list[Lesion]
    view: str = "crop"
    rendering: str = "colour"
    # the harder generators' look-alikes, as conspicuous as the lesions and never part of
    # the label (:data:`DISTRACTORS`); empty on today's generators
    distractors: list[Lesion] = field(default_factory=list)

    @property
    def class_name(self) -> str:
        return CLASSES[self.label]


def label_for(lesions: list[Lesion]) -> int:
    """The class of an image with these lesions (:data:`LABEL_RULE`)."""
    kinds = {lesion.kind for lesion in lesions}
    if "EXUDATE" in kinds:
        return CLASSES.index("EXUDATE")
    if "MICROANEURYSM" in kinds:
        return CLASSES.index("MICROANEURYSM")
    return 0


@lru_cache(maxsize=1)
def _retina() -> tuple[np.ndarray, np.ndarray]:
    """The retina photograph (uint8 RGB) and a mask of the fundus disk."""
    from skimage import data

    photo = data.retina()
    mask = photo.astype(np.float32).mean(axis=2) > 20
    return photo, mask


@lru_cache(maxsize=1)
def retina_landmarks() -> dict[str, tuple[float, float]]:
    """(x, y) in the photograph of the optic disc (brightest smoothed spot), the macula
    (darkest smoothed spot near the centre) and the fundus centre."""
    from scipy.ndimage import gaussian_filter

    photo, mask = _retina()
    step = 4
    brightness = photo[::step, ::step].astype(np.float32).mean(axis=2)
    inside = mask[::step, ::step]
    smooth = gaussian_filter(brightness, 8)
    smooth_inside = np.where(inside, smooth, np.nan)
    disc = np.unravel_index(np.nanargmax(smooth_inside), smooth.shape)
    ys, xs = np.nonzero(inside)
    centre = (float(xs.mean()), float(ys.mean()))
    radius = 0.5 * (xs.max() - xs.min())
    yy, xx = np.mgrid[0 : smooth.shape[0], 0 : smooth.shape[1]]
    near_centre = (xx - centre[0]) ** 2 + (yy - centre[1]) ** 2 < (0.35 * radius) ** 2
    macula = np.unravel_index(np.nanargmin(np.where(near_centre, smooth, np.nan)), smooth.shape)
    return {
        "disc": (float(disc[1] * step), float(disc[0] * step)),
        "macula": (float(macula[1] * step), float(macula[0] * step)),
        "centre": (centre[0] * step, centre[1] * step),
        "radius": (radius * step, radius * step),
    }


class FundusGenerator:
    """Seeded generator of fundus views with planted lesions.

    Args:
        seed: random seed; each call to :meth:`sample` advances the same stream.
        size: output side in pixels.
        distractors: the harder generator: every eye also carries :data:`DISTRACTORS`
            (the same seed then draws other images than without them).
    """

    def __init__(self, seed: int = 0, size: int = IMAGE_SIZE, distractors: bool = False):
        self.rng = np.random.default_rng(seed)
        self.size = size
        self.distractors = distractors  # the harder generator: look-alikes on every eye
        photo, mask = _retina()
        self._photo = Image.fromarray(photo)
        self._mask = Image.fromarray(mask.astype(np.uint8) * 255)
        self._levels = [self._photo, self._photo.reduce(2), self._photo.reduce(4)]
        self._landmarks = retina_landmarks()

    def _choice(self, weights: dict[str, float]) -> str:
        names = list(weights)
        return names[int(self.rng.choice(len(names), p=np.array(list(weights.values()))))]

    # -- views --------------------------------------------------------------------------

    def _window(self, view: str) -> tuple[float, float, float]:
        """(centre x, centre y, side) of the photo region the view shows."""
        cx, cy = self._landmarks["centre"]
        radius = self._landmarks["radius"][0]
        if view == "whole":
            return (
                cx + self.rng.normal(0, 15),
                cy + self.rng.normal(0, 15),
                2 * radius * self.rng.uniform(1.0, 1.12),
            )
        side = float(np.exp(self.rng.uniform(np.log(180), np.log(700))))
        if view == "anatomy":
            target = self._choice({"disc": 0.4, "macula": 0.35, "border": 0.25})
            if target == "border":
                angle = self.rng.uniform(0, 2 * np.pi)
                distance = radius - side * self.rng.uniform(0.1, 0.35)
                return cx + distance * np.cos(angle), cy + distance * np.sin(angle), side
            x, y = self._landmarks[target]
            return x + self.rng.normal(0, side / 5), y + self.rng.normal(0, side / 5), side
        for _ in range(100):  # a crop inside the fundus disk
            angle = self.rng.uniform(0, 2 * np.pi)
            distance = self.rng.uniform(0, max(radius - side * 0.75, 1))
            x, y = cx + distance * np.cos(angle), cy + distance * np.sin(angle)
            if distance + side * 0.71 < radius * 1.02:
                break
        return x, y, side

    def _view(self, view: str) -> tuple[np.ndarray, np.ndarray]:
        """The view as float RGB in [0, 1] and its retina mask (rotated, maybe flipped)."""
        x, y, side = self._window(view)
        scale = side / self.size  # photo pixels per output pixel
        level = 0 if scale < 2 else 1 if scale < 4 else 2
        factor = 2**level
        angle = self.rng.uniform(0, 2 * np.pi)
        flip = -1.0 if self.rng.random() < 0.5 else 1.0
        cos, sin = np.cos(angle) * scale / factor, np.sin(angle) * scale / factor
        half = self.size / 2
        # output (u, v) -> photo level coords: centre + R * (u - half, v - half)
        a, b = cos * flip, -sin
        d, e = sin * flip, cos
        c = x / factor - a * half - b * half
        f = y / factor - d * half - e * half
        data = (a, b, c, d, e, f)
        picture = self._levels[level].transform(
            (self.size, self.size), Image.AFFINE, data, resample=Image.BILINEAR
        )
        mask_data = tuple(v * factor for v in data)  # the same map, in full-size coords
        mask = self._mask.transform(
            (self.size, self.size), Image.AFFINE, mask_data, resample=Image.NEAREST
        )
        return np.asarray(picture, dtype=np.float32) / 255.0, np.asarray(mask) > 0

    # -- lesions ------------------------------------------------------------------------

    def _place(self, radius: float, taken: list[Lesion], retina: np.ndarray):
        margin = radius + 3
        for _ in range(200):
            x = float(self.rng.uniform(margin, self.size - margin))
            y = float(self.rng.uniform(margin, self.size - margin))
            if not retina[int(y), int(x)]:
                continue
            inner = int(max(radius, 2))
            box = retina[
                max(int(y) - inner, 0) : int(y) + inner + 1,
                max(int(x) - inner, 0) : int(x) + inner + 1,
            ]
            if not box.all():
                continue
            if all((x - o.x) ** 2 + (y - o.y) ** 2 > (radius + o.radius + 6) ** 2 for o in taken):
                return x, y
        return None

    def _window_grid(self, x: float, y: float, reach: float):
        x0, x1 = max(int(x - reach), 0), min(int(x + reach) + 2, self.size)
        y0, y1 = max(int(y - reach), 0), min(int(y + reach) + 2, self.size)
        yy, xx = np.mgrid[y0:y1, x0:x1].astype(np.float32)
        return (slice(y0, y1), slice(x0, x1)), xx, yy

    def _spot(self, radii: tuple[float, float], reach: float, taken, retina):
        """A log-uniform radius, a free place on the retina and the pixel grid around it
        (``reach`` radii + 2 px): (radius, x, y, window, xx, yy), or None if none fits."""
        radius = float(np.exp(self.rng.uniform(*np.log(radii))))
        spot = self._place(radius, taken, retina)
        if spot is None:
            return None
        x, y = spot
        return (radius, x, y, *self._window_grid(x, y, radius * reach + 2))

    def _microaneurysm(self, image, taken, retina) -> Lesion | None:
        found = self._spot(MICROANEURYSM_RADIUS, 2.5, taken, retina)
        if found is None:
            return None
        radius, x, y, window, xx, yy = found
        stretch = self.rng.uniform(0.85, 1.15)
        distance = np.sqrt(((xx - x) * stretch) ** 2 + ((yy - y) / stretch) ** 2)
        edge = self.rng.uniform(0.3, 1.2) * max(radius / 3, 0.5)
        profile = 1.0 / (1.0 + np.exp((distance - radius) / edge))
        contrast = self.rng.uniform(0.35, 0.9)
        colour = np.array(
            [self.rng.uniform(0.28, 0.5), self.rng.uniform(0.02, 0.1), self.rng.uniform(0.02, 0.08)]
        )
        alpha = (profile * contrast)[..., None]
        image[window] = image[window] * (1 - alpha) + colour * alpha
        return Lesion("MICROANEURYSM", x, y, radius)

    def _exudate(self, image, taken, retina) -> Lesion | None:
        found = self._spot(EXUDATE_RADIUS, 1.6, taken, retina)
        if found is None:
            return None
        radius, x, y, window, xx, yy = found
        blob = np.zeros(xx.shape, dtype=np.float32)
        pieces = 1 if radius < 2.5 else int(self.rng.integers(2, 6))
        sharpness = self.rng.uniform(1.0, 3.0)
        for _ in range(pieces):
            bx = x + (self.rng.normal(0, radius * 0.35) if pieces > 1 else 0.0)
            by = y + (self.rng.normal(0, radius * 0.35) if pieces > 1 else 0.0)
            br = radius * (self.rng.uniform(0.4, 0.75) if pieces > 1 else 1.0)
            d2 = ((xx - bx) ** 2 + (yy - by) ** 2) / (br**2)
            blob = np.maximum(blob, np.exp(-(d2**sharpness)))
        colour = np.array(
            [self.rng.uniform(0.93, 1.0), self.rng.uniform(0.8, 0.97), self.rng.uniform(0.3, 0.8)]
        )
        alpha = (np.clip(blob * 1.3, 0, 1) * self.rng.uniform(0.55, 0.95))[..., None]
        image[window] = image[window] * (1 - alpha) + colour * alpha
        return Lesion("EXUDATE", x, y, radius)

    # -- the harder generator's look-alikes ----------------------------------------------

    def _clear_spot(self, reach: float, lesions: list[Lesion], others: list[Lesion], retina):
        """(x, y) on the retina DISTRACTOR_CLEARANCE px beyond every lesion and 3 px beyond
        the other look-alikes, for one of ``reach`` px; None when none fits."""
        margin = reach + 3
        for _ in range(200):
            x = float(self.rng.uniform(margin, self.size - margin))
            y = float(self.rng.uniform(margin, self.size - margin))
            inner = int(max(reach, 2))
            box = retina[
                max(int(y) - inner, 0) : int(y) + inner + 1,
                max(int(x) - inner, 0) : int(x) + inner + 1,
            ]
            if not (retina[int(y), int(x)] and box.all()):
                continue
            gaps = [(o, DISTRACTOR_CLEARANCE) for o in lesions] + [(o, 3) for o in others]
            if all((x - o.x) ** 2 + (y - o.y) ** 2 > (reach + o.radius + g) ** 2 for o, g in gaps):
                return x, y
        return None

    def _blend(self, image, window, alpha: np.ndarray, colour: np.ndarray) -> None:
        alpha = alpha[..., None]
        image[window] = image[window] * (1 - alpha) + colour * alpha

    def _glare_profile(self, xx, yy, x: float, y: float, radius: float) -> np.ndarray:
        distance = np.hypot(xx - x, yy - y)
        return 1.0 / (1.0 + np.exp((distance - 0.8 * radius) / (0.3 * radius)))

    def _reflex_profile(self, xx, yy, x: float, y: float, reach: float) -> np.ndarray:
        """A thin streak or shallow arc of length 2 * ``reach`` through the window."""
        angle = self.rng.uniform(0, np.pi)
        along = np.array([np.cos(angle), np.sin(angle)])
        across = np.array([-np.sin(angle), np.cos(angle)])
        bend = self.rng.uniform(-0.3, 0.3) * 2 * reach
        t = np.linspace(-0.5, 0.5, 41)[:, None]
        curve = np.array([x, y]) + t * 2 * reach * along + (1 - 4 * t**2) * bend * across
        distance = np.min(
            np.hypot(xx[..., None] - curve[:, 0], yy[..., None] - curve[:, 1]), axis=-1
        )
        half = self.rng.uniform(0.75, 2.0)
        return 1.0 / (1.0 + np.exp((distance - half) / 0.6))

    def _pigment_profile(self, xx, yy, x: float, y: float, radius: float) -> np.ndarray:
        """Two to four overlapping sharp discs: an irregular clump."""
        clump = np.zeros(xx.shape, dtype=np.float32)
        for _ in range(int(self.rng.integers(2, 5))):
            bx, by = x + self.rng.normal(0, radius * 0.3), y + self.rng.normal(0, radius * 0.3)
            br = radius * self.rng.uniform(0.45, 0.8)
            clump = np.maximum(clump, 1.0 / (1.0 + np.exp((np.hypot(xx - bx, yy - by) - br) / 0.3)))
        return clump

    def _drusen_profile(self, xx, yy, x: float, y: float, radius: float) -> np.ndarray:
        return np.exp(-(((xx - x) ** 2 + (yy - y) ** 2) / radius**2) * 1.2)

    def _look_alike_colour(self, kind: str) -> np.ndarray:
        """One look-alike's RGB colour in [0, 1], drawn from its kind's ranges."""
        low, high = LOOK_ALIKE_COLOURS[kind]
        return np.array([self.rng.uniform(a, b) if a != b else a for a, b in zip(low, high)])

    def _look_alike_reaches(self, kind: str) -> list[float]:
        """Radii (a reflex: half its length) of one look-alike, or of a drusen cluster's
        2-5 spots; log-uniform in the kind's range (a reflex's length uniform)."""
        low, high = LOOK_ALIKE_REACH[kind]
        if kind == "REFLEX":
            return [float(self.rng.uniform(low, high))]
        count = int(self.rng.integers(2, 6)) if kind == "DRUSEN" else 1
        return [float(np.exp(self.rng.uniform(np.log(low), np.log(high)))) for _ in range(count)]

    def _look_alikes(self, image, lesions: list[Lesion], retina) -> list[Lesion]:
        """Paint 1-3 glares, 1-3 reflexes, 1-3 pigment clumps and 0-2 clusters of 2-5
        drusen onto ``image`` away from the ``lesions``; the look-alikes painted."""
        kinds = (
            ["GLARE"] * int(self.rng.integers(1, 4))
            + ["REFLEX"] * int(self.rng.integers(1, 4))
            + ["PIGMENT"] * int(self.rng.integers(1, 4))
            + ["DRUSEN"] * int(self.rng.integers(0, 3))
        )
        profiles = {"GLARE": self._glare_profile, "REFLEX": self._reflex_profile,
                    "PIGMENT": self._pigment_profile, "DRUSEN": self._drusen_profile}  # fmt: skip
        painted: list[Lesion] = []
        for kind in kinds:
            for reach in self._look_alike_reaches(kind):
                spot = self._clear_spot(reach, lesions, painted, retina)
                if spot is None:
                    continue
                window, xx, yy = self._window_grid(*spot, reach * 1.6 + 3)
                profile = profiles[kind](xx, yy, *spot, reach)
                alpha = np.clip(profile, 0, 1) * self.rng.uniform(*LOOK_ALIKE_STRENGTH[kind])
                self._blend(image, window, alpha, self._look_alike_colour(kind))
                painted.append(Lesion(kind, spot[0], spot[1], reach))
        return painted

    def _kinds(self, label: int, count: int) -> list[str]:
        """Lesion kinds for a label: MICROANEURYSM images have only microaneurysms; an
        EXUDATE image has at least one exudate and, 30% of the time, microaneurysms too."""
        if CLASSES[label] == "MICROANEURYSM":
            return ["MICROANEURYSM"] * count
        exudates = count
        if count > 1 and self.rng.random() < 0.3:
            exudates = int(self.rng.integers(1, count))
        return ["EXUDATE"] * exudates + ["MICROANEURYSM"] * (count - exudates)

    # -- rendering ----------------------------------------------------------------------

    def _render(self, image: np.ndarray, retina: np.ndarray, rendering: str) -> np.ndarray:
        gain = self.rng.uniform(0.7, 1.3)
        tint = self.rng.uniform(0.85, 1.15, size=3)
        ramp = np.linspace(-1, 1, self.size, dtype=np.float32)
        direction = self.rng.uniform(0, 2 * np.pi)
        gradient = 1 + self.rng.uniform(0, 0.15) * (
            np.cos(direction) * ramp[None, :] + np.sin(direction) * ramp[:, None]
        )
        image = np.clip(image * gain * tint * gradient[..., None], 0, 1) ** self.rng.uniform(
            0.75, 1.35
        )
        if rendering != "colour":
            luminance = np.array([0.299, 0.587, 0.114], dtype=np.float32)
            channel = image[..., 1] if rendering == "green" else image @ luminance
            inside = channel[retina] if retina.any() else channel.ravel()
            mean, std = float(inside.mean()), float(inside.std()) + 1e-6
            target_mean, target_std = self.rng.uniform(0.38, 0.6), self.rng.uniform(0.06, 0.16)
            channel = (channel - mean) / std * target_std + target_mean
            channel = np.where(retina, channel, channel * 0.15)
            image = np.repeat(channel[..., None], 3, axis=2)
        noise = self.rng.normal(0, self.rng.uniform(0.004, 0.02), image.shape)
        return np.clip(image + noise, 0, 1)

    # -- public -------------------------------------------------------------------------

    def sample(
        self,
        label: int | None = None,
        lesions: int | None = None,
        view: str | None = None,
        rendering: str | None = None,
        kinds: list[str] | None = None,
    ) -> Sample:
        """One image. ``label`` picks the class (random if None); ``lesions`` how many a
        non-NORMAL image gets (1-4 at random if None); ``view``/``rendering`` as in
        :data:`VIEWS`/:data:`RENDERINGS` (random if None); ``kinds`` plants exactly
        these lesion kinds (the label then follows :data:`LABEL_RULE`)."""
        if label is None and kinds is None:
            label = int(self.rng.integers(0, len(CLASSES)))
        view = view or self._choice(VIEWS)
        rendering = rendering or self._choice(RENDERINGS)
        image, retina = self._view(view)
        image = image.copy()
        if kinds is None:
            count = lesions if lesions is not None else int(self.rng.integers(1, 5))
            kinds = [] if label == 0 else self._kinds(label, count)
        planted: list[Lesion] = []
        for kind in kinds:
            plant = self._microaneurysm if kind == "MICROANEURYSM" else self._exudate
            lesion = plant(image, planted, retina)
            if lesion is not None:
                planted.append(lesion)
        look_alikes = self._look_alikes(image, planted, retina) if self.distractors else []
        image = self._render(image, retina, rendering)
        pixels = np.round(image * 255).astype(np.uint8)
        return Sample(pixels, label_for(planted), planted, view, rendering, look_alikes)

    def _pick_lesion(self, sample: Sample) -> tuple[int, Lesion, list[Lesion]]:
        """One of the sample's lesions at random: its index, itself and the others."""
        index = int(self.rng.integers(len(sample.lesions)))
        return index, sample.lesions[index], sample.lesions[:index] + sample.lesions[index + 1 :]

    def hide_lesion(self, sample: Sample) -> tuple[np.ndarray, list[Lesion]] | None:
        """The sample with one lesion wholly under a mid-gray box that touches no other
        lesion, and the lesions still visible; None when no such box fits. Training on it
        teaches what occlusion assumes: a hidden lesion is no evidence."""
        if not sample.lesions:
            return None
        _, lesion, others = self._pick_lesion(sample)
        for _ in range(20):
            side = int(self.rng.integers(max(12, int(2 * lesion.radius) + 3), 33))
            low_x, low_y = lesion.x + lesion.radius + 1 - side, lesion.y + lesion.radius + 1 - side
            high_x, high_y = lesion.x - lesion.radius - 1, lesion.y - lesion.radius - 1
            if high_x < low_x or high_y < low_y:
                continue
            x0 = int(np.clip(self.rng.uniform(low_x, high_x), 0, self.size - side))
            y0 = int(np.clip(self.rng.uniform(low_y, high_y), 0, self.size - side))
            inside = (
                x0 <= lesion.x - lesion.radius
                and lesion.x + lesion.radius < x0 + side
                and y0 <= lesion.y - lesion.radius
                and lesion.y + lesion.radius < y0 + side
            )
            if inside and not any(other.covered_by(x0, y0, side) for other in others):
                image = sample.image.copy()
                image[y0 : y0 + side, x0 : x0 + side] = 128
                return image, others
        return None

    def partly_hide_lesion(self, sample: Sample) -> tuple[np.ndarray, int, float] | None:
        """The sample with one lesion partly under a mid-gray box that touches no other
        lesion: (image, the lesion's index, the share of its disk still visible, 0.1-0.9);
        None when no such box fits. Training on it teaches that evidence fades as the
        occluder covers more of a lesion, so the lowest occlusion probability lies where
        the patch covers the lesion best, not anywhere it covers half."""
        if not sample.lesions:
            return None
        index, lesion, others = self._pick_lesion(sample)
        reach = lesion.radius + 1  # the soft edge reaches about a pixel past the radius
        offsets = np.linspace(-reach, reach, 15)
        disk_x, disk_y = np.meshgrid(offsets + lesion.x, offsets + lesion.y)
        in_disk = (disk_x - lesion.x) ** 2 + (disk_y - lesion.y) ** 2 <= reach**2
        disk_x, disk_y = disk_x[in_disk], disk_y[in_disk]
        for _ in range(20):
            side = int(self.rng.integers(12, 33))
            x0 = int(round(lesion.x + self.rng.uniform(-side - reach, reach)))
            y0 = int(round(lesion.y + self.rng.uniform(-side - reach, reach)))
            x0, y0 = int(np.clip(x0, 0, self.size - side)), int(np.clip(y0, 0, self.size - side))
            under = (disk_x >= x0) & (disk_x < x0 + side) & (disk_y >= y0) & (disk_y < y0 + side)
            visible = 1.0 - float(under.mean())
            if 0.1 <= visible <= 0.9 and not any(o.covered_by(x0, y0, side) for o in others):
                image = sample.image.copy()
                image[y0 : y0 + side, x0 : x0 + side] = 128
                return image, index, visible
        return None

    def gray_box(self, sample: Sample, max_side: int = 48) -> np.ndarray:
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
