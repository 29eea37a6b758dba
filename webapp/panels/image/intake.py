"""The image kind's intake: loading an image (upload, sample or PACS), a DICOM file's window
and frame, the picture the model sees and the region the user selects on it (the volume
kind's: webapp.panels.volume.intake)."""

from __future__ import annotations

from dash import Input, Output, State, ctx, no_update
from dash.exceptions import PreventUpdate

from krypton.registry import available_models, model_for_modality

from ... import figures, helpers, ids, pacs
from ...client import request_client
from ...figures import placeholder_figure
from ...helpers import InputError
from ...panel_scope import IMAGE_PANEL
from ...samples import DICOM_SAMPLES, SAMPLE_MODALITIES, sample_path
from ...services import Services
from ..common import hide_at_click, origin, register_intake


class ImageIntake:
    """The image panel's intake callbacks (a part of :class:`webapp.panels.image.ImagePanel`);
    ``services`` holds the stored images and models."""

    services: Services

    def register_intake_callbacks(self, app) -> None:
        """Attach the intake's callbacks to ``app``."""
        dicom = (Output(ids.WINDOW_PRESET, "value"), Output(ids.DICOM_FRAME, "max"),
                 Output(ids.DICOM_FRAME, "value"),
                 Output(IMAGE_PANEL.model, "value", allow_duplicate=True))  # fmt: skip
        register_intake(app, IMAGE_PANEL, "image", self.load_image, dicom,
                        (State(IMAGE_PANEL.model, "value"),))  # fmt: skip
        # a click hides the prediction, class list and estimate and disables Run; the
        # settings panel's rule shows them again once what arrived is for the picture
        # (and the result: its heatmap, summary, downloads and Compare, in the same update)
        hidden = [ids.TOP5, IMAGE_PANEL.label, IMAGE_PANEL.strip.estimate,
                  IMAGE_PANEL.result_area, IMAGE_PANEL.compare_panel]  # fmt: skip
        hide_at_click(app, IMAGE_PANEL, hidden)
        app.callback(
            Output(IMAGE_PANEL.store, "data", allow_duplicate=True),
            Output(IMAGE_PANEL.strip.message, "children", allow_duplicate=True),
            Input(ids.WINDOW_PRESET, "value"),
            Input(ids.WINDOW_CENTRE, "value"),
            Input(ids.WINDOW_WIDTH, "value"),
            Input(ids.DICOM_FRAME, "value"),
            State(IMAGE_PANEL.store, "data"),
            State(ids.SESSION, "data"),
            prevent_initial_call=True,
        )(self.rewindow)
        app.callback(
            Output(ids.DICOM_PANEL, "style"),
            Output(ids.DICOM_INFO, "children"),
            Output(ids.FRAME_PICKER, "style"),
            Output(ids.WINDOW_CENTRE, "value"),
            Output(ids.WINDOW_WIDTH, "value"),
            Input(IMAGE_PANEL.store, "data"),
            Input(IMAGE_PANEL.model, "value"),
            Input(IMAGE_PANEL.patch, "value"),
        )(self.show_dicom)
        app.callback(Output(ids.MANUAL_WINDOW, "style"), Input(ids.WINDOW_PRESET, "value"))(
            toggle_manual_window
        )
        app.callback(
            Output(IMAGE_PANEL.region, "data", allow_duplicate=True),
            Input(ids.IMAGE_GRAPH, "selectedData"),
            Input(IMAGE_PANEL.reset_region, "n_clicks"),
            State(IMAGE_PANEL.model, "value"),
            prevent_initial_call=True,
        )(self.select_region)
        app.callback(
            Output(ids.IMAGE_GRAPH, "figure"),
            Output(IMAGE_PANEL.region_text, "children"),
            Output(ids.IMAGE_SHOWN, "data"),
            Input(IMAGE_PANEL.store, "data"),
            Input(IMAGE_PANEL.region, "data"),
            Input(IMAGE_PANEL.model, "value"),
        )(self.draw_image)

    def load_image(self, ticket, sample_clicks, compare_clicks, session, model=None):
        """An uploaded file or a sample becomes the page's image (a DICOM file: its
        windowed frame, with the file kept for this tab). Where the chosen shipped model
        is made for other images and another for this file's modality or this sample's
        kind, that one (:meth:`model_for`), said in the DICOM panel or the model card. A
        sample's Compare button also marks the image for Compare: Run is pressed once its
        prediction shows (panels.compare). The last output names the request answered
        (:func:`origin`), loaded or refused, so the page knows the picture it waits for
        has come."""
        trigger = ctx.triggered_id
        answered = origin(trigger, ticket)
        if answered is None:
            raise PreventUpdate
        *loaded, pending = self._load_image(trigger, ticket, sample_clicks, compare_clicks, session)
        chosen = self.model_for(trigger, loaded[0], str(model or ""))
        return (*loaded, chosen or no_update, pending, answered)

    @staticmethod
    def model_for(trigger, image_data, model: str) -> str | None:
        """The model to explain what arrived with instead of ``model`` (None: keep it): a
        DICOM file's modality, or what a picture sample is
        (webapp.samples.SAMPLE_MODALITIES), decides (krypton.registry.model_for_modality);
        an uploaded picture says nothing of itself and keeps the model. The choice is
        kept in ``image_data`` for the page to say (the DICOM panel, or the model card
        beside a picture: panels.image.estimate)."""
        if not isinstance(image_data, dict):  # refused: the message says why
            return None
        record = image_data.get("dicom")
        if record:
            modality = str((record.get("info") or {}).get("modality") or "")
        else:
            sample = trigger.get("name") if isinstance(trigger, dict) else None
            modality = SAMPLE_MODALITIES.get(str(sample), "")
        chosen = model_for_modality(modality, model) if modality else None
        if chosen:
            image_data["chosen_model"] = dict(model=chosen, instead_of=model, modality=modality)
            return chosen
        made_for = next((i.modalities for i in available_models() if i.name == model), ())
        if modality and made_for and modality not in made_for:  # none here is made for it
            image_data["unmatched_model"] = dict(
                model=model, modality=modality, made_for="/".join(made_for)
            )
        return None

    def _load_image(self, trigger, ticket, sample_clicks, compare_clicks, session):
        compare = isinstance(trigger, dict) and trigger.get("type") == IMAGE_PANEL.compare_sample
        session = str(session or "")
        ticket = ticket if isinstance(ticket, dict) else {}  # the page's, so the client's
        filename = str(ticket.get("name") or "") if trigger == IMAGE_PANEL.ticket else None
        try:
            if trigger == IMAGE_PANEL.ticket and isinstance(ticket.get("pacs"), dict):
                return self.pacs_image(ticket["pacs"], filename or "the image", session)
            if trigger == IMAGE_PANEL.ticket:
                data = self.uploaded_bytes(ticket, "image", session)
                name = filename
            elif isinstance(trigger, dict) and any(sample_clicks + compare_clicks):
                name = trigger["name"]
                try:
                    data = sample_path(name).read_bytes()
                except (KeyError, OSError):
                    raise InputError(f"the sample {name!r} is not available") from None
                if name in DICOM_SAMPLES:
                    name = DICOM_SAMPLES[name][0]
            else:
                raise PreventUpdate
            with self.services.intake() as client:
                if helpers.upload_is_dicom(
                    data, filename if trigger == IMAGE_PANEL.ticket else name
                ):
                    image_data = self.dicom_image_data(data, str(name or "the file"), session)
                    record = image_data["dicom"]
                    pending = image_data["key"] if compare else None
                    frames = record["frames"], record["frame"] + 1
                    return image_data, None, "", "file", *frames, pending
                image = helpers.decode_upload(data, name)
                key = self.services.images.put(image, client)
        except InputError as exc:
            return no_update, no_update, str(exc), no_update, no_update, no_update, None
        image_data = {"key": key, "name": name, "size": list(image.size)}
        return image_data, None, "", no_update, no_update, no_update, key if compare else None

    def pacs_image(self, chosen: dict, name: str, session: str) -> tuple:
        """One image of a PACS series (webapp.panels.pacs names it): fetched within the
        image limit by this client's one intake, then read as an uploaded DICOM file is;
        the server remembers its study and series, where Send stores the result."""
        study, series = str(chosen.get("study", "")), str(chosen.get("series", ""))
        number = str(chosen.get("image") or "").strip() or None
        with self.services.intake():
            with self.services.pacs_call():
                data = pacs.fetch_image_bytes(
                    self.services.settings.pacs, study, series, number,
                    self.services.settings.max_image_bytes,
                )  # fmt: skip
            image_data = self.dicom_image_data(data, name, session)
        record = image_data["dicom"]
        self.services.pacs_sources.remember(record["source"], session, study, series)
        image_data["pacs"] = True
        return image_data, None, "", "file", record["frames"], record["frame"] + 1, None

    def uploaded_bytes(self, ticket: dict | None, purpose: str, session: str) -> bytes:
        """The bytes of a file the page posted to the upload route (its ticket)."""
        if not isinstance(ticket, dict):
            raise InputError("the file could not be uploaded; try again")
        if ticket.get("error"):
            raise InputError(str(ticket["error"]))
        with self.services.uploads.take(str(ticket.get("token", "")), purpose, session) as (
            path,
            _,
        ):
            return path.read_bytes()

    def dicom_image_data(self, data: bytes, name: str, session: str, window=None, frame=None):
        """Keep a DICOM file's bytes (for this tab only), store its windowed frame; the
        page's record of it."""
        client = request_client()
        source = self.services.images.put_source(data, session, client)
        loaded, record = helpers.dicom_view(data, source, window, frame, name)
        key = self.services.images.put(loaded.picture, client)
        return {
            "key": key,
            "name": helpers.dicom_name(record),
            "size": list(loaded.picture.size),
            "dicom": record,
        }

    def rewindow(self, preset, centre, width, frame, image_data, session):
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
            data = self.services.images.source(record["source"], session)
            with self.services.intake():
                return (
                    self.dicom_image_data(data, image_data["name"], session, window, frame),
                    "",
                )
        except InputError as exc:
            return no_update, str(exc)

    def show_dicom(self, image_data, model_name, patch):
        """The DICOM panel: what the file is and how it is windowed (hidden otherwise)."""
        record = (image_data or {}).get("dicom")
        if not record:
            return {"display": "none"}, "", {"display": "none"}, no_update, no_update
        try:
            size = self.services.model(model_name).input_size
        except InputError:
            size = tuple(reversed(image_data["size"]))
        text = helpers.dicom_description(record, size, patch)
        chosen = image_data.get("chosen_model") or {}
        if chosen.get("model") == model_name:
            text += (
                f" The model changed to {model_name}, made for {chosen['modality']} images, "
                f"for this file ({chosen['instead_of']} is made for other images)."
            )
        unmatched = image_data.get("unmatched_model") or {}
        if unmatched.get("model") == model_name:  # the model the page had: say so
            text += (
                f" No model here is made for {unmatched['modality']} images: {model_name} "
                f"(made for {unmatched['made_for']}) explains it, as the model chosen last; "
                "its answer may mean nothing for this file. Choose the model in Model."
            )
        centre, width = record["window"] or (None, None)
        frames = {"display": "block"} if record["frames"] > 1 else {"display": "none"}
        return {"display": "block"}, text, frames, centre, width

    def select_region(self, selected, reset, model_name):
        """The box drawn on the picture (in the model's input pixels), or none on Reset."""
        if ctx.triggered_id == IMAGE_PANEL.reset_region:
            return None
        try:
            size = self.services.model(model_name).input_size
        except InputError:
            raise PreventUpdate from None
        region = helpers.region_from_selection(selected, size)
        if region is None:
            raise PreventUpdate
        return region

    def draw_image(self, image_data, region, model_name):
        """The picture at the model's input size, with the selected region, and which
        image and model the page now shows (the prediction beside it must be theirs)."""
        if not image_data:
            return placeholder_figure("Load an image: upload one or pick a sample"), "", None
        try:
            loaded = self.services.model(model_name)
            image = figures.model_view(
                self.services.images.get(image_data["key"]), loaded.input_size
            )
        except InputError as exc:
            return placeholder_figure(str(exc)), "", None
        height, width = loaded.input_size
        if region:
            x0, y0, x1, y1 = region
            text = f"Region x {x0}–{x1}, y {y0}–{y1} ({x1 - x0}×{y1 - y0} px)"
        else:
            text = f"Whole image ({width}×{height} px, the model's input size)"
        shown = {"key": image_data["key"], "model": model_name}
        return figures.image_figure(image, region), text, shown


def toggle_manual_window(preset):
    """Centre and width fields only for a manual window."""
    return {"display": "flex"} if preset == "manual" else {"display": "none"}
