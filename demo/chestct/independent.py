"""A second chest-CT-like volume generator, written apart from krypton.synthetic.chestct to the same
spec, for evaluating the demo model on volumes its training code never drew.

Same spec (48^3 HU volumes; air, body with a fat layer, spine, two lungs with branching
vessels; solid 0-80 HU or ground-glass -650 to -400 HU nodules 5-9 voxels across, free,
touching a vessel or touching the pleura; any nodule makes it NODULE), different drawing:
the body is a superellipse, each lung a union of overlapping balls, vessels random walks of
balls that fork at random, nodules smooth logistic-edged blobs with lobulated outlines, and
the noise is box-filtered rather than Gaussian-blurred.
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from krypton.synthetic.chestct import VOLUME_SIDE, Nodule, VolumeSample

__all__ = ["IndependentChestCT"]


class IndependentChestCT:
    """Seeded volumes with :meth:`sample` like
    :class:`krypton.synthetic.chestct.ChestCTGenerator`."""

    def __init__(self, seed: int = 0, side: int = VOLUME_SIDE) -> None:
        self.rng = np.random.default_rng(seed + 10_000)
        self.n = side
        self.zz, self.yy, self.xx = np.indices((side, side, side), dtype=np.float32)

    def _ball(self, centre, radius: float) -> tuple[tuple[slice, ...], np.ndarray]:
        """Bounding box of a ball and its soft (0..1) occupancy there."""
        lo = [max(int(c - radius - 2), 0) for c in centre]
        hi = [min(int(c + radius + 3), self.n) for c in centre]
        box = tuple(slice(a, b) for a, b in zip(lo, hi))
        d = np.sqrt(
            (self.zz[box] - centre[0]) ** 2
            + (self.yy[box] - centre[1]) ** 2
            + (self.xx[box] - centre[2]) ** 2
        )
        return box, np.clip(radius + 0.5 - d, 0.0, 1.0)

    def _body(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rng, n = self.rng, self.n
        a, b = n * rng.uniform(0.37, 0.43), n * rng.uniform(0.45, 0.49)
        cy, cx = n / 2 + rng.normal(0, 1), n / 2 + rng.normal(0, 1)
        power = rng.uniform(2.2, 3.0)
        shape = np.abs((self.yy - cy) / a) ** power + np.abs((self.xx - cx) / b) ** power
        vol = np.where(shape <= 1.0, rng.normal(40, 8), -1000.0).astype(np.float32)
        vol[(shape > 0.78) & (shape <= 1.0)] = rng.normal(-100, 10)
        vertebra = (np.abs(self.yy - (cy + 0.75 * a)) < 0.08 * n) & (
            np.abs(self.xx - cx) < 0.07 * n
        )
        vol[vertebra] = rng.uniform(350, 600)
        lungs = np.zeros(vol.shape, np.float32)
        for sign in (-1.0, 1.0):
            centre_x = cx + sign * b * rng.uniform(0.44, 0.52)
            for _ in range(7):  # a lung: overlapping balls along a tilted axis
                t = rng.uniform(-1, 1)
                centre = (
                    n / 2 + t * n * 0.55,
                    cy - a * 0.05 + rng.normal(0, a * 0.12),
                    centre_x + rng.normal(0, b * 0.05),
                )
                box, ball = self._ball(centre, rng.uniform(0.2, 0.26) * n)
                lungs[box] = np.maximum(lungs[box], ball)
        lung_mask = (lungs > 0.5) & (shape <= 0.7) & (np.abs(self.xx - cx) > 0.1 * n)
        parenchyma = rng.uniform(-890, -810)
        wobble = ndimage.uniform_filter(rng.normal(0, 1, vol.shape).astype(np.float32), 5)
        vol[lung_mask] = parenchyma + 250 * wobble[lung_mask]
        return vol, lung_mask, np.array([cy, cx])

    def _vessel_tree(self, vol, lungs, hilum, heading) -> list[tuple[np.ndarray, float]]:
        """Random-walk vessels of balls from the hilum; returns (centre, radius) points."""
        rng = self.rng
        hu = rng.uniform(25, 70)
        walkers = [(np.array(hilum, float), np.array(heading, float), rng.uniform(1.7, 2.3))]
        points = []
        steps = 0
        while walkers and steps < 400:
            steps += 1
            position, heading, radius = walkers.pop()
            heading = heading + rng.normal(0, 0.25, 3)
            heading /= np.linalg.norm(heading)
            position = position + heading
            inside = np.all((position >= 0) & (position < self.n))
            if not inside or radius < 0.6:
                continue
            here = tuple(int(p) for p in position)
            if lungs[here]:
                box, ball = self._ball(position, radius)
                ball = ball * lungs[box]
                vol[box] = vol[box] * (1 - ball) + hu * ball
                points.append((position.copy(), radius))
            radius *= 0.985
            walkers.append((position, heading, radius))
            if rng.random() < 0.09:  # fork: a thinner daughter leaves at an angle
                turn = rng.normal(0, 1, 3)
                walkers.append((position.copy(), heading + turn, radius * 0.8))
        return points

    def _place(self, lungs, depth, points, kind, site) -> Nodule | None:
        rng, n = self.rng, self.n
        radius = rng.uniform(2.5, 4.5)
        hu = rng.uniform(0, 80) if kind == "solid" else rng.uniform(-650, -400)
        if site == "vascular" and points:
            centre, vessel = points[rng.integers(len(points))]
            offset = rng.normal(0, 1, 3)
            centre = centre + offset / np.linalg.norm(offset) * (vessel + 0.8 * radius)
        elif site == "pleural":
            zone = np.argwhere((depth > 0.5 * radius) & (depth <= radius))
            if not len(zone):
                return None
            centre = zone[rng.integers(len(zone))].astype(float)
        else:
            zone = np.argwhere(depth > radius + 1.5)
            if not len(zone):
                return None
            centre = zone[rng.integers(len(zone))].astype(float)
        if np.any(centre < 3) or np.any(centre > n - 4):
            return None
        if not lungs[tuple(int(round(c)) for c in centre)]:
            return None
        return Nodule(*map(float, centre), float(radius), float(hu), kind, site)

    def _paint(self, vol, lungs, nodule: Nodule) -> None:
        rng = self.rng
        centre = (nodule.z, nodule.y, nodule.x)
        box, _ = self._ball(centre, nodule.radius * 1.3)
        dz, dy, dx = (self.zz[box] - centre[0], self.yy[box] - centre[1], self.xx[box] - centre[2])
        d = np.sqrt(dz**2 + dy**2 + dx**2) + 1e-6
        lobes = 1 + 0.12 * np.sin(rng.integers(2, 5) * np.arctan2(dy, dx) + rng.uniform(0, 6))
        weight = 1 / (1 + np.exp((d - nodule.radius * lobes) * 3.0))
        weight = weight * ndimage.binary_dilation(lungs[box])
        vol[box] = vol[box] * (1 - weight) + nodule.hu * weight

    def sample(self, label: int | None = None, nodules: int | None = None) -> VolumeSample:
        """One volume; ``label`` 0 (NORMAL) or 1 (NODULE), else a coin flip."""
        rng = self.rng
        label = int(rng.integers(2)) if label is None else label
        count = 0 if label == 0 else (nodules or int(rng.integers(1, 4)))
        vol, lungs, (cy, cx) = self._body()
        points: list = []
        for sign in (-1.0, 1.0):
            xs = np.nonzero(lungs.any(axis=(0, 1)))[0]
            side_xs = xs[xs < cx] if sign < 0 else xs[xs > cx]
            if not len(side_xs):
                continue
            medial = side_xs.max() if sign < 0 else side_xs.min()
            hilum = (self.n / 2 + rng.normal(0, 2), cy, medial - sign * 1.0)
            for _ in range(2):
                heading = (rng.normal(0, 0.6), rng.normal(0, 0.4), sign)
                points += self._vessel_tree(vol, lungs, hilum, heading)
        depth = ndimage.distance_transform_edt(lungs)
        planted: list[Nodule] = []
        tries = 0
        while len(planted) < count and tries < 100:
            tries += 1
            kind = "solid" if rng.random() < 0.6 else "ground-glass"
            site = rng.choice(["free", "vascular", "pleural"], p=[0.45, 0.3, 0.25])
            nodule = self._place(lungs, depth, points, kind, str(site))
            if nodule and all(
                nodule.distance(o.z, o.y, o.x) > nodule.radius + o.radius + 2 for o in planted
            ):
                planted.append(nodule)
        for nodule in planted:
            self._paint(vol, lungs, nodule)
        noise = rng.normal(0, rng.uniform(25, 60), vol.shape).astype(np.float32)
        vol = ndimage.uniform_filter(vol, 3) * 0.6 + vol * 0.4 + ndimage.uniform_filter(noise, 2)
        return VolumeSample(vol.astype(np.float32), tuple(planted), int(bool(planted)))
