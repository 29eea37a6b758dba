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
* coverage (fundus, images with 2-4 lesions): the share of those images' lesions whose
  centre lies under the top 5% of cells, counted over the lesions, with their n, the
  images' count and a 95% Wilson interval (lesions of one image are not independent, so
  the interval is the narrowest honest one, not a per-image one);
* deletion and insertion AUC (Petsiuk et al., 2018): the class's probability as the
  top-ranked cells are hidden under the fill (low is good) or revealed on an image all
  fill (high is good), 10 steps, cells of equal importance in a seeded random order
  (krypton.methods.MethodMap.ranked_cells); each mean with a 95% t interval; and the same
  with neither occlusion's fill nor its grid (krypton.methods.blur_deletion_curve: blocks
  1.5x the patch, hidden by a Gaussian blur of the input), so occlusion is not scored by
  its own yardstick;
* seconds per image or volume;
* IG's path: its steps and on how many inputs its attributions sum to f(input) -
  f(fill) within 1% (Captum's convergence delta), and the worst gap;
* the randomisation check (Adebayo et al., 2018; krypton.baselines.randomisation_verdict):
  a map passes when the |Spearman| of its absolute map on the trained model and on the
  same architecture re-initialised is below 0.5; a map that goes flat passes, an
  undefined one fails; passes counted per method;
* the model-free rows (krypton.baselines.model_free_maps), scored like the methods: a
  uniform random map, whose pointing is given as its exact chance (per input, the share
  of cells that would be a hit, averaged), a centre prior, Sobel edges and local contrast
  (they read the picture only, so they must fail the randomisation check);
* paired tests (krypton.paired) between every two rows on the same inputs: McNemar's
  exact test on pointing with Holm's correction over the table, and the paired
  differences of the areas with 95% bootstrap intervals;
* cascading randomisation (Adebayo et al., 2018, section 3.1) on the first ``--cascade``
  inputs: the model's blocks re-initialised one more at a time from the output down,
  and at each step each method's map compared with its trained-model map (Spearman of
  the absolute maps, SSIM), flat maps counted;
* Grad-CAM block by block: its pointing with each convolutional block it may read
  (krypton.methods.gradcam_candidates), the map's cells, and the block the default rule
  picks (the last module on the last convolution's grid), for each model, and the best
  block against the default with McNemar's p, Bonferroni-corrected for the blocks tried;
* data randomisation (Adebayo et al., 2018, section 3.2; the chest model, where the
  control trains in minutes): each method's maps on the no-fill control beside its maps
  on the same network trained to fit shuffled labels (demo.controls' ``chestct-shuffled``).

The held-out sets are demo.fundus.independent and demo.chestct.independent: separately
written drawing code, seeds no training or tuning used.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.methods_tables import (
    COMPACT_HEADER,
    HEADER,
    NAMES,
    ROWS,
    compact_rows,
    paired_rows,
    share,
    table_rows,
    write_tables,
)
from krypton.baselines import (
    RANDOMISATION_THRESHOLD,
    model_free_maps,
    passes_randomisation,
    randomisation_verdict,
)
from krypton.engine.capture_lock import CAPTURE_LOCK
from krypton.methods import (
    METHODS,
    blur_deletion_curve,
    cascading_randomisation,
    compare,
    deletion_curve,
    gradcam_candidates,
    gradcam_layer,
    path_gap,
    randomised,
    similarity,
)
from krypton.paired import mcnemar
from krypton.registry import load_model
from krypton.synthetic.fundus import CLASSES

SEED = 77  # the held-out draws: no training, tuning or evaluation used this seed


# The fills each comparison runs with: occlusion's value, IG's baseline and the deletion
# curves' fill. "trained": the model's own (gray; parenchyma), which both demo models saw
# while they learnt; "mean": the input's own mean per channel, which no model was shown.
FILLS = {
    "trained": lambda model, tensor: model.gray_fill(),
    "mean": lambda model, tensor: tensor.mean(dim=tuple(range(1, tensor.dim()))).tolist(),
}


def _measure(model, cases, stride: int, randomisation: int, hit, coverage=None, fill="trained"):
    """Each method and each model-free map (krypton.baselines) on each (input, label,
    lesions) of ``cases`` with the ``fill`` rule (:data:`FILLS`): ``hit(map, lesions)``
    for the pointing game (for the random map also its exact chance), ``coverage(map,
    lesions)`` on inputs with 2 or more, the deletion and insertion areas with the fill on
    the map's cells and with a blur on another grid, the seconds and IG's steps and
    completeness gap; and on the first ``randomisation`` inputs, each map's randomisation
    verdict against its map on the re-initialised model."""
    scores: dict = defaultdict(lambda: defaultdict(list))
    verdicts: dict = defaultdict(list)
    shuffled = randomised(model, seed=SEED)
    for number, (tensor, label, lesions) in enumerate(cases):
        value = FILLS[fill](model, tensor)
        maps = compare(model, tensor, patch=model.patch, stride=stride, label=label, fill=value)
        free = model_free_maps(tensor, maps["occlusion"], seed=SEED + number)
        for method, found in {**maps, **free}.items():
            _score(scores[method], model, tensor, found, lesions, hit, coverage, value, number)
        if number < randomisation:
            other = compare(shuffled, tensor, patch=model.patch, stride=stride, label=label,
                            fill=value)  # fmt: skip
            # the model-free maps read the picture only: on the re-initialised model's
            # grid they come out the same, and must fail
            again = model_free_maps(tensor, other["occlusion"], seed=SEED + number)
            for method, found in {**maps, **free}.items():
                verdicts[method].append(randomisation_verdict(found, {**other, **again}[method]))
    return scores, verdicts


def _score(score, model, tensor, found, lesions, hit, coverage, fill, number: int) -> None:
    """One map's scores on one input, appended to ``score``."""
    explained, anywhere = hit(found, lesions)
    score["pointing"].append(explained)
    score["pointing_any"].append(anywhere)
    if found.method == "random":  # a uniform map's strongest cell is any cell alike
        cells = [hit(found, lesions, cell) for cell in np.ndindex(*found.importance.shape)
                 if np.isfinite(found.importance[cell])]  # fmt: skip
        score["pointing_chance"].append(float(np.mean([e for e, _ in cells])))
        score["pointing_any_chance"].append(float(np.mean([a for _, a in cells])))
    if coverage is not None and len(lesions) >= 2:
        score["coverage"].extend(coverage(found, lesions))
        score["coverage_images"].append(number)
    score["deletion"].append(deletion_curve(model, tensor, found, fill=fill)[2])
    score["insertion"].append(deletion_curve(model, tensor, found, insertion=True, fill=fill)[2])
    score["blur_deletion"].append(blur_deletion_curve(model, tensor, found)[2])
    score["blur_insertion"].append(blur_deletion_curve(model, tensor, found, insertion=True)[2])
    score["seconds"].append(found.seconds)
    if found.method == "gradcam":
        score["layer"].append(found.detail.removeprefix("layer "))
    if (path := path_gap(found.detail)) is not None:
        score["ig_path"].append(path)


def cascade(model, cases, stride: int, count: int) -> list[str]:
    """The cascading-randomisation curve over the first ``count`` of ``cases``: per step,
    each method's mean Spearman of absolute maps and SSIM with the trained model's maps,
    over the maps that are not flat, and how many were flat; as markdown lines."""
    steps: dict = {}
    edges_passed = edges_checked = 0  # the model-free row that must fail
    for number, (tensor, label, _) in enumerate(cases):
        if number >= count:
            break
        records = cascading_randomisation(
            model, tensor, patch=model.patch, stride=stride, label=label, seed=SEED
        )
        grid = dict(patch=model.patch, stride=stride, label=label, methods=("occlusion",))
        trained = compare(model, tensor, **grid)["occlusion"]
        reinitialised = compare(randomised(model, seed=SEED), tensor, **grid)["occlusion"]
        verdict = randomisation_verdict(
            model_free_maps(tensor, trained)["edges"],
            model_free_maps(tensor, reinitialised)["edges"],
        )
        edges_passed += verdict["passed"]
        edges_checked += 1
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
    if steps:  # the verdict at full re-initialisation, and the model-free row that must fail
        last = list(steps.values())[-1]
        verdicts = [
            f"{NAMES[m]} {sum(passes_randomisation(f) for f in last[m])} of {len(last[m])}"
            for m in METHODS
        ]
        lines += [
            "",
            f"Passes at full re-initialisation (|Spearman of |map|| < "
            f"{RANDOMISATION_THRESHOLD}; a map gone flat passes, an undefined one fails): "
            + ", ".join(verdicts)
            + f"; Sobel edges (model-free: the row that must fail) {edges_passed} of "
            f"{edges_checked}.",
        ]
    print("\n" + "\n".join(lines), flush=True)
    return lines


def _fundus(model, count: int, distractors: bool = False, generator=None):
    """(the held-out images as (tensor, label, lesions), the pointing rule, coverage);
    ``distractors``: the harder generator's, look-alikes on every eye; ``generator``:
    draw from this one instead (bench.conspicuity scores the training generator too)."""
    from demo.fundus.independent import IndependentFundusGenerator

    def cases():  # the same draws each call, unless ``generator`` was given
        drawn = generator or IndependentFundusGenerator(seed=SEED, distractors=distractors)
        for number in range(count):
            sample = drawn.sample(label=1 + number % 2)
            yield model.preprocess(Image.fromarray(sample.image)), sample.label, sample.lesions

    def hit(found, lesions, cell=None) -> tuple[bool, bool]:  # the strongest cell's (or
        cell = _strongest(found) if cell is None else cell  # ``cell``'s) patch touches a
        y, x = (int(a[i]) for a, i in zip(found.axes, cell))  # lesion
        touched = [lesion for lesion in lesions if lesion.covered_by(x, y, model.patch)]
        kind = CLASSES[found.label]  # of the explained class; of any kind
        return any(lesion.kind == kind for lesion in touched), bool(touched)

    return cases, hit, _covered


def _strongest(found) -> tuple[int, ...]:
    return np.unravel_index(int(found.top_cells(0.0)[0]), found.importance.shape)


def _covered(found, lesions) -> list[bool]:
    """Per lesion, whether its centre lies under one of the top 5% of cells."""
    top = [np.unravel_index(int(f), found.importance.shape) for f in found.top_cells(0.05)]
    boxes = [[(int(a[i]), int(a[i]) + p) for a, i, p in zip(found.axes, c, found.patch)]
             for c in top]  # fmt: skip
    hit = [any(y0 <= k.y < y1 and x0 <= k.x < x1 for (y0, y1), (x0, x1) in boxes)
           for k in lesions]  # fmt: skip
    return hit


def _chest(model, count: int):
    """(the held-out volumes as (tensor, label, nodules), the pointing rule, no coverage)."""
    from demo.chestct.independent import IndependentChestCT
    from demo.chestct.train import to_tensor

    def cases():
        generator = IndependentChestCT(seed=SEED)
        for _ in range(count):
            sample = generator.sample(label=1, nodules=1)
            yield to_tensor([sample.volume])[0], 1, sample.nodules

    def hit(found, nodules, cell=None) -> tuple[bool, bool]:  # the strongest cell's (or
        cell = _strongest(found) if cell is None else cell  # ``cell``'s) cube holds the
        corner = [int(a[i]) for a, i in zip(found.axes, cell)]  # nodule's centre
        centre = (nodules[0].z, nodules[0].y, nodules[0].x)
        inside = all(c <= v < c + model.patch for c, v in zip(corner, centre))
        return inside, inside  # one nodule, of the explained class

    return cases, hit, None


def gradcam_by_layer(model, cases, stride: int, hit) -> list[str]:
    """Grad-CAM's pointing at the explained class with each block
    :func:`krypton.methods.gradcam_candidates` offers (a block whose output is its last
    child's is shown once, under both names), its map's cells, and which one the default
    rule picks; as markdown lines."""
    hits: dict = defaultdict(list)
    blocks: dict[str, tuple[str, tuple[int, ...]]] = {}
    default = ""
    for tensor, label, lesions in cases:
        if not blocks:
            blocks = _block_outputs(model, tensor)
            default = gradcam_layer(model, tensor)[0]
        for layer in dict.fromkeys(shown for shown, _ in blocks.values()):
            options = dict(patch=model.patch, stride=stride, label=label, methods=("gradcam",))
            found = compare(model, tensor, layer=layer.split(" = ")[0], **options)["gradcam"]
            hits[layer].append(hit(found, lesions)[0])
    lines = [
        f"{model.name}: Grad-CAM's pointing at the explained class, block by block (default: "
        f"the last module on the last convolution's grid, {default}):",
        "",
        "| block | its map's cells | pointing: explained class |",
        "|---|---|---|",
    ]
    for layer, found in hits.items():
        cells = "×".join(str(n) for n in next(c for s, c in blocks.values() if s == layer))
        marked = f"**{layer}** (default)" if default in layer.split(" = ") else layer
        lines.append(f"| {marked} | {cells} | {share(found)} |")
    lines += ["", _best_against_default(hits, default)]
    print("\n" + "\n".join(lines), flush=True)
    return lines


def _best_against_default(hits: dict[str, list[bool]], default: str) -> str:
    """The best block's pointing against the default's on the same inputs: McNemar's
    exact p, and that p times the blocks tried (Bonferroni: the best of many is picked
    after the fact, so its lead must clear every comparison that could have been made)."""
    shown = next((name for name in hits if default in name.split(" = ")), None)
    best = max(hits, key=lambda name: np.mean(hits[name]))
    if shown is None or best == shown:
        return f"The default block points best of the {len(hits)} tried."
    test = mcnemar(hits[best], hits[shown])
    corrected = min(1.0, test["p"] * len(hits))
    return (
        f"The best block, {best} ({np.mean(hits[best]):.0%}), against the default "
        f"({np.mean(hits[shown]):.0%}) on the same {test['n']} inputs: {test['only_first']} "
        f"hit only with the best, {test['only_second']} only with the default, McNemar p = "
        f"{test['p']:.3g}, {corrected:.3g} after a Bonferroni correction for picking the best "
        f"of {len(hits)} blocks."
    )


def _block_outputs(model, tensor) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Per Grad-CAM candidate block: (its name as shown, joined with the blocks that give
    the very same output, e.g. 'layer4.1 = layer4'; its output's spatial shape)."""
    names = gradcam_candidates(model, tensor)
    modules = dict(model.module.named_modules())
    outputs: dict[str, torch.Tensor] = {}
    # exclusive, as gradcam_candidates' own hooks: no other forward of the shared model
    with CAPTURE_LOCK.exclusive():
        hooks = [modules[n].register_forward_hook(
            lambda _, __, out, name=n: outputs.__setitem__(name, out)) for n in names]  # fmt: skip
        try:
            with torch.inference_mode():
                model.module(tensor.unsqueeze(0))
        finally:
            for hook in hooks:
                hook.remove()
    same = defaultdict(list)
    for name in names:
        same[id(outputs[name])].append(name)
    return {n: (" = ".join(same[id(outputs[n])]), tuple(outputs[n].shape[2:])) for n in names}


def data_randomisation(control, shuffled, cases, stride: int, count: int, fill: str) -> list[str]:
    """Adebayo et al.'s data randomisation (2018, section 3.2) on the first ``count`` of
    ``cases``: each method's map on ``control`` beside its map on ``shuffled`` (the same
    architecture trained to fit shuffled labels), Spearman of the signed and absolute
    maps and SSIM, flat maps counted; as markdown lines."""
    found: dict = defaultdict(list)
    for number, (tensor, label, _) in enumerate(cases):
        if number >= count:
            break
        value = FILLS[fill](control, tensor)
        options = dict(patch=control.patch, stride=stride, label=label, fill=value)
        first, second = compare(control, tensor, **options), compare(shuffled, tensor, **options)
        for method in METHODS:
            found[method].append(similarity(first[method], second[method]))
    training = shuffled.extra.get("entry", {}).get("training") or {}
    fitted, held_out = (training.get(k) for k in ("last_train_accuracy", "held_out_accuracy"))
    lines = [
        f"Data randomisation on {count} inputs: {control.name}'s maps beside those of "
        f"{shuffled.name}, the same network trained to fit shuffled labels (accuracy on "
        f"them over its last 100 training steps {'—' if fitted is None else f'{fitted:.0%}'}, "
        f"held out {'—' if held_out is None else f'{held_out:.0%}'}), {fill} fill:",
        "",
        "| method | Spearman | Spearman of abs. map | SSIM | flat maps |",
        "|---|---|---|---|---|",
    ]
    for method in METHODS:
        ranked = [f for f in found[method] if not f["flat"]]
        means = [np.nanmean([f[k] for f in ranked]) if ranked else float("nan")
                 for k in ("spearman", "spearman_abs", "ssim")]  # fmt: skip
        lines.append(f"| {NAMES[method]} | {means[0]:+.2f} | {means[1]:+.2f} | {means[2]:.2f} | "
                     f"{len(found[method]) - len(ranked)} of {len(found[method])} |")  # fmt: skip
    print("\n" + "\n".join(lines), flush=True)
    return lines


def _fundus_harder(model, count: int):
    return _fundus(model, count, distractors=True)


KINDS = {  # kind: (shipped model, its held-out subject, stride, what is counted)
    "fundus": ("fundus-demo", _fundus, 8, "images (demo.fundus.independent), patch 12, stride 8"),
    "fundus-harder": ("fundus-hard-demo", _fundus_harder, 8, "images with look-alikes "
                      "(demo.fundus.independent, distractors=True), patch 12, stride 8"),
    "chestct": ("chestct-demo", _chest, 5, "volumes with one nodule (demo.chestct.independent), "
                "cube 8, stride 5"),
}  # fmt: skip


def _home(model: str) -> Path | None:
    """Where ``model`` is written when it is not shipped (the harder generator's model:
    demo.fundus.data.TASKS); None: the registry's own search."""
    from demo.fundus.data import TASKS, TODAY

    task = TASKS.get(model)
    return None if task is None or task == TODAY else task.directory


def _models(shipped: str, controls: Path | None) -> tuple[list, object | None]:
    """The shipped model (or the harder generator's, where trained) and, where
    ``controls`` holds it, its no-fill control; and its data-randomisation control where
    ``controls`` holds that. No models where the first is not trained."""
    home = _home(shipped)
    if home is not None and not (home / f"{shipped}.json").exists():
        print(f"no {shipped} in {home}: `make harder` trains it")
        return [], None
    models, shuffled = [load_model(shipped, home)], None
    if controls is not None:
        from demo.controls import CONTROLS, SHUFFLED

        if (controls / f"{CONTROLS[shipped]}.json").exists():
            models.append(load_model(CONTROLS[shipped], controls))
        else:
            print(f"no {CONTROLS[shipped]} in {controls}: `make controls` trains it")
        if shipped in SHUFFLED and (controls / f"{SHUFFLED[shipped]}.json").exists():
            shuffled = load_model(SHUFFLED[shipped], controls)
    return models, shuffled


def accuracy_note(shipped: str, controls: Path | None) -> str:
    """Whether the no-fill control's held-out accuracy is within ACCURACY_MATCH of the
    shipped model's (the same test set: each card's ``held_out``); "" without a control.
    Where it is not, a drop from shipped to control is not the occluder's alone; where
    ``controls`` lacks it, the table says it has no control rows."""
    from demo.controls import ACCURACY_MATCH, CONTROLS
    from krypton.registry.entries import find_entry

    if controls is None:
        return ""
    path = controls / f"{CONTROLS[shipped]}.json"
    if not path.exists():
        return (
            f"No {CONTROLS[shipped]} (the same training without the occluder) was trained "
            f"for this run, so no control rows (`make controls` trains it)."
        )
    control = json.loads(path.read_text())["training"].get("held_out_accuracy")
    card = find_entry(shipped, _home(shipped))[1].get("evaluation", {})
    mine = card.get("held_out", {}).get("accuracy")
    if control is None or mine is None:
        return f"{CONTROLS[shipped]}: no held-out accuracy to compare with {shipped}'s."
    within = abs(control - mine) <= ACCURACY_MATCH
    verdict = (
        f"within {ACCURACY_MATCH * 100:.0f} point"
        if within
        else f"NOT within {ACCURACY_MATCH * 100:.0f} point: a drop from {shipped} to its "
        f"control is partly the accuracy's, not the occluder's alone"
    )
    return (
        f"{CONTROLS[shipped]} (no occluder) holds out {control:.1%} against {shipped}'s "
        f"{mine:.1%}: {verdict}."
    )


def _comparison(kind: str, count: int, fills: list[str], args) -> dict[str, tuple[str, str]]:
    """Every (model, fill) of ``kind`` on ``count`` inputs (with ``args.tables``), and
    with ``args.checks`` the Grad-CAM blocks, cascading and data randomisation: per
    section, (the whole tables for docs/models.md, the short one for README, empty for
    the checks)."""
    shipped, subject, stride, what = KINDS[kind]
    title = f"{count} held-out {what}, seed {SEED}"
    models, shuffled = _models(shipped, args.controls)
    if not models:
        return {}
    note = accuracy_note(shipped, args.controls)  # after the fill: "..., trained fill. Note."
    said = f" {note}" if note else ""
    sections: dict[str, tuple[str, str]] = {}
    for fill in fills if args.tables else []:
        rows, compact, paired = [], [], []
        for model in models:
            cases, hit, coverage = subject(model, count)
            randomisation = args.randomisation if fill == fills[0] else 0
            scores, verdicts = _measure(model, cases(), stride, randomisation, hit, coverage, fill)
            rows += table_rows(model.name, fill, scores, verdicts)
            paired += ["", *paired_rows(model.name, fill, scores)]
            compact.append(compact_rows(model.name, fill, scores))
            print("\n".join(rows[-len(ROWS) :] + paired), flush=True)
        heading = f"{title}, {fill} fill.{said}"
        whole = [heading, "", HEADER, "|---" * HEADER.count(" |") + "|", *rows, *paired]
        sections[f"{kind} {fill}"] = (
            "\n".join(whole),
            "\n".join([heading, "", COMPACT_HEADER, *compact]),
        )  # fmt: skip
    if args.checks:
        checks: list[str] = []
        for model in models:
            cases, hit, _ = subject(model, count)
            checks += ["", *gradcam_by_layer(model, cases(), stride, hit)]
            if args.cascade:
                checks += ["", *cascade(model, cases(), stride, args.cascade)]
        if shuffled is not None and len(models) > 1:
            cases = subject(models[1], count)[0]()
            checks += ["", *data_randomisation(models[1], shuffled, cases, stride,
                                               args.randomisation, fills[0])]  # fmt: skip
        sections[f"{kind} checks"] = ("\n".join([f"{title}.{said}", *checks]), "")
    return sections


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--volumes", type=int, default=50)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument("--randomisation", type=int, default=20, help="per model")
    parser.add_argument("--cascade", type=int, default=20, help="inputs per model")
    parser.add_argument("--checks", action=argparse.BooleanOptionalAction, default=True,
                        help="Grad-CAM's blocks, cascading and data randomisation")  # fmt: skip
    parser.add_argument("--tables", action=argparse.BooleanOptionalAction, default=True,
                        help="the main table per fill (--no-tables: the checks only)")  # fmt: skip
    parser.add_argument("--controls", type=Path, help="where demo.controls wrote the controls")
    parser.add_argument("--fills", default=",".join(FILLS), help=f"of {', '.join(FILLS)}")
    parser.add_argument("--doc", type=Path, help="a file whose bench.methods sections get "
                        "the whole tables (docs/models.md)")  # fmt: skip
    parser.add_argument("--readme", type=Path, help="one that gets the short ones (README.md)")
    args = parser.parse_args(argv)
    fills = [f.strip() for f in args.fills.split(",") if f.strip()]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if unknown := (set(fills) - set(FILLS)) | (set(kinds) - set(KINDS)):
        parser.error(f"unknown fill or kind: {', '.join(sorted(unknown))}")
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads")
    counts = {"fundus": args.images, "fundus-harder": args.images, "chestct": args.volumes}
    for kind in kinds:
        if not counts[kind]:
            continue
        for section, (whole, short) in _comparison(kind, counts[kind], fills, args).items():
            print("\n" + whole, flush=True)
            for path, text in ((args.doc, whole), (args.readme, short)):
                if path is not None and text:
                    write_tables(path, text, section)
                    print(f"wrote {section} into {path}")


if __name__ == "__main__":
    main()
