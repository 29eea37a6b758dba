"""The image panel's kept result on screen: the heatmap over the picture, its summary line
and which downloads are offered, shown only while what is on screen is what the result
explains (webapp.panels.run.shown_view). The downloads themselves and another class are
the subject panel's (webapp.panels.subject_panel), one for both panels."""

from __future__ import annotations

from dash import ALL, Input, Output, State, html

from .. import comparison, figures, ids, runs, wording
from ..helpers import InputError
from ..layout import placeholder_figure
from ..panel_scope import IMAGE_PANEL
from ..services import Services
from .common import SCREEN_INPUTS
from .compare import image_compare_view
from .run import model_picture, shown_view

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

    def show_result(self, handle, overlay, *screen_and_states):
        """The kept result, its line and its downloads, only while what is on screen is
        what it explains; otherwise why not."""
        *screen, label, session, buttons = screen_and_states
        none = [True] * len(buttons), {"display": "none"}, []
        result, why = runs.kept_result(self.services.results, session, handle)
        if result is None:  # why: the store is away, or the result was let go
            return placeholder_figure(why or NO_RESULT), "", *none
        view = shown_view(self.services, result, *screen, label)
        if not view.show:
            return placeholder_figure(view.reason), html.P(view.reason, className="warning"), *none
        try:
            figure = self.result_figure(result, overlay)
            compared = image_compare_view(result, model_picture(self.services, result))
        except InputError as exc:
            return placeholder_figure(str(exc)), "", *none
        is_dicom = bool(result.get("dicom"))
        unavailable = {"dcm": not is_dicom, "compare": not comparison.available(result)}
        disabled = [unavailable.get(button["format"], False) for button in buttons]
        dicom_style = {"display": "block" if is_dicom else "none"}
        return figure, summary(result), disabled, dicom_style, compared

    def result_figure(self, result: runs.ResultRecord, overlay: dict | None):
        """The heatmap over the picture the model saw, drawn with the overlay settings."""
        return figures.heatmap_figure(
            model_picture(self.services, result),
            result["values"],
            result["xs"],
            result["ys"],
            result["patch"],
            result["prob"],
            runs.picture_title(result),
            figures.overlay_style(overlay),
            (overlay or {}).get("view") == "side",
        )


def summary(result: runs.ResultRecord) -> html.Div:
    """The result line (wording decided by runs.summary_lines, in the page's plain words
    with the planner's and the detector's terms behind "details": webapp.wording)."""
    children = wording.summary_children(runs.summary_lines(result), ids={"Reused": ids.REUSE_INFO})
    if not result["reused"]:
        children.append(html.Div("", id=ids.REUSE_INFO, style={"display": "none"}))
    return html.Div(children)
