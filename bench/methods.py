"""Which method points at the lesion? Occlusion, Grad-CAM and Integrated Gradients on the
demo models' independently written generators, where the ground truth is known.

    python -m bench.methods [--images 100] [--volumes 50] [--controls out/controls]
                            [--fills trained,mean] [--doc docs/models.md] [--readme README.md]
    (make bench-methods: the controls trained first, the tables written into both files)

Both demo models learnt on occlusion's own fill (gray boxes; parenchyma cubes), which
is also IG's baseline and the deletion curves' fill, so each comparison runs on the
shipped model and on its no-fill control (demo.controls), and with two fills: the
model's own ("trained") and the input's own mean per channel ("mean"), which no model
was shown. For each model, fill and method (krypton.methods.compare, on occlusion's
grid: fundus patch 12, stride 8; chest CT cube 8, stride 5, the app's defaults for it):

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
* IG's path: its steps and on how many inputs its attributions sum to f(input) -
  f(fill) within 1% (Captum's convergence delta), and the worst gap;
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
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from krypton.fundus import CLASSES
from krypton.methods import (
    IG_GAP,
    METHODS,
    agreement,
    cascading_randomisation,
    compare,
    deletion_curve,
    path_gap,
    randomised,
)
from krypton.registry import load_model

SEED = 77  # the held-out draws: no training, tuning or evaluation used this seed
NAMES = {"occlusion": "occlusion (exact)", "gradcam": "Grad-CAM", "integrated_gradients": "IG"}


# The fills each comparison runs with: occlusion's value, IG's baseline and the deletion
# curves' fill. "trained": the model's own (gray; parenchyma), which both demo models saw
# while they learnt; "mean": the input's own mean per channel, which no model was shown.
FILLS = {
    "trained": lambda model, tensor: model.gray_fill(),
    "mean": lambda model, tensor: tensor.mean(dim=tuple(range(1, tensor.dim()))).tolist(),
}


def _measure(model, cases, stride: int, randomisation: int, hit, coverage=None, fill="trained"):
    """Each method on each (input, label, lesions) of ``cases`` with the ``fill`` rule
    (:data:`FILLS`): ``hit(map, lesions)`` for the pointing game, ``coverage(map,
    lesions)`` on inputs with 2 or more, the deletion and insertion areas, the seconds and
    IG's steps and completeness gap; and on the first ``randomisation`` inputs, each map's
    rank correlation with its map on the re-initialised model."""
    scores: dict = defaultdict(lambda: defaultdict(list))
    similarity: dict = defaultdict(list)
    shuffled = randomised(model, seed=SEED)
    for number, (tensor, label, lesions) in enumerate(cases):
        value = FILLS[fill](model, tensor)
        maps = compare(model, tensor, patch=model.patch, stride=stride, label=label, fill=value)
        for method, found in maps.items():
            score = scores[method]
            explained, anywhere = hit(found, lesions)
            score["pointing"].append(explained)
            score["pointing_any"].append(anywhere)
            if coverage is not None and len(lesions) >= 2:
                score["coverage"].append(coverage(found, lesions))
            score["deletion"].append(deletion_curve(model, tensor, found, fill=value)[2])
            score["insertion"].append(
                deletion_curve(model, tensor, found, insertion=True, fill=value)[2]
            )
            score["seconds"].append(found.seconds)
            if (path := path_gap(found.detail)) is not None:
                score["ig_path"].append(path)
        if number < randomisation:
            other = compare(shuffled, tensor, patch=model.patch, stride=stride, label=label,
                            fill=value)  # fmt: skip
            for method in METHODS:
                similarity[method].append(agreement(maps[method], other[method])["spearman"])
    return scores, similarity


def cascade(model, cases, stride: int, count: int) -> list[str]:
    """The cascading-randomisation curve over the first ``count`` of ``cases``: per step,
    each method's mean Spearman of absolute maps and SSIM with the trained model's maps,
    over the maps that are not flat, and how many were flat; as markdown lines."""
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
    lines = [
        f"{model.name}: cascading randomisation on {count} inputs, Spearman of |map| / SSIM "
        f"with the trained model's map as blocks are re-initialised from the output down:",
        "",
        "| re-initialised down to | " + " | ".join(NAMES[m] for m in METHODS) + " |",
        "|---" * (1 + len(METHODS)) + "|",
    ]
    for block, found in steps.items():
        cells = []
        for method in METHODS:
            ranked = [f for f in found[method] if not f["flat"]]
            flat = len(found[method]) - len(ranked)
            rho = np.mean([f["spearman_abs"] for f in ranked]) if ranked else float("nan")
            ssim = np.nanmean([f["ssim"] for f in ranked]) if ranked else float("nan")
            shown = f"{rho:+.2f} / {ssim:.2f}" if ranked else "—"
            cells.append(shown + (f" ({flat} flat)" if flat else ""))
        lines.append(f"| {block} | " + " | ".join(cells) + " |")
    print("\n" + "\n".join(lines), flush=True)
    return lines


def _fundus(model, count: int, stride: int, randomisation: int, cascaded: int = 0,
            fill: str = "trained") -> tuple[dict, dict, list[str]]:  # fmt: skip
    from demo.fundus.independent import IndependentFundusGenerator

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

    scores, similarity = _measure(model, cases(), stride, randomisation, hit, _covered, fill)
    return scores, similarity, cascade(model, cases(), stride, cascaded) if cascaded else []


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


def _chest(model, count: int, stride: int, randomisation: int, cascaded: int = 0,
           fill: str = "trained") -> tuple[dict, dict, list[str]]:  # fmt: skip
    from demo.chestct.independent import IndependentChestCT
    from demo.chestct.train import to_tensor

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

    scores, similarity = _measure(model, cases(), stride, randomisation, hit, fill=fill)
    return scores, similarity, cascade(model, cases(), stride, cascaded) if cascaded else []


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


def ig_paths(paths: list[tuple[int, float, bool]]) -> str:
    """IG's steps and completeness: '32-64 steps; within 1% on 98 of 100 (worst 1.4%)'."""
    if not paths:
        return "—"
    steps = sorted({used for used, _, _ in paths})
    counted = f"{steps[0]}" if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
    within = sum(reached for _, _, reached in paths)
    worst = max(gap for _, gap, _ in paths)
    return f"{counted} steps; within {IG_GAP:.0%} on {within} of {len(paths)} (worst {worst:.1%})"


HEADER = (
    "| model | fill | method | pointing: explained class | pointing: any lesion | coverage "
    "(2-4 lesions) | deletion AUC ↓ | insertion AUC ↑ | s each | IG path | randomisation: "
    "Spearman with a re-initialised model |"
)


def table_rows(model: str, fill: str, scores: dict, similarity: dict) -> list[str]:
    """One markdown row per method: every share with its n and Wilson interval."""
    rows = []
    for method in METHODS:
        score = scores[method]
        covered = score["coverage"]
        cells = [
            model, fill, NAMES[method], share(score["pointing"]), share(score["pointing_any"]),
            f"{np.mean(covered):.0%} (n {len(covered)})" if covered else "—",
            f"{np.mean(score['deletion']):.3f}", f"{np.mean(score['insertion']):.3f}",
            f"{statistics.median(score['seconds']):.2f}",
            ig_paths(score["ig_path"]) if method == "integrated_gradients" else "—",
            correlations(similarity[method]),
        ]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def write_tables(path: Path, text: str) -> None:
    """Put ``text`` between the file's BEGIN and END markers (the rest is kept)."""
    document = path.read_text()
    if BEGIN not in document or END not in document:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section to write the tables into")
    head, rest = document.split(BEGIN, 1)
    path.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])


BEGIN, END = "<!-- bench.methods: begin -->", "<!-- bench.methods: end -->"
KINDS = {  # kind: (shipped model, run, stride, what is counted)
    "fundus": ("fundus-demo", _fundus, 8, "images (demo.fundus.independent), patch 12, stride 8"),
    "chestct": ("chestct-demo", _chest, 5, "volumes with one nodule (demo.chestct.independent), "
                "cube 8, stride 5"),
}  # fmt: skip


def _models(shipped: str, controls: Path | None) -> list:
    """The shipped model and, where ``controls`` holds it, its no-fill control."""
    models = [load_model(shipped)]
    if controls is not None:
        from demo.controls import CONTROLS

        if (controls / f"{CONTROLS[shipped]}.json").exists():
            models.append(load_model(CONTROLS[shipped], controls))
        else:
            print(f"no {CONTROLS[shipped]} in {controls}: `make controls` trains it")
    return models


def compact_rows(model: str, fill: str, scores: dict) -> str:
    """README's row: pointing at the explained class and deletion AUC, per method."""
    pointing = " / ".join(f"{np.mean(scores[m]['pointing']):.0%}" for m in METHODS)
    deletion = " / ".join(f"{np.mean(scores[m]['deletion']):.3f}" for m in METHODS)
    n = len(scores[METHODS[0]]["pointing"])
    return f"| {model} | {fill} | {n} | {pointing} | {deletion} |"


COMPACT_HEADER = (
    "| model | fill | n | pointing: occlusion / Grad-CAM / IG | deletion AUC ↓: occlusion / "
    "Grad-CAM / IG |\n|---|---|---|---|---|"
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--volumes", type=int, default=50)
    parser.add_argument("--randomisation", type=int, default=20, help="per model")
    parser.add_argument("--cascade", type=int, default=2, help="inputs per model")
    parser.add_argument("--controls", type=Path, help="where demo.controls wrote the controls")
    parser.add_argument("--fills", default=",".join(FILLS), help=f"of {', '.join(FILLS)}")
    parser.add_argument("--doc", type=Path, help="a file whose bench.methods section gets "
                        "the whole tables (docs/models.md)")  # fmt: skip
    parser.add_argument("--readme", type=Path, help="one that gets the short ones (README.md)")
    args = parser.parse_args(argv)
    fills = [f.strip() for f in args.fills.split(",") if f.strip()]
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads")
    whole, short = [], []
    for kind, count in (("fundus", args.images), ("chestct", args.volumes)):
        if not count:
            continue
        shipped, run, stride, what = KINDS[kind]
        rows, compact, curves = [], [], []
        for model in _models(shipped, args.controls):
            for fill in fills:
                cascaded = args.cascade if fill == fills[0] else 0
                scores, similarity, curve = run(
                    model, count, stride, args.randomisation, cascaded, fill
                )
                rows += table_rows(model.name, fill, scores, similarity)
                compact.append(compact_rows(model.name, fill, scores))
                curves += ["", *curve] if curve else []
                print("\n".join(rows[-len(METHODS) :]), flush=True)
        title = f"{count} held-out {what}, seed {SEED}:"
        whole.append("\n".join([title, "", HEADER, "|---" * 11 + "|", *rows, *curves]))
        short.append("\n".join([title, "", COMPACT_HEADER, *compact]))
        print("\n" + whole[-1], flush=True)
    for path, tables in ((args.doc, whole), (args.readme, short)):
        if path is not None:
            write_tables(path, "\n\n".join(tables))
            print(f"wrote the tables into {path}")


if __name__ == "__main__":
    main()
