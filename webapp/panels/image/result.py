"""The image kind's result: its request from the page's controls, its live picture over
the image, its heatmap and Compare view of a kept result, its downloads and the rule that
shows a result only beside what it explains (the volume kind's:
webapp.panels.volume.result). The strip around a run (Run, Cancel, the queue place, the
progress bar with the time left), the summary, another class and the download callback
are webapp.panels.subject_panel's, one for both kinds. The run itself is
webapp.runs.execute (no browser needed); its states are webapp.jobs.RunLifecycle."""

from __future__ import annotations

import re

from dash import Input, Output, State, dcc

from ... import comparison, exports, figures, helpers, ids, model_card, runs
from ...figures import placeholder_figure
from ...panel_scope import IMAGE_PANEL
from ...path_budget import chosen_budget
from ...run_strip import Prepared, values
from ...services import Services
from ..common import SCREEN_INPUTS
from ..compare import image_compare_view

# The Run callback's outputs: the result's handle and the message (team mode's manager
# answers with a message alone when the queue or the workers are gone). The panel shows
# a handle only beside what it explains (SubjectPanel.show_result).
RUN_OUTPUTS, RUN_MESSAGE_OUTPUT = 2, 1
NO_RESULT = "Press Run to compute the heatmap"
HEX_COLOUR = re.compile(r"^#?([0-9a-fA-F]{6})$")


def waiting_progress(text: str) -> list:
    """The Run callback's progress outputs showing only a message (team mode's manager
    uses it while no worker has taken the run)."""
    return ["0", "1", placeholder_figure(text), text]


class ImageResult:
    """The image panel's run and result (a part of :class:`webapp.panels.image.ImagePanel`):
    its request from the page's controls, its live picture over the image, and its
    downloads (each only while the screen shows what the result explains)."""

    services: Services

    def run_settings(self) -> list[State]:
        return [
            *values(IMAGE_PANEL.patch, IMAGE_PANEL.stride, IMAGE_PANEL.mode, ids.COLOUR,
                    ids.CUSTOM_COLOUR),
            State(IMAGE_PANEL.label, "value"),
            State(IMAGE_PANEL.region, "data"),
            *values(ids.TARGET_SSIM, ids.DRILL_DOWN, ids.TARGET_SPEEDUP, ids.SNAP),
            State(ids.OVERLAY_STORE, "data"),
            *values(IMAGE_PANEL.compare, IMAGE_PANEL.compare_layer, IMAGE_PANEL.compare_steps),
        ]  # fmt: skip

    def register_result_callbacks(self, app) -> None:
        """Attach the result's own callbacks to ``app`` (beside the subject panel's)."""
        # A new image or model: the live picture of the run it stops goes at once, in the
        # browser, before any answer from the server.
        # The Compare view of the old image goes with it.
        app.clientside_callback(
            """function(image, model) {
                return [{"display": "none"}, {"display": "block"}, []];
            }""",
            Output(IMAGE_PANEL.strip.live_panel, "style", allow_duplicate=True),
            Output(ids.RESULT_PANEL_BODY, "style", allow_duplicate=True),
            Output(IMAGE_PANEL.compare_panel, "children", allow_duplicate=True),
            Input(IMAGE_PANEL.store, "data"),
            Input(IMAGE_PANEL.model, "value"),
            prevent_initial_call=True,
        )

    def prepare(self, session: str, image_data, model_name: str, *settings) -> Prepared:
        if not image_data:
            raise helpers.InputError("load an image first")
        loaded = self.services.model(model_name)
        request, overlay = run_request(image_data, model_name, *settings)
        picture = self.services.images.get(request.key)
        draw = figures.live_heatmap(picture, loaded.input_size, overlay)
        return Prepared(request, draw, list(loaded.classes))

    def screen(self) -> list[tuple[str, str]]:
        return [(str(i.component_id), i.component_property) for i in SCREEN_INPUTS]

    def hidden(self, result: runs.ResultRecord, *screen) -> str:
        view = shown_view(self.services, result, *screen)
        return "" if view.show else view.reason

    def picture_outputs(self) -> list[Output]:
        return [
            Output(ids.HEATMAP_GRAPH, "figure"),
            Output(ids.DICOM_IDENTITY, "style"),
            Output(IMAGE_PANEL.compare_panel, "children"),
        ]

    def picture_inputs(self) -> list[Input]:
        return [Input(ids.OVERLAY_STORE, "data")]

    def on_screen_inputs(self) -> list[Input]:
        return [Input(ids.IMAGE_SHOWN, "data")]

    def picture(self, result: runs.ResultRecord | None, why: str, overlay=None) -> tuple:
        """The heatmap over the picture the model saw (drawn with the overlay settings),
        the DICOM identity choice where the result has a DICOM source, the Compare view."""
        if result is None:
            return placeholder_figure(why or NO_RESULT), {"display": "none"}, []
        picture = model_picture(self.services, result)
        figure = figures.heatmap_figure(
            picture, result["values"], result["xs"], result["ys"], result["patch"],
            result["prob"], runs.picture_title(result), figures.overlay_style(overlay),
            (overlay or {}).get("view") == "side",
        )  # fmt: skip
        dicom = {"display": "block" if result.get("dicom") else "none"}
        return figure, dicom, image_compare_view(result, picture)

    def file_states(self) -> list[State]:
        return [State(ids.OVERLAY_STORE, "data"), State(ids.DICOM_IDENTITY, "value")]

    def write_export(self, result: runs.ResultRecord, fmt: str, session: str, *page) -> dict:
        """The file for one export button (webapp.exports' writers), drawn with the
        overlay settings (the last but one of ``page``)."""
        overlay, identity = page[-2:]
        stem = exports.export_stem(result)
        style = figures.overlay_style(overlay)
        if fmt == "png":
            original = self.services.images.get(result["source_key"])
            return dcc.send_bytes(exports.export_png(original, result, style), f"{stem}.png")
        if fmt == "dicom":
            runs.refuse_partial(result, "a DICOM file")
            source = self.services.images.source((result.get("dicom") or {}).get("source", ""),
                                                 session)  # fmt: skip
            data = exports.export_dicom(source, result, style, "identity" in (identity or []))
            return dcc.send_bytes(data, f"{stem}.dcm")
        if fmt == "npy":  # one array and nothing else: a flagged image's name says so
            flagged = "-out-of-distribution" if model_card.ood_text(result.get("ood")) else ""
            return dcc.send_bytes(exports.export_npy(result), f"{stem}{flagged}.npy")
        if fmt == "npz":
            return dcc.send_bytes(exports.export_all_classes(result), f"{stem}-all.npz")
        if fmt == "csv":
            return dcc.send_string(exports.export_csv(result), f"{stem}.csv")
        if fmt == "compare":  # the three methods side by side
            data = comparison.comparison_png(result, model_picture(self.services, result))
            return dcc.send_bytes(data, f"{stem}-compare.png")
        return dcc.send_string(runs.export_json(result), f"{stem}.json")


def shown_view(services: Services, result: runs.ResultRecord, *screen) -> runs.ResultView:
    """Whether ``result`` may be shown beside what the page shows now (``screen``: the
    image, model, region, patch, stride, mode, colour, custom colour, quality target,
    drill-down, speed-up and class): webapp.runs.shown_view, the volume panel's rule too."""
    image_data, model_name, region, patch, stride, mode, colour, custom, *rest = screen
    target_ssim, drill_down, speedup, label = rest
    try:
        asked, _ = run_request(
            image_data, model_name, patch, stride, mode, colour, custom, label, region,
            target_ssim, drill_down, speedup, snap=True, overlay=None,
        )  # fmt: skip
        weights = services.weights_checksum(model_name)
    except (helpers.InputError, KeyError, TypeError, ValueError):
        asked, weights = None, None  # nothing runnable on screen
    return runs.shown_view(result, asked, weights)


def model_picture(services: Services, result: runs.ResultRecord):
    """The picture the model saw for ``result`` (its input size)."""
    loaded = services.model(result["model"])
    return figures.model_view(services.images.get(result["source_key"]), loaded.input_size)


def run_request(
    image_data: dict,
    model_name: str,
    patch,
    stride,
    mode,
    colour,
    custom,
    label,
    region,
    target_ssim,
    drill,
    speedup,
    snap,
    overlay,
    compare=None,
    layer=None,
    steps=None,
    shown=None,
) -> tuple[runs.RunRequest, dict | None]:
    """The page's controls as a run request (and the overlay settings it is drawn with);
    ``shown``: the estimate the page showed for them (webapp.runs.shown_estimate). The
    quality target, drill-down and speed-up are read in approximate mode only: the other
    modes do not use them, and a blank one there refuses nothing."""
    approximate = (
        dict(target_ssim=target_ssim, r_drill_down=float(drill), target_speedup=float(speedup))
        if mode == "approximate"
        else {}
    )
    request = runs.RunRequest(
        key=image_data["key"],
        name=str(image_data.get("name")),
        model=model_name,
        patch=int(patch),
        stride=int(stride),
        mode=mode,
        fill_rgb=parse_colour(colour, custom),
        label=None if label is None else int(label),
        region=tuple(region) if region else None,
        **approximate,
        snap=bool(snap),
        compare=bool(compare),
        compare_layer=str(layer) if layer else None,
        compare_steps=chosen_budget(steps) if compare else None,  # read only by Compare
        dicom=image_data.get("dicom"),
        estimate=shown,
    )
    return request, overlay


def parse_colour(choice: str, custom: str | None) -> tuple[float, float, float]:
    """Occlusion colour as RGB in [0, 1]: gray, black or a custom #rrggbb."""
    if choice == "gray":
        return (0.5, 0.5, 0.5)
    if choice == "black":
        return (0.0, 0.0, 0.0)
    match = HEX_COLOUR.match((custom or "").strip())
    if not match:
        raise helpers.InputError(f"custom colour must look like #808080, got {custom!r}")
    red, green, blue = (int(match.group(1)[i : i + 2], 16) / 255 for i in (0, 2, 4))
    return (red, green, blue)
