"""The volume kind's settings and estimate: the volume models offered, and the line that
says how many positions the settings make, how many are known already and how long the
rest should take here (the image kind's: webapp.panels.image.estimate)."""

from __future__ import annotations

import dataclasses

from dash import Input, State

from krypton.registry import available_models

from ... import comparison, ids, runs
from ...helpers import InputError
from ...panel_scope import VOLUME_PANEL
from ...path_budget import chosen_budget
from ...run_strip import register_estimate
from ...runs import volumes
from ...services import Services
from .result import volume_request, whole_voxels

__all__ = ["VolumeEstimate", "volume_model_options", "default_volume_model"]


def volume_model_options() -> list[dict]:
    """The volume models (unavailable ones disabled, with why)."""
    return [
        {
            "label": info.name if info.available else f"{info.name} (unavailable)",
            "value": info.name,
            "disabled": not info.available,
            "title": info.description if info.available else f"{info.reason}; fix: {info.fix}",
        }
        for info in available_models()
        if info.is_volume
    ]


def default_volume_model() -> str | None:
    options = [o for o in volume_model_options() if not o["disabled"]]
    return options[0]["value"] if options else None


class VolumeEstimate:
    """The volume panel's estimate (a part of :class:`webapp.panels.volume.VolumePanel`)."""

    services: Services

    def register_settings_callbacks(self, app) -> None:
        """Attach the estimate's callbacks to ``app``."""
        register_estimate(
            app, VOLUME_PANEL, self.estimate_shown,
            Input(VOLUME_PANEL.result, "data"),  # a finished run is one more to learn from
            Input(VOLUME_PANEL.compare, "value"),
            State(VOLUME_PANEL.store, "data"),
            State(ids.SESSION, "data"),
            Input(VOLUME_PANEL.compare_steps, "value"),
        )  # fmt: skip

    def estimate(self, model, patch, stride, mode, region, _handle, compare=None,
                 record=None, session=None, steps=None):  # fmt: skip
        """The positions the settings make, how many of them are known already (the run
        reuses them: webapp.runs.plan_run, as the run plans itself), and how long the
        rest should take here (with Compare ticked, that its gradient step comes on
        top)."""
        return self.estimate_shown(
            model, patch, stride, mode, region, _handle, compare, record, session, steps
        )[0]

    def estimate_shown(self, model, patch, stride, mode, region, _handle, compare=None,
                       record=None, session=None, steps=None):  # fmt: skip
        """(:meth:`estimate`'s line, the estimate as the run strip keeps it for Run:
        webapp.runs.shown_estimate, or None)."""
        if not model:
            return "", None
        try:
            loaded = self.services.model(model, rank=3)
            patch, stride = whole_voxels(patch, "cube"), whole_voxels(stride, "stride")
        except InputError as exc:
            return str(exc), None
        asked, known = None, 0
        if record:
            try:
                asked = volume_request(record, model, patch, stride, mode, None, region)
                if mode in ("exact", "naive"):
                    planned = runs.plan_run(self.services, asked, str(session or ""))
                    region, known = planned.region, planned.known  # the run's own grid
            except (InputError, ValueError, KeyError):
                asked, known = None, 0  # the line below says what is wrong
        load = runs.host_load()  # sampled once for the line
        text, found, positions = volumes.volume_estimate_found(
            model, loaded.input_size, patch, stride, mode, region, load, known
        )
        shown = None
        if asked is not None and positions:
            region = tuple(region) if region else None
            planned = runs.PlannedRun(region, positions, min(known, positions))
            shown = runs.shown_estimate(asked, planned, found)
        if compare:
            session = str(session or "")
            try:  # the image panel's rule (webapp.panels.image.estimate): a value not offered
                if asked is not None:  # leaves the maps left untold, the line standing
                    asked = dataclasses.replace(asked, compare_steps=chosen_budget(steps))
            except ValueError:
                asked = None
            left = None if asked is None else runs.compare_left(self.services, asked, session)
            budget = None if asked is None else asked.compare_steps
            text = f"{text}. {comparison.estimate_note(loaded, load, left, budget)}"
        return text, shown
