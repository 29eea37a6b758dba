"""The run panel: Run and Cancel, the queue place, the progress bar with the time left and
the live picture. The run itself is webapp.runs.execute (no browser needed); its states
are webapp.lifecycle.RunLifecycle."""

from __future__ import annotations

import logging
import time

from dash import Input, Output, State, ctx, no_update
from dash.exceptions import PreventUpdate

from .. import comparison, figures, helpers, ids, runs
from ..guard import CLIENT_HEADER
from ..helpers import InputError
from ..jobs import JobCancelled, QueueFull, check_cancelled
from ..layout import placeholder_figure
from ..lifecycle import RunLifecycle
from ..services import Services
from .common import empty_figure, off_while_running

LIVE_UPDATE_SECONDS = 0.3
# The Run callback's outputs: the result's handle and the message (team mode's manager
# answers with a message alone when the queue or the workers are gone). The result panel
# draws a handle only beside what it explains (panels.result).
RUN_OUTPUTS, RUN_MESSAGE_OUTPUT = 2, 1
logger = logging.getLogger("krypton.app")


def waiting_progress(text: str) -> list:
    """The Run callback's progress outputs showing only a message (team mode's manager
    uses it while no worker has taken the run)."""
    return ["0", "1", placeholder_figure(text), text]


class RunPanel:
    """The Run callback (a background job on ``manager``) and its companions."""

    def __init__(self, services: Services, manager):
        self.services = services
        self.manager = manager

    def register(self, app) -> None:
        """Attach the panel's callbacks to ``app``."""
        app.callback(
            Output(ids.RESULT_STORE, "data"),
            Output(ids.MESSAGE, "children", allow_duplicate=True),
            Input(ids.RUN, "n_clicks"),
            State(ids.SESSION, "data"),
            State(ids.IMAGE_STORE, "data"),
            State(ids.MODEL, "value"),
            State(ids.PATCH, "value"),
            State(ids.STRIDE, "value"),
            State(ids.MODE, "value"),
            State(ids.COLOUR, "value"),
            State(ids.CUSTOM_COLOUR, "value"),
            State(ids.LABEL, "value"),
            State(ids.REGION_STORE, "data"),
            State(ids.TARGET_SSIM, "value"),
            State(ids.DRILL_DOWN, "value"),
            State(ids.TARGET_SPEEDUP, "value"),
            State(ids.SNAP, "value"),
            State(ids.OVERLAY_STORE, "data"),
            State(ids.COMPARE, "value"),
            State(ids.COMPARE_LAYER, "value"),
            background=True,
            manager=self.manager,
            prevent_initial_call=True,
            interval=LIVE_UPDATE_SECONDS * 1000,
            running=[
                # Run's own state follows this and the prediction (settings panel)
                (Output(ids.RUN_BUSY, "data"), True, False),
                (Output(ids.CANCEL, "disabled"), False, True),
                (Output(ids.RESULT_PANEL_BODY, "style"), {"display": "none"}, {"display": "block"}),
                (Output(ids.LIVE_PANEL, "style"), {"display": "block"}, {"display": "none"}),
                (Output(ids.COMPARE_PANEL, "style"), {"display": "none"}, {}),
            ],
            # A new image or model stops the run that explains the old one (Dash cancels
            # a background job when any of these inputs changes).
            cancel=[
                Input(ids.CANCEL, "n_clicks"),
                Input(ids.IMAGE_STORE, "data"),
                Input(ids.MODEL, "value"),
            ],
            progress=[
                Output(ids.PROGRESS, "value"),
                Output(ids.PROGRESS, "max"),
                Output(ids.LIVE_GRAPH, "figure"),
                Output(ids.LIVE_STATUS, "children"),
            ],
            progress_default=["0", "1", empty_figure("Starting…"), ""],
        )(self.run)
        off_while_running(app, ids.RUN_BUSY, ids.RUN)
        # A new image or model: the live picture of the run it stops goes at once, in the
        # browser, before any answer from the server.
        # The Compare view of the old image goes with it.
        app.clientside_callback(
            """function(image, model) {
                return [{"display": "none"}, {"display": "block"}, []];
            }""",
            Output(ids.LIVE_PANEL, "style", allow_duplicate=True),
            Output(ids.RESULT_PANEL_BODY, "style", allow_duplicate=True),
            Output(ids.COMPARE_PANEL, "children", allow_duplicate=True),
            Input(ids.IMAGE_STORE, "data"),
            Input(ids.MODEL, "value"),
            prevent_initial_call=True,
        )
        app.callback(
            Output(ids.MESSAGE, "children", allow_duplicate=True),
            Input(ids.CANCEL, "n_clicks"),
            State(ids.RESULT_STORE, "data"),
            prevent_initial_call=True,
        )(cancelled)

    def run(self, set_progress, n_clicks, session, image_data, model_name, *settings):
        """Queue, run and keep one run; the page gets its handle {id, provenance}.

        ``session`` keys this tab's queue place and its results on the server; as a
        callback argument it is also part of the background job's cache key, so two tabs
        with identical settings never share a job's progress or result."""
        if not n_clicks:
            raise PreventUpdate
        session = str(session or "")
        lifecycle = RunLifecycle()

        def waiting(ahead: int) -> None:
            check_cancelled()
            text = f"Queued: {ahead} run{'s' if ahead > 1 else ''} ahead of yours"
            set_progress(("0", "1", empty_figure(text), text))

        try:
            if not image_data:
                raise InputError("load an image first")
            loaded = self.services.model(model_name)
            request, overlay = run_request(image_data, model_name, *settings)
            style = figures.overlay_style(overlay)
            shown = helpers.model_view(self.services.images.get(request.key), loaded.input_size)
            client = (ctx.headers or {}).get(CLIENT_HEADER) or "unknown"
            lifecycle.queue()
            # a run whose every cell is known computes nothing: it does not queue (a Compare
            # run still computes its gradient maps, so it does)
            planned = runs.plan_run(self.services, request)
            light = planned.positions > 0 and not planned.to_compute and not request.compare
            with self.services.job(), self.services.jobs.slot(session, waiting, client, light):
                lifecycle.start()
                reporter, stage = live_reporter(
                    set_progress, shown, style, lifecycle, list(loaded.classes)
                )
                result = runs.execute(self.services, session, request, reporter, stage)
            lifecycle.finish()
        except QueueFull as exc:
            lifecycle.fail(str(exc))
            return no_update, str(exc)
        except JobCancelled:
            lifecycle.cancel("cancelled")
            raise PreventUpdate from None
        except (InputError, ValueError) as exc:
            lifecycle.fail(str(exc))
            return no_update, str(exc)
        except Exception as exc:  # keep serving; say what happened instead of hanging
            logger.exception("run failed")
            lifecycle.fail(repr(exc))
            return (
                no_update,
                f"The run failed unexpectedly ({type(exc).__name__}: {exc}); see the server log.",
            )
        # The browser holds only a handle; the picture, exports and refinement read the
        # server's copy, and the result panel shows it only beside what it explains.
        return {"id": result["id"], "provenance": result["provenance"]}, ""


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
) -> tuple[runs.RunRequest, dict | None]:
    """The page's controls as a run request (and the overlay settings it is drawn with)."""
    request = runs.RunRequest(
        key=image_data["key"],
        name=str(image_data.get("name")),
        model=model_name,
        patch=int(patch),
        stride=int(stride),
        mode=mode,
        fill_rgb=helpers.parse_colour(colour, custom),
        label=None if label is None else int(label),
        region=tuple(region) if region else None,
        target_ssim=target_ssim,
        r_drill_down=float(drill),
        target_speedup=float(speedup),
        snap=bool(snap),
        compare=bool(compare),
        compare_layer=str(layer) if layer else None,
        dicom=image_data.get("dicom"),
    )
    return request, overlay


def live_reporter(
    set_progress, shown, style, lifecycle: RunLifecycle, classes: list[str]
) -> tuple[runs.Reporter, comparison.Stage]:
    """Progress to the page: the bar, the count, the time left and the live picture.
    Every update carries the latest picture (a progress output cannot be left unchanged:
    Dash would blank it), rebuilt when new values arrive, at most every
    LIVE_UPDATE_SECONDS. A picture without a count (approximate mode's coarse picture)
    keeps the last count, so the bar never jumps back. The second callable reports the
    Compare steps after the occlusion (webapp.comparison), over the finished picture."""
    state = {"figure": empty_figure("Computing the first positions…"), "sent": 0.0}
    planned: dict[str, int] = {}

    def report(done: int, total: int, partial: runs.Partial | None = None) -> None:
        check_cancelled()
        if total:
            planned.setdefault("total", total)
            lifecycle.progress(done, total)
        now = time.perf_counter()
        if partial is None and now - state["sent"] < LIVE_UPDATE_SECONDS:
            return
        if partial is not None:
            state["figure"] = figures.heatmap_figure(
                shown,
                helpers.fill_for_display(partial.values),
                partial.xs,
                partial.ys,
                partial.patch,
                partial.prob,
                f"{partial.label_name} (computing)",
                style,
            )
        state["sent"] = now
        status = lifecycle.status() if lifecycle.total else "coarse picture ready"
        if lifecycle.total and lifecycle.total != planned.get("total"):
            status += (
                f" (planned {planned['total']}; stage one chose which blocks to refine, "
                f"so the count was revised)"
            )
        bar = (str(lifecycle.done), str(max(lifecycle.total, 1)))
        set_progress((*bar, state["figure"], status))

    def stage(done: int, total: int, method: str, label: int) -> None:
        check_cancelled()
        text = comparison.stage_text(done, total, method, label, classes)
        set_progress((str(done), str(total), state["figure"], text))

    return report, stage


def cancelled(n_clicks, handle):
    """What Cancel did, in words (the image and the volume panels alike)."""
    if not n_clicks:
        return no_update
    if not handle:
        return "Run cancelled."
    return (
        "Run cancelled; the heatmap below, if any, is the previous run's (shown only while "
        "it matches these settings)."
    )
