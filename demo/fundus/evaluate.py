"""Every number of the fundus demo model's card: held-out accuracy, the pointing games
(the lowest cell on the lesion; strict), coverage of several lesions, the independent
generator and the real samples, and the out-of-distribution check (fit, and its rates on
natural photographs, typeset pages, tomography slices and fresh fundus images).

    python -m demo.fundus.train evaluate     # re-measures them into the registry entry
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time
from pathlib import Path

import numpy as np
import torch

from demo.fundus.data import (
    HEATMAP_PATCH,
    MULTI_SEED,
    OOD_TEST_SEED,
    POINTING_SEED,
    REFERENCE_SEED,
    TEST_SEED,
    THRESHOLD_SEED,
    TODAY,
    Task,
    _batch,
    to_tensor,
)  # fmt: skip
from krypton.registry.models import IMAGENET_MEAN, IMAGENET_STD
from krypton.synthetic.fundus import CLASSES, IMAGE_SIZE, Sample

# The two microaneurysms visible in scikit-image's Microaneurysms sample, (x, y) in its
# 102 x 102 pixels: read off the picture, and the two strongest dark blobs a
# Laplacian-of-Gaussian finds there (skimage.feature.blob_log).
MICROANEURYSM_SAMPLE_DOTS = ((16, 23), (49, 71))
# scikit-image's photographs that are not fundus images (files it ships, no download)
NATURAL_PHOTOS = (
    "astronaut.png", "brick.png", "camera.png", "cell.png", "chelsea.png",
    "clock_motion.png", "coffee.png", "coins.png", "grass.png", "gravel.png",
    "hubble_deep_field.jpg", "ihc.png", "moon.png", "motorcycle_left.png",
    "motorcycle_right.png", "page.png", "rocket.jpg", "text.png",
)  # fmt: skip


@torch.inference_mode()
def accuracy(
    model: torch.nn.Module, count: int = 600, seed: int = TEST_SEED, task: Task = TODAY
) -> float:
    """Accuracy on held-out generated images of ``task`` (balanced over the classes)."""
    generator = task.generator(seed)
    correct = 0
    for begin in range(0, count, 50):
        images, labels = _batch(generator, min(50, count - begin), gray_boxes=False)
        correct += int((model(images).argmax(1) == labels).sum())
    return correct / count


def pointing_set(count: int, seed: int = POINTING_SEED, task: Task = TODAY) -> list[Sample]:
    """Held-out images with exactly one planted lesion, alternating the lesion classes."""
    generator = task.generator(seed)
    return [generator.sample(label=1 + i % 2, lesions=1) for i in range(count)]


def pointing_game(
    model: torch.nn.Module, samples: list[Sample], patch: int = 16, stride: int = 8
) -> float:
    """Fraction of images whose most sensitive heatmap cell lies on the lesion.

    The heatmap explains the true class; a hit is when the occluder at the cell with the
    lowest probability touches the planted lesion.
    """
    import krypton

    gray = tuple((0.5 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))
    hits = 0
    for sample in samples:
        image = to_tensor(sample.image[None])[0]
        heatmap = krypton.explain(
            model, image, patch=patch, stride=stride, fill=gray, label=sample.label
        )
        row, col = np.unravel_index(np.nanargmin(heatmap.values), heatmap.values.shape)
        x0, y0 = int(heatmap.xs[col]), int(heatmap.ys[row])
        hits += sample.lesions[0].covered_by(x0, y0, patch)
    return hits / len(samples)


def _gray_fill() -> tuple[float, ...]:
    return tuple((0.5 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD))


def _picture_tensor(picture, size: int = IMAGE_SIZE) -> torch.Tensor:
    from PIL import Image

    resized = picture.convert("RGB").resize((size, size), Image.BILINEAR)
    return to_tensor(np.asarray(resized)[None])[0]


@torch.inference_mode()
def independent_accuracy(
    model: torch.nn.Module, count: int = 600, seed: int = TEST_SEED, task: Task = TODAY
) -> float:
    """Accuracy on the independently written generator (demo.fundus.independent)."""
    generator = task.independent(seed)
    correct = 0
    for begin in range(0, count, 50):
        samples = [generator.sample(label=(begin + i) % 3) for i in range(min(50, count - begin))]
        images = to_tensor(np.stack([s.image for s in samples]))
        labels = torch.tensor([s.label for s in samples])
        correct += int((model(images).argmax(1) == labels).sum())
    return correct / count


def _prediction(model: torch.nn.Module, picture) -> dict:
    with torch.inference_mode():
        probs = torch.softmax(model(_picture_tensor(picture)[None])[0], 0)
    index = int(probs.argmax())
    return {"class": CLASSES[index], "p": round(float(probs[index]), 4)}


def real_samples(model: torch.nn.Module, patch: int = HEATMAP_PATCH, stride: int = 4) -> dict:
    """The gallery's real photographs: the Retina sample (lesion-free), the Microaneurysms
    sample (class, and whether its lowest heatmap cell lies on a visible dark dot) and 3 x 3
    tiles of it."""
    import krypton

    retina, dots_picture = _real_photographs()
    found = {"retina": _prediction(model, retina)}
    micro = _prediction(model, dots_picture)
    heatmap = krypton.explain(
        model,
        _picture_tensor(dots_picture),
        patch=patch,
        stride=stride,
        fill=_gray_fill(),
        label=CLASSES.index("MICROANEURYSM"),
    )
    row, col = np.unravel_index(np.nanargmin(heatmap.values), heatmap.values.shape)
    scale = IMAGE_SIZE / dots_picture.width
    x0, y0 = int(heatmap.xs[col]), int(heatmap.ys[row])
    micro["lowest_cell"] = [x0, y0]
    micro["lowest_on_dot"] = any(
        x0 <= x * scale < x0 + patch and y0 <= y * scale < y0 + patch
        for x, y in MICROANEURYSM_SAMPLE_DOTS
    )
    found["microaneurysms"] = micro
    found["microaneurysm_tiles"] = [
        {**_prediction(model, tile), "has_dot": has_dot}
        for tile, has_dot in _microaneurysm_tiles(dots_picture)
    ]
    return found


def _real_photographs() -> tuple:
    """scikit-image's two real fundus photographs: the Retina and Microaneurysms samples."""
    from PIL import Image
    from skimage import data

    return Image.fromarray(data.retina()), Image.fromarray(data.microaneurysms())


def _microaneurysm_tiles(picture) -> list[tuple[object, bool]]:
    """3 x 3 overlapping half-size tiles of the Microaneurysms sample, and whether each
    holds one of its visible dark dots."""
    tiles = []
    side = picture.width // 2
    for top in (0, side // 2, side):
        for left in (0, side // 2, side):
            has_dot = any(
                left <= x < left + side and top <= y < top + side
                for x, y in MICROANEURYSM_SAMPLE_DOTS
            )
            tiles.append((picture.crop((left, top, left + side, top + side)), has_dot))
    return tiles


def _sample_heatmap(model: torch.nn.Module, sample: Sample, patch: int, stride: int):
    """The exact heatmap of a generated sample's true class, gray occluder."""
    import krypton

    image = to_tensor(sample.image[None])[0]
    return krypton.explain(
        model, image, patch=patch, stride=stride, fill=_gray_fill(), label=sample.label
    )


# Cells count as "the lowest" when within this share of the heatmap's largest drop of the
# minimum: a lesion hidden by several patches drops p equally under each of them.
LOWEST_REGION_SHARE = 0.1


def lowest_points(heatmap, patch: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Where a heatmap points: the centre of its lowest cell (the first in raster order
    among equals), and the centre of its lowest region (the mean centre of the cells
    within :data:`LOWEST_REGION_SHARE` of the drop of the minimum)."""
    values = heatmap.values
    row, col = np.unravel_index(np.nanargmin(values), values.shape)
    half = (patch - 1) / 2
    cell = (float(heatmap.xs[col] + half), float(heatmap.ys[row] + half))
    lowest = float(np.nanmin(values))
    near = values <= lowest + LOWEST_REGION_SHARE * max(float(heatmap.prob) - lowest, 0.0)
    rows, cols = np.nonzero(near)
    region = (float(heatmap.xs[cols].mean() + half), float(heatmap.ys[rows].mean() + half))
    return cell, region


def strict_pointing_game(
    model: torch.nn.Module, samples: list[Sample], patch: int = HEATMAP_PATCH, stride: int = 8
) -> dict:
    """Share of single-lesion images that point within 8 px of the lesion's centre (the
    patch merely touching the lesion does not count), by the lowest cell and by the
    lowest region (:func:`lowest_points`)."""
    by_cell = by_region = 0
    for sample in samples:
        cell, region = lowest_points(_sample_heatmap(model, sample, patch, stride), patch)
        lesion = sample.lesions[0]
        by_cell += (cell[0] - lesion.x) ** 2 + (cell[1] - lesion.y) ** 2 <= 8**2
        by_region += (region[0] - lesion.x) ** 2 + (region[1] - lesion.y) ** 2 <= 8**2
    return {"hit_rate": by_cell / len(samples), "hit_rate_region": by_region / len(samples)}


def multi_lesion_set(count: int, seed: int = MULTI_SEED, task: Task = TODAY) -> list[Sample]:
    """Images with 2-4 lesions of one class, alternating the classes."""
    generator = task.generator(seed)
    samples = []
    while len(samples) < count:
        kind = CLASSES[1 + len(samples) % 2]
        sample = generator.sample(kinds=[kind] * int(generator.rng.integers(2, 5)))
        if len(sample.lesions) >= 2:
            samples.append(sample)
    return samples


def multi_lesion_coverage(
    model: torch.nn.Module, samples: list[Sample], patch: int = HEATMAP_PATCH, stride: int = 8
) -> float:
    """Share of all lesions whose centre lies under at least one of the lowest 5% of
    heatmap cells (each cell stands for the patch placed there)."""
    found = total = 0
    for sample in samples:
        heatmap = _sample_heatmap(model, sample, patch, stride)
        values = heatmap.values
        lowest = values <= np.quantile(values, 0.05)
        rows, cols = np.nonzero(lowest)
        for lesion in sample.lesions:
            total += 1
            found += any(
                heatmap.xs[c] <= lesion.x < heatmap.xs[c] + patch
                and heatmap.ys[r] <= lesion.y < heatmap.ys[r] + patch
                for r, c in zip(rows, cols)
            )
    return found / total


def natural_photos() -> dict:
    """scikit-image's photographs that are not fundus images, as shipped (no download)."""
    import skimage
    from PIL import Image

    folder = Path(skimage.__file__).parent / "data"
    return {name: Image.open(folder / name).convert("RGB") for name in NATURAL_PHOTOS}


def natural_photo_set() -> tuple[list[str], list]:
    """The OOD evaluation's 90 photographs: each of :func:`natural_photos` whole and as
    its 4 corner crops (half the width and height), with names."""
    pictures, names = [], []
    for name, picture in natural_photos().items():
        pictures.append(picture)
        names.append(name)
        half_w, half_h = picture.width // 2, picture.height // 2
        for index, (left, top) in enumerate(((0, 0), (half_w, 0), (0, half_h), (half_w, half_h))):
            pictures.append(picture.crop((left, top, left + half_w, top + half_h)))
            names.append(f"{name} (crop {index + 1})")
    return names, pictures


DOCUMENT_SEED = 12


def document_pages(count: int = 30, seed: int = DOCUMENT_SEED) -> list:
    """Pages of real text typeset with Pillow's own font (the prose of the standard
    library's argparse, logging and unittest docstrings): light or dark paper, 9-26 px
    type, left-aligned lines with margins — the screen captures and scanned reports a
    user may upload by mistake. Never used in fitting the out-of-distribution check."""
    import logging
    import unittest

    from PIL import Image, ImageDraw, ImageFont

    words = " ".join(m.__doc__ for m in (argparse, logging, unittest)).split()
    rng = np.random.default_rng(seed)
    pages = []
    for _ in range(count):
        light = rng.uniform() < 0.75  # dark text on light paper, or a dark theme
        paper = rng.integers(215, 256, 3) if light else rng.integers(0, 60, 3)
        ink = rng.integers(0, 90, 3) if light else rng.integers(180, 256, 3)
        size = int(rng.integers(9, 27))
        font = ImageFont.load_default(size=size)
        page = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), tuple(int(v) for v in paper))
        pen = ImageDraw.Draw(page)
        start = int(rng.integers(len(words)))
        margin = int(rng.integers(2, 20))
        y = int(rng.integers(0, 20))
        while y < IMAGE_SIZE:
            line, x = [], margin
            while x < IMAGE_SIZE - margin:
                word = words[start % len(words)]
                start += 1
                line.append(word)
                x += int(pen.textlength(word + " ", font=font))
            pen.text((margin, y), " ".join(line), fill=tuple(int(v) for v in ink), font=font)
            y += int(size * rng.uniform(1.2, 1.8))
        pages.append(page)
    return pages


def _generated_features(model, seed: int, count: int, make=None):
    """The model's feature statistics of ``count`` images of ``make(seed)`` (default:
    today's training generator)."""
    from krypton.registry.ood import feature_statistics

    generator = (make or TODAY.generator)(seed)
    images = (
        to_tensor(generator.sample(label=i % len(CLASSES)).image[None])[0] for i in range(count)
    )
    return feature_statistics(model, images)


# drawn CT/MR slices among the outlier boundary's counter-examples (demo.tomography): with
# 600 the Chest CT sample scored at the threshold or just under it, by the draw; 1,200
# placed it and every held-out real slice at the highest score there is
TOMOGRAPHY_OUTLIERS, TOMOGRAPHY_SEED = 1200, 24


def fit_ood(
    model: torch.nn.Module, reference: int = 2000, held_out: int = 1000, task: Task = TODAY
):
    """The out-of-distribution reference of the demo model: generated training-like
    images (every view and rendering) fit the densities and, against synthetic outliers
    (dead leaves, 1/f noise, and CT/MR slices drawn from this project's own phantoms),
    the outlier boundary; others calibrate them."""
    from krypton.registry.ood import feature_statistics, fit_density, outlier_features

    from ..tomography import drawn_slices

    names, fit = _generated_features(model, REFERENCE_SEED, reference, task.generator)
    _, calibrate = _generated_features(model, THRESHOLD_SEED, held_out, task.generator)
    outliers = outlier_features(model, (IMAGE_SIZE, IMAGE_SIZE), lambda p: to_tensor(p[None])[0])
    slices = drawn_slices(TOMOGRAPHY_OUTLIERS, IMAGE_SIZE, seed=TOMOGRAPHY_SEED)
    _, tomography = feature_statistics(model, (to_tensor(p[None])[0] for p in slices))
    return fit_density(
        names,
        fit,
        calibrate,
        f"{reference} generated fundus images (every view and rendering); outliers: "
        f"dead leaves, 1/f noise and {TOMOGRAPHY_OUTLIERS} drawn CT/MR slices",
        outliers=[np.vstack(pair) for pair in zip(outliers, tomography)],
    )


def tomography_rates(model: torch.nn.Module, density) -> dict:
    """Real CT and MR images nobody tuned the check on (:func:`demo.tomography.real_slices`):
    the app's gallery samples, and the held-out slices of pydicom's and nibabel's test data."""
    from krypton.registry.ood import feature_statistics

    from ..tomography import APP_SAMPLES, real_slices

    named = real_slices()
    scores = density.score(feature_statistics(model, (_picture_tensor(p) for _, p in named))[1])
    flagged = {name: bool(score > density.threshold) for (name, _), score in zip(named, scores)}
    held_out = [name for name in flagged if name not in APP_SAMPLES]
    return {
        "app_samples_flagged": {name: flagged[name] for name in APP_SAMPLES},
        "held_out_flagged": round(sum(flagged[n] for n in held_out) / len(held_out), 4),
        "held_out_slices": len(held_out),
        "held_out_missed": [n for n in held_out if not flagged[n]],
    }


def ood_rates(model: torch.nn.Module, density, count: int = 600, task: Task = TODAY) -> dict:
    """Flag rates: fresh in-distribution images (target <= 2%), the independent
    generator's, scikit-image's natural photographs, whole and as 4 corner crops
    (target >= 95%), typeset text pages (:func:`document_pages`), and whether the real
    fundus photographs (the Retina and Microaneurysms samples, the tiles of the latter)
    are flagged."""
    from krypton.registry.ood import feature_statistics

    in_distribution = density.score(
        _generated_features(model, OOD_TEST_SEED, count, task.generator)[1]
    )
    independent = density.score(
        _generated_features(model, OOD_TEST_SEED, count // 2, task.independent)[1]
    )
    names, pictures = natural_photo_set()
    natural = density.score(feature_statistics(model, (_picture_tensor(p) for p in pictures))[1])
    pages = document_pages()
    documents = density.score(feature_statistics(model, map(_picture_tensor, pages))[1])
    retina, dots_picture = _real_photographs()
    real = [retina, dots_picture, *(tile for tile, _ in _microaneurysm_tiles(dots_picture))]
    real_flagged = density.score(feature_statistics(model, map(_picture_tensor, real))[1]) > (
        density.threshold
    )
    return {
        "threshold": round(density.threshold, 3),
        "in_distribution_flagged": round(float((in_distribution > density.threshold).mean()), 4),
        "in_distribution_images": count,
        "independent_flagged": round(float((independent > density.threshold).mean()), 4),
        "independent_images": count // 2,
        "natural_flagged": round(float((natural > density.threshold).mean()), 4),
        "natural_images": len(pictures),
        # the photographs as scikit-image ships them, without the corner crops
        "natural_whole_flagged": int(
            sum(s > density.threshold for n, s in zip(names, natural) if n in NATURAL_PHOTOS)
        ),
        "natural_whole_images": len(NATURAL_PHOTOS),
        "natural_missed": [n for n, s in zip(names, natural) if s <= density.threshold],
        # typeset text pages (document_pages), never used in fitting
        "documents_flagged": round(float((documents > density.threshold).mean()), 4),
        "documents_images": len(pages),
        # real fundus photographs: flagged or not (tiles: how many of the 9)
        "real_flagged": {
            "retina": bool(real_flagged[0]),
            "microaneurysms": bool(real_flagged[1]),
            "microaneurysm_tiles": int(real_flagged[2:].sum()),
        },
        # real CT and MR images: the app's samples and held-out slices (demo.tomography)
        "tomography": tomography_rates(model, density),
    }


EVALUATION_PARTS = ("held_out", "independent", "real_samples", "pointing", "multi", "ood")


def evaluate(
    model: torch.nn.Module,
    density,
    held_out: int = 600,
    pointing_images: int = 100,
    multi_images: int = 40,
    log=print,
    pointing_stride: int = 4,
    parts: tuple[str, ...] = EVALUATION_PARTS,
    task: Task = TODAY,
) -> dict:
    """Every number the model card states, each with its test set (issue: a default
    model that deserves trust); ``parts`` (of :data:`EVALUATION_PARTS`) picks which are
    measured, so one number can be re-measured without the others (:func:`merge_evaluation`)."""
    unknown = set(parts) - set(EVALUATION_PARTS)
    if unknown:
        raise ValueError(f"unknown evaluation parts {sorted(unknown)}; known: {EVALUATION_PARTS}")
    evaluation: dict = {}
    seconds: dict[str, float] = {}

    def measure(part: str, compute) -> None:
        if part in parts:
            started = time.perf_counter()
            compute()
            seconds[part] = round(time.perf_counter() - started, 1)

    def accuracy_part(key: str, measure_accuracy, test_set: str) -> None:
        evaluation[key] = {
            "accuracy": round(measure_accuracy(model, held_out, task=task), 4),
            "images": held_out,
            "test_set": test_set,
        }
        log(f"{key} accuracy {evaluation[key]['accuracy']:.4f}")

    def real_part() -> None:
        evaluation["real_samples"] = real_samples(model)
        log(f"real samples {evaluation['real_samples']}")

    def pointing_part() -> None:
        samples = pointing_set(pointing_images, task=task)
        rates = strict_pointing_game(model, samples, stride=pointing_stride)
        evaluation["pointing_game_strict"] = {
            "hit_rate": round(rates["hit_rate"], 4),
            "hit_rate_region": round(rates["hit_rate_region"], 4),
            "images": pointing_images,
            "stride": pointing_stride,
            "patch": HEATMAP_PATCH,
            "test_set": f"single-lesion images (seed 4), half each class; patch "
            f"{HEATMAP_PATCH}, stride {pointing_stride}; a hit: the lowest cell's centre "
            f"(hit_rate) or the lowest region's centre (hit_rate_region: cells within "
            f"{LOWEST_REGION_SHARE:.0%} of the drop of the minimum) within 8 px of the "
            "lesion's centre",
        }
        log(f"strict pointing game {rates}")

    def multi_part() -> None:
        multi = multi_lesion_set(multi_images, task=task)
        evaluation["multi_lesion_coverage"] = {
            "share": round(multi_lesion_coverage(model, multi), 4),
            "images": multi_images,
            "lesions": sum(len(s.lesions) for s in multi),
            "patch": HEATMAP_PATCH,
            "test_set": f"images with 2-4 lesions of one class (seed 8); patch "
            f"{HEATMAP_PATCH}, stride 8; a lesion counts when its centre lies under one of "
            "the lowest 5% of cells",
        }
        log(f"multi-lesion coverage {evaluation['multi_lesion_coverage']['share']:.3f}")

    def ood_part() -> None:
        evaluation["ood"] = ood_rates(model, density, held_out, task)
        log(f"out-of-distribution {evaluation['ood']}")

    measure(
        "held_out",
        lambda: accuracy_part(
            "held_out",
            accuracy,
            "this project's generator (seed 3): 1-4 lesions, every view and rendering",
        ),
    )
    measure(
        "independent",
        lambda: accuracy_part(
            "independent",
            independent_accuracy,
            "demo.fundus.independent: separately written drawing code, same spec",
        ),
    )
    measure("real_samples", real_part)
    measure("pointing", pointing_part)
    measure("multi", multi_part)
    if density is not None:
        measure("ood", ood_part)
    evaluation["evaluated"] = datetime.date.today().isoformat()
    evaluation["machine"] = f"{platform.machine()}, {torch.get_num_threads()} threads"
    evaluation["seconds"] = seconds
    return evaluation


def merge_evaluation(earlier: dict | None, fresh: dict) -> dict:
    """The record's evaluation with the freshly measured parts replacing theirs; the
    others are kept (the same weights), and each part keeps the seconds it took."""
    merged = dict(earlier or {})
    earlier_seconds = merged.get("seconds")
    merged.update(fresh)
    merged["seconds"] = {
        **(earlier_seconds if isinstance(earlier_seconds, dict) else {}),
        **fresh.get("seconds", {}),
    }
    return merged
