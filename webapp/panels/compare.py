"""The Compare view: occlusion, Grad-CAM and Integrated Gradients side by side for the
class on screen (three maps over an image, or a row of three linked views per method for
a volume), each on its own colour scale, with how alike they rank the cells and the time
each took. It draws what a run with Compare ticked kept (webapp.comparison); the run
itself is the page's one Run (panels.image, panels.volume). A sample's Compare button loads
the sample and presses Run once the page shows its prediction."""

from __future__ import annotations

import numpy as np
from dash import Input, Output, State, dcc, html
from PIL import Image

from krypton.render.methods import TITLES
from krypton.render.volumes import voxel_values

from .. import comparison, figures, ids, runs, volume_views
from ..helpers import InputError
from ..panel_scope import IMAGE_PANEL, VOLUME_PANEL, PanelScope
from ..path_budget import more_steps_note
from ..runs import Services

SIGN_NOTE = (
    "Each map: evidence for the class, higher is more, on its own colour scale "
    "(occlusion: the probability's drop under the patch; Grad-CAM and Integrated "
    "Gradients: attribution). Agreement: Spearman's rank correlation over the cells, and "
    "the share of the top 5% of cells two maps have in common."
)


def agreement_table(maps, panel: PanelScope) -> html.Table:
    """Every pair's rank correlation and top-5% overlap, one row each, in ``panel``'s
    Compare view (its id is the panel's: both panels' views can be on the page)."""
    rows = [html.Tr([html.Th("Methods"), html.Th("Rank correlation"), html.Th("Top 5% overlap")])]
    for row in comparison.agreement_rows(maps):
        rows.append(
            html.Tr(
                [
                    html.Td(" vs ".join(row["titles"])),
                    html.Td(
                        "— (a flat map)" if np.isnan(row["spearman"]) else f"{row['spearman']:+.2f}"
                    ),
                    html.Td(f"{row['top_overlap']:.0%}"),
                ]
            )
        )
    return html.Table(rows, id=panel.compare_panel + "-agreement")


def _heading(result: runs.ResultRecord, maps) -> list:
    """The class, the time each map took, the gradient maps' time so far, and what is
    still to come (webapp.comparison.pending_note)."""
    times = " · ".join(f"{TITLES[m]} {found.seconds:.2f} s" for m, found in maps.items())
    kept = result.get("methods") or {}
    classes = len({c for entry in kept.values() for c in entry["labels"]})
    step = sum(sum(found["seconds"]) for found in kept.values())
    pending = comparison.pending_note(result)
    short = more_steps_note(result)
    if pending:
        done = f"Gradient maps so far: {step:.2f} s."
    else:
        for_what = f"all {classes} classes" if classes > 1 else "this class"
        done = f"Both gradient methods for {for_what}, after the occlusion: {step:.2f} s."
    return [
        html.H3(f"Compare methods: {result['label_name']}"),
        html.Div(
            f"Time for this class: {times} (occlusion: the whole run). {done}",
            className="help",
        ),
        *([html.P(pending, className="status compare-pending")] if pending else []),
        *([html.P(short, className="warning compare-more-steps")] if short else []),
    ]


def _flat(result: runs.ResultRecord, maps) -> list:
    """A warning line for each map that says nothing (webapp.comparison.flat_notes)."""
    return [
        html.P(note, className="warning")
        for note in comparison.flat_notes(maps, result["label_name"])
    ]


def image_compare_view(result: runs.ResultRecord, shown: Image.Image) -> list:
    """The image panel's Compare view for a kept result (empty without Compare)."""
    maps = comparison.method_maps(result)
    if isinstance(maps, str):
        return [html.P(maps, className="warning")]
    if not maps:
        return []
    # the title names the method and its time; how it ran goes below in a line of words
    # (wrapped into the plot's title, it read "attributionssum" when copied or read out)
    graphs = [
        html.Div(
            [
                dcc.Graph(
                    figure=figures.importance_figure(
                        shown, found, f"{TITLES[method]} · {found.seconds:.2f} s"
                    ),
                    config={"displaylogo": False},
                    className="compare-map",
                ),
                html.Small(found.detail, className="help"),
            ]
        )
        for method, found in maps.items()
    ]
    return [
        *_heading(result, maps),
        *_flat(result, maps),
        html.Div(graphs, className="compare-maps"),
        agreement_table(maps, IMAGE_PANEL),
        html.Small(SIGN_NOTE, className="help"),
    ]


def volume_compare_view(result: runs.ResultRecord, unit: np.ndarray, cursor) -> list:
    """The volume panel's Compare view: per method a row of the three views through the
    panel's crosshair ``cursor`` (z, y, x), its map on its own colour scale."""
    maps = comparison.method_maps(result)
    if isinstance(maps, str):
        return [html.P(maps, className="warning")]
    if not maps:
        return []
    rows: list = []
    for method, found in maps.items():
        # painted as the panel's own views paint a heatmap (nearest cell per voxel)
        grid = runs.grid_heatmap(found.importance, found.axes, found.patch[0])
        per_voxel = voxel_values(grid, unit.shape)
        low, high = found.value_range()
        high = low + 1.0 if found.flat() else high + 1e-9  # a flat map: one colour, said so
        title = f"{TITLES[method]} · {found.seconds:.2f} s"
        figure = volume_views.views_live_figure(
            unit, cursor, per_voxel, (low, high), title, importance=True
        )
        rows.append(
            dcc.Graph(figure=figure, config={"displaylogo": False}, className="compare-map")
        )
        rows.append(html.Small(found.detail, className="help"))
    return [
        *_heading(result, maps),
        *_flat(result, maps),
        *rows,
        agreement_table(maps, VOLUME_PANEL),
        html.Small(SIGN_NOTE, className="help"),
    ]


# In the browser, once the page shows the pending sample: tick Compare, press Run, clear.
PRESS_RUN = """function(shown, pending, record, clicks) {
    const none = window.dash_clientside.no_update;
    return %s ? [["compare"], (clicks || 0) + 1, null] : [none, none, none];
}"""
# the image panel: Run is enabled (its prediction is the shown image's) for that image
IMAGE_SHOWN = "!shown && pending && record && pending === record.key"
# the volume panel: the panel describes that volume (show_volume prepared it)
VOLUME_SHOWN = (
    'pending && record && pending.key === record.key && typeof shown === "string" '
    '&& shown.startsWith(pending.name + ":")'
)


class ComparePanel:
    """A sample's Compare button (an image's or a volume's): the panel loads the sample
    (its load callback takes these clicks too) and marks it pending; once the page shows
    it — the image's prediction with Run enabled, or the volume's description — Compare
    is ticked and Run pressed, in the browser: the page's one Run, nothing beside it.
    And Grad-CAM's layer picker, in each panel, lists the chosen model's blocks."""

    def __init__(self, services: Services):
        self.services = services

    def register(self, app) -> None:
        """Attach the panel's callbacks to ``app``."""
        for panel, rank in ((IMAGE_PANEL, 2), (VOLUME_PANEL, 3)):
            picker = panel.compare_layer
            app.callback(
                Output(picker, "options"), Output(picker, "value"), Input(panel.model, "value")
            )(layer_picker(lambda name, rank=rank: self.services.model(name, rank)))
        for panel in (IMAGE_PANEL, VOLUME_PANEL):
            # another image or volume starts unticked: Compare costs minutes on a laptop
            # and was asked for the last input, not this one (a sample's Compare button
            # ticks it again once its input shows)
            app.clientside_callback(
                "function(data) { return []; }",
                Output(panel.compare, "value", allow_duplicate=True),
                Input(panel.store, "data"),
                prevent_initial_call=True,
            )
        for panel, shown, condition in (
            (IMAGE_PANEL, (IMAGE_PANEL.strip.run, "disabled"), IMAGE_SHOWN),
            (VOLUME_PANEL, (ids.VOLUME_INFO, "children"), VOLUME_SHOWN),
        ):
            run, pending = panel.strip.run, panel.compare_pending
            app.clientside_callback(
                PRESS_RUN % condition,
                Output(panel.compare, "value"),
                Output(run, "n_clicks"),
                Output(pending, "data", allow_duplicate=True),
                Input(*shown),
                Input(pending, "data"),
                State(panel.store, "data"),
                State(run, "n_clicks"),
                prevent_initial_call=True,
            )


def layer_picker(load):
    """The callback filling a panel's Grad-CAM layer picker from its model (``load``: the
    services' loader for the panel's kind of model): its blocks, back to the default."""

    def layers(model_name):
        try:
            loaded = load(model_name)
        except InputError:
            return [], None
        return comparison.layer_choices(loaded), None

    return layers
