"""Which method points at the lesion? Occlusion, Grad-CAM and Integrated Gradients on the
demo models' independently written generators, where the ground truth is known.

    python -m bench.methods [--images 100] [--volumes 50]      (part of make bench)

For each method (krypton.methods.compare, on occlusion's grid: fundus-demo patch 12,
stride 8; chestct-demo cube 8, stride 5, the app's defaults for it):

* pointing game: the strongest cell touches a planted lesion of the explained class
  (fundus; and, labelled apart, a lesion of any kind: exudate images hold
  microaneurysms too), or its cube holds the nodule's centre (chest CT); each share with
  its n and a 95% Wilson interval;
* coverage (fundus, images with 2-4 lesions): the share of lesions under the top 5% of
  cells;
* deletion and insertion AUC (Petsiuk et al., 2018): the class's probability as the
  top-ranked cells are hidden under the fill (low is good) or revealed on an image all
  fill (high is good), 10 steps;
* seconds per image or volume;
* the randomisation test (Adebayo et al., 2018): Spearman's rank correlation of each
  method's map on the trained model with its map on the same architecture re-initialised
  (near 0: the map depends on what the model learnt; near 1: it does not); a flat map has
  no ranks, and is counted and reported, never dropped from the count;
* cascading randomisation (Adebayo et al., 2018, section 3.1) on the first ``--cascade``
  inputs: the model's blocks re-initialised one more at a time from the output down,
  and at each step each method's map compared with its trained-model map (Spearman of
  the absolute maps, SSIM), flat maps counted.

The held-out sets are demo.fundus.independent and demo.chestct.independent: separately
written drawing code, seeds no training or tuning used.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import numpy as np
import torch
from PIL import Image

from krypton.fundus import CLASSES
from krypton.methods import (
    METHODS,
    agreement,
    cascading_randomisation,
    compare,
    deletion_curve,
    randomised,
)
from krypton.registry import load_model

SEED = 77  # the held-out draws: no training, tuning or evaluation used this seed
NAMES = {"occlusion": "occlusion (exact)", "gradcam": "Grad-CAM", "integrated_gradients": "IG"}


def _measure(model, cases, stride: int, randomisation: int, hit, coverage=None):
    """Each method on each (input, label, lesions) of ``cases``: ``hit(map, lesions)`` for
    the pointing game, ``coverage(map, lesions)`` on inputs with 2 or more, the deletion
    and insertion areas and the seconds; and on the first ``randomisation`` inputs, each
    map's rank correlation with its map on the re-initialised model."""
    scores: dict = defaultdict(lambda: defaultdict(list))
    similarity: dict = defaultdict(list)
    shuffled = randomised(model, seed=SEED)
    for number, (tensor, label, lesions) in enumerate(cases):
        maps = compare(model, tensor, patch=model.patch, stride=stride, label=label)
        for method, found in maps.items():
            score = scores[method]
            explained, anywhere = hit(found, lesions)
            score["pointing"].append(explained)
            score["pointing_any"].append(anywhere)
            if coverage is not None and len(lesions) >= 2:
                score["coverage"].append(coverage(found, lesions))
            score["deletion"].append(deletion_curve(model, tensor, found)[2])
            score["insertion"].append(deletion_curve(model, tensor, found, insertion=True)[2])
            score["seconds"].append(found.seconds)
        if number < randomisation:
            other = compare(shuffled, tensor, patch=model.patch, stride=stride, label=label,
                            fill=model.gray_fill())  # fmt: skip
            for method in METHODS:
                similarity[method].append(agreement(maps[method], other[method])["spearman"])
    return scores, similarity


def cascade(model, cases, stride: int, count: int) -> None:
    """The cascading-randomisation curve over the first ``count`` of ``cases``: per step,
    each method's mean Spearman of absolute maps and SSIM with the trained model's maps,
    over the maps that are not flat, and how many were flat."""
    steps: dict = {}
    for number, (tensor, label, _) in enumerate(cases):
        if number >= count:
            break
        records = cascading_randomisation(
            model, tensor, patch=model.patch, stride=stride, label=label, seed=SEED
        )
        for record in records:
            step = steps.setdefault(record["randomised"][-1], defaultdict(list))
            for method in METHODS:
                step[method].append(record[method])
    print(f"\n{model.name}: cascading randomisation, {count} inputs: Spearman of |map| / "
          f"SSIM with the trained model's map, as blocks are re-initialised from the output "
          f"down")  # fmt: skip
    print("| re-initialised down to | " + " | ".join(NAMES[m] for m in METHODS) + " |")
    print("|---" * (1 + len(METHODS)) + "|")
    for block, found in steps.items():
        cells = []
        for method in METHODS:
            ranked = [f for f in found[method] if not f["flat"]]
            flat = len(found[method]) - len(ranked)
            rho = np.mean([f["spearman_abs"] for f in ranked]) if ranked else float("nan")
            ssim = np.nanmean([f["ssim"] for f in ranked]) if ranked else float("nan")
            shown = f"{rho:+.2f} / {ssim:.2f}" if ranked else "—"
            cells.append(shown + (f" ({flat} flat)" if flat else ""))
        print(f"| {block} | " + " | ".join(cells) + " |", flush=True)


def _fundus(count: int, stride: int, randomisation: int, cascaded: int = 0) -> tuple[dict, dict]:
    from demo.fundus.independent import IndependentFundusGenerator

    model = load_model("fundus-demo")

    def cases():
        generator = IndependentFundusGenerator(seed=SEED)
        for number in range(count):
            sample = generator.sample(label=1 + number % 2)
            yield model.preprocess(Image.fromarray(sample.image)), sample.label, sample.lesions

    def hit(found, lesions) -> tuple[bool, bool]:  # the strongest cell's patch touches a
        y, x = (int(a[i]) for a, i in zip(found.axes, _strongest(found)))  # lesion
        touched = [lesion for lesion in lesions if lesion.covered_by(x, y, model.patch)]
        kind = CLASSES[found.label]  # of the explained class; of any kind
        return any(lesion.kind == kind for lesion in touched), bool(touched)

    measured = _measure(model, cases(), stride, randomisation, hit, _covered)
    if cascaded:
        cascade(model, cases(), stride, cascaded)
    return measured


def _strongest(found) -> tuple[int, ...]:
    return np.unravel_index(int(found.top_cells(0.0)[0]), found.importance.shape)


def _covered(found, lesions) -> float:
    """The share of lesions whose centre lies under one of the top 5% of cells."""
    top = [np.unravel_index(int(f), found.importance.shape) for f in found.top_cells(0.05)]
    boxes = [[(int(a[i]), int(a[i]) + p) for a, i, p in zip(found.axes, c, found.patch)]
             for c in top]  # fmt: skip
    hit = [any(y0 <= k.y < y1 and x0 <= k.x < x1 for (y0, y1), (x0, x1) in boxes)
           for k in lesions]  # fmt: skip
    return float(np.mean(hit))


def _chest(count: int, stride: int, randomisation: int, cascaded: int = 0) -> tuple[dict, dict]:
    from demo.chestct.independent import IndependentChestCT
    from demo.chestct.train import to_tensor

    model = load_model("chestct-demo")

    def cases():
        generator = IndependentChestCT(seed=SEED)
        for _ in range(count):
            sample = generator.sample(label=1, nodules=1)
            yield to_tensor([sample.volume])[0], 1, sample.nodules

    def hit(found, nodules) -> tuple[bool, bool]:  # the strongest cell's cube holds the
        corner = [int(a[i]) for a, i in zip(found.axes, _strongest(found))]  # nodule's centre
        centre = (nodules[0].z, nodules[0].y, nodules[0].x)
        inside = all(c <= v < c + model.patch for c, v in zip(corner, centre))
        return inside, inside  # one nodule, of the explained class

    measured = _measure(model, cases(), stride, randomisation, hit)
    if cascaded:
        cascade(model, cases(), stride, cascaded)
    return measured


def share(hits: list[bool]) -> str:
    """'55% (n 100, 45-65%)': a share with its n and 95% Wilson interval."""
    from scipy.stats import binomtest

    count, n = int(sum(hits)), len(hits)
    if n == 0:
        return "— (n 0)"
    interval = binomtest(count, n).proportion_ci(confidence_level=0.95, method="wilson")
    return f"{count / n:.0%} (n {n}, {interval.low:.0%}-{interval.high:.0%})"


def correlations(values: list[float]) -> str:
    """The mean Spearman of the maps that have ranks, how many, and how many were flat."""
    ranked = [v for v in values if np.isfinite(v)]
    flat = len(values) - len(ranked)
    mean = f"{np.mean(ranked):+.2f}" if ranked else "—"
    return f"{mean} ({len(ranked)} maps; {flat} flat, no ranks)"


def _table(title: str, count: int, scores: dict, similarity: dict) -> None:
    print(f"\n{title} ({count} held-out)")
    coverage = "coverage (2-4 lesions) | " if any("coverage" in s for s in scores.values()) else ""
    print(f"| method | pointing: explained class | pointing: any lesion | {coverage}deletion "
          f"AUC ↓ | insertion AUC ↑ | s each | randomisation: Spearman with a re-initialised "
          f"model |")  # fmt: skip
    print("|---" * (7 + bool(coverage)) + "|")
    for method in METHODS:
        score = scores[method]
        cells = [share(score["pointing"]), share(score["pointing_any"])]
        if coverage:
            cells.append(f"{np.mean(score['coverage']):.0%} ({len(score['coverage'])} images)")
        cells += [
            f"{np.mean(score['deletion']):.3f}",
            f"{np.mean(score['insertion']):.3f}",
            f"{statistics.median(score['seconds']):.2f}",
            correlations(similarity[method]),
        ]
        print(f"| {NAMES[method]} | " + " | ".join(cells) + " |", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--volumes", type=int, default=50)
    parser.add_argument("--randomisation", type=int, default=20, help="per model")
    parser.add_argument("--cascade", type=int, default=2, help="inputs per model")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads")
    if args.images:
        scores, similarity = _fundus(args.images, 8, args.randomisation, args.cascade)
        _table("fundus-demo, demo.fundus.independent, patch 12, stride 8", args.images,
               scores, similarity)  # fmt: skip
    if args.volumes:
        scores, similarity = _chest(args.volumes, 5, args.randomisation, args.cascade)
        _table("chestct-demo, demo.chestct.independent (one nodule), cube 8, stride 5",
               args.volumes, scores, similarity)  # fmt: skip


if __name__ == "__main__":
    main()
