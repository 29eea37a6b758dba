"""Synthetic chest-CT-like volumes with pulmonary nodules (the 3-D demo model's task).

A volume is a (D, H, W) block of Hounsfield units, :data:`VOLUME_SIDE` voxels a side at a
nominal :data:`SPACING_MM`: a slab of a chest — air around an elliptic body with a fat
layer under the skin, a spine behind (round to squarish), two lungs (smooth or bumpy) of
parenchyma (about -850 HU, with low-frequency texture) and in each lung a tree of vessels
(soft-tissue tubes that branch from the hilum and thin at each generation, straight or
wandering, with a bulge at each bifurcation). Planted nodules (:class:`Nodule`) are solid
(0-80 HU) or ground-glass (-650 to -400 HU) spheroids 5-9 voxels across, free in the
lung, touching a vessel, or touching the pleura. The hard negatives are in every volume:
bifurcation bulges are blobs of nodule density, and the vessels cross every slice as
round dots. Partial-volume blur and noise finish it.

``ChestCTGenerator(varied=True)`` draws more of the anatomy a chest slab shows (off by
default, so a seed's volumes stay what they were): lungs that end inside the slab (an apex,
or a base over the dome of the diaphragm) and lobes that meet in a notch, and a second kind
of vessel tree that curves continuously, tapers along its length, gives off side branches
along the way without a bulge, and crosses the other lung's vessels and its own.
``varied_nodules=True`` (also off by default) draws nodules as real ones vary: lobulated
outlines, margins from sharp to soft, vascular nodules that sit on a bifurcation or a branch
point (larger than the bulge there) or sink into the vessel, and pleural ones on a broad base.

Label rule (:data:`LABEL_RULE`): any nodule makes it NODULE, else NORMAL. Everything is
seeded: the same seed gives the same volumes, nodules and labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

__all__ = [
    "CLASSES",
    "VOLUME_SIDE",
    "SPACING_MM",
    "HU_WINDOW",
    "PARENCHYMA_HU",
    "LABEL_RULE",
    "Nodule",
    "VolumeSample",
    "ChestCTGenerator",
    "label_for",
    "to_unit",
]

CLASSES = ("NORMAL", "NODULE")
VOLUME_SIDE = 48
SPACING_MM = (5.0, 5.0, 5.0)  # nominal (slice, row, column) spacing the model is trained at
HU_WINDOW = (-1000.0, 400.0)  # the model's input: HU clipped to this range, scaled to [0, 1]
PARENCHYMA_HU = -850.0  # the occluder the demo model's heatmaps are made with
LABEL_RULE = "any nodule: NODULE; else NORMAL"
NODULE_RADIUS = {"solid": (2.5, 4.5), "ground-glass": (2.5, 4.5)}  # voxels
NODULE_KINDS = {"solid": 0.65, "ground-glass": 0.35}
NODULE_SITES = {"free": 0.5, "vascular": 0.3, "pleural": 0.2}


@dataclass(frozen=True)
class Nodule:
    """A planted nodule: centre (z, y, x) and radius in voxels, density in HU."""

    z: float
    y: float
    x: float
    radius: float
    hu: float
    kind: str  # "solid" | "ground-glass"
    site: str  # "free" | "vascular" | "pleural"

    def distance(self, z: float, y: float, x: float) -> float:
        """Distance in voxels from (z, y, x) to the nodule's centre."""
        return float(np.sqrt((z - self.z) ** 2 + (y - self.y) ** 2 + (x - self.x) ** 2))


@dataclass(frozen=True)
class VolumeSample:
    """A generated volume (D, H, W) float32 HU, its nodules and its class index."""

    volume: np.ndarray
    nodules: tuple[Nodule, ...]
    label: int


def label_for(nodules) -> int:
    """Class index under :data:`LABEL_RULE`."""
    return 1 if len(nodules) else 0


def to_unit(volume: np.ndarray) -> np.ndarray:
    """HU -> the model's [0, 1] input (:data:`HU_WINDOW`)."""
    low, high = HU_WINDOW
    return np.clip((volume - low) / (high - low), 0.0, 1.0).astype(np.float32)


def _segment_distance(points: tuple, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Distance from grid points (z, y, x arrays) to the segment start-end."""
    axis = end - start
    length2 = float(axis @ axis) or 1.0
    rel = [p - s for p, s in zip(points, start)]
    t = np.clip(sum(r * a for r, a in zip(rel, axis)) / length2, 0.0, 1.0)
    return np.sqrt(sum((r - t * a) ** 2 for r, a in zip(rel, axis)))


def _junctions(segments: list) -> list[tuple[np.ndarray, float]]:
    """Points where vessels meet, with the thicker vessel's radius there: a bifurcation
    (a segment that forks at its end) or a point two segments leave (a side branch)."""
    starts: dict[tuple, float] = {}
    junctions = []
    for start, end, vessel, forks in segments:
        key = tuple(np.round(start, 3))
        if key in starts:  # two branches leave this point
            junctions.append((start, max(vessel, starts[key])))
        starts[key] = vessel
        if forks:
            junctions.append((end, vessel))
    return junctions


class ChestCTGenerator:
    """Seeded generator of :class:`VolumeSample` (see the module's docstring)."""

    def __init__(
        self,
        seed: int = 0,
        side: int = VOLUME_SIDE,
        varied: bool = False,
        varied_nodules: bool = False,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.side = side
        self.varied = varied
        self.varied_nodules = varied_nodules
        self.grid = np.ogrid[:side, :side, :side]

    # -- anatomy -----------------------------------------------------------------------
    def _anatomy(self) -> tuple[np.ndarray, np.ndarray, list]:
        rng, n = self.rng, self.side
        z, y, x = self.grid
        cy, cx = n / 2 + rng.uniform(-2, 2), n / 2 + rng.uniform(-2, 2)
        ry, rx = n * rng.uniform(0.36, 0.44), n * rng.uniform(0.44, 0.49)
        body_r = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2
        volume = np.full((n, n, n), -1000.0, np.float32)
        body = np.broadcast_to(body_r <= 1.0, volume.shape)
        volume[body] = rng.uniform(20, 60)
        volume[np.broadcast_to((body_r > 0.8) & (body_r <= 1.0), volume.shape)] = rng.uniform(
            -120, -80
        )
        # the spine: round to squarish (a superellipse), and where it sits varies
        power, half = rng.uniform(2, 6), 0.09 * n * rng.uniform(0.8, 1.2)
        spine_y = cy + ry * rng.uniform(0.7, 0.82)
        spine = (np.abs(y - spine_y) / half) ** power + (np.abs(x - cx) / half) ** power <= 1
        volume[np.broadcast_to(spine, volume.shape)] = rng.uniform(300, 600)
        lungs = np.zeros(volume.shape, bool)
        hila = []
        # lung surfaces: smooth ellipsoids, or bumpy ones (low-frequency noise on the
        # implicit surface, which also makes concave junctions like overlapping lobes)
        bumps = ndimage.zoom(rng.standard_normal((6, 6, 6)).astype(np.float32), n / 6, order=1)
        bumpiness = rng.choice([0.0, rng.uniform(0.1, 0.35)])
        for side_sign in (-1, 1):
            lx = cx + side_sign * rx * rng.uniform(0.42, 0.5)
            ly = cy - ry * rng.uniform(0.0, 0.12)
            lz = n / 2 + rng.uniform(-4, 4)
            sx, sy, sz = rx * rng.uniform(0.3, 0.38), ry * rng.uniform(0.55, 0.7), n * 0.7
            shape = ((x - lx) / sx) ** 2 + ((y - ly) / sy) ** 2 + ((z - lz) / sz) ** 2
            lung = (shape + bumpiness * bumps <= 1.0) & (body_r <= 0.72)
            if self.varied:
                lung, lz = self._lung_ends(lung, (lx, ly, sx, sy))
            lungs |= lung
            hila.append(np.array([lz, ly, lx - side_sign * sx * 0.75]))
        texture = ndimage.gaussian_filter(rng.standard_normal(volume.shape).astype(np.float32), 2)
        volume[lungs] = PARENCHYMA_HU + rng.uniform(-40, 40) + 120 * texture[lungs]
        return volume, lungs, hila

    def _lung_ends(self, lung: np.ndarray, outline: tuple) -> tuple[np.ndarray, float]:
        """A lung of the varied draw: it may end inside the slab (an apex that narrows
        to a rounded tip, or a base cut by the dome of the diaphragm) and may be split
        into lobes that meet in a notch (a fissure seen as a soft-tissue cusp). Returns the
        lung and the height its vessels leave the hilum at."""
        rng, n = self.rng, self.side
        z, y, x = self.grid
        lx, ly, sx, sy = outline
        top, bottom = 0.0, float(n)
        end = rng.choice(["through", "apex", "base"], p=[0.3, 0.35, 0.35])
        radial = ((x - lx) / sx) ** 2 + ((y - ly) / sy) ** 2  # 0 on the lung's axis
        if end == "apex":  # the lung narrows upwards (low z) to a rounded tip
            top = rng.uniform(0.05, 0.4) * n
            lung = lung & (radial <= np.clip((z - top) / rng.uniform(8, 20), 0, 1))
        elif end == "base":  # the dome of the diaphragm rises into the lung from below
            bottom = rng.uniform(0.6, 0.95) * n
            lung = lung & (z < bottom - rng.uniform(4, 14) * (1 - np.clip(radial, 0, 1)))
        if rng.random() < 0.5:  # a fissure: a thin slanted sheet between two lobes
            tilt = rng.uniform(-0.8, 0.8, 2)
            level = rng.uniform(top + 0.25 * (bottom - top), top + 0.75 * (bottom - top))
            sheet = np.abs(z - level - tilt[0] * (y - ly) - tilt[1] * (x - lx))
            lung = lung & (sheet > rng.uniform(0.6, 1.6))
        return lung, float(np.clip((top + bottom) / 2, 6, n - 6))

    def _vessels(self, hila: list) -> list[tuple[np.ndarray, np.ndarray, float, bool]]:
        """Segments (start, end, radius, forks at its end) of one branching tree per lung."""
        rng = self.rng
        segments = []
        for hilum, sign in zip(hila, (1, -1)):  # left hilum grows to +x, right to -x
            if self.varied and rng.random() < 0.6:
                for _ in range(2):  # an artery and a vein: two trees that cross
                    segments += self._curving_tree(hilum, sign)
                continue
            stack = [(hilum, np.array([0.0, 0.0, float(sign)]), rng.uniform(1.6, 2.2), 0)]
            tortuous = rng.random() < 0.5  # vessels that wander: a chain of short pieces
            while stack:
                start, direction, radius, generation = stack.pop()
                direction = direction + rng.normal(0, 0.35, 3)
                direction /= np.linalg.norm(direction)
                length = rng.uniform(5, 9) * (1 - 0.12 * generation)
                pieces = 3 if tortuous else 1
                for piece in range(pieces):
                    if tortuous:
                        direction = direction + rng.normal(0, 0.45, 3)
                        direction /= np.linalg.norm(direction)
                    end = start + direction * length / pieces
                    last = piece == pieces - 1
                    segments.append((start, end, radius, last and generation < 4))
                    start = end
                if generation < 4:
                    for _ in range(2):
                        bend = rng.normal(0, 0.7, 3)
                        stack.append((end, direction + bend, radius * 0.78, generation + 1))
        return segments

    def _curving_tree(self, hilum: np.ndarray, sign: int) -> list:
        """A vessel tree of the varied draw, as unit-length pieces: each branch bends a
        little at every voxel, thins along its length, and gives off thinner side branches
        at random along the way; it ends where it has thinned to below 0.6 voxels. How
        much it bends, thins and branches is drawn per tree, from stiff, sparse trees to
        wandering, bushy ones."""
        rng = self.rng
        bend, taper = rng.uniform(0.1, 0.4), rng.uniform(0.975, 0.995)
        branching, daughter = rng.uniform(0.03, 0.14), rng.uniform(0.7, 0.9)
        heading = np.array([*rng.normal(0, 0.5, 2), float(sign)])
        stack = [(hilum.astype(float), heading, rng.uniform(1.6, 2.3))]
        segments: list = []
        while stack and len(segments) < 500:
            start, direction, radius = stack.pop()
            direction = direction + rng.normal(0, bend, 3)
            direction /= np.linalg.norm(direction)
            end = start + direction
            if radius < 0.6 or not np.all((end >= 0) & (end < self.side)):
                continue
            segments.append((start, end, radius, False))
            stack.append((end, direction, radius * taper))
            if rng.random() < branching:
                stack.append((end.copy(), direction + rng.normal(0, 1, 3), radius * daughter))
        return segments

    def _draw_tubes(self, volume, lungs, segments, hu: float) -> None:
        n = self.side
        for start, end, radius, forks in segments:
            low = np.maximum(np.floor(np.minimum(start, end) - radius - 1), 0).astype(int)
            high = np.minimum(np.ceil(np.maximum(start, end) + radius + 2), n).astype(int)
            if np.any(high <= low):
                continue
            box = tuple(slice(a, b) for a, b in zip(low, high))
            points = np.ogrid[box]
            alpha = np.clip(radius + 0.5 - _segment_distance(points, start, end), 0, 1)
            if forks:  # the bulge of a bifurcation; the last generation just ends
                bulge = np.sqrt(sum((p - e) ** 2 for p, e in zip(points, end)))
                alpha = np.maximum(alpha, np.clip(radius * 1.25 + 0.5 - bulge, 0, 1))
            alpha = alpha * lungs[box]
            volume[box] = volume[box] * (1 - alpha) + hu * alpha

    # -- nodules -----------------------------------------------------------------------
    def _nodule(self, lungs, depth, segments, junctions: list) -> Nodule | None:
        rng = self.rng
        kind = rng.choice(list(NODULE_KINDS), p=list(NODULE_KINDS.values()))
        site = rng.choice(list(NODULE_SITES), p=list(NODULE_SITES.values()))
        radius = float(rng.uniform(*NODULE_RADIUS[kind]))
        hu = float(rng.uniform(0, 80) if kind == "solid" else rng.uniform(-650, -400))
        margin = 3
        if site == "vascular":
            centre = self._vascular_centre(lungs, depth, segments, junctions, radius)
            if centre is None:
                return None
        else:
            if site == "pleural":  # the varied draw's may sit on a broader base
                low, high = radius * (rng.uniform(0.3, 0.6) if self.varied_nodules else 0.6), radius
            else:
                low, high = radius + 1.5, np.inf
            candidates = np.argwhere((depth >= low) & (depth <= high))
            candidates = candidates[
                np.all((candidates >= margin) & (candidates < self.side - margin), axis=1)
            ]
            if not len(candidates):
                return None
            centre = candidates[rng.integers(len(candidates))] + rng.uniform(-0.5, 0.5, 3)
        return Nodule(*map(float, centre), radius, hu, str(kind), str(site))

    def _vascular_centre(
        self, lungs, depth, segments, junctions: list, radius: float
    ) -> np.ndarray | None:
        """Where a nodule touching a vessel goes: beside a piece of vessel, its centre
        0.8 radius beyond the vessel's wall, inside the lung. The varied draw also sinks
        it 0.4-0.9 radius into the wall or puts it on a point where vessels meet, and tries
        up to 12 places: most pieces of a tree lie outside the lung or near its surface, so
        a single try leaves vascular nodules at 5-7% of nodules instead of 30%."""
        rng = self.rng
        for _ in range(12 if self.varied_nodules else 1):
            if self.varied_nodules and rng.random() < 0.5:
                centre = self._at_junction(junctions, radius)
            else:
                start, end, vessel, _ = segments[rng.integers(len(segments))]
                point = start + (end - start) * rng.uniform(0.2, 0.8)
                normal = np.cross(end - start, rng.normal(0, 1, 3))
                normal /= np.linalg.norm(normal) or 1.0
                sunk = rng.uniform(0.4, 0.9) if self.varied_nodules else 0.8
                centre = point + normal * (vessel + radius * sunk)
            if centre is None:
                continue
            inside = tuple(np.clip(np.round(centre).astype(int), 0, self.side - 1))
            if lungs[inside] and depth[inside] >= radius * 0.8:
                return centre
        return None

    def _at_junction(self, junctions: list, radius: float) -> np.ndarray | None:
        """A nodule's centre on one of the ``junctions`` (:func:`_junctions`), a little
        off it; None where the vessel there is too thick for a nodule of ``radius`` to
        stand out of its bulge (radius < 1.25 vessel + 1)."""
        rng = self.rng
        if not junctions:
            return None
        point, vessel = junctions[rng.integers(len(junctions))]
        if radius < 1.25 * vessel + 1.0:
            return None
        return point + rng.normal(0, 0.3 * radius, 3)

    def _draw_nodule(self, volume, lungs, nodule: Nodule) -> None:
        n, r, rng = self.side, nodule.radius, self.rng
        stretch = rng.uniform(0.85, 1.15, 3)
        centre = np.array([nodule.z, nodule.y, nodule.x])
        reach = 1.4 if self.varied_nodules else 1.2
        low = np.maximum(np.floor(centre - r * reach - 1), 0).astype(int)
        high = np.minimum(np.ceil(centre + r * reach + 2), n).astype(int)
        box = tuple(slice(a, b) for a, b in zip(low, high))
        points = np.ogrid[box]
        offsets = [(p - c) / s for p, c, s in zip(points, centre, stretch)]
        d = np.sqrt(sum(o**2 for o in offsets))
        if self.varied_nodules:
            alpha = self._lobulated(offsets, d, r)
        else:
            alpha = np.clip(r + 0.5 - d, 0, 1)
        alpha = alpha * ndimage.binary_dilation(lungs[box], iterations=1)
        volume[box] = volume[box] * (1 - alpha) + nodule.hu * alpha

    def _lobulated(self, offsets: list, d: np.ndarray, r: float) -> np.ndarray:
        """Occupancy of a nodule of the varied draw: its radius swells and dips by up to
        15% with direction (a few lobes about random axes), and its margin runs from a
        one-voxel edge to a soft one (a logistic ramp of slope 1.5-4 per voxel)."""
        rng = self.rng
        bound = np.full(d.shape, r, np.float64)
        amplitude = rng.uniform(0.0, 0.15)
        for _ in range(3):
            axis = rng.normal(0, 1, 3)
            axis /= np.linalg.norm(axis)
            cosine = sum(o * a for o, a in zip(offsets, axis)) / np.maximum(d, 1e-6)
            lobes, phase = int(rng.integers(2, 5)), rng.uniform(0, 2 * np.pi)
            bound = bound + r * amplitude / 3 * np.cos(
                lobes * np.arccos(np.clip(cosine, -1, 1)) + phase
            )
        slope = rng.uniform(1.5, 4.0)
        return 1.0 / (1.0 + np.exp(-slope * (bound + 0.5 - d)))

    # -- samples -----------------------------------------------------------------------
    def sample(self, label: int | None = None, nodules: int | None = None) -> VolumeSample:
        """One volume; ``label`` picks the class (else 50/50), ``nodules`` how many (1-3)."""
        rng = self.rng
        if label is None:
            label = int(rng.random() < 0.5)
        count = 0 if label == 0 else (nodules or int(rng.choice([1, 1, 1, 2, 2, 3])))
        volume, lungs, hila = self._anatomy()
        segments = self._vessels(hila)
        self._draw_tubes(volume, lungs, segments, float(rng.uniform(20, 70)))
        depth = ndimage.distance_transform_edt(lungs) if count else None
        junctions = _junctions(segments) if count and self.varied_nodules else []
        planted: list[Nodule] = []
        for _ in range(count * 20):
            if len(planted) == count:
                break
            nodule = self._nodule(lungs, depth, segments, junctions)
            if nodule is not None and all(
                nodule.distance(o.z, o.y, o.x) > nodule.radius + o.radius + 2 for o in planted
            ):
                planted.append(nodule)
        for nodule in planted:
            self._draw_nodule(volume, lungs, nodule)
        volume = ndimage.gaussian_filter(volume, rng.uniform(0.5, 0.8))
        volume += rng.normal(0, rng.uniform(10, 35), volume.shape).astype(np.float32)
        if rng.random() < 0.5:  # left-right flip
            volume = volume[:, :, ::-1].copy()
            planted = [
                Nodule(o.z, o.y, self.side - 1 - o.x, o.radius, o.hu, o.kind, o.site)
                for o in planted
            ]
        return VolumeSample(volume.astype(np.float32), tuple(planted), label_for(planted))
