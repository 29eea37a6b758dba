"""The image kind's settings and estimate: the model's card and prediction (top 5, the
class to explain), the patch, stride, mode and colour controls, the overlay controls and
the runtime estimate (the volume kind's: webapp.panels.volume.estimate)."""

from __future__ import annotations

import dataclasses

from dash import ClientsideFunction, Input, Output, State, ctx, html, no_update
from dash.exceptions import PreventUpdate

import krypton
from krypton.io.images import plain_reason

from ... import comparison, ids, runs, wording
from ...helpers import InputError
from ...layout import patch_options
from ...model_card import model_card_lines, ood_text
from ...panel_scope import IMAGE_PANEL, mode_options
from ...path_budget import chosen_budget
from ...run_strip import register_estimate
from ...services import Services
from .result import parse_colour


class ImageEstimate:
    """The image panel's settings callbacks (a part of :class:`webapp.panels.image.ImagePanel`);
    ``services`` holds models and stored images."""

    services: Services

    def register_settings_callbacks(self, app) -> None:
        """Attach the settings' and the estimate's callbacks to ``app``."""
        app.callback(
            Output(ids.PREDICTION_STORE, "data"),
            Output(IMAGE_PANEL.label, "options"),
            Output(IMAGE_PANEL.label, "value"),
            Output(ids.TOP5, "children"),
            Output(ids.MODEL_CARD, "children"),
            Output(IMAGE_PANEL.strip.message, "children", allow_duplicate=True),
            Output(IMAGE_PANEL.mode, "options"),
            Output(IMAGE_PANEL.mode, "value"),
            Input(IMAGE_PANEL.store, "data"),
            Input(IMAGE_PANEL.model, "value"),
            State(IMAGE_PANEL.mode, "value"),
            State(IMAGE_PANEL.strip.busy, "data"),
            prevent_initial_call="initial_duplicate",
        )(self.predict)
        # The prediction, the class list and Run belong to one image and model: shown (and
        # Run enabled, no run of this tab under way) only while the prediction on the page
        # is the one for what is on screen, and the estimate only once the image it counts
        # is the one on screen. The click hid them all (panels.image.intake, assets/binding.js);
        # this rule shows them again once the picture, the image it would explain, the
        # prediction and the request last answered all agree.
        app.clientside_callback(
            ClientsideFunction("krypton_binding", "showImage"),
            Output(ids.TOP5, "style"),
            Output(IMAGE_PANEL.label, "style"),
            Output(IMAGE_PANEL.strip.estimate, "style"),
            Output(IMAGE_PANEL.strip.run, "disabled"),
            Input(ids.PREDICTION_STORE, "data"),
            Input(IMAGE_PANEL.store, "data"),
            Input(IMAGE_PANEL.model, "value"),
            Input(IMAGE_PANEL.strip.busy, "data"),
            Input(ids.IMAGE_SHOWN, "data"),
            Input(IMAGE_PANEL.wanted, "data"),
            Input(IMAGE_PANEL.answered, "data"),
            Input(IMAGE_PANEL.strip.estimate, "children"),
        )
        app.callback(
            Output(IMAGE_PANEL.patch, "options"),
            Output(IMAGE_PANEL.patch, "value"),
            Input(IMAGE_PANEL.model, "value"),
        )(self.model_patch)
        app.callback(Output(ids.APPROXIMATE_SETTINGS, "style"), Input(IMAGE_PANEL.mode, "value"))(
            toggle_approximate
        )
        app.callback(Output(ids.CUSTOM_COLOUR, "style"), Input(ids.COLOUR, "value"))(
            toggle_custom_colour
        )
        app.callback(
            Output(ids.OVERLAY_STORE, "data"),
            Input(ids.OVERLAY_SHOW, "value"),
            Input(ids.OVERLAY_VIEW, "value"),
            Input(ids.OVERLAY_SCALE, "value"),
            Input(ids.OVERLAY_OPACITY, "value"),
            Input(ids.OVERLAY_THRESHOLD, "value"),
        )(overlay_settings)
        register_estimate(
            app, IMAGE_PANEL, self.estimate_shown,
            Input(ids.DRILL_DOWN, "value"),
            Input(ids.TARGET_SPEEDUP, "value"),
            Input(IMAGE_PANEL.result, "data"),  # refreshed after each run: it learns
            Input(IMAGE_PANEL.store, "data"),  # its cells computed already cost nothing
            Input(ids.COLOUR, "value"),
            Input(ids.CUSTOM_COLOUR, "value"),
            Input(IMAGE_PANEL.compare, "value"),
            Input(IMAGE_PANEL.compare_steps, "value"),
        )  # fmt: skip
        app.callback(
            Output(IMAGE_PANEL.strip.message, "children", allow_duplicate=True),
            Input(IMAGE_PANEL.region, "data"),
            Input(IMAGE_PANEL.patch, "value"),
            Input(IMAGE_PANEL.stride, "value"),
            prevent_initial_call=True,
        )(clear_stale_message)

    def predict(self, image_data, model_name, mode, running):
        """The model's card and its prediction for the image: the top 5, the class list
        (the first class chosen), the OOD warning and which modes the model allows. It
        also materialises the views a Run will reuse."""
        try:
            loaded = self.services.model(model_name)
        except InputError as exc:
            return None, [], None, "", "", str(exc), no_update, no_update
        card = model_card(loaded)
        if not image_data:
            return None, [], None, "", card, no_update, no_update, no_update
        card = with_model_choice(card, image_data, model_name)
        try:
            image = self.services.images.get(image_data["key"])
        except InputError as exc:
            return None, [], None, "", card, str(exc), no_update, no_update
        tensor = loaded.preprocess(image)
        top5, capture_error = self.services.top_classes(model_name, tensor)
        ood = loaded.check_ood(tensor)
        warning = ood_text(None if ood is None else ood.as_dict())
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
            said, detail = wording.plain_and_detail(warning)
            table = html.Div(
                [
                    html.P(said, id=ids.OOD_WARNING, className="warning"),
                    html.Details([html.Summary("details"), html.Small(detail, className="help")]),
                    table,
                ]
            )
        message = (
            ""
            if capture_error is None
            else f"Only naive mode works for this model: {plain_reason(capture_error)}"
        )
        stopped = (
            "The run in progress explained the previous image or model, so it was stopped."
            if running and ctx.triggered_id in (IMAGE_PANEL.store, IMAGE_PANEL.model)
            else ""
        )
        plain = wording.plain_and_detail(warning)[0] if warning else ""
        message = " ".join(part for part in (stopped, plain, message) if part)
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

    def model_patch(self, model_name):
        """Each model opens with its own default patch (its registry entry's)."""
        try:
            patch = self.services.model(model_name).patch
        except InputError:
            raise PreventUpdate from None
        return patch_options(patch), patch

    def estimate(
        self, model_name, patch, stride, mode, region, drill, speedup, _result, image, colour,
        custom, compare=None, steps=None,
    ):  # fmt: skip
        """How long a Run with these settings should take, and where that comes from:
        fixed cost + the positions not computed yet x their cost, and what naive would
        take for the same positions, scaled alike; with Compare ticked, that its
        gradient step comes on top. The host's load is sampled once for all of it."""
        return self.estimate_shown(
            model_name, patch, stride, mode, region, drill, speedup, _result, image, colour,
            custom, compare, steps,
        )[0]  # fmt: skip

    def estimate_shown(
        self, model_name, patch, stride, mode, region, drill, speedup, _result, image, colour,
        custom, compare=None, steps=None,
    ):  # fmt: skip
        """(:meth:`estimate`'s line, the estimate as the run strip keeps it for Run:
        webapp.runs.shown_estimate, or None)."""
        load = runs.host_load()
        text, shown = self._estimate(
            model_name, patch, stride, mode, region, drill, speedup, image, colour, custom, load
        )
        if not compare or not isinstance(text, str):
            return text, shown
        loaded = self.services.model(model_name)
        left, request = None, None
        if image:  # the run's request again, without planning it a second time
            try:
                request = _base_request(model_name, patch, stride, mode, region, image)
                request = _with_settings(request, colour, custom, drill, speedup)
                request = dataclasses.replace(request, compare_steps=chosen_budget(steps))
                left = runs.compare_left(self.services, request)
            except (InputError, TypeError, ValueError):
                left, request = None, None  # the line above says what is wrong
        budget = request.compare_steps if request is not None else None
        return f"{text} {comparison.estimate_note(loaded, load, left, budget)}", shown

    def _estimate(
        self, model_name, patch, stride, mode, region, drill, speedup, image, colour, custom, load
    ):
        try:
            size = self.services.model(model_name).input_size
            runs.check_grid(size, patch, stride, region)
        except (InputError, ValueError) as exc:
            return html.Span(str(exc), className="warning"), None
        request, planned = self._planned(
            model_name, patch, stride, mode, region, image, colour, custom, drill, speedup
        )
        if planned.positions and not planned.to_compute:
            found = runs.cached_estimate(model_name, load) if mode in ("exact", "naive") else None
            return (
                f"Nothing to compute: all {planned.positions} positions are known from an "
                f"earlier run, so Run shows them at once"
                + (f" (about {runs.estimate_text(dataclasses.asdict(found))})." if found else ".")
            ), runs.shown_estimate(request, planned, found)
        left = (
            f"{planned.to_compute} of {planned.positions}"
            if planned.known
            else f"{planned.positions}"
        )
        found = runs.find_estimate(
            model_name, patch, stride, mode, planned.region, drill, speedup, planned.known, load
        )
        shown = runs.shown_estimate(request, planned, found)
        if found is None:
            return (
                f"{left} positions; no time estimate for this model and patch size yet "
                f"(it learns from your first runs)"
            ), shown
        text = f"About {runs.estimate_text(dataclasses.asdict(found))} for {left} positions"
        if mode != "naive":
            _, naive = self._planned(
                model_name, patch, stride, "naive", region, image, colour, custom, drill, speedup
            )
            found_naive = runs.find_estimate(
                model_name, patch, stride, "naive", naive.region, drill, speedup, naive.known,
                load,
            )  # fmt: skip
            if found_naive is not None and naive.to_compute:
                text += f" (naive: about {runs.format_seconds(found_naive.seconds)})"
        return text + ".", shown

    def _planned(
        self, model_name, patch, stride, mode, region, image, colour, custom, drill, speedup
    ):
        """(the request these settings make, the run it plans: webapp.runs.plan_run,
        its grid as the run will snap it and the positions known already; none where the
        image is unknown)."""
        request = _base_request(model_name, patch, stride, mode, region, image)
        try:
            request = _with_settings(request, colour, custom, drill, speedup)
            return request, runs.plan_run(self.services, request)
        except (InputError, KeyError, TypeError, ValueError):
            size = self.services.model(model_name).input_size
            count = runs.grid_count(size, patch, stride, region)
            return request, runs.PlannedRun(tuple(region) if region else None, count, 0)


def _base_request(model_name, patch, stride, mode, region, image) -> runs.RunRequest:
    """The request the estimate line plans for these settings, before its colour."""
    return runs.RunRequest(
        key=image["key"] if image else "", name="", model=model_name, patch=int(patch),
        stride=int(stride), mode=mode, region=tuple(region) if region else None,
    )  # fmt: skip


def _with_settings(request: runs.RunRequest, colour, custom, drill, speedup) -> runs.RunRequest:
    """``request`` with the occluder's colour and the approximate settings of the page."""
    return dataclasses.replace(
        request, r_drill_down=float(drill), target_speedup=float(speedup),
        fill_rgb=parse_colour(colour, custom),
    )  # fmt: skip


def toggle_approximate(mode):
    """The approximate settings only in approximate mode."""
    return {"display": "block"} if mode == "approximate" else {"display": "none"}


def toggle_custom_colour(colour):
    """The colour field only for a custom patch colour."""
    return {"display": "inline-block"} if colour == "custom" else {"display": "none"}


def overlay_settings(show, view, scale, opacity, threshold):
    """The overlay controls as one record (the result panel redraws from it)."""
    return {
        "show": "show" in (show or []),
        "view": view,
        "scale": scale,
        "opacity": opacity,
        "threshold": threshold or 0.0,
    }


def with_model_choice(card: html.Div, image_data: dict, model_name: str) -> html.Div:
    """The model card, led by why the model changed where the page chose it for this
    picture sample (panels.image.intake's model_for; a DICOM file's choice is said in the DICOM
    panel, beside its modality)."""
    chosen = image_data.get("chosen_model") or {}
    if chosen.get("model") != model_name or image_data.get("dicom"):
        return card
    said = f"The model changed to {model_name} for this picture"
    why = f"({chosen['instead_of']} is made for other images)."
    return html.Div([html.P(f"{said} {why}", className="model-choice"), card])


def clear_stale_message(*_):
    """A message about the last settings goes when the settings change."""
    return ""


def model_card(loaded: krypton.LoadedModel) -> html.Div:
    """What the model is (model_card_lines) in a few words — its name, classes and
    input, whether images are checked against its training images — with the description
    and every measured number behind "more about this model": the whole card (about 250
    words) pushed Run below the fold."""
    description, *rest = model_card_lines(loaded)
    check = next((line for line in rest if line.startswith("Out-of-distribution check")), "")
    short = [f"{loaded.name} · {rest[0]}" if rest else loaded.name]
    device = "A demonstration model, not a medical device."
    if "not a medical device" in description:
        short.append(device)
        description = description.replace(device, "").strip()  # said above, once
    if check:
        short.append(check.split(" (")[0] + ".")
    more = [line for line in [description] + rest[1:] if line]
    return html.Div(
        [html.P(short[0])]
        + [html.P(line, className="help") for line in short[1:]]
        + [
            html.Details(
                [html.Summary("more about this model")]
                + [html.P(line, className="help") for line in more],
                className="model-card-more",
            )
        ]
    )
