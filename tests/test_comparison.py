"""Compare in the app without a browser (webapp.comparison through webapp.runs and
webapp.runs at rank 3): a run with Compare ticked carries Grad-CAM and Integrated Gradients
on its own grid, equal to krypton.methods.compare on the same input, for every class of a
small model (the class switch shows all three at once) or for the run's class only past
EVERY_CLASS_UP_TO; its steps are reported and can stop it; the exports carry all three."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from test_app_volumes import nifti_bytes, stored  # noqa: F401
from test_app_volumes import request as volume_request
from test_runs import IMAGE, request
from test_volume_cli import hu_volume, volume_model  # noqa: F401

from krypton.methods import compare
from webapp import comparison, gradient_steps, runs
from webapp.helpers import InputError
from webapp.services import Services

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.usefixtures("quick_integrated_gradients"),
]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def services(tmp_path, volume_model):  # noqa: F811
    return Services(tmp_path / "cache")


def reference(services, run: runs.RunRequest, label: int) -> dict:
    loaded = services.model(run.model)
    fill = tuple((c - m) / s for c, m, s in zip(run.fill_rgb, loaded.mean, loaded.std))
    return compare(
        loaded, loaded.preprocess(IMAGE), patch=run.patch, stride=run.stride,
        region=run.region, fill=fill, label=label, mode="naive",
    )  # fmt: skip


def test_a_compared_run_carries_the_gradient_maps_of_every_class_on_its_grid(services):
    steps = []
    run = request(services, compare=True, fill_rgb=(0.0, 0.0, 0.0))  # black: IG's baseline too
    result = runs.execute(services, "s", run, lambda *a: None, lambda *a: steps.append(a))
    assert result["methods"]["gradcam"]["labels"] == [0, 1, 2]  # fundus-demo: 3 classes
    explained = result["label"]
    first = [explained] + [c for c in range(3) if c != explained]
    assert steps == [  # 2 methods x 3 classes, the explained class's two maps first
        (i, 6, method, label)
        for i, (method, label) in enumerate(
            (m, c) for c in first for m in ("gradcam", "integrated_gradients")
        )
    ]
    assert result.get("methods_pending") is None
    for label in (result["label"], (result["label"] + 1) % 3):
        shown = runs.relabel(result, label) if label != result["label"] else result
        maps = comparison.method_maps(shown)
        assert list(maps) == ["occlusion", "gradcam", "integrated_gradients"]
        expected = reference(services, run, label)
        for method, found in maps.items():
            assert found.label == label and found.importance.shape == (5, 5)
            np.testing.assert_allclose(
                found.importance, expected[method].importance, atol=1e-5, rtol=1e-4
            )
        rows = comparison.agreement_rows(maps)
        assert [r["methods"] for r in rows] == [
            ["occlusion", "gradcam"], ["occlusion", "integrated_gradients"],
            ["gradcam", "integrated_gradients"],
        ]  # fmt: skip
        assert all(-1 <= r["spearman"] <= 1 and 0 <= r["top_overlap"] <= 1 for r in rows)


def test_a_run_without_compare_has_no_maps_and_no_compare_export(services):
    result = runs.execute(services, "s", request(services), lambda *a: None)
    assert result["methods"] is None and comparison.method_maps(result) == {}
    assert "comparison" not in json.loads(runs.export_json(result))
    with pytest.raises(InputError, match="tick Compare"):
        comparison.comparison_png(result, np.zeros((224, 224, 3)))


def test_past_few_classes_only_the_runs_class_and_another_asks_for_a_run(services, monkeypatch):
    monkeypatch.setattr(gradient_steps, "EVERY_CLASS_UP_TO", 2)
    result = runs.execute(services, "s", request(services, compare=True), lambda *a: None)
    assert result["methods"]["integrated_gradients"]["labels"] == [result["label"]]
    other = runs.relabel(result, (result["label"] + 1) % 3)
    reason = comparison.method_maps(other)
    assert isinstance(reason, str) and "press Run" in reason
    assert "comparison" not in json.loads(runs.export_json(other))


def test_the_heatmap_is_kept_and_shown_before_the_gradient_maps_each_joining_as_done(
    services,
):
    shown = []
    run = request(services, compare=True)
    result = runs.execute(services, "s", run, lambda *a: None, None, shown.append)
    first = shown[0]
    assert first["methods"] == {} and len(first["methods_pending"]["steps"]) == 6
    assert np.array_equal(first["values"], result["values"])  # the heatmap, before any map
    assert services.results.get("s")["id"] == first["id"]  # kept for the page's handle
    assert isinstance(comparison.method_maps(first), dict)
    assert list(comparison.method_maps(first)) == ["occlusion"]
    assert "Computing Grad-CAM and Integrated Gradients for" in comparison.pending_note(first)
    done = [sum(len(e["labels"]) for e in r["methods"].values()) for r in shown]
    assert done == [0, 1, 2, 3, 4, 5]  # each map joins as it is done
    second = shown[2]  # the explained class's both maps, before the other classes'
    assert list(comparison.method_maps(second)) == [
        "occlusion", "gradcam", "integrated_gradients"
    ]  # fmt: skip
    assert "switch class" in comparison.pending_note(second)
    assert comparison.pending_note(result) == "" and comparison.available(result)


def test_a_stopped_compare_run_keeps_its_heatmap_and_maps_done_and_a_rerun_finishes_them(
    services, monkeypatch
):
    class Stop(Exception):
        pass

    def stage(done, total, method, label):
        if done == 2:
            raise Stop

    run = request(services, compare=True)
    with pytest.raises(Stop):
        runs.execute(services, "s", run, lambda *a: None, stage)
    kept = services.results.get("s")  # the heatmap and the explained class's two maps
    assert kept is not None and kept["methods_pending"]["stopped"]
    assert len(kept["methods_pending"]["steps"]) == 4
    assert list(comparison.method_maps(kept)) == ["occlusion", "gradcam", "integrated_gradients"]
    assert "stopped before the other classes' 4 maps" in comparison.pending_note(kept)
    other = runs.relabel(kept, (kept["label"] + 1) % 3)
    assert "stopped before Grad-CAM and Integrated Gradients" in comparison.pending_note(other)
    computed = []
    real = comparison.pixel_attribution
    monkeypatch.setattr(
        comparison, "pixel_attribution", lambda *a, **k: computed.append(a[2:4]) or real(*a, **k)
    )
    again = runs.execute(services, "s", run, lambda *a: None)  # Run again: the rest only
    assert len(computed) == 4 and (kept["label"] not in {label for _, label in computed})
    assert again.get("methods_pending") is None
    computed.clear()
    once_more = runs.execute(services, "s", run, lambda *a: None)  # everything known
    assert computed == []
    for method in ("gradcam", "integrated_gradients"):
        np.testing.assert_array_equal(
            once_more["methods"][method]["values"], again["methods"][method]["values"]
        )


def test_a_class_switched_while_maps_come_stays_switched(services):
    session, explained = "s", []

    def switch(record):  # the user picks another class once the first map is shown
        if sum(len(e["labels"]) for e in record["methods"].values()) == 1:
            explained.append(record["label"])
            handle = {"id": record["id"]}
            runs.switch_class(services.results, session, handle, (record["label"] + 1) % 3)

    result = runs.execute(
        services, session, request(services, compare=True), lambda *a: None, None, switch
    )
    kept = services.results.get(session)
    assert kept["label"] == (explained[0] + 1) % 3  # not switched back by the later maps
    assert kept["id"] == result["id"] == f"{str(kept['id']).split(':')[0]}:{kept['label']}"
    assert kept.get("methods_pending") is None and comparison.available(kept)


def test_the_exports_carry_all_three_maps_and_their_agreement(services):
    result = runs.execute(services, "s", request(services, compare=True), lambda *a: None)
    record = json.loads(runs.export_json(result))["comparison"]
    assert set(record["methods"]) == {"occlusion", "gradcam", "integrated_gradients"}
    assert np.asarray(record["methods"]["gradcam"]["importance"]).shape == (5, 5)
    assert len(record["agreement"]) == 3 and "evidence for the class" in record["importance"]
    picture = comparison.comparison_png(result, np.asarray(IMAGE.resize((224, 224))))
    assert picture.startswith(PNG)


def test_a_compared_volume_run_has_three_maps_per_class_on_its_grid(
    services,
    nifti_bytes,  # noqa: F811
):
    key = stored(services, nifti_bytes)
    run = volume_request(key, compare=True)
    result = runs.execute(services, "tab-1", run, lambda *a: None)
    maps = comparison.method_maps(result)
    assert list(maps) == ["occlusion", "gradcam", "integrated_gradients"]
    loaded = services.model("ct-test", rank=3)
    tensor = services.prepared_volume(key, "tab-1", "ct-test").model_input.tensor
    expected = compare(loaded, tensor, patch=8, stride=8, label=result["label"], mode="naive")
    for method, found in maps.items():
        assert found.importance.shape == expected[method].importance.shape
        np.testing.assert_allclose(
            found.importance, expected[method].importance, atol=1e-5, rtol=1e-4
        )
    other = runs.relabel(result, 1 - result["label"])
    assert comparison.method_maps(other)["gradcam"].label == 1 - result["label"]
    exported = json.loads(runs.export_json(result))
    assert set(exported["comparison"]["methods"]) == set(maps) and "methods" not in exported
    prepared = services.prepared_volume(key, "tab-1", "ct-test")
    assert comparison.comparison_png(result, prepared.unit).startswith(PNG)
    # both panels' Compare views can be on the page: their agreement tables' ids differ
    # (before: both were "compare-panel-agreement")
    from webapp.panels.compare import image_compare_view, volume_compare_view

    image_result = runs.execute(services, "s", request(services, compare=True), lambda *a: None)
    ids = [
        [part.id for part in view if getattr(part, "id", None)]
        for view in (
            image_compare_view(image_result, IMAGE.resize((224, 224))),
            volume_compare_view(result, prepared.unit, (8, 8, 8)),
        )
    ]
    assert ids[0] and ids[1] and not set(ids[0]) & set(ids[1]), ids


def test_the_estimate_says_the_gradient_step_comes_on_top_while_compare_is_ticked(
    services,
    monkeypatch,
    nifti_bytes,  # noqa: F811
):
    """The estimate covers the occlusion positions; with Compare ticked it says the
    gradient step follows and is not in it (the page did not say, and the run took ~5 s
    more than the line beside Run), for both panels."""
    from webapp import runs
    from webapp.panels.image import ImagePanel
    from webapp.panels.volume import VolumePanel

    monkeypatch.setattr(runs, "host_load", lambda: 0.0)  # one load for both texts
    image = {"key": services.images.put(IMAGE)}
    settings = ("fundus-demo", 16, 8, "exact", None, 0.25, 3.0, None, image, "gray", None)
    panel = ImagePanel(services)
    plain, ticked = panel.estimate(*settings), panel.estimate(*settings, ["compare"])
    note = "Grad-CAM and Integrated Gradients for all 3 classes follow"
    assert "The heatmap shows when it is done" in ticked and "6 gradient maps" in ticked
    assert note not in plain and ticked.startswith(plain) and note in ticked
    # before any step is logged here: the shipped calibration's timing of the step
    assert "more (" in ticked and "calibration (" in ticked
    # once a compared run has logged its step, the line says how long it took here
    loaded = services.model("fundus-demo")
    gray = tuple((0.5 - m) / s for m, s in zip(loaded.mean, loaded.std))
    comparison.compute_methods(
        loaded, loaded.preprocess(IMAGE), (np.arange(0, 224, 56), np.arange(0, 224, 56)), 16,
        gray, 0, load=0.0,
    )  # fmt: skip
    assert "more (" in panel.estimate(*settings, ["compare"])
    # the maps' own range until five whole steps are logged with their estimates
    said = "from this machine's last 3 gradient maps (first runs on this machine)."
    assert said in panel.estimate(*settings, ["compare"])
    # once a Compare run of this image kept its maps, a re-run computes none of them
    run = runs.RunRequest(key=image["key"], name="", model="fundus-demo", patch=16, stride=8,
                          mode="exact", fill_rgb=(0.5, 0.5, 0.5), compare=True)  # fmt: skip
    runs.execute(services, "s", run, lambda *a: None)
    known = panel.estimate(*settings, ["compare"])
    assert "known from an earlier run: shown with the heatmap" in known and "more (" not in known
    volume = VolumePanel(services, None)
    plain = volume.estimate("ct-test", 8, 8, "exact", None, None)
    ticked = volume.estimate("ct-test", 8, 8, "exact", None, None, ["compare"])
    assert ticked.startswith(plain) and "for all 2 classes" in ticked
    # a model with neither a logged step nor a calibrated one says when it will know
    assert "measured on the first compared run here" in ticked
    # steps the page does not offer leave the line standing in both panels (the volume
    # panel's estimate raised ValueError from the callback)
    record = {"key": stored(services, nifti_bytes), "name": "chest.nii.gz"}
    odd = volume.estimate("ct-test", 8, 8, "exact", None, None, ["compare"], record, "tab-1", "999")
    assert odd.startswith(plain.split(".")[0]) and "for all 2 classes" in odd
    assert "for all 3 classes" in panel.estimate(*settings, ["compare"], "999")
    monkeypatch.setattr(gradient_steps, "EVERY_CLASS_UP_TO", 1)
    assert "for the explained class" in panel.estimate(*settings, ["compare"])


def test_the_layer_picker_lists_the_models_blocks_deepest_first_never_a_pooling_layer(services):
    """Grad-CAM's layer was the CLI's and batch's choice only: the page offers each
    model's convolutional blocks, the default (the deepest) first and said so."""
    from webapp.panels.compare import layer_picker

    options, value = layer_picker(services.model)("fundus-demo")
    names = [option["value"] for option in options]
    assert value is None and names[0] == "layer4" and "layer3" in names
    assert options[0]["label"] == "layer4 (the default)"
    assert not any("pool" in name for name in names) and "fc" not in names
    volume_options, _ = layer_picker(lambda name: services.model(name, rank=3))("ct-test")
    assert volume_options and not any("pool" in o["value"] for o in volume_options)
    assert layer_picker(services.model)("ct-test") == ([], None)  # a volume model: none


def test_a_chosen_layer_is_the_one_grad_cam_reads_and_is_named_in_the_export(services):
    run = request(services, compare=True, compare_layer="layer3")
    result = runs.execute(services, "s", run, lambda *a: None)
    assert result["methods"]["gradcam"]["detail"] == "layer layer3"
    loaded = services.model(run.model)
    fill = tuple((c - m) / s for c, m, s in zip(run.fill_rgb, loaded.mean, loaded.std))
    expected = compare(
        loaded, loaded.preprocess(IMAGE), patch=run.patch, stride=run.stride, region=run.region,
        fill=fill, label=result["label"], mode="naive", methods=["gradcam"], layer="layer3",
    )  # fmt: skip
    found = comparison.method_maps(result)["gradcam"]
    np.testing.assert_allclose(found.importance, expected["gradcam"].importance, atol=1e-6)
    exported = json.loads(runs.export_json(result))["comparison"]["methods"]["gradcam"]
    assert "layer3" in json.dumps(exported)
    default = runs.execute(services, "t", request(services, compare=True), lambda *a: None)
    assert default["methods"]["gradcam"]["detail"] == "layer layer4"
    assert not np.allclose(comparison.method_maps(default)["gradcam"].importance, found.importance)


def test_a_layer_that_is_not_one_of_the_models_blocks_is_refused(services):
    for layer in ("avgpool", "no.such.layer"):
        with pytest.raises(InputError, match="convolutional blocks"):
            runs.execute(
                services, "s", request(services, compare=True, compare_layer=layer),
                lambda *a: None,
            )  # fmt: skip


def test_a_compared_volume_run_reads_the_chosen_layer(services, nifti_bytes):  # noqa: F811
    key = stored(services, nifti_bytes)
    deepest, chosen = [
        o["value"] for o in comparison.layer_choices(services.model("ct-test", rank=3))
    ][:2]
    run = volume_request(key, compare=True, compare_layer=chosen)
    result = runs.execute(services, "tab-1", run, lambda *a: None)
    assert result["methods"]["gradcam"]["detail"] == f"layer {chosen}" != f"layer {deepest}"
    exported = json.loads(runs.export_json(result))
    assert chosen in json.dumps(exported["comparison"]["methods"]["gradcam"])


def test_one_redraw_of_the_image_panel_builds_the_comparison_once(services, monkeypatch):
    """A redraw of the result panel drew the Compare view (the three maps) and then asked
    whether the Compare download is available, which built the three maps again; it now
    reads that from what the run kept."""
    from webapp.panels.compare import image_compare_view

    result = runs.execute(services, "s", request(services, compare=True), lambda *a: None)
    built = []
    real = comparison.method_maps
    monkeypatch.setattr(comparison, "method_maps", lambda r: built.append(1) or real(r))
    view = image_compare_view(result, IMAGE.resize((224, 224)))  # what one redraw calls
    assert view and comparison.available(result) and len(built) == 1
    other = runs.relabel(result, (result["label"] + 1) % 3)
    assert comparison.available(other) == isinstance(real(other), dict)
    assert not comparison.available(dict(result, methods=None))


def test_a_flat_map_says_so_instead_of_a_colour_scale_to_a_billionth(services):
    """A near-zero Grad-CAM map for another class was drawn on a scale "0 … 1n" without a
    word (and scipy warned of a constant input): it now says it finds no evidence, has no
    colour scale and no rank correlation."""
    import warnings

    from webapp.figures import importance_figure
    from webapp.panels.compare import image_compare_view

    result = runs.execute(services, "s", request(services, compare=True), lambda *a: None)
    kept = result["methods"]["gradcam"]
    flat = dict(kept, values=np.full_like(kept["values"], 1e-9))
    flat["values"][0, 0, :] = 2e-9  # rounding, not evidence
    shown = dict(result, methods=dict(result["methods"], gradcam=flat))
    maps = comparison.method_maps(shown)
    assert maps["gradcam"].flat() and not maps["occlusion"].flat()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no ConstantInputWarning
        rows = comparison.agreement_rows(maps)
    assert [np.isnan(r["spearman"]) for r in rows] == [True, False, True]
    notes = comparison.flat_notes(maps, result["label_name"])
    assert notes == [
        f"Grad-CAM finds no evidence for {result['label_name']}: its map is the same in every "
        "cell (2e-09), so it has no colour scale and no rank correlation with the others."
    ]
    figure = importance_figure(IMAGE.resize((224, 224)), maps["gradcam"], "Grad-CAM")
    assert figure.data[1].showscale is False and figure.data[1].zmax - figure.data[1].zmin == 1
    text = str(image_compare_view(shown, IMAGE.resize((224, 224))))
    assert "finds no evidence" in text and "— (a flat map)" in text


def test_a_path_short_of_completeness_says_by_how_much_and_more_steps_compute_only_it(
    services, monkeypatch
):
    """Before: "within 16.7% (over the 1% aimed at: more steps needed)" and no control
    offered more steps. The view now says how far and what the next budget costs at the
    map's own pace; a run with that budget computes only the paths that stopped short."""
    from krypton import methods
    from webapp.path_budget import budget_options, chosen_budget, more_steps_note

    run = request(services, compare=True)  # quick_integrated_gradients: 8 evaluations
    result = runs.execute(services, "s", run, lambda *a: None)
    paths = result["methods"]["integrated_gradients"]["paths"]
    labels = result["methods"]["integrated_gradients"]["labels"]
    assert [budget for *_, budget in paths] == [8, 8, 8]
    short = [label for label, (_, gap, _) in zip(labels, paths) if gap > methods.IG_GAP]
    reached = [label for label in labels if label not in short]
    assert short, paths  # 8 evaluations leave at least one class short of 1%
    shown = result if result["label"] == short[0] else runs.relabel(result, short[0])
    note = more_steps_note(shown)
    gap = paths[labels.index(short[0])][1]
    assert f"stopped {gap:.1%} from completeness" in note and "after 8 gradient" in note
    assert 'choose 256 under "Integrated Gradients steps"' in note and "per class" in note
    for label in reached:  # a class whose path reached 1% says nothing more
        other = result if result["label"] == label else runs.relabel(result, label)
        assert more_steps_note(other) == ""
    # the page offers the library's budgets; anything else is refused
    assert [o["value"] for o in budget_options()] == list(methods.IG_STEP_CHOICES)
    assert chosen_budget(None) is None and chosen_budget(1024) == 1024
    for refused in ("999", "many", [256]):  # what the page does not offer, in its words
        with pytest.raises(ValueError, match="steps are one of 256, 1024, 4096"):
            chosen_budget(refused)
    # more steps: only the paths that stopped short are computed again
    more = dataclasses.replace(run, compare_steps=32)
    assert runs.compare_left(services, more) == [("integrated_gradients", c) for c in short]
    computed = []
    real = comparison.pixel_attribution
    monkeypatch.setattr(
        comparison, "pixel_attribution", lambda *a, **k: computed.append(a[2:4]) or real(*a, **k)
    )
    again = runs.execute(services, "s", more, lambda *a: None)
    assert sorted(computed) == sorted(("integrated_gradients", c) for c in short)
    kept_paths = again["methods"]["integrated_gradients"]["paths"]
    for label, (used, new_gap, budget) in zip(labels, kept_paths):
        if label in short:
            assert budget == 32 and used > 8 and new_gap < paths[labels.index(label)][1]
        else:
            assert budget == 8  # reached 1% at 8: kept, not computed again
    assert runs.compare_left(services, more) == []


def test_compare_titles_name_the_method_and_the_path_is_said_in_words(services):
    """The maps' titles carried how each ran, wrapped into the plot title with <br>: read
    out or copied it ran words together ("attributionssum"), and "f(input) − f(fill)"
    alone meant nothing to a radiologist. A title names the method and its seconds; how
    it ran is a line of words below the map."""
    from webapp.panels.compare import image_compare_view

    result = runs.execute(services, "s", request(services, compare=True), lambda *a: None)
    view = image_compare_view(result, IMAGE.resize((224, 224)))
    maps = next(part for part in view if getattr(part, "className", "") == "compare-maps")
    for cell in maps.children:
        graph, said = cell.children
        title = graph.figure.layout.title.text
        assert "steps" not in title and "layer" not in title and "<br>" not in title, title
        assert said.children
    gradients = [cell.children[1].children for cell in maps.children]
    assert any("the class score's change from the fill to the image" in s for s in gradients)
