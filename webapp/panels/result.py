"""The result panel: the kept heatmap, its summary line and its downloads, shown only while
what is on screen is what the result explains (webapp.runs.shown_view). Another class
is both panels' one switch (webapp.panels.kept_result)."""

from __future__ import annotations

from dash import ALL, Input, Output, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from .. import comparison, exports, figures, ids, model_card, runs, wording
from ..helpers import InputError
from ..layout import placeholder_figure
from ..panel_scope import IMAGE_PANEL
from ..services import Services
from .common import SCREEN_INPUTS
from .compare import image_compare_view
from .run import run_request

NO_RESULT = "Press Run to compute the heatmap"
EXPORTS = {"type": IMAGE_PANEL.strip.export, "format": ALL}


class ResultPanel:
    """Callbacks of the result panel; ``services`` holds the kept results and images."""

    def __init__(self, services: Services):
        self.services = services

    def register(self, app) -> None:
        """Attach the panel's callbacks to ``app``."""
        app.callback(
            Output(ids.HEATMAP_GRAPH, "figure"),
            Output(IMAGE_PANEL.summary, "children"),
            Output(EXPORTS, "disabled"),
            Output(ids.DICOM_IDENTITY, "style"),
            Output(IMAGE_PANEL.compare_panel, "children"),
            Input(IMAGE_PANEL.result, "data"),
            Input(ids.OVERLAY_STORE, "data"),
            *SCREEN_INPUTS,
            State(IMAGE_PANEL.label, "value"),
            State(ids.SESSION, "data"),
            State(EXPORTS, "id"),
        )(self.show_result)
        app.callback(
            Output(IMAGE_PANEL.strip.download, "data"),
            Output(IMAGE_PANEL.strip.message, "children", allow_duplicate=True),
            Input(EXPORTS, "n_clicks"),
            State(ids.SESSION, "data"),
            State(IMAGE_PANEL.result, "data"),
            State(ids.OVERLAY_STORE, "data"),
            State(ids.DICOM_IDENTITY, "value"),
            *[State(i.component_id, i.component_property) for i in SCREEN_INPUTS],
            State(IMAGE_PANEL.label, "value"),
            prevent_initial_call=True,
        )(self.export)

    def show_result(self, handle, overlay, *screen_and_states):
        """The kept result, its line and its downloads, only while what is on screen is
        what it explains; otherwise why not."""
        *screen, label, session, buttons = screen_and_states
        none = [True] * len(buttons), {"display": "none"}, []
        result, why = runs.kept_result(self.services.results, session, handle)
        if result is None:  # why: the store is away, or the result was let go
            return placeholder_figure(why or NO_RESULT), "", *none
        view = self.shown_view(result, *screen, label)
        if not view.show:
            return placeholder_figure(view.reason), html.P(view.reason, className="warning"), *none
        try:
            figure = self.result_figure(result, overlay)
            compared = image_compare_view(result, self.model_picture(result))
        except InputError as exc:
            return placeholder_figure(str(exc)), "", *none
        is_dicom = bool(result.get("dicom"))
        unavailable = {"dcm": not is_dicom, "compare": not comparison.available(result)}
        disabled = [unavailable.get(button["format"], False) for button in buttons]
        dicom_style = {"display": "block" if is_dicom else "none"}
        return figure, summary(result), disabled, dicom_style, compared

    def shown_view(self, result: runs.ResultRecord, *screen) -> runs.ResultView:
        """Whether ``result`` may be shown beside what the page shows now (``screen``:
        the image, model, region, patch, stride, mode, colour, custom colour, quality
        target, drill-down, speed-up and class): webapp.runs.shown_view, the volume
        panel's rule too."""
        image_data, model_name, region, patch, stride, mode, colour, custom, *rest = screen
        target_ssim, drill_down, speedup, label = rest
        try:
            asked, _ = run_request(
                image_data, model_name, patch, stride, mode, colour, custom, label, region,
                target_ssim, drill_down, speedup, snap=True, overlay=None,
            )  # fmt: skip
            weights = self.services.weights_checksum(model_name)
        except (InputError, KeyError, TypeError, ValueError):
            asked, weights = None, None  # nothing runnable on screen
        return runs.shown_view(result, asked, weights)

    def model_picture(self, result: runs.ResultRecord):
        """The picture the model saw for ``result`` (its input size)."""
        loaded = self.services.model(result["model"])
        return figures.model_view(self.services.images.get(result["source_key"]), loaded.input_size)

    def result_figure(self, result: runs.ResultRecord, overlay: dict | None):
        """The heatmap over the picture the model saw, drawn with the overlay settings."""
        return figures.heatmap_figure(
            self.model_picture(result),
            result["values"],
            result["xs"],
            result["ys"],
            result["patch"],
            result["prob"],
            runs.picture_title(result),
            figures.overlay_style(overlay),
            (overlay or {}).get("view") == "side",
        )

    def export(self, clicks, session, handle, overlay, identity, *screen):
        """A download of the result on screen, in the format of the button pressed."""
        if not any(clicks or []) or not isinstance(handle, dict):
            raise PreventUpdate
        result, why = runs.kept_result(self.services.results, session, handle)
        if result is None and why:
            return no_update, why
        if result is None:
            raise PreventUpdate  # not this tab's current result
        view = self.shown_view(result, *screen)
        if not view.show:
            return no_update, view.reason
        try:
            return self.download(result, ctx.triggered_id["format"], session, overlay, identity)
        except InputError as exc:
            return no_update, str(exc)

    def download(
        self, result: runs.ResultRecord, fmt: str, session, overlay, identity
    ) -> tuple[dict, str]:
        """The file for one export button (helpers' writers) and an empty message."""
        stem = exports.export_stem(result)
        style = figures.overlay_style(overlay)
        if fmt == "png":
            original = self.services.images.get(result["source_key"])
            return dcc.send_bytes(exports.export_png(original, result, style), f"{stem}.png"), ""
        if fmt == "dcm":
            runs.refuse_partial(result, "a DICOM file")
            source = self.services.images.source(
                (result.get("dicom") or {}).get("source", ""), str(session or "")
            )
            data = exports.export_dicom(source, result, style, "identity" in (identity or []))
            return dcc.send_bytes(data, f"{stem}.dcm"), ""
        if fmt == "npy":  # one array and nothing else: a flagged image's name says so
            flagged = "-out-of-distribution" if model_card.ood_text(result.get("ood")) else ""
            return dcc.send_bytes(exports.export_npy(result), f"{stem}{flagged}.npy"), ""
        if fmt == "npz":
            return dcc.send_bytes(exports.export_all_classes(result), f"{stem}-all.npz"), ""
        if fmt == "csv":
            return dcc.send_string(exports.export_csv(result), f"{stem}.csv"), ""
        if fmt == "compare":  # the three methods side by side
            data = comparison.comparison_png(result, self.model_picture(result))
            return dcc.send_bytes(data, f"{stem}-compare.png"), ""
        return dcc.send_string(runs.export_json(result), f"{stem}.json"), ""


def summary(result: runs.ResultRecord) -> html.Div:
    """The result line (wording decided by runs.summary_lines, in the page's plain words
    with the planner's and the detector's terms behind "details": webapp.wording)."""
    children = wording.summary_children(runs.summary_lines(result), ids={"Reused": ids.REUSE_INFO})
    if not result["reused"]:
        children.append(html.Div("", id=ids.REUSE_INFO, style={"display": "none"}))
    return html.Div(children)
