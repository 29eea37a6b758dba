"""One panel class for any rank (MONAI's way: rank is the input's shape; Dash's All-in-One:
a component owns its ids and its callbacks). :class:`SubjectPanel` registers, once for
both panels, what every panel does with a run: its Run strip (queue, progress, live
picture, Cancel), its kept result shown only beside what it explains (the summary, which
downloads are offered, and the kind's picture of it), another class of it, and its
downloads. A panel kind — the image panel (:class:`webapp.panels.image.ImagePanel`) or the
volume panel (:class:`webapp.panels.volume.VolumePanel`) — supplies only what differs:
its scope and rank, the controls its request is read from and the request with its live
picture (:meth:`SubjectPanel.prepare`), what on screen a result must match
(:meth:`SubjectPanel.screen`, :meth:`SubjectPanel.hidden`), its picture of a result and
its files. The run itself is webapp.runs; the Compare settings and Send are registered
once for both (webapp.panels.compare, webapp.panels.pacs)."""

from __future__ import annotations

from functools import partial

from dash import ALL, ClientsideFunction, Input, Output, State, ctx, html, no_update
from dash.exceptions import PreventUpdate

from .. import comparison, ids, runs, wording
from ..helpers import InputError
from ..panel_scope import PanelScope
from ..run_strip import Prepared, register_strip, result_handle, run_job
from ..services import Services

__all__ = ["SubjectPanel"]


class SubjectPanel:
    """A panel of ``rank`` in ``scope``: the callbacks every panel has, registered by
    :meth:`register`; :meth:`register_own` adds the kind's own (its picture, its
    intake). Runs are background jobs on ``manager``."""

    scope: PanelScope
    rank: int
    export_formats: tuple[str, ...]  # the download buttons' formats, in the page's order
    hidden_while_running: tuple[str, ...] = ()  # what goes while a run runs
    # whether the summary repeats the out-of-distribution warning: not where the panel's
    # prediction beside the picture says it (the image panel's top 5)
    summary_warns: bool = True

    def __init__(self, services: Services, manager=None):
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

    def screen(self) -> list[tuple[str, str]]:
        """What a kept result is compared with before it is shown or written, beside the
        class: (id, property) of the subject, the model and the settings on screen."""
        raise NotImplementedError

    def hidden(self, result: runs.ResultRecord, *screen) -> str:
        """Why ``result`` may not be shown or written beside ``screen`` (the values of
        :meth:`screen`, then the class), in the page's words; "" where it may."""
        raise NotImplementedError

    def unavailable(self, result: runs.ResultRecord) -> set[str]:
        """The formats ``result`` has no file of: DICOM without a DICOM source (the
        record's ``dicom``, either kind's), Compare without its maps."""
        missing = set() if result.get("dicom") else {"dicom"}
        return missing | (set() if comparison.available(result) else {"compare"})

    def picture_outputs(self) -> list[Output]:
        """What the kind draws of the result shown, with its summary."""
        return []

    def picture_inputs(self) -> list[Input]:
        """What the kind's picture is drawn with beyond the result (the overlay)."""
        return []

    def picture(self, result: runs.ResultRecord | None, why: str, *drawn_with) -> tuple:
        """The values of :meth:`picture_outputs`: ``result`` drawn or, where it is None,
        the kind's empty picture saying ``why``; InputError where it cannot be drawn."""
        return ()

    def file_states(self) -> list[State]:
        """What a download reads beyond the screen (the image's overlay and identity)."""
        return []

    def write_export(self, result: runs.ResultRecord, fmt: str, session: str, *screen) -> dict:
        """The file of format ``fmt`` (a ``dcc.send_*`` answer); ``screen``: the values
        of :meth:`screen`, the class, then :meth:`file_states`. InputError to refuse."""
        raise NotImplementedError

    def register_own(self, app) -> None:
        """The kind's own callbacks (its picture, its intake)."""

    def on_screen_inputs(self) -> list[Input]:
        """What the page draws the subject from, where it is not the subject's store
        itself (the image panel's picture: ids.IMAGE_SHOWN): a result is shown only once
        that is its subject too."""
        return []

    # -- what every panel does ----------------------------------------------------------------

    def register(self, app) -> None:
        """Attach the panel's callbacks to ``app``: the Run strip, the result shown,
        another class, the downloads, then the kind's own."""
        scope = self.scope
        register_strip(
            scope, app, self.run, manager=self.manager, services=self.services,
            rank=self.rank, settings=self.run_settings(),
            hidden_while_running=self.hidden_while_running,
        )  # fmt: skip
        app.callback(
            Output(scope.summary, "children"),
            *[Output({"type": scope.strip.export, "format": fmt}, "disabled")
              for fmt in self.export_formats],
            *self.picture_outputs(),
            Output(scope.result_shown, "data"),
            Input(scope.result, "data"),
            *[Input(*part) for part in self.screen()],
            *self.picture_inputs(),
            # the class is read, not listened to: another class is a new handle, from
            # switch_class, and listening would hide the result for a moment in between
            State(scope.label, "value"),
            State(ids.SESSION, "data"),
        )(self.show_result)  # fmt: skip
        # The result beside its own subject only, decided in the browser
        # (assets/binding.js): the click that changes the subject or the model hid it in
        # the same update as the prediction (panels.common.hide_at_click); an answer of
        # show_result computed for the subject before (a run that ended just before the
        # click) shows nothing beside the new one. Measured before: the old heatmap,
        # its "p = " and enabled downloads beside the new picture for up to ~1 s.
        app.clientside_callback(
            ClientsideFunction("krypton_binding", "showResult"),
            Output(scope.result_area, "style"),
            Output(scope.compare_panel, "style"),
            Output({"type": scope.strip.export, "format": ALL}, "disabled", allow_duplicate=True),
            Input(scope.result_shown, "data"),
            Input(scope.store, "data"),
            Input(scope.model, "value"),
            Input(scope.wanted, "data"),
            Input(scope.answered, "data"),
            *self.on_screen_inputs(),
            prevent_initial_call=True,
        )
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

    def export_states(self) -> list[State]:
        """What a download reads of the page beside the result's handle: the screen, the
        class, then the kind's :meth:`file_states`."""
        screen = [State(*part) for part in self.screen()]
        return [*screen, State(self.scope.label, "value"), *self.file_states()]

    def shown(self, handle, session: str, *screen) -> tuple[runs.ResultRecord | None, str]:
        """The kept result ``handle`` names, where it explains ``screen`` (the values of
        :meth:`screen`, then the class); else None and why not, in the page's words."""
        key = runs.results_key(str(session or ""), self.rank)
        result, why = runs.kept_result(self.services.results, key, handle)
        if result is None:
            return None, why
        return self.beside(result, *screen)

    def beside(self, result: runs.ResultRecord, *screen) -> tuple[runs.ResultRecord | None, str]:
        """``result`` as it may be shown or written beside ``screen`` (the values of
        :meth:`screen`, then the class): itself, or re-coloured for the class on screen
        where the class alone moved to one the run kept; else None and why not."""
        hidden = self.hidden(result, *screen)
        with_class = len(screen) == len(self.screen()) + 1
        kept = self.for_class(result, screen[-1]) if hidden and with_class else None
        if kept is not None:  # the class alone may have moved, to one the run kept
            result, hidden = kept, self.hidden(kept, *screen)
        return (None, hidden) if hidden else (result, "")

    @staticmethod
    def for_class(result: runs.ResultRecord, label) -> runs.ResultRecord | None:
        """``result`` for the class ``label`` where the run kept every class's values (what
        switch_class will answer with), else None. The class box moves on its own as a
        sample is loaded again (its prediction's class): the panel showed "the class
        changed ... press Run" for 1-2 s before the switch's new handle came, where no
        run was needed."""
        if label is None or int(label) == int(result["label"]):
            return None
        try:
            return runs.relabel(result, int(label))
        except (InputError, TypeError, ValueError):
            return None

    def show_result(self, handle, *page):
        """The kept result's summary, which downloads it has, the kind's picture of it and
        what it explains (:attr:`PanelScope.result_shown`), only beside what it explains;
        otherwise why not, and None. ``page``: the values of
        :meth:`screen`, of :meth:`picture_inputs`, the class and the session."""
        count = len(self.screen())
        screen, drawn_with = page[:count], page[count:-2]
        label, session = page[-2:]
        result, why = self.shown(handle, session, *screen, label)
        picture: tuple = ()
        if result is not None:
            try:
                picture = self.picture(result, "", *drawn_with)
            except InputError as exc:
                result, why = None, str(exc)
        off = [True] * len(self.export_formats)
        if result is None:
            said = html.P(why, className="warning") if why else ""
            return said, *off, *self.picture(None, why, *drawn_with), None
        unavailable = self.unavailable(result)
        disabled = [fmt in unavailable for fmt in self.export_formats]
        # what this result explains, for the browser's rule (and its downloads' state)
        shown = {"key": result["source_key"], "model": result["model"], "disabled": disabled}
        return self.summary(result), *disabled, *picture, shown

    def summary(self, result: runs.ResultRecord) -> html.Div:
        """The result's lines in the page's plain words (webapp.runs.summary_lines; the
        planner's and the detector's terms behind "details": webapp.wording), with the
        reuse line under the panel's own id."""
        reuse = self.scope.id("reuse-info")
        lines = runs.summary_lines(result, ood=self.summary_warns)
        children = wording.summary_children(lines, ids={"Reused": reuse})
        if not result["reused"]:
            children.append(html.Div("", id=reuse, style={"display": "none"}))
        return html.Div(children)

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
        result, refusal = self.beside(result, *screen[: len(self.screen()) + 1])
        if result is None:
            return no_update, refusal
        try:
            return self.write_export(result, ctx.triggered_id["format"], session, *screen), ""
        except InputError as exc:
            return no_update, str(exc)
