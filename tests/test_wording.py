"""The page's plain words (webapp.wording): the detector's and the planner's terms go
behind "details", the plain part says what a user acts on."""

from dash import html

from webapp.wording import plain_and_detail, summary_children

SPEED = (
    "2.1× faster than naive, the whole run: 27 s here, about 57 s for a naive run of its "
    "355 positions, every fixed cost counted (measured in this run on the same positions: "
    "222.7 ms/position incremental vs 533.0 ms naive)."
)
OOD = (
    "Warning: this image does not look like the images the model was trained on "
    "(unusualness 2.7 at layer4; the threshold is 1.9)."
)


def test_the_speed_line_says_the_times_and_keeps_the_measurement_for_details():
    plain, detail = plain_and_detail(SPEED)
    assert plain == "2.1× faster than naive: 27 s here against about 57 s for a naive run."
    assert "ms/position" not in plain and "222.7 ms/position" in detail


def test_the_out_of_distribution_warning_says_what_it_means_without_the_score():
    plain, detail = plain_and_detail(OOD)
    assert "unusualness" not in plain and plain.startswith("Warning: this image does not look")
    assert "unusualness 2.7 at layer4" in detail
    # said once: the page added "The heatmap may not mean much for this image." to a
    # warning that already says its prediction and heatmap are not meaningful
    from krypton.registry.ood import caveat, warning_text

    flagged = {"flagged": True, "warning": warning_text("fundus-demo"), "score": 2.7,
               "threshold": 1.9, "stage": "layer4"}  # fmt: skip
    plain, _ = plain_and_detail(f"Warning: {caveat(flagged)}.")
    assert plain.count("mean") == 1 and plain.count(".") == 1, plain


def test_the_plan_goes_behind_details_and_other_lines_stay():
    assert plain_and_detail("Plan: incremental; the first global op is avgpool") == (
        None,
        "Plan: incremental; the first global op is avgpool",
    )
    assert plain_and_detail("Reused 12 cells from earlier runs") == (
        "Reused 12 cells from earlier runs",
        None,
    )
    children = summary_children(
        ["EXUDATE: p = 0.836", OOD, SPEED, "Plan: the first global op is avgpool"],
        ids={"Reused": "reuse-info"},
    )
    assert isinstance(children[0], html.Strong) and isinstance(children[-1], html.Details)
    shown = " ".join(str(c.children) for c in children[:-1])
    assert "global op" not in shown and "ms/position" not in shown
