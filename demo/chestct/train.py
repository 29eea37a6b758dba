"""Train and evaluate the chest-CT nodule demo model (krypton ct3d-small, 2 classes, 48^3).

    python -m demo.chestct.train train      # ~30 min on 2 cores; writes out/chestct/
    python -m demo.chestct.train second     # ~12 min: on from it, more anatomy (seed 2)
    python -m demo.chestct.train third      # ~10 min: on from that, the varied draw (seed 7)
    python -m demo.chestct.train fourth     # then fifth: ~10 min each, fresh pools
    python -m demo.chestct.train sixth      # then seventh, eighth: varied nodules, the
                                            # last two on graded targets (~10 min each)
    python -m demo.chestct.train evaluate   # every number of the model card
    python -m demo.chestct.train ood        # refit only the out-of-distribution check
    python -m demo.chestct.train tune       # approximate mode's tau (SSIM over volumes)
    python -m demo.chestct.train save       # weights + registry entry + card into
                                            # krypton/shipped_models/
    python -m demo.chestct.train gallery    # the volume panel's sample (assets/samples/)

Seeded and reproducible: training volumes come from ChestCTGenerator(seed=1), a pool
of 3000 seen as random crops, flips and occlusions (training_pool, _batch); held-out
volumes from seed 3, the pointing-game set from seed 4; the independent generator
(demo.chestct.independent) is never trained on. 30% of the training crops carry a
parenchyma-filled cube (the occluder the model's heatmaps are made with), on a nodule half
of those times; the target follows what stays visible, so occluding a nodule lowers
p(NODULE) as it should.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from krypton.registry.architectures import build
from krypton.synthetic.chestct import (
    CLASSES,
    HU_WINDOW,
    PARENCHYMA_HU,
    SPACING_MM,
    VOLUME_SIDE,
    ChestCTGenerator,
    VolumeSample,
    to_unit,
)

ROOT = Path(__file__).resolve().parents[2]
WORK_DIR = ROOT / "out" / "chestct"
MODEL_DIR = ROOT / "krypton" / "shipped_models"
NAME = "chestct-demo"
ARCHITECTURE = "ct3d-small"
TRAIN_SEED, TEST_SEED, POINTING_SEED = 1, 3, 4
MEAN, STD = 0.4, 0.35  # on the [0, 1] window (krypton.synthetic.chestct.to_unit)
# The patch and stride the card's heatmaps are made with: nodules are 5-9 voxels across.
HEATMAP_PATCH, HEATMAP_STRIDE = 8, 5
OCCLUDER_SIDES = (6, 16)  # cube sides drawn during training


def to_tensor(volumes: list[np.ndarray]) -> torch.Tensor:
    """HU volumes (D, H, W) -> the model's normalised (N, 1, D, H, W) input."""
    unit = np.stack([to_unit(v) for v in volumes])[:, None]
    return (torch.from_numpy(unit) - MEAN) / STD


def fill_value() -> float:
    """The occluder (lung parenchyma, :data:`krypton.synthetic.chestct.PARENCHYMA_HU`) in
    input space."""
    low, high = HU_WINDOW
    return ((PARENCHYMA_HU - low) / (high - low) - MEAN) / STD


def nodule_target(visible_share: float, graded: bool = False) -> float:
    """p(NODULE) the target gives a volume whose best-visible nodule shows this share:
    0.05 up to a fifth in view, 0.95 from 70%, linear between. ``graded`` also orders
    what lies under 0.05: from 0.02 with nothing in view to 0.05 at a fifth, so an
    occluder that hides all of a nodule scores lower than one that leaves a sliver."""
    floor = 0.02 + 0.03 * min(visible_share / 0.2, 1.0) if graded else 0.05
    return floor + 0.9 * float(np.clip((visible_share - 0.2) / 0.5, 0.0, 1.0))


def visible_share(nodule, crop: tuple, cube: tuple | None) -> float:
    """Share of a nodule's voxels inside the ``crop`` box and outside the ``cube`` box,
    each (corner (z, y, x), side)."""
    r = int(np.ceil(nodule.radius))
    grid = np.mgrid[-r : r + 1, -r : r + 1, -r : r + 1].astype(np.float32)
    centre = np.array([nodule.z, nodule.y, nodule.x], np.float32)[:, None, None, None]
    points = grid + np.round(centre)
    inside = ((points - centre) ** 2).sum(0) <= nodule.radius**2

    def within(box) -> np.ndarray:
        corner, side = box
        return np.all([(p >= c) & (p < c + side) for p, c in zip(points, corner)], axis=0)

    seen = inside & within(crop) & (~within(cube) if cube is not None else True)
    return float(seen.sum()) / max(int(inside.sum()), 1)


def training_pool(
    count: int, seed: int = TRAIN_SEED, varied: float = 0.0, varied_nodules: bool = False
) -> list[VolumeSample]:
    """Generated volumes to train on, half with nodules; in every ten, ``round(10 * varied)``
    come from the varied draw (``ChestCTGenerator(varied=True)``, seeded ``seed + 1000``);
    ``varied_nodules`` draws both kinds' nodules varied (lobulated, soft-edged, on vessels'
    junctions)."""
    plain = ChestCTGenerator(seed=seed, varied_nodules=varied_nodules)
    other = ChestCTGenerator(seed=seed + 1000, varied=True, varied_nodules=varied_nodules)
    tenths = round(10 * varied)
    return [
        (other if index % 10 < tenths else plain).sample(label=index % 2) for index in range(count)
    ]


def _batch(
    pool: list[VolumeSample],
    size: int,
    crop: int,
    rng: np.random.Generator,
    graded: bool = False,
    occluded: bool = True,
    labels: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``size`` crops of side ``crop`` (the whole volume at VOLUME_SIDE): centred near a
    nodule 60% of the time when the volume has one, flipped left-right and head-foot at
    random, 30% with a parenchyma cube of side 6-16 (on a nodule half those times); the
    target follows the share of a nodule left in view (:func:`nodule_target`). Without
    ``occluded`` no crop carries a cube (the method comparison's control). With
    ``labels`` (one per pool volume) the target is the volume's label in it, whatever the
    crop shows (the data-randomisation control's shuffled labels)."""
    volumes, targets = [], []
    for _ in range(size):
        index = int(rng.integers(len(pool)))
        sample = pool[index]
        nodules = sample.nodules
        if nodules and rng.random() < 0.6:
            target = nodules[rng.integers(len(nodules))]
            centre = np.array([target.z, target.y, target.x]) + rng.uniform(-crop / 3, crop / 3, 3)
        else:
            centre = rng.uniform(0, VOLUME_SIDE, 3)
        corner = tuple(int(np.clip(round(c - crop / 2), 0, VOLUME_SIDE - crop)) for c in centre)
        volume = sample.volume.copy()
        cube = None
        if rng.random() < 0.3 and occluded:
            side = int(rng.integers(OCCLUDER_SIDES[0], OCCLUDER_SIDES[1] + 1))
            at = centre + rng.uniform(-side / 2, side / 2, 3)
            cube_corner = tuple(
                int(np.clip(round(c - side / 2), 0, VOLUME_SIDE - side)) for c in at
            )
            volume[tuple(slice(c, c + side) for c in cube_corner)] = PARENCHYMA_HU
            cube = (cube_corner, side)
        share = max((visible_share(o, (corner, crop), cube) for o in nodules), default=0.0)
        volume = volume[tuple(slice(c, c + crop) for c in corner)]
        if rng.random() < 0.5:
            volume = volume[:, :, ::-1]
        if rng.random() < 0.5:
            volume = volume[::-1]
        nodule = nodule_target(share, graded) if labels is None else nodule_target(labels[index])
        volumes.append(np.ascontiguousarray(volume))
        targets.append([1 - nodule, nodule])
    return to_tensor(volumes), torch.tensor(targets, dtype=torch.float32)


# Two stages: 32^3 crops (3.4x cheaper per sample: the network is fully convolutional
# with a global max pool, so it applies unchanged to 48^3), then whole volumes, the size it
# is used at, so its calibration is that of whole volumes.
STAGES = (
    {"crop": 32, "steps": 1800, "batch": 32},
    {"crop": VOLUME_SIDE, "steps": 160, "batch": 16},
)


# The second stage: the independent generator showed the first model calling NORMAL
# volumes NODULE where its anatomy was drawn differently (squarish vertebrae, bumpy lungs,
# wandering vessels: 65% accuracy on it). krypton.synthetic.chestct then learnt to draw those
# variations too, and the model went on from its weights on a fresh pool (seed 2).
SECOND_STAGES = (
    {"crop": 32, "steps": 600, "batch": 32},
    {"crop": VOLUME_SIDE, "steps": 100, "batch": 16},
)
SECOND_SEED = 2

# The third to fifth stages: the independent generator still read 74.5%, its NORMAL
# volumes taken for NODULE where its vessels wander and thin along their length and its
# lungs end inside the slab. krypton.synthetic.chestct's varied draw (ChestCTGenerator(varied=True))
# learnt that anatomy, and the model went on from the second stage's weights, a stage at
# a time, each on a fresh pool in which seven volumes in ten are varied (the rest keep the
# plain draw it already knows). Whether to add a stage was read on independent volumes
# of seed 13 (92.2% after the fourth, 94.0% after the fifth), not on the card's seed 3;
# a sixth on the same draw (seed 10, 5e-4) read 93.5% there and was not kept.
TRAINED_VARIED = 0.7  # varied share of the later pools, and of the OOD reference's volumes
TRAINED_NODULES = True  # the last stages' nodules (varied_nodules), also the OOD reference's
LATER_SCHEDULE = (
    {"crop": 32, "steps": 900, "batch": 32},
    {"crop": VOLUME_SIDE, "steps": 150, "batch": 16},
)


class LaterStage(NamedTuple):
    """A stage after the second: 2,000 fresh volumes, seven in ten varied, LATER_SCHEDULE."""

    learning_rate: float
    seed: int
    varied_nodules: bool = False  # ChestCTGenerator(varied_nodules=True) for the pool
    graded: bool = False  # nodule_target(graded=True)


LATER_STAGES = {
    "third": LaterStage(1e-3, 7),
    "fourth": LaterStage(7e-4, 8),
    "fifth": LaterStage(5e-4, 9),
    "sixth": LaterStage(5e-4, 11, varied_nodules=True),
    "seventh": LaterStage(3e-4, 12, varied_nodules=True, graded=True),
    "eighth": LaterStage(2e-4, 15, varied_nodules=True, graded=True),
}
# The sixth stage: the fifth model's misses on independent volumes of seed 13 were mostly
# solid nodules on vessels (5 of 10) and on the pleura (3), and a count showed why: a
# vascular nodule was placed at one try, which most pieces of vessel fail, so only 5-7% of
# the training nodules touched a vessel (30% meant). ChestCTGenerator(varied_nodules=True)
# tries until one fits, also puts nodules on vessels' junctions, and draws lobulated,
# soft-edged nodules; the stage draws its whole pool so. It read 95.5% on seed 13, but
# its pointing game fell to 86% on ties: every crop showing a fifth of a nodule or less
# had the same target, so an occluder beside the nodule scored as low as one on it. The
# seventh and eighth stages train on graded targets (nodule_target(graded=True)):
# pointing 89% and 91%, independent 95.8% / 95.5% on seed 13, 94.2% / 94.3% on seed 14.


def train_step(model, optimizer, schedule, inputs, targets) -> tuple[float, int]:
    """One optimisation step on soft ``targets``: (its loss, how many inputs' argmax
    matched the target's)."""
    logits = model(inputs)
    loss = F.cross_entropy(logits, targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    schedule.step()
    return float(loss.detach()), int((logits.argmax(1) == targets.argmax(1)).sum())


def train(
    pool_size: int = 3000,
    stages: tuple = STAGES,
    learning_rate: float = 2e-3,
    seed: int = TRAIN_SEED,
    log=print,
    initial: torch.nn.Module | None = None,
    varied: float = 0.0,
    varied_nodules: bool = False,
    graded: bool = False,
    occluded: bool = True,
    shuffled: bool = False,
) -> tuple[torch.nn.Module, dict]:
    """Train from scratch (or on from ``initial``); returns the eval-mode model and a
    record. Without ``occluded`` no crop carries a parenchyma cube; with ``shuffled`` the
    pool's labels are permuted and each crop's target is its volume's shuffled label
    (Adebayo et al.'s data randomisation, 2018)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    pool = training_pool(pool_size, seed, varied, varied_nodules)
    labels = rng.permutation([s.label for s in pool]).tolist() if shuffled else None
    log(f"{pool_size} training volumes generated in {time.perf_counter() - started:.0f} s")
    model = initial if initial is not None else build(ARCHITECTURE, len(CLASSES))
    total = sum(stage["steps"] for stage in stages)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=learning_rate, total_steps=total, pct_start=0.05
    )
    step, trained = 0, None  # the accuracy of the last 100 steps logged
    for stage in stages:
        model.train()
        loss_sum = correct = seen = 0.0
        for _ in range(stage["steps"]):
            volumes, targets = _batch(
                pool, stage["batch"], stage["crop"], rng, graded, occluded, labels
            )
            loss, matched = train_step(model, optimizer, schedule, volumes, targets)
            step += 1
            loss_sum += loss * len(targets)
            correct += matched
            seen += len(targets)
            if step % 100 == 0:
                trained = correct / seen
                log(
                    f"step {step}/{total} (crop {stage['crop']}): loss {loss_sum / seen:.4f}, "
                    f"train accuracy {trained:.3f}, {time.perf_counter() - started:.0f} s"
                )
                loss_sum = correct = seen = 0.0
    record = {
        "architecture": ARCHITECTURE,
        "pool_volumes": pool_size,
        "varied_share": varied,
        "varied_nodules": varied_nodules,
        "graded_floor": graded,
        "stages": list(stages),
        "learning_rate": learning_rate,
        "seed": seed,
        "targets": "p(NODULE) 0.95 with a nodule in view, 0.05 without; crops centred near "
        "a nodule 60% of the time, flips, "
        + ("30% with a parenchyma cube of side 6-16; " if occluded else "no occluding cube; ")
        + (
            "the target is the volume's label shuffled over the pool, whatever the crop shows"
            if shuffled
            else "the target follows the share of a nodule left in view"
        ),
        "shuffled_labels": shuffled,
        # the last 100 steps', on the targets trained; None under 100 steps (JSON has no NaN)
        "last_train_accuracy": None if trained is None else round(trained, 4),
        "train_seconds": round(time.perf_counter() - started, 1),
        "threads": torch.get_num_threads(),
    }
    return model.eval(), record


@torch.inference_mode()
def accuracy(model: torch.nn.Module, samples: list[VolumeSample]) -> float:
    """Share of volumes classified as their label."""
    correct = 0
    for start in range(0, len(samples), 32):
        chunk = samples[start : start + 32]
        logits = model(to_tensor([s.volume for s in chunk]))
        correct += int((logits.argmax(1) == torch.tensor([s.label for s in chunk])).sum())
    return correct / len(samples)


def held_out(count: int = 600, seed: int = TEST_SEED) -> list[VolumeSample]:
    generator = ChestCTGenerator(seed=seed)
    return [generator.sample() for _ in range(count)]


def independent_set(count: int = 600, seed: int = TEST_SEED) -> list[VolumeSample]:
    from .independent import IndependentChestCT

    generator = IndependentChestCT(seed=seed)
    return [generator.sample() for _ in range(count)]


def pointing_set(count: int, seed: int = POINTING_SEED, independent: bool = False) -> list:
    """Held-out volumes with exactly one nodule."""
    if independent:
        from .independent import IndependentChestCT

        other = IndependentChestCT(seed=seed)
        return [other.sample(label=1, nodules=1) for _ in range(count)]
    generator = ChestCTGenerator(seed=seed)
    return [generator.sample(label=1, nodules=1) for _ in range(count)]


def lowest_cell_centre(heatmap, patch: int) -> tuple[float, float, float]:
    """(z, y, x) centre of the occluder at the heatmap's lowest cell."""
    values = heatmap.values
    k, i, j = np.unravel_index(np.nanargmin(values), values.shape)
    half = (patch - 1) / 2
    return (
        float(heatmap.zs[k] + half),
        float(heatmap.ys[i] + half),
        float(heatmap.xs[j] + half),
    )


def pointing_game(
    model: torch.nn.Module,
    samples: list,
    patch: int = HEATMAP_PATCH,
    stride: int = HEATMAP_STRIDE,
    mode: str = "exact",
) -> dict:
    """3-D pointing game on single-nodule volumes: the exact heatmap of NODULE over the
    whole volume; a hit when the occluder at the lowest cell hides the nodule's centre
    (its cube contains it). Also the mean distance from that cell's centre to the nodule's
    centre, in voxels."""
    import krypton

    hits, distances, seconds = 0, [], 0.0
    for sample in samples:
        started = time.perf_counter()
        heatmap = krypton.explain(
            model,
            to_tensor([sample.volume])[0],
            patch=patch,
            stride=stride,
            mode=mode,
            fill=fill_value(),
            label=1,
        )
        seconds += time.perf_counter() - started
        centre = lowest_cell_centre(heatmap, patch)
        nodule = sample.nodules[0]
        distances.append(nodule.distance(*centre))
        hits += all(abs(c - n) <= patch / 2 for c, n in zip(centre, (nodule.z, nodule.y, nodule.x)))
    return {
        "hit_rate": hits / len(samples),
        "volumes": len(samples),
        "mean_distance_voxels": round(float(np.mean(distances)), 2),
        "patch": patch,
        "stride": stride,
        "seconds_per_volume": round(seconds / len(samples), 2),
    }


def evaluate(model: torch.nn.Module, pointing: int = 100, log=print) -> dict:
    """Every number of the model card."""
    results: dict = {}
    started = time.perf_counter()

    def drawn(**options) -> list[VolumeSample]:
        generator = ChestCTGenerator(seed=TEST_SEED, **options)
        return [generator.sample() for _ in range(600)]

    accuracy_sets = (  # (card key, log name, the 600 volumes, what they are)
        ("held_out", "held out", held_out,
         f"krypton.synthetic.chestct (seed {TEST_SEED}), 50/50 classes, 1-3 nodules"),
        ("held_out_varied", "held out, varied draw", lambda: drawn(varied=True),
         f"krypton.synthetic.chestct's varied draw (seed {TEST_SEED}), 50/50 classes"),
        ("held_out_varied_nodules", "held out, varied nodules",
         lambda: drawn(varied=True, varied_nodules=True),
         f"krypton.synthetic.chestct's varied draw with varied nodules (seed {TEST_SEED})"),
        ("independent", "independent", independent_set,
         "demo.chestct.independent: separately written drawing code, same spec"),
    )  # fmt: skip
    for key, name, samples, test_set in accuracy_sets:
        score = round(accuracy(model, samples()), 4)
        results[key] = {"accuracy": score, "volumes": 600, "test_set": test_set}
        log(f"{name}: {results[key]} ({time.perf_counter() - started:.0f} s)")
    results["pointing"] = pointing_game(model, pointing_set(pointing))
    log(f"pointing: {results['pointing']} ({time.perf_counter() - started:.0f} s)")
    results["pointing_independent"] = pointing_game(
        model, pointing_set(pointing // 2, independent=True)
    )
    log(f"pointing (independent): {results['pointing_independent']}")
    results["ood"] = refit_ood(model)
    log(f"ood: {results['ood']} ({time.perf_counter() - started:.0f} s)")
    return results


def refit_ood(model: torch.nn.Module) -> dict:
    """Fit the out-of-distribution check, store it in the work folder, and return the
    card's flag rates for it."""
    density = fit_ood(model)
    density.save(WORK_DIR / OOD_FILE)
    return ood_rates(model, density)


REFERENCE_SEED, THRESHOLD_SEED, OOD_TEST_SEED = 5, 6, 9
OOD_FILE = f"{NAME}.ood.npz"


def _features(model: torch.nn.Module, volumes) -> tuple[list[str], list[np.ndarray]]:
    from krypton.registry.ood import feature_statistics

    return feature_statistics(model, (to_tensor([v])[0] for v in volumes), batch_size=16)


def _generated(seed: int, count: int, generator_class=ChestCTGenerator):
    """Volumes as the model was trained on them (the plain and varied draws mixed, with
    nodules, as in its last stages' pools), or from another generator class."""
    if generator_class is ChestCTGenerator:
        pool = training_pool(count, seed, TRAINED_VARIED, TRAINED_NODULES)
        return (sample.volume for sample in pool)
    generator = generator_class(seed=seed)
    return (generator.sample().volume for _ in range(count))


def ood_reference(count: int = 600) -> str:
    """What the OOD check's reference volumes are, for the check and the registry entry."""
    nodules = ", nodules varied" if TRAINED_NODULES else ""
    return (
        f"{count} generated chest-CT-like volumes (krypton.synthetic.chestct, "
        f"seed {REFERENCE_SEED}, {round(10 * TRAINED_VARIED)} in 10 from the varied draw{nodules})"
    )


def fit_ood(model: torch.nn.Module, reference: int = 600, held_out: int = 2400):
    """The out-of-distribution reference: generated training-like volumes fit the
    densities (seed 5), others calibrate the p-values and set the threshold (seed 6).
    Half of ``held_out`` calibrates: with 200 (the first card's) the model trained on
    the plain and varied draws put more than 1% of genuine volumes beyond all 200 at
    some stage, and the threshold at the highest score there is, so nothing was flagged
    (FeatureDensity.can_flag); 1,200 give the tail the resolution a 99th percentile needs
    without the fitted tails fit_density falls back to."""
    from krypton.registry.ood import fit_density

    names, fit = _features(model, _generated(REFERENCE_SEED, reference))
    _, calibrate = _features(model, _generated(THRESHOLD_SEED, held_out))
    density = fit_density(names, fit, calibrate, ood_reference(reference))
    if density.fitted_tails:  # the card's check keeps empirical p-values
        raise ValueError(f"{held_out} held-out volumes are too few for empirical p-values")
    return density


def head_phantom(rng: np.random.Generator, side: int = VOLUME_SIDE) -> np.ndarray:
    """A head CT, not a chest: skull shell (~1000 HU) around brain (~35 HU) and ventricles."""
    z, y, x = np.ogrid[:side, :side, :side]
    c = side / 2 + rng.normal(0, 1.5, 3)
    radii = side * rng.uniform(0.38, 0.46, 3)
    r = np.sqrt(sum(((a - m) / s) ** 2 for a, m, s in zip((z, y, x), c, radii)))
    volume = np.where(r <= 1.0, rng.uniform(25, 45), -1000.0)
    volume = np.where((r > 0.88) & (r <= 1.0), rng.uniform(800, 1200), volume)
    ventricle = np.sqrt(((y - c[1]) / (0.12 * side)) ** 2 + ((x - c[2]) / (0.05 * side)) ** 2)
    volume = np.where((ventricle <= 1) & (r < 0.6), 5.0, volume)
    return (volume + rng.normal(0, 15, volume.shape)).astype(np.float32)


def abdomen_phantom(rng: np.random.Generator, side: int = VOLUME_SIDE) -> np.ndarray:
    """An abdominal CT slab: body, fat, liver, kidneys, spine; no lungs."""
    from scipy import ndimage

    z, y, x = np.ogrid[:side, :side, :side]
    c = side / 2 + rng.normal(0, 1.5, 2)
    body = ((y - c[0]) / (0.4 * side)) ** 2 + ((x - c[1]) / (0.47 * side)) ** 2
    volume = np.where(body <= 1, rng.uniform(-110, -80), -1000.0) * np.ones((side, 1, 1))
    inner = body <= 0.7
    volume = np.where(np.broadcast_to(inner, volume.shape), rng.uniform(30, 50), volume)
    liver = ((y - c[0] + 3) / (0.22 * side)) ** 2 + ((x - c[1] + 0.2 * side) / (0.2 * side)) ** 2
    volume = np.where(np.broadcast_to(liver <= 1, volume.shape), rng.uniform(55, 70), volume)
    for sign in (-1, 1):
        kidney = ((y - c[0] - 0.2 * side) / (0.08 * side)) ** 2 + (
            (x - c[1] - sign * 0.2 * side) / (0.06 * side)
        ) ** 2
        volume = np.where(np.broadcast_to(kidney <= 1, volume.shape), 150.0, volume)
    spine = (y - c[0] - 0.3 * side) ** 2 + (x - c[1]) ** 2 <= (0.08 * side) ** 2
    volume = np.where(np.broadcast_to(spine, volume.shape), 450.0, volume)
    volume = ndimage.gaussian_filter(volume.astype(np.float32), 0.7)
    return volume + rng.normal(0, 20, volume.shape).astype(np.float32)


def photo_volumes(count: int) -> list[np.ndarray]:
    """scikit-image's gray photographs, each stacked into a volume over the HU window."""
    from PIL import Image
    from skimage import data

    names = ("camera", "coins", "moon", "page", "text", "brick", "grass", "gravel")
    volumes = []
    for index in range(count):
        picture = Image.fromarray(getattr(data, names[index % len(names)])())
        picture = picture.convert("L").resize((VOLUME_SIDE, VOLUME_SIDE))
        plane = np.asarray(picture, np.float32) / 255 * 1400 - 1000
        shift = index // len(names)
        volumes.append(np.stack([np.roll(plane, shift * 3 + k // 4, 1) for k in range(48)]))
    return volumes


def ood_rates(model: torch.nn.Module, density, count: int = 300) -> dict:
    """Flag rates: fresh generated volumes (target <= 2%), the independent generator's,
    and volumes that are not chest CT: head and abdomen phantoms, photographs stacked into
    volumes, smooth noise over the window."""
    from scipy import ndimage

    from .independent import IndependentChestCT

    rng = np.random.default_rng(OOD_TEST_SEED)
    outside = {
        "head_ct": [head_phantom(rng) for _ in range(40)],
        "abdomen_ct": [abdomen_phantom(rng) for _ in range(40)],
        "photographs": photo_volumes(40),
        "noise": [
            ndimage.gaussian_filter(rng.normal(-300, 500, (VOLUME_SIDE,) * 3), 2).astype(np.float32)
            for _ in range(40)
        ],
    }
    rates = {"threshold": round(density.threshold, 3)}
    inside = density.score(_features(model, _generated(OOD_TEST_SEED, count))[1])
    rates["in_distribution_flagged"] = round(float((inside > density.threshold).mean()), 4)
    rates["in_distribution_volumes"] = count
    independent = density.score(
        _features(model, _generated(OOD_TEST_SEED, count // 2, IndependentChestCT))[1]
    )
    rates["independent_flagged"] = round(float((independent > density.threshold).mean()), 4)
    rates["independent_volumes"] = count // 2
    for name, volumes in outside.items():
        scores = density.score(_features(model, volumes)[1])
        rates[f"{name}_flagged"] = round(float((scores > density.threshold).mean()), 4)
        rates[f"{name}_volumes"] = len(volumes)
    return rates


def half_state(model: torch.nn.Module) -> dict:
    return {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}


def load_trained(path: Path = WORK_DIR / "weights.pt") -> torch.nn.Module:
    model = build(ARCHITECTURE, len(CLASSES))
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return model.eval()


DESCRIPTION = (
    "A small 3-D CNN (ct3d-small) trained by this project on 48^3 synthetic chest-CT-like "
    "volumes at a nominal 5 mm (krypton.synthetic.chestct): body, spine, two lungs with branching "
    "vessels, and solid or ground-glass nodules of 5-9 voxels across, free, touching a "
    "vessel or touching the pleura; vessel bifurcations are the hard negatives. "
    "It learnt with nodules hidden under parenchyma-filled cubes, the fill its heatmaps use "
    "and Integrated Gradients' baseline, so a method comparison on it favours occlusion and "
    "IG over Grad-CAM; docs/models.md compares it with a control trained without any cube. "
    "A demonstration model, not a medical device."
)


def save(record: dict, evaluation: dict, tuning: dict, model: torch.nn.Module) -> Path:
    """Weights (float16) and the registry entry, with the card's numbers."""
    import shutil

    from krypton.registry.entries import write_entry

    torch.save(half_state(model), MODEL_DIR / f"{NAME}.pt")
    shutil.copyfile(WORK_DIR / OOD_FILE, MODEL_DIR / OOD_FILE)
    entry = {
        "name": NAME,
        "description": DESCRIPTION,
        "architecture": ARCHITECTURE,
        "weights": {"source": "file", "path": f"{NAME}.pt", "format": "state_dict"},
        "input_size": [VOLUME_SIDE] * 3,
        "mean": [MEAN],
        "std": [STD],
        "volume": {
            "spacing_mm": list(SPACING_MM),
            "window_hu": list(HU_WINDOW),
            "fill_hu": PARENCHYMA_HU,
        },
        "classes": list(CLASSES),
        "patch": HEATMAP_PATCH,
        "ood": {
            "path": OOD_FILE,
            "threshold": evaluation["ood"]["threshold"],
            "reference": ood_reference(),
        },
        "training": record,
        "evaluation": evaluation,
        "tuning": tuning,
    }
    path = MODEL_DIR / f"{NAME}.json"
    write_entry(path, entry)
    return path


TUNE_SEED, TUNE_HELD_OUT_SEED = 30, 31


def tune(model: torch.nn.Module, count: int = 8, held_out: int = 8, log=print) -> dict:
    """Approximate mode's τ for this model (paper §4.3, :func:`krypton.tune`):
    SSIM(τ) fitted over whole-volume heatmaps of generated volumes (half with a nodule),
    checked on others, at the card's patch and stride."""
    from krypton.tune import tune_tau

    def volumes(seed: int, number: int) -> list[torch.Tensor]:
        generator = ChestCTGenerator(seed=seed)
        return [to_tensor([generator.sample(label=i % 2).volume])[0] for i in range(number)]

    return tune_tau(
        model,
        volumes(TUNE_SEED, count),
        patch=HEATMAP_PATCH,
        stride=HEATMAP_STRIDE,
        fill=fill_value(),
        held_out=volumes(TUNE_HELD_OUT_SEED, held_out),
        log=log,
    )


GALLERY_SEED = 40  # a held-out draw (no training, tuning or card seed) with one nodule
GALLERY_FILE = "chestct-nodule.nii.gz"


def write_gallery(folder: Path = ROOT / "assets" / "samples") -> Path:
    """The volume panel's sample: a generated chest CT with one nodule, as a scanner would
    write it — NIfTI, int16 Hounsfield units, at the model's 5 mm in an LPS-to-RAS frame."""
    import nibabel

    sample = ChestCTGenerator(seed=GALLERY_SEED).sample(label=1, nodules=1)
    voxels = np.rint(np.transpose(sample.volume, (2, 1, 0))).astype(np.int16)  # (x, y, z)
    slice_mm, row_mm, column_mm = SPACING_MM
    affine = np.diag([-column_mm, -row_mm, slice_mm, 1.0])
    affine[:3, 3] = [100.0, 120.0, -60.0]
    image = nibabel.Nifti1Image(voxels, affine)
    image.header.set_xyzt_units("mm")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / GALLERY_FILE
    nibabel.save(image, str(path))
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    steps = ("train", "second", *LATER_STAGES, "evaluate", "ood", "tune", "save", "gallery")
    parser.add_argument("step", choices=steps)
    parser.add_argument("--pointing", type=int, default=100)
    args = parser.parse_args(argv)
    if args.step == "gallery":
        print("wrote", write_gallery())
        return
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    if args.step == "train":
        model, record = train()
        torch.save(half_state(model), WORK_DIR / "weights.pt")
        (WORK_DIR / "record.json").write_text(json.dumps(record, indent=2))
    elif args.step == "second":
        first = json.loads((WORK_DIR / "record.json").read_text())
        model, record = train(
            1500, SECOND_STAGES, 1e-3, SECOND_SEED, initial=load_trained().train()
        )
        torch.save(half_state(model), WORK_DIR / "weights.pt")
        first = first.get("first", first)
        (WORK_DIR / "record.json").write_text(
            json.dumps({"first": first, "second": record}, indent=2)
        )
    elif args.step in LATER_STAGES:
        earlier = json.loads((WORK_DIR / "record.json").read_text())
        stage = LATER_STAGES[args.step]
        model, record = train(
            2000,
            LATER_SCHEDULE,
            stage.learning_rate,
            stage.seed,
            initial=load_trained().train(),
            varied=TRAINED_VARIED,
            varied_nodules=stage.varied_nodules,
            graded=stage.graded,
        )
        torch.save(half_state(model), WORK_DIR / "weights.pt")
        (WORK_DIR / "record.json").write_text(json.dumps({**earlier, args.step: record}, indent=2))
    elif args.step == "ood":  # refit the OOD check alone; the card's other numbers stay
        model, path = load_trained(), WORK_DIR / "evaluation.json"
        evaluation = json.loads(path.read_text())
        evaluation["ood"] = refit_ood(model)
        print(evaluation["ood"])
        path.write_text(json.dumps(evaluation, indent=2))
    elif args.step == "evaluate":
        evaluation = evaluate(load_trained(), pointing=args.pointing)
        (WORK_DIR / "evaluation.json").write_text(json.dumps(evaluation, indent=2))
    elif args.step == "tune":
        (WORK_DIR / "tuning.json").write_text(json.dumps(tune(load_trained()), indent=2))
    else:
        record = json.loads((WORK_DIR / "record.json").read_text())
        evaluation = json.loads((WORK_DIR / "evaluation.json").read_text())
        tuning = json.loads((WORK_DIR / "tuning.json").read_text())
        print(save(record, evaluation, tuning, load_trained()))


if __name__ == "__main__":
    main()
