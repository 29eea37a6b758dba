"""One panel class for any rank (MONAI's way: rank is the input's shape; Dash's All-in-One:
a component owns its ids and its callbacks). :class:`SubjectPanel` registers, once for
both panels, what every panel does with a run: its Run strip (queue, progress, live
picture, Cancel), another class of its kept result, and its downloads. A panel kind —
the image panel (:class:`webapp.panels.run.RunPanel`) or the volume panel
(:class:`webapp.panels.volume.VolumePanel`) — supplies only what differs: its scope and
rank, the controls its request is read from and the request with its live picture
(:meth:`SubjectPanel.prepare`), what its downloads read of the screen and when they are
refused, and its files. The run itself is webapp.runs, the Compare view and Send are
registered once for both (webapp.panels.compare, webapp.panels.pacs)."""

from __future__ import annotations

from functools import partial

from dash import ALL, Input, Output, State, ctx, no_update
from dash.exceptions import PreventUpdate

from .. import ids, runs
from ..helpers import InputError
from ..panel_scope import PanelScope
from ..services import Services
from .run_strip import Prepared, register_strip, result_handle, run_job

__all__ = ["SubjectPanel"]


class SubjectPanel:
    """A panel of ``rank`` in ``scope``: the callbacks every panel has, registered by
    :meth:`register`; :meth:`register_own` adds the kind's own (its picture, its
    intake). Runs are background jobs on ``manager``."""

    scope: PanelScope
    rank: int
    hidden_while_running: tuple[str, ...] = ()  # what goes while a run runs

    def __init__(self, services: Services, manager):
        self.services = services
        self.manager = manager
        self.result = self.scope.result  # the store a Compare run's early handles go to

    # -- what a kind supplies ---------------------------------------------------------------

    def run_settings(self) -> list[State]:
        """The controls Run reads after the session, the subject and the model."""
        raise NotImplementedError

    def prepare(self, session: str, record, model: str, *settings) -> Prepared:
        """The run of these controls, ready to queue (InputError in the page's words)."""
        raise NotImplementedError

    def export_states(self) -> list[State]:
        """What a download reads of the screen beside the result's handle."""
        return []

    def export_refusal(self, result: runs.ResultRecord, *screen) -> str | None:
        """Why ``result`` may not be downloaded beside the screen, or None."""
        return None

    def write_export(self, result: runs.ResultRecord, fmt: str, session: str, *screen) -> dict:
        """The file of format ``fmt`` (a ``dcc.send_*`` answer); InputError to refuse."""
        raise NotImplementedError

    def register_own(self, app) -> None:
        """The kind's own callbacks (its picture, its intake)."""

    # -- what every panel does ----------------------------------------------------------------

    def register(self, app) -> None:
        """Attach the panel's callbacks to ``app``: the Run strip, another class, the
        downloads, then the kind's own."""
        scope = self.scope
        register_strip(
            scope, app, self.run, manager=self.manager, services=self.services,
            rank=self.rank, settings=self.run_settings(),
            hidden_while_running=self.hidden_while_running,
        )  # fmt: skip
        app.callback(
            Output(scope.result, "data", allow_duplicate=True),
            Output(scope.strip.message, "children", allow_duplicate=True),
            Input(scope.label, "value"),
            State(scope.result, "data"),
            State(ids.SESSION, "data"),
            prevent_initial_call=True,
        )(self.switch_class)
        app.callback(
            Output(scope.strip.download, "data"),
            Output(scope.strip.message, "children", allow_duplicate=True),
            Input({"type": scope.strip.export, "format": ALL}, "n_clicks"),
            State(scope.result, "data"),
            State(ids.SESSION, "data"),
            *self.export_states(),
            prevent_initial_call=True,
        )(self.export)
        self.register_own(app)

    def run(self, set_progress, n_clicks, session, record, model, *settings):
        """Queue, run and keep one run; the page gets its handle {id, provenance}.
        ``settings``: the kind's controls (:meth:`run_settings`), then the estimate the
        page showed for them (the run keeps it where its plan is the same).

        ``session`` keys this tab's queue place and its results on the server; as a
        callback argument it is also part of the background job's cache key, so two tabs
        with identical settings never share a job's progress or result."""
        if not n_clicks:
            raise PreventUpdate
        session = str(session or "")
        prepare = partial(self.prepare, session, record, model, *settings)
        return run_job(self.services, set_progress, session, prepare, self.result)

    def switch_class(self, label, handle, session):
        """Another class of the kept run, re-coloured at once (nothing recomputed): the
        new handle and no message; a class the run did not keep leaves the handle marked
        ``refused``, so the panel hides the heatmap rather than show it under a class it
        does not explain."""
        key = runs.results_key(str(session or ""), self.rank)
        try:
            result = runs.switch_class(self.services.results, key, handle, label)
        except runs.ResultUnavailable as exc:  # the store is away, or it let the result go
            return no_update, str(exc)
        except InputError as exc:
            return dict(handle, refused=int(label)), str(exc)
        if result is None:
            raise PreventUpdate
        return result_handle(result), ""

    def export(self, clicks, handle, session, *screen):
        """A download of the kept result, in the format of the button pressed, only while
        the screen shows what it explains; otherwise why not."""
        if not any(clicks or []) or not isinstance(handle, dict):
            raise PreventUpdate
        if not isinstance(ctx.triggered_id, dict):
            raise PreventUpdate
        session = str(session or "")
        key = runs.results_key(session, self.rank)
        result, why = runs.kept_result(self.services.results, key, handle)
        if result is None and why:
            return no_update, why
        if result is None:
            raise PreventUpdate  # not this tab's current result
        refusal = self.export_refusal(result, *screen)
        if refusal:
            return no_update, refusal
        try:
            return self.write_export(result, ctx.triggered_id["format"], session, *screen), ""
        except InputError as exc:
            return no_update, str(exc)
