"""Integrated Gradients at the default policy on the shipped fundus samples: per sample
and class, the gradient evaluations the adaptive path used, the completeness gap and
the seconds, beside one Gauss-Legendre rule of 128 steps on the same path (the most the
old doubling rule reached) for comparison. ``make bench`` runs it.

    python -m bench.integrated_gradients [--all-classes]

By default each sample's explained (predicted) class, which the Compare view computes
first; ``--all-classes``: every class, as the view goes on to."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-classes", action="store_true")
    args = parser.parse_args(argv)
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
