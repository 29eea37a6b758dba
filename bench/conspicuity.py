"""Does pointing measure conspicuity? The model-free maps (krypton.baselines: Sobel edges,
local contrast, a centre prior) scored by bench.methods' pointing rule on each fundus
generator, beside the exact chance of a uniform random map, with no model involved.

    python -m bench.conspicuity [--images 100]     (also part of make bench-methods)

Today's generators plant lesions on a clean retina, so a map that follows brightness or
edges finds them (local contrast pointed at a lesion of the class on 72% of the held-out
images). The harder generators (``distractors=True``) add look-alikes as conspicuous as
the lesions on every eye; there a model-free map should score near chance, so that a
method beating chance there follows the model, not the picture. The grid is the method
comparison's (patch 12, stride 8), the explained class the image's own.

The chest-CT volumes (one nodule, cube 8, stride 5, bench.methods' rule: the strongest
cube holds the nodule's centre) are scored too: there the body's outline against the air
and the vessel tree outshine a nodule already, so today's generator is the harder one.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import numpy as np
import torch

from bench.methods import _chest, _fundus
from krypton.baselines import MODEL_FREE, model_free_maps
from krypton.methods import MethodMap
from krypton.registry import load_model
from krypton.synthetic.fundus import FundusGenerator

SEED = 77  # bench.methods' held-out draws
PATCH, STRIDE = 12, 8  # bench.methods' fundus grid
WITHIN = 0.10  # the harder generator's promise: model-free rows within 10 points of chance


def _generators() -> dict:
    from demo.fundus.independent import IndependentFundusGenerator

    return {
        "held-out": lambda hard: IndependentFundusGenerator(seed=SEED, distractors=hard),
        "training": lambda hard: FundusGenerator(seed=SEED, distractors=hard),
    }


def _scores(cases, hit, grid) -> dict[str, float]:
    """Per model-free map, the share of ``cases`` whose strongest cell the pointing rule
    ``hit`` (bench.methods' own) counts; ``chance``: a uniform random map's exact
    expectation, the mean over the grid's cells of the same rule."""
    hits: dict[str, list[bool]] = {name: [] for name in MODEL_FREE if name != "random"}
    chance = []
    for tensor, label, lesions in cases():
        like = grid(tensor, label)
        cells = np.ndindex(*like.importance.shape)
        chance.append(float(np.mean([hit(like, lesions, c)[0] for c in cells])))
        for name, found in model_free_maps(tensor, like).items():
            if name in hits:
                hits[name].append(hit(found, lesions)[0])
    return {"chance": float(np.mean(chance)), **{k: float(np.mean(v)) for k, v in hits.items()}}


def _like(patch: int, stride: int, rank: int):
    """A blank map on the grid of ``patch`` and ``stride`` over a square input of ``rank``
    spatial dimensions: the model-free maps are made on its cells."""

    def grid(tensor: torch.Tensor, label: int) -> MethodMap:
        axis = np.arange(0, tensor.shape[-1] - patch + 1, stride)
        blank = np.zeros((len(axis),) * rank)
        return MethodMap("grid", blank, (axis,) * rank, (patch,) * rank, label, 1.0, 0.0, "")

    return grid


def pointing(generator, count: int, preprocess) -> dict[str, float]:
    """Per model-free map, the share of ``count`` lesion images from ``generator``
    (MICROANEURYSM and EXUDATE alternately, as bench.methods draws them) whose strongest
    cell's patch touches a lesion of the image's class; ``chance``: a uniform random map's
    exact expectation."""
    subject = SimpleNamespace(patch=PATCH, preprocess=preprocess)
    cases, hit, _ = _fundus(subject, count, generator=generator)
    return _scores(cases, hit, _like(PATCH, STRIDE, 2))


CUBE, CUBE_STRIDE = 8, 5  # bench.methods' chest-CT grid


def chest_pointing(count: int) -> dict[str, float]:
    """:func:`pointing` for ``count`` held-out chest-CT volumes with one nodule each (the
    strongest cube holds the nodule's centre)."""
    cases, hit, _ = _chest(SimpleNamespace(patch=CUBE), count)
    return _scores(cases, hit, _like(CUBE, CUBE_STRIDE, 3))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--volumes", type=int, default=50)
    args = parser.parse_args(argv)
    preprocess = load_model("fundus-demo").preprocess
    torch.manual_seed(0)
    print(f"{args.images} images per generator, seed {SEED}; pointing at a lesion of the "
          f"image's class (patch {PATCH}, stride {STRIDE})")  # fmt: skip
    print(
        "| generator | look-alikes | chance | "
        + " | ".join(MODEL_FREE[1:])
        + " | most above chance |"
    )
    print("|---" * (len(MODEL_FREE) + 3) + "|")
    for name, make in _generators().items() if args.images else ():
        for hard in (False, True):
            found = pointing(make(hard), args.images, preprocess)
            above = max(found[k] for k in MODEL_FREE[1:]) - found["chance"]
            cells = " | ".join(f"{found[k]:.0%}" for k in MODEL_FREE[1:])
            verdict = "" if not hard else (" (within)" if above <= WITHIN else " (NOT within)")
            print(f"| {name} | {'yes' if hard else 'no'} | {found['chance']:.1%} | {cells} | "
                  f"{above * 100:+.0f} points{verdict} |", flush=True)  # fmt: skip
    if args.volumes:
        found = chest_pointing(args.volumes)
        above = max(found[k] for k in MODEL_FREE[1:]) - found["chance"]
        cells = " | ".join(f"{found[k]:.0%}" for k in MODEL_FREE[1:])
        print(f"| chest CT held-out, {args.volumes} volumes | no | {found['chance']:.1%} | "
              f"{cells} | {above * 100:+.0f} points |")  # fmt: skip


if __name__ == "__main__":
    main()
