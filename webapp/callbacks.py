"""Callbacks of the Krypton app. Tensor work stays in the engine; this wires the page."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import plotly.graph_objects as go
import torch
from dash import ALL, ClientsideFunction, Input, Output, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

import krypton
from krypton.capture_lock import CAPTURE_LOCK
from krypton.explainer import grid_positions, model_fingerprint
from krypton.registry import (
    CheckpointError,
    RegistryError,
    load_model,
)

from . import helpers
from .guard import CLIENT_HEADER
from .helpers import InputError
from . import runs
from .jobs import JobCancelled, JobQueue, QueueFull, check_cancelled, running_as
from .lifecycle import Provenance, RunLifecycle, result_view
from .model_panel import register_model_panel
from .layout import DICOM_SAMPLES, mode_options, patch_options, placeholder_figure, sample_path
from .settings import ServerSettings
from .uploads import UploadStore

LIVE_UPDATE_SECONDS = 0.3
# The Run callback's outputs: the result's handle and the message (team mode's manager
# answers with a message alone when the queue or the workers are gone). The result panel
# draws a handle only beside what it explains (show_result).
RUN_OUTPUTS, RUN_MESSAGE_OUTPUT = 2, 1
NO_RESULT = "Press Run to compute the heatmap"
DROPPED_RESULT = (
    "This heatmap is no longer kept on the server (results are kept within "
    "KRYPTON_RESULT_STORE_MB, least recently used first); press Run to compute it again."
)
logger = logging.getLogger("krypton.app")


class Services:
    """Loaded models, their explainers (graphs and views), stored images, the sessions'
    last results and the job queue, per server."""

    def __init__(self, cache_dir: Path, settings: ServerSettings | None = None, team=None):
        self.settings = settings or ServerSettings()
        self.team = team  # webapp.team.TeamStores in team mode: state lives in Redis
        if team is not None:
            self.images, self.results, self.cells = team.images(), team.results(), team.cells()
        else:
            self.images = helpers.ImageStore(
                Path(cache_dir) / "images",
                self.settings.mb(self.settings.image_store_mb),
                self.settings.image_store_count,
            )
            self.results = helpers.ResultStore(
                self.settings.results_kept, self.settings.mb(self.settings.result_store_mb)
            )
            self.cells = runs.CellCache(max_bytes=self.settings.mb(self.settings.cell_cache_mb))
        self.uploads = UploadStore(
            Path(cache_dir) / "uploads", self.settings.mb(self.settings.upload_store_mb)
        )
        self._checksums: dict[str, str] = {}
        self.jobs = JobQueue(
            self.settings.max_running_jobs,
            self.settings.max_queued_jobs,
            self.settings.max_jobs_per_session,
            self.settings.max_jobs_per_client,
        )
        self._models: dict[str, krypton.LoadedModel] = {}
        self._explainers: dict[str, krypton.OcclusionExplainer] = {}
        self._lock = threading.Lock()

    @contextmanager
    def job(self) -> Iterator[None]:
        """Around a run: nothing in embedded mode (the thread manager tracks the job); in
        team mode, inside a Celery worker, the job's lease (cancel, abandoned page, and
        the broker message kept from redelivery while this worker is alive)."""
        request = None
        if self.team is not None:
            from celery import current_task

            request = getattr(current_task, "request", None)
        if request is None or not getattr(request, "id", None):
            yield
            return
        from krypton.distributed import delivery_tag

        from .team import JobLease

        lease = JobLease(
            self.team.client, request.id, delivery_tag(request), self.settings.abandon_seconds
        )
        lease.wait_for_other_holder()
        with lease, running_as(lease):
            yield

    def forget(self, name: str) -> None:
        """Drop a removed model from memory."""
        with self._lock:
            self._models.pop(name, None)
            self._explainers.pop(name, None)
            self._checksums.pop(name, None)

    def model(self, name: str) -> krypton.LoadedModel:
        if not name:
            raise InputError("choose a model")
        with self._lock:
            if name not in self._models:
                try:
                    self._models[name] = load_model(name)
                except (RegistryError, CheckpointError, krypton.WeightsUnavailableError) as exc:
                    raise InputError(str(exc)) from exc
                self._explainers[name] = krypton.OcclusionExplainer(self._models[name].module)
            return self._models[name]

    def weights_checksum(self, name: str) -> str:
        """Digest of the model's weights and settings: which version made a result."""
        module = self.model(name).module
        with self._lock:
            if name not in self._checksums:
                self._checksums[name] = model_fingerprint(module)[1]
            return self._checksums[name]

    def explainer(self, name: str) -> krypton.OcclusionExplainer:
        self.model(name)
        return self._explainers[name]

    def logits(self, name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, str | None]:
        """Logits of the unoccluded image, and why exact/approximate modes cannot run
        (None when they can). For traceable models this also materialises the views a Run
        will reuse; a model that cannot be captured runs plainly, and the capture error is
        returned for the page to show — any other error propagates."""
        with torch.inference_mode():
            try:
                return self.explainer(name).views_for(tensor)[1].logits, None
            except krypton.UnsupportedModelError as exc:
                with CAPTURE_LOCK.shared():
                    return self.model(name).module(tensor.unsqueeze(0)), str(exc)


# What a result's provenance is compared with: the page's image, model and settings.
SCREEN_INPUTS = [
    Input("image-store", "data"),
    Input("model", "value"),
    Input("region-store", "data"),
    Input("patch", "value"),
    Input("stride", "value"),
    Input("mode", "value"),
    Input("colour", "value"),
    Input("custom-colour", "value"),
]


def waiting_progress(text: str) -> list:
    """The Run callback's progress outputs showing only a message (team mode's manager
    uses it while no worker has taken the run)."""
    return ["0", "1", placeholder_figure(text), text]


def _empty_figure(text: str = "") -> go.Figure:
    return go.Figure(placeholder_figure(text))


def register_callbacks(app, manager, services: Services) -> None:
    """Attach every callback to ``app``; jobs run on ``manager``."""
    register_model_panel(app, services)

    def _dicom_image_data(data: bytes, name: str, session: str, window=None, frame=None) -> dict:
        """Keep a DICOM file's bytes (for this tab only), store its windowed frame; the
        page's record of it."""
        source = services.images.put_source(data, session)
        loaded, record = helpers.dicom_view(data, source, window, frame, name)
        key = services.images.put(loaded.picture)
        return {
            "key": key,
            "name": helpers.dicom_name(record),
            "size": list(loaded.picture.size),
            "dicom": record,
        }

    @app.callback(
        Output("image-store", "data"),
        Output("region-store", "data"),
        Output("message", "children"),
        Output("window-preset", "value"),
        Output("dicom-frame", "max"),
        Output("dicom-frame", "value"),
        Input("upload-ticket", "data"),
        Input({"type": "sample", "name": ALL}, "n_clicks"),
        State("session", "data"),
        prevent_initial_call=True,
    )
    def load_image(ticket, sample_clicks, session):
        trigger = ctx.triggered_id
        session = str(session or "")
        ticket = ticket if isinstance(ticket, dict) else {}  # the page's, so the client's
        filename = str(ticket.get("name") or "") if trigger == "upload-ticket" else None
        try:
            if trigger == "upload-ticket":
                data = _uploaded_bytes(ticket, "image", session)
                name = filename
            elif isinstance(trigger, dict) and any(sample_clicks):
                name = trigger["name"]
                try:
                    data = sample_path(name).read_bytes()
                except (KeyError, OSError):
                    raise InputError(f"the sample {name!r} is not available") from None
                if name in DICOM_SAMPLES:
                    name = DICOM_SAMPLES[name][0]
            else:
                raise PreventUpdate
            if helpers.upload_is_dicom(data, filename if trigger == "upload-ticket" else name):
                image_data = _dicom_image_data(data, str(name or "the file"), session)
                record = image_data["dicom"]
                return image_data, None, "", "file", record["frames"], record["frame"] + 1
            image = helpers.decode_upload(data, name)
            key = services.images.put(image)
        except InputError as exc:
            return no_update, no_update, str(exc), no_update, no_update, no_update
        image_data = {"key": key, "name": name, "size": list(image.size)}
        return image_data, None, "", no_update, no_update, no_update

    def _uploaded_bytes(ticket: dict | None, purpose: str, session: str) -> bytes:
        """The bytes of a file the page posted to the upload route (its ticket)."""
        if not isinstance(ticket, dict):
            raise InputError("the file could not be uploaded; try again")
        if ticket.get("error"):
            raise InputError(str(ticket["error"]))
        with services.uploads.take(str(ticket.get("token", "")), purpose, session) as (path, _):
            return path.read_bytes()

    app.clientside_callback(
        ClientsideFunction("krypton_upload", "image"),
        Output("upload-ticket", "data"),
        Input("upload", "contents"),
        State("upload", "filename"),
        State("session", "data"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output("image-store", "data", allow_duplicate=True),
        Output("message", "children", allow_duplicate=True),
        Input("window-preset", "value"),
        Input("window-centre", "value"),
        Input("window-width", "value"),
        Input("dicom-frame", "value"),
        State("image-store", "data"),
        State("session", "data"),
        prevent_initial_call=True,
    )
    def rewindow(preset, centre, width, frame, image_data, session):
        """Another window or frame of the same DICOM file: a new picture for the model."""
        record = (image_data or {}).get("dicom")
        if not record:
            raise PreventUpdate
        if preset == "manual" and (centre is None or width is None):
            raise PreventUpdate  # still typing
        try:
            window = helpers.requested_window(preset, centre, width)
            frame = record["frame"] if frame is None else int(frame) - 1
            requested = list(window) if isinstance(window, tuple) else window
            if requested == record["requested"] and frame == record["frame"]:
                raise PreventUpdate  # the controls caught up with the stored image
            session = str(session or "")
            data = services.images.source(record["source"], session)
            return _dicom_image_data(data, image_data["name"], session, window, frame), ""
        except InputError as exc:
            return no_update, str(exc)

    @app.callback(
        Output("dicom-panel", "style"),
        Output("dicom-info", "children"),
        Output("frame-picker", "style"),
        Output("window-centre", "value"),
        Output("window-width", "value"),
        Input("image-store", "data"),
        Input("model", "value"),
        Input("patch", "value"),
    )
    def show_dicom(image_data, model_name, patch):
        record = (image_data or {}).get("dicom")
        if not record:
            return {"display": "none"}, "", {"display": "none"}, no_update, no_update
        try:
            size = services.model(model_name).input_size
        except InputError:
            size = tuple(reversed(image_data["size"]))
        text = helpers.dicom_description(record, size, patch)
        centre, width = record["window"] or (None, None)
        frames = {"display": "block"} if record["frames"] > 1 else {"display": "none"}
        return {"display": "block"}, text, frames, centre, width

    @app.callback(Output("manual-window", "style"), Input("window-preset", "value"))
    def toggle_manual_window(preset):
        return {"display": "flex"} if preset == "manual" else {"display": "none"}

    @app.callback(
        Output("overlay-store", "data"),
        Input("overlay-show", "value"),
        Input("overlay-view", "value"),
        Input("overlay-scale", "value"),
        Input("overlay-opacity", "value"),
        Input("overlay-threshold", "value"),
    )
    def overlay_settings(show, view, scale, opacity, threshold):
        return {
            "show": "show" in (show or []),
            "view": view,
            "scale": scale,
            "opacity": opacity,
            "threshold": threshold or 0.0,
        }

    def _result_figure(result: dict, overlay: dict | None, title: str | None = None):
        loaded = services.model(result["model"])
        shown = helpers.model_view(services.images.get(result["image_key"]), loaded.input_size)
        return helpers.heatmap_figure(
            shown,
            result["values"],
            result["xs"],
            result["ys"],
            result["patch"],
            result["prob"],
            result["label_name"] if title is None else title,
            helpers.overlay_style(overlay),
            (overlay or {}).get("view") == "side",
        )

    @app.callback(
        Output("region-store", "data", allow_duplicate=True),
        Input("image-graph", "selectedData"),
        Input("reset-region", "n_clicks"),
        State("model", "value"),
        prevent_initial_call=True,
    )
    def select_region(selected, reset, model_name):
        if ctx.triggered_id == "reset-region":
            return None
        try:
            size = services.model(model_name).input_size
        except InputError:
            raise PreventUpdate
        region = helpers.region_from_selection(selected, size)
        if region is None:
            raise PreventUpdate
        return region

    @app.callback(
        Output("image-graph", "figure"),
        Output("region-text", "children"),
        Input("image-store", "data"),
        Input("region-store", "data"),
        Input("model", "value"),
    )
    def draw_image(image_data, region, model_name):
        if not image_data:
            return _empty_figure("Load an image: upload one or pick a sample"), ""
        try:
            loaded = services.model(model_name)
            image = helpers.model_view(services.images.get(image_data["key"]), loaded.input_size)
        except InputError as exc:
            return _empty_figure(str(exc)), ""
        height, width = loaded.input_size
        if region:
            x0, y0, x1, y1 = region
            text = f"Region x {x0}–{x1}, y {y0}–{y1} ({x1 - x0}×{y1 - y0} px)"
        else:
            text = f"Whole image ({width}×{height} px, the model's input size)"
        return helpers.image_figure(image, region), text

    @app.callback(
        Output("prediction-store", "data"),
        Output("label", "options"),
        Output("label", "value"),
        Output("top5", "children"),
        Output("model-card", "children"),
        Output("message", "children", allow_duplicate=True),
        Output("mode", "options"),
        Output("mode", "value"),
        Input("image-store", "data"),
        Input("model", "value"),
        State("mode", "value"),
        State("run", "disabled"),
        prevent_initial_call="initial_duplicate",
    )
    def predict(image_data, model_name, mode, running):
        try:
            loaded = services.model(model_name)
        except InputError as exc:
            return None, [], None, "", "", str(exc), no_update, no_update
        card = _model_card(loaded)
        if not image_data:
            return None, [], None, "", card, no_update, no_update, no_update
        try:
            image = services.images.get(image_data["key"])
        except InputError as exc:
            return None, [], None, "", card, str(exc), no_update, no_update
        # materialises the views now, so the Run job only computes patches
        tensor = loaded.preprocess(image)
        logits, capture_error = services.logits(model_name, tensor)
        ood = loaded.check_ood(tensor)
        warning = helpers.ood_text(None if ood is None else ood.as_dict())
        probs = torch.softmax(logits[0].float(), 0)
        top = torch.topk(probs, min(5, probs.numel()))
        top5 = [(int(i), float(p)) for p, i in zip(top.values, top.indices)]
        options = [{"label": f"{loaded.class_name(i)} ({p:.1%})", "value": i} for i, p in top5]
        others = [
            {"label": loaded.class_name(i), "value": i}
            for i in range(len(loaded.classes))
            if i not in dict(top5)
        ]
        table = html.Table(
            [html.Tr([html.Td(loaded.class_name(i)), html.Td(f"{p:.1%}")]) for i, p in top5],
            className="top5-table",
        )
        if warning:
            table = html.Div([html.P(warning, id="ood-warning", className="warning"), table])
        message = (
            ""
            if capture_error is None
            else f"Only naive mode works for this model: {capture_error}"
        )
        stopped = (
            "The run in progress explained the previous image or model, so it was stopped."
            if running and ctx.triggered_id in ("image-store", "model")
            else ""
        )
        message = " ".join(part for part in (stopped, warning, message) if part)
        traceable = capture_error is None
        return (
            {"top5": top5, "model": model_name, "image": image_data["key"]},
            options + others,
            top5[0][0],
            table,
            card,
            message,
            mode_options(traceable),
            mode if traceable else "naive",
        )

    @app.callback(Output("patch", "options"), Output("patch", "value"), Input("model", "value"))
    def model_patch(model_name):
        """Each model opens with its own default patch (its registry entry's)."""
        try:
            patch = services.model(model_name).patch
        except InputError:
            raise PreventUpdate
        return patch_options(patch), patch

    @app.callback(Output("approximate-settings", "style"), Input("mode", "value"))
    def toggle_approximate(mode):
        return {"display": "block"} if mode == "approximate" else {"display": "none"}

    @app.callback(Output("custom-colour", "style"), Input("colour", "value"))
    def toggle_custom_colour(colour):
        return {"display": "inline-block"} if colour == "custom" else {"display": "none"}

    @app.callback(
        Output("estimate", "children"),
        Input("model", "value"),
        Input("patch", "value"),
        Input("stride", "value"),
        Input("mode", "value"),
        Input("region-store", "data"),
        Input("drill-down", "value"),
        Input("target-speedup", "value"),
        Input("result-store", "data"),
    )  # refreshed after each run: it learns
    def estimate(model_name, patch, stride, mode, region, drill, speedup, _result):
        try:
            size = services.model(model_name).input_size
            helpers.check_region(region, size, patch, stride)
            ys, xs = grid_positions(size, patch, stride, region)
        except (InputError, ValueError) as exc:
            return html.Span(str(exc), className="warning")
        found = runs.find_estimate(model_name, patch, stride, mode, region, drill, speedup)
        naive = runs.find_estimate(model_name, patch, stride, "naive", region, drill, speedup)
        positions = len(ys) * len(xs)
        if found is None:
            return (
                f"{positions} positions; no runtime estimate for this model and patch "
                f"size yet (make calibrate, or it learns from your first runs)"
            )
        text = (
            f"Estimated {runs.estimate_text(dataclasses.asdict(found))} for {positions} "
            f"positions, from {found.source}"
        )
        if naive and mode != "naive":
            text += f" (naive ≈ {runs.format_seconds(naive.seconds)})"
        return text

    @app.callback(
        Output("result-store", "data"),
        Output("message", "children", allow_duplicate=True),
        Input("run", "n_clicks"),
        State("session", "data"),
        State("image-store", "data"),
        State("model", "value"),
        State("patch", "value"),
        State("stride", "value"),
        State("mode", "value"),
        State("colour", "value"),
        State("custom-colour", "value"),
        State("label", "value"),
        State("region-store", "data"),
        State("target-ssim", "value"),
        State("drill-down", "value"),
        State("target-speedup", "value"),
        State("snap", "value"),
        State("overlay-store", "data"),
        background=True,
        manager=manager,
        prevent_initial_call=True,
        interval=LIVE_UPDATE_SECONDS * 1000,
        running=[
            (Output("run", "disabled"), True, False),
            (Output("cancel", "disabled"), False, True),
            (Output("result-panel-body", "style"), {"display": "none"}, {"display": "block"}),
            (Output("live-panel", "style"), {"display": "block"}, {"display": "none"}),
        ],
        # A new image or model stops the run that explains the old one (Dash cancels a
        # background job when any of these inputs changes).
        cancel=[Input("cancel", "n_clicks"), Input("image-store", "data"), Input("model", "value")],
        progress=[
            Output("progress", "value"),
            Output("progress", "max"),
            Output("live-graph", "figure"),
            Output("live-status", "children"),
        ],
        progress_default=["0", "1", _empty_figure("Starting…"), ""],
    )
    def run(
        set_progress,
        n_clicks,
        session,
        image_data,
        model_name,
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
    ):
        # ``session`` keys this tab's queue place and its results on the server; as a
        # callback argument it is also part of the background job's cache key, so two tabs
        # with identical settings never share a job's progress or result.
        if not n_clicks:
            raise PreventUpdate
        session = str(session or "")
        lifecycle = RunLifecycle()

        def waiting(ahead: int) -> None:
            check_cancelled()
            text = f"Queued: {ahead} run{'s' if ahead > 1 else ''} ahead of yours"
            set_progress(("0", "1", _empty_figure(text), text))

        try:
            if not image_data:
                raise InputError("load an image first")
            loaded = services.model(model_name)
            request = runs.RunRequest(
                image_key=image_data["key"],
                image_name=str(image_data.get("name")),
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
                dicom=image_data.get("dicom"),
            )
            style = helpers.overlay_style(overlay)
            shown = helpers.model_view(services.images.get(request.image_key), loaded.input_size)
            client = (ctx.headers or {}).get(CLIENT_HEADER) or "unknown"
            lifecycle.queue()
            with services.job(), services.jobs.slot(session, waiting, client):
                lifecycle.start()
                reporter = _live_reporter(set_progress, shown, style, lifecycle)
                result = runs.execute(services, session, request, reporter)
            lifecycle.finish()
        except QueueFull as exc:
            lifecycle.fail(str(exc))
            return no_update, str(exc)
        except JobCancelled:
            lifecycle.cancel("cancelled")
            raise PreventUpdate
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

    def _live_reporter(set_progress, shown, style, lifecycle: RunLifecycle) -> runs.Reporter:
        """Progress to the page: the bar, the count, the time left and the live picture.
        Every update carries the latest picture (a progress output cannot be left
        unchanged: Dash would blank it), rebuilt when new values arrive, at most every
        LIVE_UPDATE_SECONDS. A picture without a count (approximate mode's coarse picture)
        keeps the last count, so the bar never jumps back."""
        state = {"figure": _empty_figure("Computing the first positions…"), "sent": 0.0}
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
                state["figure"] = helpers.heatmap_figure(
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

        return report

    @app.callback(
        Output("result-store", "data", allow_duplicate=True),
        Output("message", "children", allow_duplicate=True),
        Input("label", "value"),
        State("session", "data"),
        State("result-store", "data"),
        prevent_initial_call=True,
    )
    def recolour(label, session, handle):
        """Another class of the same run: re-coloured at once, nothing recomputed (the
        result panel redraws from the new handle)."""
        try:
            result = services.results.get(session)
        except InputError as exc:  # team mode: Redis is away
            return no_update, str(exc)
        if label is not None and handle and result is None and services.results.dropped(session):
            return no_update, DROPPED_RESULT
        if (
            label is None
            or not handle
            or result is None
            or result["id"] != handle.get("id")
            or int(label) == result["label"]
        ):
            raise PreventUpdate
        try:
            result = runs.relabel(result, int(label))
            services.results.put(session, result)
        except InputError as exc:
            # the panel hides the heatmap: the class on screen is not the one it explains
            return dict(handle, refused=int(label)), str(exc)
        return {"id": result["id"], "provenance": result["provenance"]}, ""

    @app.callback(
        Output("heatmap-graph", "figure"),
        Output("result-summary", "children"),
        Output({"type": "export", "format": ALL}, "disabled"),
        Output("dicom-identity", "style"),
        Input("result-store", "data"),
        Input("overlay-store", "data"),
        *SCREEN_INPUTS,
        State("label", "value"),
        State("session", "data"),
        State({"type": "export", "format": ALL}, "id"),
    )
    def show_result(handle, overlay, *screen_and_states):
        """The result panel: the kept result, its line and its downloads, only while
        what is on screen is what it explains (webapp.lifecycle.result_view)."""
        *screen, label, session, buttons = screen_and_states
        none = [True] * len(buttons), {"display": "none"}
        try:
            result = services.results.get(session) if handle else None
        except InputError as exc:  # team mode: Redis is away
            return _empty_figure(str(exc)), "", *none
        if result is None or result["id"] != handle.get("id"):
            if handle and services.results.dropped(session):
                return _empty_figure(DROPPED_RESULT), "", *none
            return _empty_figure(NO_RESULT), "", *none
        view = result_view(
            Provenance.from_dict(result["provenance"]), _screen_provenance(*screen, label)
        )
        if not view.show:
            return _empty_figure(view.reason), html.P(view.reason, className="warning"), *none
        try:
            figure = _result_figure(result, overlay)
        except InputError as exc:
            return _empty_figure(str(exc)), "", *none
        is_dicom = bool(result.get("dicom"))
        disabled = [button["format"] == "dcm" and not is_dicom for button in buttons]
        return figure, _summary(result), disabled, {"display": "block" if is_dicom else "none"}

    def _screen_provenance(
        image_data, model_name, region, patch, stride, mode, colour, custom, label
    ) -> Provenance | None:
        """What the page shows now, as a run's provenance (None: nothing runnable)."""
        try:
            return Provenance.make(
                image=(image_data or {})["key"],
                model=model_name,
                weights=services.weights_checksum(model_name),
                region=region,
                patch=patch,
                stride=stride,
                mode=mode,
                colour=helpers.parse_colour(colour, custom),
                label=label,
            )
        except (InputError, KeyError, TypeError, ValueError):
            return None

    # A new image or model: the live picture of the run it stops goes at once, in the
    # browser, before any answer from the server.
    app.clientside_callback(
        """function(image, model) {
            return [{"display": "none"}, {"display": "block"}];
        }""",
        Output("live-panel", "style", allow_duplicate=True),
        Output("result-panel-body", "style", allow_duplicate=True),
        Input("image-store", "data"),
        Input("model", "value"),
        prevent_initial_call=True,
    )

    @app.callback(
        Output("message", "children", allow_duplicate=True),
        Input("region-store", "data"),
        Input("patch", "value"),
        Input("stride", "value"),
        prevent_initial_call=True,
    )
    def clear_stale_message(*_):
        """A message about the last settings goes when the settings change."""
        return ""

    @app.callback(
        Output("message", "children", allow_duplicate=True),
        Input("cancel", "n_clicks"),
        State("result-store", "data"),
        prevent_initial_call=True,
    )
    def cancelled(n_clicks, handle):
        if not n_clicks:
            return no_update
        return "Run cancelled; the previous heatmap is kept." if handle else "Run cancelled."

    @app.callback(
        Output("download", "data"),
        Output("message", "children", allow_duplicate=True),
        Input({"type": "export", "format": ALL}, "n_clicks"),
        State("session", "data"),
        State("result-store", "data"),
        State("overlay-store", "data"),
        State("dicom-identity", "value"),
        *[State(i.component_id, i.component_property) for i in SCREEN_INPUTS],
        State("label", "value"),
        prevent_initial_call=True,
    )
    def export(clicks, session, handle, overlay, identity, *screen):
        if not any(clicks or []) or not isinstance(handle, dict):
            raise PreventUpdate
        result = services.results.get(session)
        if result is None and services.results.dropped(session):
            return no_update, DROPPED_RESULT
        if result is None or result["id"] != handle.get("id"):
            raise PreventUpdate  # not this tab's current result
        view = result_view(Provenance.from_dict(result["provenance"]), _screen_provenance(*screen))
        if not view.show:
            return no_update, view.reason
        fmt = ctx.triggered_id["format"]
        stem = helpers.export_stem(result)
        try:
            style = helpers.overlay_style(overlay)
            if fmt == "png":
                original = services.images.get(result["image_key"])
                sent = dcc.send_bytes(helpers.export_png(original, result, style), f"{stem}.png")
            elif fmt == "dcm":
                source = services.images.source(
                    (result.get("dicom") or {}).get("source", ""), str(session or "")
                )
                data = helpers.export_dicom(source, result, style, "identity" in (identity or []))
                sent = dcc.send_bytes(data, f"{stem}.dcm")
            elif fmt == "npy":
                sent = dcc.send_bytes(helpers.export_npy(result), f"{stem}.npy")
            elif fmt == "npz":
                sent = dcc.send_bytes(helpers.export_all_classes(result), f"{stem}-all.npz")
            elif fmt == "csv":
                sent = dcc.send_string(helpers.export_csv(result), f"{stem}.csv")
            else:
                sent = dcc.send_string(runs.export_summary(result), f"{stem}.json")
        except InputError as exc:
            return no_update, str(exc)
        return sent, ""


def _model_card(loaded: krypton.LoadedModel) -> html.Div:
    first, *rest = helpers.model_card_lines(loaded)
    return html.Div([html.P(first)] + [html.P(line, className="help") for line in rest])


def _summary(result: dict) -> html.Div:
    """The result line (wording decided by runs.summary_lines)."""
    first, *rest = runs.summary_lines(result)
    children = [html.Strong(first)]
    for line in rest:
        is_reuse = line.startswith("Reused")
        children.append(html.Div(line, id="reuse-info") if is_reuse else html.Div(line))
    if not result["reused"]:
        children.append(html.Div("", id="reuse-info", style={"display": "none"}))
    return html.Div(children)
