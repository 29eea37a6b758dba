"""What both panels do with their kept result, registered once for both scopes: another
class re-colours the same run (nothing recomputed). A class the run cannot show (it kept
one class only) leaves the handle marked ``refused``, so either panel hides the heatmap
rather than show it under a class it does not explain."""

from __future__ import annotations

from functools import partial

from dash import Input, Output, State, no_update
from dash.exceptions import PreventUpdate

from .. import ids, runs
from ..helpers import InputError
from ..panel_scope import IMAGE_PANEL, VOLUME_PANEL
from ..services import Services
from .run_strip import result_handle

__all__ = ["KeptResultPanel"]


class KeptResultPanel:
    """The class switch of the image and the volume panel, one callback per scope."""

    def __init__(self, services: Services):
        self.services = services

    def register(self, app) -> None:
        """Attach the callbacks to ``app``, once per panel scope."""
        for scope, rank in ((IMAGE_PANEL, 2), (VOLUME_PANEL, 3)):
            app.callback(
                Output(scope.result, "data", allow_duplicate=True),
                Output(scope.strip.message, "children", allow_duplicate=True),
                Input(scope.label, "value"),
                State(scope.result, "data"),
                State(ids.SESSION, "data"),
                prevent_initial_call=True,
            )(partial(self.switch_class, rank))

    def switch_class(self, rank: int, label, handle, session):
        """Another class of the run the panel of ``rank`` shows: (the new handle, or the
        old one marked refused, or no_update; the message)."""
        key = runs.results_key(str(session or ""), rank)
        try:
            result = runs.switch_class(self.services.results, key, handle, label)
        except runs.ResultUnavailable as exc:  # the store is away, or it let the result go
            return no_update, str(exc)
        except InputError as exc:
            # the panel hides the heatmap: the class on screen is not the one it explains
            return dict(handle, refused=int(label)), str(exc)
        if result is None:
            raise PreventUpdate
        return result_handle(result), ""
