"""The method comparison's tables (bench.methods measures, this module writes): each
share with its n and Wilson interval, each mean with its t interval, the model-free rows
beside the methods, the paired tests between every two of them, and the markers that
let one run rewrite its own sections of docs/models.md and README.md."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

import numpy as np

from krypton.baselines import MODEL_FREE, RANDOMISATION_THRESHOLD
from krypton.methods import IG_GAP, METHODS
from krypton.paired import holm, mcnemar, paired_difference

# every row of a table: the methods, then the maps that never look at the model
ROWS = METHODS + MODEL_FREE
NAMES = {
    "occlusion": "occlusion (exact)",
    "gradcam": "Grad-CAM",
    "integrated_gradients": "IG",
    "random": "chance (uniform random map)",
    "centre": "centre prior (model-free)",
    "edges": "Sobel edges (model-free)",
    "contrast": "local contrast (model-free)",
}


def share(hits: list[bool]) -> str:
    """'55% (n 100, 45-65%)': a share with its n and 95% Wilson interval."""
    from scipy.stats import binomtest

    count, n = int(sum(hits)), len(hits)
    if n == 0:
        return "— (n 0)"
    interval = binomtest(count, n).proportion_ci(confidence_level=0.95, method="wilson")
    return f"{count / n:.0%} (n {n}, {interval.low:.0%}-{interval.high:.0%})"


def chance_share(chances: list[float]) -> str:
    """'3.1% (exact chance, n 100)': the pointing a uniform random map scores in
    expectation, the mean over inputs of the share of cells that would be a hit."""
    if not chances:
        return "— (n 0)"
    return f"{np.mean(chances):.1%} (exact chance, n {len(chances)})"


def mean_interval(values: list[float]) -> str:
    """'0.333 (0.301-0.365)': a mean with its 95% t interval (the mean alone for one value)."""
    from scipy.stats import t

    if not values:
        return "—"
    mean = float(np.mean(values))
    if len(values) < 2:
        return f"{mean:.3f}"
    half = t.ppf(0.975, len(values) - 1) * float(np.std(values, ddof=1)) / np.sqrt(len(values))
    return f"{mean:.3f} ({mean - half:.3f}-{mean + half:.3f})"


def covered_share(lesions: list[bool], images: list[int]) -> str:
    """Coverage over the lesions: '62% (n 230, 56-68%) on 98 images'."""
    return f"{share(lesions)} on {len(images)} images" if lesions else "—"


def randomisation_cell(verdicts: list[dict]) -> str:
    """The randomisation check over inputs (krypton.baselines.randomisation_verdict
    records): how many passed, the mean |Spearman| of those with ranks, how many went
    flat (a pass) and how many were undefined (a failure)."""
    if not verdicts:
        return "— (not run with this fill)"
    passed = sum(v["passed"] for v in verdicts)
    ranked = [abs(v["spearman_abs"]) for v in verdicts if math.isfinite(v["spearman_abs"])]
    flat = sum(v["why"] == "the map went flat" for v in verdicts)
    undefined = len(verdicts) - len(ranked) - flat
    mean = f"mean abs. ρ {np.mean(ranked):.2f}" if ranked else "no ranks"
    notes = [mean] + [f"{flat} flat"] * bool(flat) + [f"{undefined} undefined"] * bool(undefined)
    return f"passes {passed} of {len(verdicts)} ({'; '.join(notes)})"


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
    "of lesions (images with 2-4) | deletion AUC ↓ | insertion AUC ↑ | deletion AUC, blur, "
    "other grid ↓ | insertion AUC, blur, other grid ↑ | s each | IG path | randomisation: "
    f"passes when the Spearman of the absolute maps, trained vs re-initialised, is within "
    f"±{RANDOMISATION_THRESHOLD} |"
)


def table_rows(model: str, fill: str, scores: dict, verdicts: dict) -> list[str]:
    """One markdown row per method and per model-free map: every share with its n and
    Wilson interval (chance: exact), every mean area with its t interval."""
    rows = []
    for method in [m for m in ROWS if m in scores]:
        score = scores[method]
        layers = ", ".join(dict.fromkeys(score.get("layer", [])))
        if method == "random":
            pointing = [chance_share(score["pointing_chance"]),
                        chance_share(score["pointing_any_chance"])]  # fmt: skip
        else:
            pointing = [share(score["pointing"]), share(score["pointing_any"])]
        cells = [
            model, fill, NAMES[method] + (f" ({layers})" if layers else ""), *pointing,
            covered_share(score["coverage"], score.get("coverage_images", [])),
            *(mean_interval(score[k]) for k in ("deletion", "insertion", "blur_deletion",
                                                "blur_insertion")),
            f"{statistics.median(score['seconds']):.2f}",
            ig_paths(score["ig_path"]) if method == "integrated_gradients" else "—",
            randomisation_cell(verdicts.get(method, [])),
        ]  # fmt: skip
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def _p(value: float) -> str:
    return "<0.001" if value < 0.001 else f"{value:.3f}"


def _difference(first: list[float], second: list[float]) -> str:
    found = paired_difference(first, second)
    if not math.isfinite(found["low"]):
        return f"{found['mean']:+.3f}"
    return f"{found['mean']:+.3f} ({found['low']:+.3f} to {found['high']:+.3f})"


PAIRED_HEADER = (
    "| A vs B | pointing A / B (A only / B only) | McNemar p (Holm) | deletion AUC A − B "
    "(95% paired bootstrap) | blur deletion A − B | insertion AUC A − B |\n"
    "|---|---|---|---|---|---|"
)


def paired_rows(model: str, fill: str, scores: dict) -> list[str]:
    """Every two of the methods and model-free maps on the same inputs (chance apart: its
    pointing is exact, not drawn): McNemar's exact test on pointing, Holm-corrected over
    the table's pairs, and the paired differences of the areas with bootstrap intervals."""
    names = [m for m in ROWS if m in scores and m != "random"]
    pairs = list(itertools.combinations(names, 2))
    tests = [mcnemar(scores[a]["pointing"], scores[b]["pointing"]) for a, b in pairs]
    adjusted = holm([t["p"] for t in tests])
    n = len(scores[names[0]]["pointing"]) if names else 0
    lines = [f"{model}, {fill} fill: paired tests on the same {n} inputs", "", PAIRED_HEADER]
    for (a, b), test, corrected in zip(pairs, tests, adjusted):
        first, second = scores[a], scores[b]
        cells = [
            f"{NAMES[a]} vs {NAMES[b]}",
            f"{np.mean(first['pointing']):.0%} / {np.mean(second['pointing']):.0%} "
            f"({test['only_first']} / {test['only_second']})",
            f"{_p(test['p'])} ({_p(corrected)})",
            *(_difference(first[k], second[k])
              for k in ("deletion", "blur_deletion", "insertion")),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


# README's short table: the methods, the strongest model-free maps and chance
COMPACT = ("occlusion", "gradcam", "integrated_gradients", "contrast", "edges")
COMPACT_HEADER = (
    "| model | fill | n | pointing: occlusion / Grad-CAM / IG / local contrast / Sobel edges "
    "(model-free) / chance | deletion AUC ↓: occlusion / Grad-CAM / IG / local contrast / "
    "Sobel edges |\n|---|---|---|---|---|"
)


def compact_rows(model: str, fill: str, scores: dict) -> str:
    """README's row: pointing at the explained class (with chance) and deletion AUC."""
    shown = [m for m in COMPACT if m in scores]
    pointing = [f"{np.mean(scores[m]['pointing']):.0%}" for m in shown]
    if "random" in scores:
        pointing.append(f"{np.mean(scores['random']['pointing_chance']):.1%}")
    deletion = " / ".join(f"{np.mean(scores[m]['deletion']):.3f}" for m in shown)
    n = len(scores[METHODS[0]]["pointing"])
    return f"| {model} | {fill} | {n} | {' / '.join(pointing)} | {deletion} |"


def marks(section: str) -> tuple[str, str]:
    """The BEGIN and END markers of one ``section`` ('fundus trained', 'chestct checks')."""
    return f"<!-- bench.methods {section}: begin -->", f"<!-- bench.methods {section}: end -->"


def write_tables(path: Path, text: str, section: str) -> None:
    """Put ``text`` between the file's markers of ``section`` (the rest is kept), so a
    run of one kind or one fill rewrites its own tables only."""
    begin, end = marks(section)
    document = path.read_text()
    if begin not in document or end not in document:
        raise SystemExit(f"{path} has no {begin} ... {end} section to write the tables into")
    head, rest = document.split(begin, 1)
    path.write_text(head + begin + "\n" + text + "\n" + end + rest.split(end, 1)[1])
