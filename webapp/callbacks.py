"""Callbacks of the Krypton app. Tensor work stays in the engine; this wires the page."""
from __future__ import annotations

import base64
import binascii
import logging
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import torch
from dash import ALL, Input, Output, State, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

import krypton
from krypton.capture_lock import CAPTURE_LOCK
from krypton.estimator import NotCalibratedError, estimate_seconds
from krypton.explainer import grid_positions
from krypton.registry import (CheckpointError, RegistryError, available_models,
                              default_model_name, load_model, register_model, remove_model)
from krypton.tuning import TauTuning

from . import helpers
from .helpers import InputError
from .jobs import JobCancelled, JobQueue, QueueFull, check_cancelled
from .layout import SAMPLES_DIR
from .settings import ServerSettings

LIVE_UPDATE_SECONDS = 0.4
logger = logging.getLogger("krypton.app")


def model_options() -> list[dict]:
    options = []
    for info in available_models():
        label = info.name if info.available else f"{info.name} (unavailable)"
        options.append({"label": label, "value": info.name, "disabled": not info.available,
                        "title": info.description if info.available else
                        f"{info.reason}; fix: {info.fix}"})
    return options


class Services:
    """Loaded models, their explainers (graphs and views), stored images, the sessions'
    last results and the job queue, per server."""

    def __init__(self, cache_dir: Path, settings: ServerSettings | None = None):
        self.settings = settings or ServerSettings()
        self.images = helpers.ImageStore(Path(cache_dir) / "images",
                                         int(self.settings.image_store_mb * 2**20),
                                         self.settings.image_store_count)
        self.results = helpers.ResultStore(self.settings.results_kept)
        self.jobs = JobQueue(self.settings.max_running_jobs, self.settings.max_queued_jobs,
                             self.settings.max_jobs_per_session)
        self._models: dict[str, krypton.LoadedModel] = {}
        self._explainers: dict[str, krypton.OcclusionExplainer] = {}
        self._lock = threading.Lock()

    def forget(self, name: str) -> None:
        """Drop a removed model from memory."""
        with self._lock:
            self._models.pop(name, None)
            self._explainers.pop(name, None)

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


def _estimate(name, patch, stride, mode, region, drill, speedup) -> float | None:
    try:
        return estimate_seconds(name, patch=patch, stride=stride, mode=mode, region=region,
                                r_drill_down=drill, target_speedup=speedup)
    except (NotCalibratedError, ValueError, RegistryError):
        return None


def _format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    return f"{seconds:.1f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _empty_figure(text: str = "") -> go.Figure:
    figure = go.Figure()
    figure.update_layout(xaxis={"visible": False}, yaxis={"visible": False}, height=420,
                         margin={"l": 0, "r": 0, "t": 0, "b": 0},
                         annotations=[{"text": text, "showarrow": False,
                                       "font": {"size": 14, "color": "#777"}}] if text else [])
    return figure


def register_callbacks(app, manager, services: Services) -> None:
    """Attach every callback to ``app``; jobs run on ``manager``."""

    @app.callback(Output("image-store", "data"), Output("region-store", "data"),
                  Output("message", "children"),
                  Input("upload", "contents"), Input({"type": "sample", "name": ALL}, "n_clicks"),
                  State("upload", "filename"), prevent_initial_call=True)
    def load_image(contents, sample_clicks, filename):
        trigger = ctx.triggered_id
        try:
            if trigger == "upload":
                image = helpers.decode_upload(contents, filename,
                                              services.settings.max_image_bytes)
                name = filename
            elif isinstance(trigger, dict) and any(sample_clicks):
                name = trigger["name"]
                image = krypton.imaging.load_image(SAMPLES_DIR / name)
            else:
                raise PreventUpdate
        except InputError as exc:
            return no_update, no_update, str(exc)
        key = services.images.put(image)
        return {"key": key, "name": name, "size": list(image.size)}, None, ""

    @app.callback(Output("region-store", "data", allow_duplicate=True),
                  Input("image-graph", "selectedData"), Input("reset-region", "n_clicks"),
                  State("model", "value"), prevent_initial_call=True)
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

    @app.callback(Output("image-graph", "figure"), Output("region-text", "children"),
                  Input("image-store", "data"), Input("region-store", "data"),
                  Input("model", "value"))
    def draw_image(image_data, region, model_name):
        if not image_data:
            return _empty_figure("Load an image: upload one or pick a sample"), ""
        try:
            loaded = services.model(model_name)
            image = helpers.model_view(services.images.get(image_data["key"]),
                                       loaded.input_size)
        except InputError as exc:
            return _empty_figure(str(exc)), ""
        height, width = loaded.input_size
        if region:
            x0, y0, x1, y1 = region
            text = f"Region x {x0}–{x1}, y {y0}–{y1} ({x1 - x0}×{y1 - y0} px)"
        else:
            text = f"Whole image ({width}×{height} px, the model's input size)"
        return helpers.image_figure(image, region), text

    @app.callback(Output("prediction-store", "data"), Output("label", "options"),
                  Output("label", "value"), Output("top5", "children"),
                  Output("model-card", "children"), Output("message", "children",
                                                           allow_duplicate=True),
                  Input("image-store", "data"), Input("model", "value"),
                  prevent_initial_call="initial_duplicate")
    def predict(image_data, model_name):
        try:
            loaded = services.model(model_name)
        except InputError as exc:
            return None, [], None, "", "", str(exc)
        card = _model_card(loaded)
        if not image_data:
            return None, [], None, "", card, no_update
        try:
            image = services.images.get(image_data["key"])
        except InputError as exc:
            return None, [], None, "", card, str(exc)
        # materialises the views now, so the Run job only computes patches
        logits, capture_error = services.logits(model_name, loaded.preprocess(image))
        probs = torch.softmax(logits[0].float(), 0)
        top = torch.topk(probs, min(5, probs.numel()))
        top5 = [(int(i), float(p)) for p, i in zip(top.values, top.indices)]
        options = [{"label": f"{loaded.class_name(i)} ({p:.1%})", "value": i} for i, p in top5]
        others = [{"label": loaded.class_name(i), "value": i}
                  for i in range(len(loaded.classes)) if i not in dict(top5)]
        table = html.Table([html.Tr([html.Td(loaded.class_name(i)), html.Td(f"{p:.1%}")])
                            for i, p in top5], className="top5-table")
        message = "" if capture_error is None else \
            f"Only naive mode works for this model: {capture_error}"
        return ({"top5": top5, "model": model_name, "image": image_data["key"]},
                options + others, top5[0][0], table, card, message)

    @app.callback(Output("approximate-settings", "style"), Input("mode", "value"))
    def toggle_approximate(mode):
        return {"display": "block"} if mode == "approximate" else {"display": "none"}

    @app.callback(Output("custom-colour", "style"), Input("colour", "value"))
    def toggle_custom_colour(colour):
        return {"display": "inline-block"} if colour == "custom" else {"display": "none"}

    @app.callback(Output("estimate", "children"),
                  Input("model", "value"), Input("patch", "value"), Input("stride", "value"),
                  Input("mode", "value"), Input("region-store", "data"),
                  Input("drill-down", "value"), Input("target-speedup", "value"))
    def estimate(model_name, patch, stride, mode, region, drill, speedup):
        try:
            size = services.model(model_name).input_size
            helpers.check_region(region, size, patch, stride)
            ys, xs = grid_positions(size, patch, stride, region)
        except (InputError, ValueError) as exc:
            return html.Span(str(exc), className="warning")
        seconds = _estimate(model_name, patch, stride, mode, region, drill, speedup)
        naive = _estimate(model_name, patch, stride, "naive", region, drill, speedup)
        positions = len(ys) * len(xs)
        if seconds is None:
            return (f"{positions} positions; no runtime estimate for this model and patch "
                    f"size yet (python -m krypton calibrate --model {model_name})")
        text = f"Estimated {_format_seconds(seconds)} for {positions} positions"
        if naive and mode != "naive":
            text += f" (naive ≈ {_format_seconds(naive)})"
        return text

    @app.callback(
        Output("heatmap-graph", "figure"), Output("result-store", "data"),
        Output("result-summary", "children"), Output("message", "children",
                                                     allow_duplicate=True),
        Input("run", "n_clicks"),
        State("session", "data"), State("image-store", "data"), State("model", "value"),
        State("patch", "value"), State("stride", "value"), State("mode", "value"),
        State("colour", "value"), State("custom-colour", "value"), State("label", "value"),
        State("region-store", "data"), State("target-ssim", "value"),
        State("drill-down", "value"), State("target-speedup", "value"),
        background=True, manager=manager, prevent_initial_call=True,
        running=[(Output("run", "disabled"), True, False),
                 (Output("cancel", "disabled"), False, True),
                 (Output("result-panel-body", "style"), {"display": "none"},
                  {"display": "block"}),
                 (Output("live-panel", "style"), {"display": "block"}, {"display": "none"})],
        cancel=[Input("cancel", "n_clicks")],
        progress=[Output("progress", "value"), Output("progress", "max"),
                  Output("live-graph", "figure"), Output("live-status", "children")],
        progress_default=["0", "1", _empty_figure(), ""],
    )
    def run(set_progress, n_clicks, session, image_data, model_name, patch, stride, mode,
            colour, custom, label, region, target_ssim, drill, speedup):
        # ``session`` keys this tab's queue place and its last result on the server; as a
        # callback argument it is also part of the background job's cache key, so two tabs
        # with identical settings never share a job's progress or result.
        if not n_clicks:
            raise PreventUpdate

        def waiting(ahead: int) -> None:
            check_cancelled()
            text = f"Queued: {ahead} run{'s' if ahead > 1 else ''} ahead of yours"
            set_progress(("0", "1", _empty_figure(text), text))

        try:
            with services.jobs.slot(str(session or ""), waiting):
                return _run(set_progress, str(session or ""), image_data, model_name, patch,
                            stride, mode, colour, custom, label, region, target_ssim, drill,
                            speedup)
        except QueueFull as exc:
            return no_update, no_update, no_update, str(exc)
        except JobCancelled:
            raise PreventUpdate
        except (InputError, ValueError) as exc:
            return no_update, no_update, no_update, str(exc)
        except Exception as exc:  # keep serving; say what happened instead of hanging
            logger.exception("run failed")
            return no_update, no_update, no_update, \
                f"The run failed unexpectedly ({type(exc).__name__}: {exc}); see the server log."

    def _run(set_progress, session, image_data, model_name, patch, stride, mode, colour,
             custom, label, region, target_ssim, drill, speedup):
        if not image_data:
            raise InputError("load an image first")
        loaded = services.model(model_name)
        size = loaded.input_size
        helpers.check_region(region, size, patch, stride)
        rgb = helpers.parse_colour(colour, custom)
        fill = helpers.normalised_fill(rgb, loaded.mean, loaded.std)
        original = services.images.get(image_data["key"])
        shown = helpers.model_view(original, size)
        tensor = loaded.preprocess(original)
        explainer = services.explainer(model_name)
        logits, _ = services.logits(model_name, tensor)
        if label is None:
            label = int(logits[0].argmax())
        prob = [float(torch.softmax(logits[0].float(), 0)[label])]
        key = helpers.settings_key(image_data["key"], model_name, patch, stride, rgb, label)
        grid_ys, grid_xs = grid_positions(size, patch, stride, region)
        estimate = _estimate(model_name, patch, stride, mode, region, drill, speedup)
        naive_estimate = _estimate(model_name, patch, stride, "naive", region, drill, speedup)
        started = time.perf_counter()
        last_update = [0.0]
        title = f"{loaded.class_name(label)}"

        def report(done, total, values=None):
            check_cancelled()
            now = time.perf_counter()
            if values is None and now - last_update[0] < LIVE_UPDATE_SECONDS:
                return
            last_update[0] = now
            figure = no_update
            if values is not None:
                figure = helpers.heatmap_figure(shown, helpers.fill_for_display(values),
                                                grid_xs, grid_ys, patch, prob[0], title)
            set_progress((str(done), str(max(total, 1)), figure,
                          f"{done} of {total} positions"))

        reused = 0
        extra = {}
        if mode in ("naive", "exact"):
            values, reused, evaluated = _run_grid(
                explainer, tensor, grid_ys, grid_xs, patch, mode, fill, label,
                helpers.known_cells(services.results.get(session), key), report)
        else:
            tuning = TauTuning.from_entry(loaded.extra.get("entry"))
            heatmap = explainer.explain(
                tensor, patch=patch, stride=stride, mode="approximate", fill=fill,
                label=label, region=region, progress=lambda d, t: report(d, t),
                tuning=tuning, target_ssim=target_ssim if tuning else None,
                tau=None if tuning else 1.0, r_drill_down=drill, target_speedup=speedup)
            values, prob[0], evaluated = heatmap.values, heatmap.prob, \
                heatmap.positions_evaluated
            extra = dict(heatmap.extra)
        seconds = time.perf_counter() - started
        cells = [[int(x), int(y), float(values[r, c])]
                 for r, y in enumerate(grid_ys) for c, x in enumerate(grid_xs)
                 if not np.isnan(values[r, c])]
        result = {"id": uuid.uuid4().hex, "key": key, "mode": mode, "model": model_name, "image": image_data["name"],
                  "label": label, "label_name": loaded.class_name(label), "prob": prob[0],
                  "patch": patch, "stride": stride, "region": region, "fill_rgb": rgb,
                  "xs": [int(x) for x in grid_xs], "ys": [int(y) for y in grid_ys],
                  "values": np.where(np.isnan(values), None, values).tolist(),
                  "cells": cells, "seconds": seconds, "estimate_seconds": estimate,
                  "naive_estimate_seconds": naive_estimate, "evaluated": evaluated,
                  "reused": reused, "approximate": extra, "image_key": image_data["key"]}
        figure = helpers.heatmap_figure(shown, values, grid_xs, grid_ys, patch, prob[0], title)
        services.results.put(session, result)
        # The browser holds only a handle; exports and refinement read the server's copy.
        return figure, {"id": result["id"]}, _summary(result), ""

    def _run_grid(explainer, tensor, grid_ys, grid_xs, patch, mode, fill, label, known,
                  report):
        """Exact/naive over the grid, reusing known cells, coarse-to-fine in chunks so the
        picture appears early and sharpens."""
        ys = np.repeat(grid_ys, len(grid_xs))
        xs = np.tile(grid_xs, len(grid_ys))
        values = np.full((len(grid_ys), len(grid_xs)), np.nan, dtype=np.float32)
        row_of = {int(y): r for r, y in enumerate(grid_ys)}
        col_of = {int(x): c for c, x in enumerate(grid_xs)}
        reused = 0
        todo = []
        for index, (y, x) in enumerate(zip(ys, xs)):
            probability = known.get((int(x), int(y)))
            if probability is None:
                todo.append(index)
            else:
                values[row_of[int(y)], col_of[int(x)]] = probability
                reused += 1
        todo = np.array(todo, dtype=int)
        todo = todo[helpers.order_coarse_to_fine(ys[todo], xs[todo])] if len(todo) else todo
        total = len(ys)
        done = reused
        chunk = 16
        begin = 0
        while begin < len(todo):
            part = todo[begin:begin + chunk]
            offset = done
            heatmap = explainer.explain(
                tensor, patch=patch, mode=mode, fill=fill, label=label,
                positions=list(zip(xs[part].tolist(), ys[part].tolist())),
                progress=lambda d, t, offset=offset: report(offset + d, total))
            for x, y, p in heatmap.position_values():
                values[row_of[y], col_of[x]] = p
            done += len(part)
            begin += len(part)
            chunk = min(chunk * 2, 256)
            report(done, total, values)
        return values, reused, len(todo)

    @app.callback(Output("message", "children", allow_duplicate=True),
                  Input("cancel", "n_clicks"), prevent_initial_call=True)
    def cancelled(n_clicks):
        return "Run cancelled; the previous heatmap is kept." if n_clicks else no_update

    @app.callback(Output("download", "data"),
                  Input({"type": "export", "format": ALL}, "n_clicks"),
                  State("session", "data"), State("result-store", "data"),
                  prevent_initial_call=True)
    def export(clicks, session, handle):
        if not any(clicks or []) or not isinstance(handle, dict):
            raise PreventUpdate
        result = services.results.get(session)
        if result is None or result["id"] != handle.get("id"):
            raise PreventUpdate  # not this tab's current result (or expired)
        fmt = ctx.triggered_id["format"]
        loaded = services.model(result["model"])
        image = helpers.model_view(services.images.get(result["image_key"]), loaded.input_size)
        files = helpers.export_files(image, result)
        stem = f"krypton-{result['model']}-{Path(str(result['image'])).stem}"
        if fmt == "png":
            return dcc.send_bytes(files.png, f"{stem}.png")
        if fmt == "npy":
            return dcc.send_bytes(files.npy, f"{stem}.npy")
        if fmt == "csv":
            return dcc.send_string(files.csv, f"{stem}.csv")
        return dcc.send_string(files.json, f"{stem}.json")

    @app.callback(Output("model-upload-name", "children"), Input("model-upload", "filename"))
    def show_model_file(filename):
        return f"selected: {filename}" if filename else ""

    @app.callback(Output("model", "options"), Output("model", "value"),
                  Output("model-register-message", "children"),
                  Input("model-register", "n_clicks"),
                  State("model-upload", "contents"), State("model-upload", "filename"),
                  State("model-name", "value"), State("model-architecture", "value"),
                  State("model-classes", "value"), State("model-size", "value"),
                  prevent_initial_call=True)
    def register(n_clicks, contents, filename, name, architecture, classes, size):
        settings = services.settings
        try:
            if not contents:
                raise InputError("choose a weights file first")
            if architecture == "torchscript" and not settings.trusted_uploads:
                raise InputError("TorchScript uploads are turned off on this server: a "
                                 "TorchScript file runs its author's code. Upload a "
                                 "state_dict instead (the operator can allow TorchScript "
                                 "with KRYPTON_TRUSTED_UPLOADS=1, for trusted uploaders "
                                 "only).")
            if not name:
                raise InputError("give the model a name")
            if not architecture:
                raise InputError("choose the architecture (or TorchScript)")
            names = [c.strip() for c in (classes or "").replace(",", "\n").splitlines()
                     if c.strip()]
            if len(names) < 2:
                raise InputError("give at least two class names")
            try:
                data = base64.b64decode(contents.split(",", 1)[1])
            except (IndexError, binascii.Error, ValueError):
                raise InputError("the weights file could not be read") from None
            if len(data) > settings.max_model_bytes:
                raise InputError(f"the weights file is {len(data) / 2**20:.0f} MB; this "
                                 f"server takes up to {settings.max_model_mb:g} MB")
            try:
                side = int(size or 224)
            except (TypeError, ValueError):
                raise InputError("the input size must be a whole number of pixels") from None
            with tempfile.TemporaryDirectory() as folder:
                # A name the server chooses: the client's file name is never part of a path.
                path = Path(folder) / "upload.weights"
                path.write_bytes(data)
                register_model(name, path, names,
                               architecture=None if architecture == "torchscript"
                               else architecture,
                               format="torchscript" if architecture == "torchscript"
                               else "state_dict", input_size=(side, side))
        except (InputError, RegistryError, CheckpointError) as exc:
            return no_update, no_update, html.Span(str(exc), className="warning")
        return model_options(), name, f"registered '{name}' with {len(names)} classes"

    @app.callback(Output("model", "options", allow_duplicate=True),
                  Output("model", "value", allow_duplicate=True),
                  Output("model-register-message", "children", allow_duplicate=True),
                  Input("model-remove", "n_clicks"), State("model", "value"),
                  prevent_initial_call=True)
    def remove(n_clicks, name):
        if not n_clicks or not name:
            raise PreventUpdate
        try:
            remove_model(name)
        except RegistryError as exc:
            return no_update, no_update, html.Span(str(exc), className="warning")
        services.forget(name)
        return model_options(), default_model_name(), f"removed '{name}'"


def _model_card(loaded: krypton.LoadedModel) -> html.Div:
    entry = loaded.extra.get("entry", {})
    lines = [html.P(loaded.description or loaded.name),
             html.P(f"{len(loaded.classes)} classes · input {loaded.input_size[0]}×"
                    f"{loaded.input_size[1]}", className="help")]
    training = entry.get("training")
    if training and "held_out_accuracy" in training:
        lines.append(html.P(f"Held-out accuracy {training['held_out_accuracy']:.1%}, "
                            f"pointing game {training['pointing_game']:.0%}", className="help"))
    tuning = TauTuning.from_entry(entry)
    lines.append(html.P(f"Approximate mode: τ = {tuning.tau_for(0.9):.2f} for SSIM 0.9"
                        if tuning else "Approximate mode: τ not tuned (uses τ = 1)",
                        className="help"))
    return html.Div(lines)


def _summary(result: dict) -> html.Div:
    lines = [html.Strong(f"{result['label_name']}: p = {result['prob']:.3f}"),
             html.Span(f" · {result['mode']} · {result['evaluated']} positions computed in "
                       f"{_format_seconds(result['seconds'])}")]
    if result["estimate_seconds"] is not None:
        lines.append(html.Span(f" (estimated {_format_seconds(result['estimate_seconds'])})"))
    if result["naive_estimate_seconds"] and result["seconds"] > 0:
        lines.append(html.Span(f" · {result['naive_estimate_seconds'] / result['seconds']:.1f}× "
                               f"faster than the naive estimate"))
    if result["reused"]:
        lines.append(html.Div(f"Reused {result['reused']} cells from the previous run",
                              id="reuse-info"))
    return html.Div(lines)
