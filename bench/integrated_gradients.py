"""Integrated Gradients at the default policy on the shipped fundus samples: per sample
and class, the gradient evaluations the adaptive path used, the completeness gap and
the seconds, beside one Gauss-Legendre rule of 128 steps on the same path (the most the
old doubling rule reached) for comparison. ``make bench`` runs it.

    python -m bench.integrated_gradients [--all-classes] [--spread 20]

By default each sample's explained (predicted) class, which the Compare view computes
first; ``--all-classes``: every class, as the view goes on to. ``--spread N``: instead,
on N generated fundus images, how far a Compare step's evaluations (every class) vary
from image to image, and how much of that two predictors known before the step could
take out (:func:`spread`): a forward-only profile of each class's logit along the path,
and the gap after the path's first two segments (a pilot the step would then reuse)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

import krypton
from krypton import methods

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ("fundus-exudates.png", "fundus-microaneurysms.png", "fundus-normal-disc.png")


def rows(all_classes: bool = False) -> list[dict]:
    """One row per (sample, class): evaluations, gap and seconds of the default policy,
    and the gap and seconds of one 128-step rule."""
    loaded = krypton.load_model("fundus-demo")
    fill = loaded.gray_fill()
    found = []
    for name in SAMPLES:
        image = loaded.preprocess(Image.open(ROOT / "assets" / "samples" / name).convert("RGB"))
        with torch.inference_mode():
            predicted = int(loaded.module(image.unsqueeze(0)).argmax())
        labels = range(len(loaded.classes)) if all_classes else [predicted]
        for label in labels:
            policy = methods.pixel_attribution(
                loaded, image, "integrated_gradients", label, fill=fill
            )
            began = time.perf_counter()
            _, _, fixed_gap = methods._integrated_gradients(loaded.module, image, label, fill, 128)
            fixed_seconds = time.perf_counter() - began
            found.append(
                {
                    "sample": name,
                    "class": loaded.classes[label],
                    "explained": label == predicted,
                    "steps": policy.steps,
                    "gap": policy.gap,
                    "seconds": policy.seconds,
                    "gap_128": fixed_gap,
                    "seconds_128": fixed_seconds,
                }  # fmt: skip
            )
    return found


def spread_rows(count: int) -> list[dict]:
    """One row per (generated image, class): the adaptive path's evaluations and seconds,
    the gap after its first two segments (``pilot``) and the class's logit at 17 points
    along the path from the gray fill (one forward pass of 17 inputs, ``profile``)."""
    from krypton.synthetic.fundus import FundusGenerator

    loaded = krypton.load_model("fundus-demo")
    fill = loaded.gray_fill()
    found = []
    for seed in range(40, 40 + count):
        generator = FundusGenerator(seed=seed)
        sample = generator.sample(label=seed % 3, lesions=2) if seed % 3 else generator.sample(0)
        image = loaded.preprocess(Image.fromarray(sample.image).convert("RGB"))
        baseline = torch.as_tensor(fill, dtype=image.dtype).view(-1, 1, 1).expand_as(image)
        alphas = torch.linspace(0, 1, 17).view(-1, 1, 1, 1)
        with torch.inference_mode():
            profile = loaded.module(baseline + alphas * (image - baseline)).float().numpy()
        for label in range(len(loaded.classes)):
            began = time.perf_counter()
            _, used, gap = methods._integrated_gradients(loaded.module, image, label, fill, None)
            seconds = time.perf_counter() - began
            _, _, pilot = methods._integrated_gradients(
                loaded.module, image, label, fill, None, 2 * methods.IG_STEPS
            )
            found.append(
                {"image": seed, "label": label, "evaluations": used, "gap": gap,
                 "seconds": seconds, "pilot": pilot, "profile": profile[:, label]}
            )  # fmt: skip
    return found


def _profile_variation(row: dict) -> float:
    """The logit's total variation along the path over its net change (1 for a path that
    only climbs or only falls; large where it turns, which is where the rule halves)."""
    profile = row["profile"]
    change = abs(float(profile[-1] - profile[0])) + 1e-9
    return float(np.abs(np.diff(profile)).sum()) / change


def held_out_ratios(rows: list[dict], feature: Callable[[dict], float]) -> np.ndarray:
    """Per image, its step's evaluations over those predicted from ``feature`` by a
    log-log line fitted on the other images' classes (leave one image out)."""
    images = sorted({row["image"] for row in rows})
    ratios = []
    for image in images:
        train = [row for row in rows if row["image"] != image]
        x = np.log([feature(row) + 1e-4 for row in train])
        y = np.log([row["evaluations"] for row in train])
        slope, intercept = np.polyfit(x, y, 1)
        test = [row for row in rows if row["image"] == image]
        predicted = sum(np.exp(intercept + slope * np.log(feature(r) + 1e-4)) for r in test)
        ratios.append(sum(row["evaluations"] for row in test) / predicted)
    return np.array(ratios)


def spread(count: int) -> None:
    """Print how a Compare step's evaluations vary over ``count`` images, and the width
    of the 80% range (10th to 90th percentile of actual over predicted) each predictor
    leaves: how narrow an estimate made before the step from that predictor could be."""
    rows = spread_rows(count)
    steps: dict[int, list[dict]] = {}
    for row in rows:
        steps.setdefault(row["image"], []).append(row)
    totals = np.array([sum(r["evaluations"] for r in kept) for kept in steps.values()])
    seconds = np.array([sum(r["seconds"] for r in kept) for kept in steps.values()])
    per_class = sorted({row["evaluations"] for row in rows})
    print(f"{count} images x {len(rows) // count} classes; evaluations per path: "
          f"{per_class[0]}-{per_class[-1]}; per step: {totals.min()}-{totals.max()}; "
          f"seconds per step: {seconds.min():.1f}-{seconds.max():.1f}; torch threads "
          f"{torch.get_num_threads()}", flush=True)  # fmt: skip
    predictors = (
        ("nothing (the step's evaluations, over their median)", totals / np.median(totals)),
        ("the logit's profile along the path (one forward)",
         held_out_ratios(rows, _profile_variation)),
        ("the gap after the first two segments (a pilot)",
         held_out_ratios(rows, lambda row: row["pilot"])),
    )  # fmt: skip
    for name, ratios in predictors:
        low, high = np.percentile(ratios, [10, 90])
        print(f"  predicted from {name}: 80% of steps within {low:.2f}-{high:.2f}x, "
              f"a range {high / low:.2f}x wide", flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-classes", action="store_true")
    parser.add_argument("--spread", type=int, default=0, metavar="N",
                        help="the step's spread over N generated images instead")  # fmt: skip
    args = parser.parse_args(argv)
    if args.spread:
        spread(args.spread)
        return
    print(f"Integrated Gradients, default policy (segments of {methods.IG_STEPS} Gauss-Legendre "
          f"nodes, at most {methods.IG_MAX_STEPS} evaluations, gap aimed at {methods.IG_GAP:.0%}); "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    print(
        f"{'sample':28} {'class':14} {'steps':>5} {'gap':>7} {'s':>6}   {'gap@128':>8} {'s@128':>6}"
    )
    for row in rows(args.all_classes):
        mark = "*" if row["explained"] else " "
        print(
            f"{row['sample']:28} {row['class'] + mark:14} {row['steps']:5d} {row['gap']:7.2%} "
            f"{row['seconds']:6.1f}   {row['gap_128']:8.2%} {row['seconds_128']:6.1f}",
            flush=True,
        )
    print("* the explained (predicted) class")


if __name__ == "__main__":
    main()
