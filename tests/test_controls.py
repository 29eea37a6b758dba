"""The method comparison's controls (demo.controls) and the bench's tables (bench.methods):
both demo models learnt on occlusion's own fill, so a comparison on them alone favours
occlusion and Integrated Gradients by construction."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from krypton.registry import load_model


def test_a_fundus_control_never_sees_a_gray_box_while_it_learns(monkeypatch):
    from demo.fundus import train as fundus
    from krypton.synthetic.fundus import FundusGenerator

    boxes = []
    real = FundusGenerator.gray_box
    monkeypatch.setattr(
        FundusGenerator, "gray_box", lambda self, sample: boxes.append(1) or real(self, sample)
    )
    options = dict(epochs=1, images_per_epoch=16, batch_size=16, log=lambda *_: None)
    _, record = fundus.train(**options, occluded=False)
    assert not boxes and record["gray_boxes"] is False
    fundus.train(**options)  # the shipped recipe: half the images carry one
    assert boxes


def test_the_fundus_control_sees_the_shipped_draws_with_the_occluder_alone_left_off():
    """The control was the shipped model's first stage only (95.2% held out against
    98.2%), so a drop from shipped to control could not be put on the occluder. It now
    takes the shipped recipe's draws, boxes drawn and left off: every image is the
    shipped batch's own where that carried no occluder, and its clean self where it
    did; the targets are those of every lesion."""
    from demo.fundus.data import _batch, evidence_target, to_tensor
    from krypton.synthetic.fundus import FundusGenerator

    for graded, partial in ((False, False), (True, False), (True, True)):
        shipped = _batch(FundusGenerator(seed=5), 24, True, graded, partial)
        control = _batch(FundusGenerator(seed=5), 24, True, graded, partial, occluder=False)
        clean = FundusGenerator(seed=5)  # the same samples, drawn without the boxes'
        samples = [clean.sample(label=i % 3) for i in range(24)]
        assert torch.equal(control[0], to_tensor(np.stack([s.image for s in samples])))
        occluded = [not torch.equal(a, b) for a, b in zip(shipped[0], control[0])]
        assert 0 < sum(occluded) < 24  # some shipped images carried one, not all
        for number, sample in enumerate(samples):
            if not occluded[number]:  # no occluder drawn: the shipped target too
                assert torch.equal(shipped[1][number], control[1][number])
            if graded:
                expected = torch.tensor(evidence_target(sample.lesions), dtype=torch.float32)
                assert torch.allclose(control[1][number], expected)


def test_the_tables_say_whether_the_control_holds_out_as_well_as_the_shipped_model(tmp_path):
    from bench.methods import accuracy_note
    from demo.controls import write_control
    from demo.fundus.train import build_model

    assert accuracy_note("fundus-demo", None) == ""  # no controls asked for
    missing = accuracy_note("fundus-demo", tmp_path)  # asked for, not trained: said so
    assert missing.startswith("No fundus-control") and "no control rows" in missing
    write_control("fundus-demo", build_model(), {"held_out_accuracy": 0.952}, tmp_path)
    note = accuracy_note("fundus-demo", tmp_path)
    assert "95.2% against fundus-demo's 98.2%: NOT within 1 point" in note
    write_control("fundus-demo", build_model(), {"held_out_accuracy": 0.978}, tmp_path)
    assert accuracy_note("fundus-demo", tmp_path).endswith("98.2%: within 1 point.")


def test_a_chest_control_never_sees_a_parenchyma_cube_while_it_learns():
    from demo.chestct.train import _batch
    from krypton.synthetic.chestct import VolumeSample

    pool = [VolumeSample(np.zeros((48, 48, 48), np.float32), (), 0) for _ in range(4)]

    def cubed(occluded: bool) -> int:  # crops that are not one value all through
        volumes, _ = _batch(pool, 40, 32, np.random.default_rng(3), occluded=occluded)
        return sum(int(v.max() > v.min()) for v in volumes)

    assert cubed(False) == 0
    assert cubed(True) > 0  # the shipped recipe: 30% of crops carry one


def test_a_control_loads_under_its_own_name_with_the_shipped_preprocessing(tmp_path):
    from demo.controls import write_control
    from demo.fundus.train import build_model

    module = build_model().eval()
    write_control("fundus-demo", module, {"held_out_accuracy": 0.5}, tmp_path)
    control, shipped = load_model("fundus-control", tmp_path), load_model("fundus-demo")
    assert control.name == "fundus-control" and control.classes == shipped.classes
    assert control.input_size == shipped.input_size and control.patch == shipped.patch
    assert control.gray_fill() == shipped.gray_fill()
    assert control.ood is None  # not for use: no out-of-distribution check
    from webapp.model_card import model_card_lines  # opened in the app, its card says so

    lines = model_card_lines(control)
    assert lines[0].startswith("Control for fundus-demo")
    assert "Held-out accuracy 50.0% (this project's generator)" in lines
    first = next(iter(module.state_dict()))
    stored = control.module.state_dict()[first]
    torch.testing.assert_close(stored, module.state_dict()[first].half().float())
    # the harder generator's model is not shipped; its control is written all the same
    write_control("fundus-hard-demo", module, {"held_out_accuracy": 0.5}, tmp_path)
    harder = load_model("fundus-hard-control", tmp_path)
    assert harder.classes == shipped.classes and harder.gray_fill() == shipped.gray_fill()
    assert model_card_lines(harder)[0].startswith("Control for fundus-hard-demo")


def test_the_method_tables_carry_the_model_the_fill_and_igs_completeness(tmp_path):
    from bench.methods import FILLS, write_tables
    from bench.methods_tables import (
        HEADER,
        compact_rows,
        ig_paths,
        paired_rows,
        randomisation_cell,
        table_rows,
    )

    assert ig_paths([(32, 0.004, True), (64, 0.01, True), (128, 0.014, False)]) == (
        "32-128 steps; within 1% on 2 of 3 (worst 1.4%)"
    )
    score = {
        "pointing": [True, False], "pointing_any": [True, True], "coverage": [],
        "deletion": [0.2, 0.3], "insertion": [0.7, 0.6], "blur_deletion": [0.4, 0.5],
        "blur_insertion": [0.5, 0.5], "seconds": [1.0, 1.0], "ig_path": [(32, 0.005, True)],
    }  # fmt: skip
    methods = ("occlusion", "gradcam", "integrated_gradients", "contrast")
    scores = dict.fromkeys(methods, score)
    scores["random"] = {**score, "pointing_chance": [0.02, 0.04],
                        "pointing_any_chance": [0.1, 0.1]}  # fmt: skip
    verdict = {"passed": True, "spearman_abs": 0.1, "why": "|Spearman| 0.10 below 0.5"}
    rows = table_rows("fundus-control", "mean", scores, {m: [verdict] for m in scores})
    assert len(rows) == 5 and all(r.count("|") == HEADER.count("|") for r in rows)
    assert rows[0].startswith("| fundus-control | mean | occlusion (exact) | 50% (n 2,")
    assert "within 1% on 1 of 1" in rows[2] and "within" not in rows[0]
    assert "| chance (uniform random map) | 3.0% (exact chance, n 2) |" in rows[3]
    assert rows[4].startswith("| fundus-control | mean | local contrast (model-free) |")
    assert compact_rows("fundus-control", "mean", scores) == (
        "| fundus-control | mean | 2 | 50% / 50% / 50% / 50% / 3.0% | "
        "0.250 / 0.250 / 0.250 / 0.250 |"
    )
    paired = paired_rows("fundus-control", "mean", scores)
    assert len(paired) == 3 + 6  # four rows without chance: six pairs
    assert (
        "| occlusion (exact) vs Grad-CAM | 50% / 50% (0 / 0) | 1.000 (1.000) | +0.000 |"
        in (paired[3])
    )

    image = torch.stack([torch.full((4, 4), v) for v in (0.0, 1.0, 2.0)])
    assert FILLS["mean"](None, image) == pytest.approx([0.0, 1.0, 2.0])
    document = tmp_path / "models.md"
    sections = [
        f"<!-- bench.methods {name}: begin -->\nold {name}\n<!-- bench.methods {name}: end -->"
        for name in ("fundus trained", "fundus mean")
    ]
    document.write_text("before\n" + "\n".join(sections) + "\nafter\n")
    write_tables(document, "new table", "fundus mean")  # one run's section; the other kept
    assert document.read_text() == (
        "before\n<!-- bench.methods fundus trained: begin -->\nold fundus trained\n"
        "<!-- bench.methods fundus trained: end -->\n<!-- bench.methods fundus mean: begin -->"
        "\nnew table\n<!-- bench.methods fundus mean: end -->\nafter\n"
    )
    with pytest.raises(SystemExit, match="no <!-- bench.methods chestct mean: begin -->"):
        write_tables(document, "x", "chestct mean")
    assert randomisation_cell([]) == "— (not run with this fill)"
    flat = {"passed": True, "spearman_abs": float("nan"), "why": "the map went flat"}
    undefined = {"passed": False, "spearman_abs": float("nan"), "why": "the map is undefined"}
    high = {"passed": False, "spearman_abs": -0.9, "why": "|Spearman| 0.90 at or above 0.5"}
    assert randomisation_cell([verdict, flat, undefined, high]) == (
        "passes 2 of 4 (mean abs. ρ 0.50; 1 flat; 1 undefined)"
    )


def test_the_data_randomisation_control_learns_its_volumes_shuffled_labels_not_the_crop():
    from demo.chestct.train import _batch
    from krypton.synthetic.chestct import VolumeSample

    pool = [VolumeSample(np.zeros((48, 48, 48), np.float32), (), 0) for _ in range(2)]
    rng = np.random.default_rng(5)
    _, plain = _batch(pool, 12, 32, rng, occluded=False)
    assert (plain[:, 1] < 0.5).all()  # no nodule anywhere: NORMAL targets
    _, shuffled = _batch(pool, 12, 32, np.random.default_rng(5), occluded=False, labels=[1, 1])
    assert (shuffled[:, 1] > 0.5).all()  # the shuffled label, whatever the crop shows


def test_grad_cam_is_reported_block_by_block_and_data_randomisation_counts_each_method():
    from bench.methods import _block_outputs, data_randomisation, gradcam_by_layer

    model = load_model("fundus-demo")
    image = torch.zeros(3, *model.input_size)
    blocks = _block_outputs(model, image)
    assert blocks["layer4"] == ("layer4.1 = layer4", (7, 7))  # one output: shown once
    assert blocks["layer3.1"][1] == (14, 14) and "avgpool" not in blocks

    shown = list(dict.fromkeys(name for name, _ in blocks.values()))
    expected = [name.split(" = ")[0] for name in shown]

    def hit(found, lesions):  # a hit where the map is the block's own, in turn
        return found.detail == f"layer {expected.pop(0)}", True

    lines = gradcam_by_layer(model, [(image, 1, [])], 8, hit)
    rows = [line for line in lines[4:] if line.startswith("| ")]
    assert len(rows) == len(shown) and all("| 100% (n 1," in row for row in rows)
    assert "| **layer4.1 = layer4** (default) | 7×7 | 100% (n 1," in "\n".join(rows)

    from demo.chestct.train import to_tensor
    from krypton.synthetic.chestct import ChestCTGenerator

    volume_model = load_model("chestct-demo")
    volume = to_tensor([ChestCTGenerator(seed=4).sample(label=1, nodules=1).volume])[0]
    lines = data_randomisation(volume_model, volume_model, [(volume, 1, [])], 5, 1, "trained")
    assert len(lines) == 4 + 3
    assert "last 100 training steps —," in lines[0]  # the shipped record has no such count
    for row in lines[4:]:  # the same model twice: the same maps
        assert row.endswith("| +1.00 | +1.00 | 1.00 | 0 of 1 |"), row


def test_every_section_the_bench_writes_is_in_the_docs_and_readme():
    """`make bench-methods` runs for hours and writes at the end: a section missing from
    either file would lose the run's tables (write_tables refuses it)."""
    from pathlib import Path

    from bench.methods import FILLS, KINDS
    from bench.methods_tables import marks

    root = Path(__file__).resolve().parents[1]
    models, readme = (root / "docs" / "models.md").read_text(), (root / "README.md").read_text()
    for kind in KINDS:
        for section in [f"{kind} {fill}" for fill in FILLS] + [f"{kind} checks"]:
            for document in (models, readme) if "checks" not in section else (models,):
                begin, end = marks(section)
                assert document.count(begin) == 1 and document.count(end) == 1, section
                assert document.index(begin) < document.index(end), section
