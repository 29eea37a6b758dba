"""The image panel's run: its request from the page's controls and its live picture over
the image; the strip around it (Run, Cancel, the queue place, the progress bar with the
time left) is the run strip's (webapp.panels.run_strip), shared with the volume panel.
The run itself is webapp.runs.execute (no browser needed); its states are
webapp.jobs.RunLifecycle."""

from __future__ import annotations

import re

from dash import Input, Output, State
from dash.exceptions import PreventUpdate

from .. import figures, helpers, ids, runs
from ..layout import placeholder_figure
from ..panel_scope import IMAGE_PANEL
from ..path_budget import chosen_budget
from ..services import Services
from .run_strip import Prepared, register_strip, run_job, values

# The Run callback's outputs: the result's handle and the message (team mode's manager
# answers with a message alone when the queue or the workers are gone). The result panel
# draws a handle only beside what it explains (panels.result).
RUN_OUTPUTS, RUN_MESSAGE_OUTPUT = 2, 1
HEX_COLOUR = re.compile(r"^#?([0-9a-fA-F]{6})$")


def waiting_progress(text: str) -> list:
    """The Run callback's progress outputs showing only a message (team mode's manager
    uses it while no worker has taken the run)."""
    return ["0", "1", placeholder_figure(text), text]


class RunPanel:
    """The image panel's Run callback (a background job on ``manager``) and its
    companions."""

    def __init__(self, services: Services, manager):
        self.services = services
        self.manager = manager
        self.result = IMAGE_PANEL.result  # the store a Compare run's early handles go to

    def register(self, app) -> None:
        """Attach the panel's callbacks to ``app``."""
        register_strip(
            IMAGE_PANEL,
            app,
            self.run,
            manager=self.manager,
            services=self.services,
            rank=2,
            settings=[
                *values(
                    IMAGE_PANEL.patch,
                    IMAGE_PANEL.stride,
                    IMAGE_PANEL.mode,
                    ids.COLOUR,
                    ids.CUSTOM_COLOUR,
                ),
                State(IMAGE_PANEL.label, "value"),
                State(IMAGE_PANEL.region, "data"),
                *values(ids.TARGET_SSIM, ids.DRILL_DOWN, ids.TARGET_SPEEDUP, ids.SNAP),
                State(ids.OVERLAY_STORE, "data"),
                *values(IMAGE_PANEL.compare, IMAGE_PANEL.compare_layer, IMAGE_PANEL.compare_steps),
            ],
            hidden_while_running=(ids.RESULT_PANEL_BODY, IMAGE_PANEL.compare_panel),
        )
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

    def run(self, set_progress, n_clicks, session, image_data, model_name, *settings):
        """Queue, run and keep one run; the page gets its handle {id, provenance}.
        ``settings``: the page's controls (:func:`run_request`), then the estimate the
        page showed for them (the run keeps it where its plan is the same).

        ``session`` keys this tab's queue place and its results on the server; as a
        callback argument it is also part of the background job's cache key, so two tabs
        with identical settings never share a job's progress or result."""
        if not n_clicks:
            raise PreventUpdate

        def prepare() -> Prepared:
            if not image_data:
                raise helpers.InputError("load an image first")
            loaded = self.services.model(model_name)
            request, overlay = run_request(image_data, model_name, *settings)
            picture = self.services.images.get(request.key)
            draw = figures.live_heatmap(picture, loaded.input_size, overlay)
            return Prepared(request, draw, list(loaded.classes))

        return run_job(self.services, set_progress, str(session or ""), prepare, self.result)


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
