"""The demo task's generators: classes by appearance not size, the label rule, hard
negatives, whole views and gray renderings; the independent generator keeps the spec."""

import hashlib

import numpy as np
import pytest

from demo.fundus.independent import IndependentFundusGenerator
from krypton.synthetic.fundus import (
    CLASSES,
    DISTRACTOR_CLEARANCE,
    DISTRACTORS,
    EXUDATE_RADIUS,
    MICROANEURYSM_RADIUS,
    FundusGenerator,
    Lesion,
    label_for,
    retina_landmarks,
)


def test_size_ranges_overlap_so_size_is_no_shortcut():
    assert EXUDATE_RADIUS[0] < MICROANEURYSM_RADIUS[1] and MICROANEURYSM_RADIUS[0] < 2
    generator = FundusGenerator(seed=0)
    radii = {"MICROANEURYSM": [], "EXUDATE": []}
    for index in range(60):
        sample = generator.sample(label=1 + index % 2, view="crop")
        for lesion in sample.lesions:
            radii[lesion.kind].append(lesion.radius)
    assert min(radii["EXUDATE"]) < 3 < max(radii["MICROANEURYSM"])  # both sizes in both


def test_label_rule_any_exudate_makes_it_exudate():
    ma, ex = Lesion("MICROANEURYSM", 0, 0, 2), Lesion("EXUDATE", 0, 0, 2)
    assert label_for([]) == 0 and label_for([ma, ma]) == 1 and label_for([ma, ex]) == 2
    sample = FundusGenerator(seed=3).sample(kinds=["MICROANEURYSM", "EXUDATE"], view="crop")
    assert sample.label == CLASSES.index("EXUDATE") and len(sample.lesions) == 2


def test_colour_of_lesions_by_class():
    """Microaneurysms darken and redden, exudates brighten and yellow the retina."""
    generator = FundusGenerator(seed=4)
    for kind, darker in (("MICROANEURYSM", True), ("EXUDATE", False)):
        plain = FundusGenerator(seed=4).sample(label=0, view="crop", rendering="colour")
        sample = generator.sample(kinds=[kind], view="crop", rendering="colour")
        lesion = sample.lesions[0]
        y, x = int(lesion.y), int(lesion.x)
        centre = sample.image[y, x].astype(float)
        ring = sample.image[max(y - 12, 0), x].astype(float)
        assert (centre.sum() < ring.sum()) == darker, kind
        del plain


@pytest.mark.parametrize("rendering", ["gray", "green"])
def test_gray_renderings_are_gray(rendering):
    """Gray up to per-channel sensor noise (sigma <= 0.02): no colour left to go by."""
    sample = FundusGenerator(seed=5).sample(label=1, rendering=rendering)
    image = sample.image.astype(float)
    for a, b in ((0, 1), (1, 2)):
        assert abs((image[..., a] - image[..., b]).mean()) < 1.0
        assert np.abs(image[..., a] - image[..., b]).mean() < 8


def test_whole_views_show_the_dark_border_and_lesions_stay_on_the_retina():
    generator = FundusGenerator(seed=6)
    for _ in range(10):
        sample = generator.sample(label=2, view="whole", rendering="colour")
        corners = sample.image[:8, :8].mean()
        assert corners < 30  # the black surround of a whole fundus
        for lesion in sample.lesions:
            assert sample.image[int(lesion.y), int(lesion.x)].mean() > 40  # not on black


def test_landmarks_and_anatomy_views():
    marks = retina_landmarks()
    photo_centre = np.array(marks["centre"])
    assert np.linalg.norm(np.array(marks["disc"]) - photo_centre) > 300  # disc off-centre
    assert np.linalg.norm(np.array(marks["macula"]) - photo_centre) < 250
    normal = FundusGenerator(seed=7).sample(label=0, view="anatomy")
    assert normal.label == 0 and not normal.lesions


def test_seeded_generators_repeat_themselves():
    first, second = FundusGenerator(seed=9).sample(), FundusGenerator(seed=9).sample()
    np.testing.assert_array_equal(first.image, second.image)
    assert first.lesions == second.lesions


def test_the_independent_generator_keeps_the_spec():
    generator = IndependentFundusGenerator(seed=1)
    samples = [generator.sample(label=i % 3) for i in range(24)]
    assert all(s.image.shape == (224, 224, 3) and s.image.dtype == np.uint8 for s in samples)
    for sample in samples:
        assert sample.label == label_for(sample.lesions)
        assert 0 <= len(sample.lesions) <= 4
        for lesion in sample.lesions:
            low, high = MICROANEURYSM_RADIUS if lesion.kind == "MICROANEURYSM" else EXUDATE_RADIUS
            assert low <= lesion.radius <= high
    assert {s.label for s in samples} == {0, 1, 2}


def _digest(generator) -> str:
    found = hashlib.sha256()
    for number in range(6):
        sample = generator.sample(label=number % 3)
        found.update(sample.image.tobytes())
        lesions = [
            (k.kind, round(k.x, 3), round(k.y, 3), round(k.radius, 3)) for k in sample.lesions
        ]
        found.update(repr(lesions).encode())
    return found.hexdigest()[:16]


def test_todays_generators_draw_what_they_drew_before_the_harder_ones():
    """The shipped model, its tables and its tests rest on these draws: the harder
    generators' option must not move a seed's stream (digests of the code before it)."""
    assert _digest(FundusGenerator(seed=11)) == "816b7ef9e64f5e10"
    assert _digest(IndependentFundusGenerator(seed=11)) == "910d8c28758c7cf8"


@pytest.mark.parametrize("make", [FundusGenerator, IndependentFundusGenerator])
def test_the_harder_generators_put_look_alikes_on_every_eye_away_from_the_lesions(make):
    generator = make(seed=4, distractors=True)
    samples = [generator.sample(label=number % 3) for number in range(18)]
    assert {s.label for s in samples} == {0, 1, 2}
    for sample in samples:
        kinds = {d.kind for d in sample.distractors}
        assert {"GLARE", "REFLEX", "PIGMENT"} <= kinds <= set(DISTRACTORS)  # normal eyes too
        assert sample.label == label_for(sample.lesions)  # look-alikes never decide it
        for look_alike in sample.distractors:
            for lesion in sample.lesions:
                gap = np.hypot(look_alike.x - lesion.x, look_alike.y - lesion.y)
                assert gap > look_alike.radius + lesion.radius + DISTRACTOR_CLEARANCE
    assert all(not s.distractors for s in (make(seed=4).sample() for _ in range(3)))


def test_on_the_harder_generators_conspicuity_is_no_evidence():
    """Model-free maps (edges, local contrast) point at a lesion of the class far above
    chance on today's held-out generator, and within 10 points of chance on the harder
    ones (bench.conspicuity on 60 images; 20 show today's gap)."""
    from bench.conspicuity import WITHIN, pointing
    from krypton.registry import load_model

    preprocess = load_model("fundus-demo").preprocess
    today = pointing(IndependentFundusGenerator(seed=77), 20, preprocess)
    assert min(today["edges"], today["contrast"]) > today["chance"] + 0.4
    for make in (FundusGenerator, IndependentFundusGenerator):
        harder = pointing(make(seed=77, distractors=True), 60, preprocess)
        assert max(harder["edges"], harder["contrast"]) <= harder["chance"] + WITHIN, harder


def test_lowest_region_is_the_centre_of_tied_minima():
    """A lesion hidden equally by four patches: the first lowest cell is one corner of the
    tie, the lowest region's centre is the middle of the four."""
    from types import SimpleNamespace

    from demo.fundus.evaluate import lowest_points

    values = np.full((5, 5), 0.9, dtype=np.float32)
    values[1:3, 2:4] = 0.05  # tied
    values[0, 0] = 0.5  # a partial drop: not part of the lowest region
    grid = np.arange(0, 40, 8)
    heatmap = SimpleNamespace(values=values, xs=grid, ys=grid, prob=0.9)
    cell, region = lowest_points(heatmap, patch=16)
    assert cell == (16 + 7.5, 8 + 7.5)
    assert region == (20 + 7.5, 12 + 7.5)


def test_evaluation_parts_are_re_measured_and_merged_into_the_record():
    """`evaluate --parts` re-measures only what it names; the record keeps the rest and
    each part's seconds, and an unknown part is refused before anything runs."""
    import torch

    from demo.fundus.train import build_model, evaluate, merge_evaluation

    torch.manual_seed(0)
    model = build_model().eval()
    earlier = {
        "held_out": {"accuracy": 0.975, "images": 600},
        "pointing_game_strict": {"hit_rate": 0.76, "stride": 8},
        "seconds": 884.0,  # records before per-part timing kept one total
    }
    fresh = evaluate(model, None, held_out=6, parts=("held_out",), log=lambda *_: None)
    assert set(fresh) == {"held_out", "evaluated", "machine", "seconds"}
    assert fresh["held_out"]["images"] == 6 and set(fresh["seconds"]) == {"held_out"}
    merged = merge_evaluation(earlier, fresh)
    assert merged["held_out"] == fresh["held_out"]
    assert merged["pointing_game_strict"] == earlier["pointing_game_strict"]
    assert merged["seconds"] == fresh["seconds"]
    again = merge_evaluation(merged, {"seconds": {"ood": 3.0}, "ood": {"threshold": 2.0}})
    assert again["seconds"] == {**fresh["seconds"], "ood": 3.0}
    with pytest.raises(ValueError, match="unknown evaluation parts"):
        evaluate(model, None, parts=("pointing", "speed"))


def test_a_partly_hidden_lesion_keeps_the_visible_share_it_reports():
    """Stage 4's augmentation: the gray box covers part of one lesion's disk (the share
    still visible as reported, 0.1-0.9), touches no other lesion, and nothing else of the
    image changes; the training target mixes the targets with and without the lesion by
    that share, so it falls between them."""
    generator = FundusGenerator(seed=21)
    shares = []
    for index in range(40):
        sample = generator.sample(label=1 + index % 2)
        found = generator.partly_hide_lesion(sample)
        assert found is not None
        image, hidden, share = found
        shares.append(share)
        changed = np.any(image != sample.image, axis=-1)
        rows, cols = np.nonzero(np.all(image == 128, axis=-1) & changed)
        assert len(rows), "the box is drawn"
        y0, y1, x0, x1 = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
        assert not changed[:y0].any() and not changed[y1:].any()
        assert not changed[:, :x0].any() and not changed[:, x1:].any()
        lesion = sample.lesions[hidden]
        assert 0.1 <= share <= 0.9
        reach = lesion.radius + 1  # the disk the share is measured on
        ys, xs = np.mgrid[0:224, 0:224] + 0.5
        disk = (xs - lesion.x) ** 2 + (ys - lesion.y) ** 2 <= reach**2
        inside = disk & (xs >= x0) & (xs < x1) & (ys >= y0) & (ys < y1)
        assert abs((1 - inside.sum() / disk.sum()) - share) < 0.15
        others = sample.lesions[:hidden] + sample.lesions[hidden + 1 :]
        assert not any(o.covered_by(x0, y0, max(x1 - x0, y1 - y0)) for o in others)
    assert min(shares) < 0.3 and max(shares) > 0.7  # from mostly hidden to mostly seen
    # the target mixes: one microaneurysm half seen is half MICROANEURYSM (0.70), half
    # NORMAL (0.05 left to it); a batch holds such mixtures and only probabilities
    from demo.fundus.data import _batch, partly_hidden_target

    dot, fleck = Lesion("MICROANEURYSM", 50, 50, 3), Lesion("EXUDATE", 90, 90, 2)
    np.testing.assert_allclose(partly_hidden_target([dot], 0, 0.5), [0.525, 0.375, 0.1])
    np.testing.assert_allclose(  # the exudate half hidden: EXUDATE or MICROANEURYSM evidence
        partly_hidden_target([dot, fleck], 1, 0.5), [0.15, 0.425, 0.425]
    )
    _, targets = _batch(FundusGenerator(seed=22), 90, gray_boxes=True, graded=True, partial=True)
    np.testing.assert_allclose(targets.sum(1), 1.0, atol=1e-6)
    pure = {0.7, 0.82, 0.89, 0.935, 0.9}
    assert any(round(float(t.max()), 3) not in pure for t in targets)
    _, targets = _batch(FundusGenerator(seed=22), 90, gray_boxes=True, graded=True)
    assert all(round(float(t.max()), 3) in pure for t in targets)


def test_a_later_stage_refuses_a_model_with_too_few_stages(tmp_path, capsys):
    """`fourth-stage` continues a three-stage model; given a two-stage record it says so
    before loading or training anything."""
    import json

    from demo.fundus.data import REGISTRY_FILE
    from demo.fundus.train import main

    (tmp_path / REGISTRY_FILE).write_text(json.dumps({"training": {"stages": [{}, {}]}}))
    with pytest.raises(SystemExit):
        main(["fourth-stage", "--from-dir", str(tmp_path)])
    assert "fourth-stage needs a model of at least 3 stages" in capsys.readouterr().err


def _local_pointing_hits(model, patch: int, images: int = 30) -> int:
    """Issue 12's strict pointing game in the lesion's neighbourhood: on how many of the
    first ``images`` pointing images the lowest of the cells (stride 4) whose centres lie
    within 16 px of the lesion lies within 8 px of its centre."""
    import krypton
    from demo.fundus.data import to_tensor
    from demo.fundus.evaluate import _gray_fill, lowest_points, pointing_set

    half = (patch - 1) / 2
    hits = 0
    explainer = krypton.OcclusionExplainer(model)  # one capture for all the images
    for sample in pointing_set(images):
        lesion = sample.lesions[0]
        near = [
            (x, y)
            for x in range(0, 224 - patch + 1, 4)
            for y in range(0, 224 - patch + 1, 4)
            if (x + half - lesion.x) ** 2 + (y + half - lesion.y) ** 2 <= 16**2
        ]
        image = to_tensor(sample.image[None])[0]
        heatmap = explainer.explain(
            image, patch=patch, fill=_gray_fill(), label=sample.label, positions=near
        )
        (x, y), _ = lowest_points(heatmap, patch)
        hits += (x - lesion.x) ** 2 + (y - lesion.y) ** 2 <= 8**2
    return hits


def test_the_shipped_model_points_at_a_lesion_not_beside_it():
    """At patch 16 the stage-3 model let a half-covered lesion take the probability to its
    floor, so the minimum fell on a covering edge as often as on the lesion: 46 of the
    first 60 pointing images (76.7%); stage 4, trained on partly hidden lesions, 50
    (83.3%). The test plays the first 30 (half the time in `make test`): 25 of 30, held
    to the same 80% as the 48 of 60 it used to need."""
    import krypton

    hits = _local_pointing_hits(krypton.load_model("fundus-demo").module, patch=16)
    assert hits >= 24, f"{hits} of 30"


def test_the_default_patch_keeps_the_lowest_cell_on_the_lesion():
    """fundus-demo's own default patch (registry "patch": 12) is the one the card's
    strict pointing game is played with. At 16 the cells that hide a small lesion whole
    reach 10 px from it diagonally, so the lowest of them may lie past 8 px (50 of the
    first 60); at 12 they stay within 7.8 px: 56 of 60, and 28 of the first 30 that the
    test plays (held to 90%, as 54 of 60 was)."""
    import krypton

    loaded = krypton.load_model("fundus-demo")
    hits = _local_pointing_hits(loaded.module, patch=loaded.patch)
    assert hits >= 27, f"{hits} of 30 at patch {loaded.patch}"


def test_a_model_of_the_harder_task_learns_from_it_and_is_written_beside_not_over_the_shipped(
    tmp_path, monkeypatch
):
    """The harder generator's model (fundus-hard-demo) trains on the generators with
    look-alikes, under its own name and files; it is not the app's default and claims no
    modality, so the shipped fundus-demo stays the one a photograph meets."""
    import json

    from demo.fundus import data
    from demo.fundus.train import save, train
    from krypton.registry import load_model

    drawn = []
    real = FundusGenerator.__init__

    def spy(self, seed=0, size=224, distractors=False):
        drawn.append(distractors)
        real(self, seed=seed, size=size, distractors=distractors)

    monkeypatch.setattr(FundusGenerator, "__init__", spy)
    options = dict(epochs=1, images_per_epoch=8, batch_size=8, log=lambda *_: None)
    model, record = train(**options, task=data.HARDER)
    assert drawn == [True] and "look-alikes" in record["generator"]
    path = save(model, record, tmp_path, task=data.HARDER)
    entry = json.loads(path.read_text())
    assert path.name == "fundus-hard-demo.json" and entry["name"] == "fundus-hard-demo"
    assert "default" not in entry and "modalities" not in entry
    assert not (tmp_path / "fundus-demo.json").exists()
    assert load_model("fundus-hard-demo", tmp_path).classes == list(CLASSES)
    assert data.TASKS["fundus-hard-demo"].independent(1).distractors
