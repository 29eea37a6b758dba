"""The volume panel's kept result: which one the panel shows (only beside what it
explains: webapp.runs.provenance), its Compare rows and its files; and the panel's
controls as a run request. The summary, the download callback and another class are the
subject panel's (webapp.panels.subject_panel), one for both panels."""

from __future__ import annotations

import dataclasses

import numpy as np
from dash import Input, Output, State, dcc, html
from dash.exceptions import PreventUpdate

from krypton.render.volumes import heatmap_nifti

from ... import comparison, ids, runs, volume_views
from ...exports import export_stem
from ...helpers import InputError
from ...panel_scope import VOLUME_PANEL
from ...path_budget import chosen_budget
from ...run_strip import Prepared
from ...runs import volumes
from ...services import Services
from ..compare import volume_compare_view
from .views import SLIDERS, VOLUME_SETTINGS, live_views

__all__ = ["VolumeResult", "volume_request", "whole_voxels"]


class VolumeResult:
    """The volume panel's result callbacks (a part of :class:`webapp.panels.volume.VolumePanel`)."""

    services: Services

    def register_result_callbacks(self, app) -> None:
        """Attach the result's own callbacks to ``app`` (beside the subject panel's): the
        Compare rows through the crosshair."""
        app.callback(
            Output(VOLUME_PANEL.compare_panel, "children"),
            Input(VOLUME_PANEL.result, "data"),
            Input(VOLUME_PANEL.store, "data"),
            Input(VOLUME_PANEL.model, "value"),
            Input(VOLUME_PANEL.region, "data"),
            *[Input(s, "value") for s in SLIDERS],
            Input(ids.VOLUME_WINDOW, "value"),
            *VOLUME_SETTINGS,
            State(ids.SESSION, "data"),
        )(self.compare_rows)

    def prepare(self, session: str, record, model: str, patch, stride, mode, label, region,
                z, y, x, compare=None, layer=None, steps=None, shown=None) -> Prepared:  # fmt: skip
        """One volume run of the panel's controls, with its live views through the
        crosshair; ``shown``: the estimate the panel showed."""
        if not record:
            raise InputError("load a volume first")
        request = volume_request(record, model, patch, stride, mode, label, region, compare, layer)
        request = dataclasses.replace(request, estimate=shown, compare_steps=chosen_budget(steps))
        prepared = self._prepared(record, model, session)
        cursor = tuple(int(v) for v in (z, y, x))
        classes = list(self.services.model(model, rank=3).classes)
        return Prepared(request, live_views(prepared, cursor), classes)

    def _prepared(self, record: dict, model: str, session: str):
        return self.services.prepared_volume(
            str(record["key"]), str(session or ""), model, str(record.get("name"))
        )

    def _result_for(self, handle, record, model, session, settings=()):
        """The kept volume result the handle names, when it explains what the panel shows:
        this volume and model and, given ``settings`` (region, patch, stride, mode,
        class), these settings — the image panel's provenance rule (webapp.runs.provenance)."""
        return self.shown(handle, session, record, model, *settings)[0]

    def screen(self) -> list[tuple[str, str]]:
        return [(VOLUME_PANEL.store, "data"), (VOLUME_PANEL.model, "value"),
                (VOLUME_PANEL.region, "data"), (VOLUME_PANEL.patch, "value"),
                (VOLUME_PANEL.stride, "value"), (VOLUME_PANEL.mode, "value")]  # fmt: skip

    def hidden(self, result: runs.ResultRecord, record=None, model=None, *settings) -> str:
        """Why ``result`` may not be shown beside this volume and model and, given
        ``settings`` (region, patch, stride, mode, class), these settings; "" where it
        may."""
        if not record:
            return "Load a volume first."
        if result.get("source_key") != record.get("key") or result.get("model") != model:
            return "The last heatmap explains another volume or model."
        if not settings or result.get("provenance") is None:
            return ""
        region, patch, stride, mode, label = settings
        try:
            asked = volume_request(record, model, patch, stride, mode, label, region)
            weights = self.services.weights_checksum(model)
        except (TypeError, ValueError):  # InputError included: a blank cube or stride
            return "The last heatmap is hidden: the settings are incomplete."
        view = runs.shown_view(result, asked, weights)
        return "" if view.show else view.reason

    def compare_rows(self, handle, record, model, region, z, y, x, window, patch, stride,
                     mode, label, session):  # fmt: skip
        """The Compare view: a row of the three views per method through the crosshair,
        only beside what the kept result explains (as the summary)."""
        result = self._result_for(
            handle, record, model, session, (region, patch, stride, mode, label)
        )
        compared = result is not None and (result.get("methods") or result.get("methods_pending"))
        if not compared or None in (z, y, x):
            return []
        try:
            prepared = self._prepared(record, model, session)
            shown = volume_views.displayed(prepared.unit, prepared.model_input.values, window)
        except (InputError, ValueError) as exc:
            return [html.P(str(exc), className="warning")]
        return volume_compare_view(result, shown, (int(z), int(y), int(x)))

    def write_export(self, result: runs.ResultRecord, fmt: str, session: str, *_screen) -> dict:
        """The file for one export button: NIfTI, JSON, the Compare PNG or a DICOM
        series."""
        stem = export_stem(result)
        if fmt == "nifti":
            heatmap = runs.result_heatmap(result)
            affine = None if result.get("affine") is None else np.asarray(result["affine"])
            data = heatmap_nifti(heatmap, affine, f"krypton {result['model']} "
                                 f"{result['label_name']}")  # fmt: skip
            return dcc.send_bytes(data, f"{stem}.nii.gz")
        if fmt == "json":
            return dcc.send_string(runs.export_json(result), f"{stem}.json")
        if fmt not in ("compare", "dicom"):
            raise PreventUpdate
        prepared = self.services.prepared_volume(
            result["source_key"], session, result["model"], result["image"]
        )
        if fmt == "compare":  # each method in the three views through its strongest cell
            return dcc.send_bytes(comparison.comparison_png(result, prepared.unit),
                                  f"{stem}-compare.png")  # fmt: skip
        runs.refuse_partial(result, "a DICOM file")
        source = self.services.images.source(result["source_key"], session)
        data = volumes.export_dicom_series(result, source, prepared)
        return dcc.send_bytes(data, f"{stem}.dcm.zip")


def volume_request(record, model, patch, stride, mode, label, region, compare=None, layer=None):
    """The panel's controls as a run request (rank 3)."""
    return runs.RunRequest(
        key=str(record["key"]), name=str(record.get("name")), model=model,
        patch=whole_voxels(patch, "cube"), stride=whole_voxels(stride, "stride"), mode=mode,
        label=None if label is None else int(label),
        region=tuple(int(v) for v in region) if region else None, compare=bool(compare),
        compare_layer=str(layer) if layer else None, rank=3,
    )  # fmt: skip


def whole_voxels(value, what: str) -> int:
    """A cube or stride from the page as a whole number of voxels, at least 1; refused in
    the page's words (InputError) otherwise."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise InputError(f"the {what} must be a whole number of voxels") from None
    if number < 1:
        raise InputError(f"the {what} must be at least 1 voxel")
    return number
