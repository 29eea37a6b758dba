"""The run strip, one component for the image and the volume panel (Dash's All-in-One
pattern: a widget used twice is one class with a scope, owning its ids, its parts and its
callbacks). Its parts — Run, Cancel, the progress bar, the live picture, the busy flag,
the downloads and the panel's message — are :class:`RunStrip`'s (each panel's is its
webapp.panel_scope.PanelScope's ``strip``); its callbacks, built once per strip, are the
background Run callback, the live reporter, Run off while busy, what Cancel did, and what
a run's end says to the page. A panel supplies only its request, how it draws the picture
so far, and the handle it keeps."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dash import ClientsideFunction, Input, Output, State, ctx, dcc, html, no_update, set_props
from dash.exceptions import PreventUpdate

from . import comparison, ids, runs
from .figures import placeholder_figure
from .guard import CLIENT_HEADER
from .helpers import InputError
from .jobs import JobCancelled, QueueFull, RunLifecycle, check_cancelled

__all__ = [
    "RunStrip",
    "AFTER_CANCEL_POLL_MS",
    "Prepared",
    "register_strip",
    "register_estimate",
    "run_job",
    "result_handle",
    "live_reporter",
    "cancelled",
    "partial_after_cancel",
    "LIVE_UPDATE_SECONDS",
]

# how often the page asks for a cancelled run's partial heatmap (it comes once the run
# reaches its next batch)
AFTER_CANCEL_POLL_MS = 500


@dataclass(frozen=True)
class RunStrip:
    """One panel's run strip; ``scope`` prefixes its ids ("" for the image panel:
    "run", "cancel", ...; "volume" for the volume panel: "volume-run", ...)."""

    scope: str

    def id(self, part: str) -> str:
        """The id of the strip's ``part`` in this scope."""
        return f"{self.scope}-{part}" if self.scope else part

    @property
    def run(self) -> str:
        return self.id("run")

    @property
    def cancel(self) -> str:
        return self.id("cancel")

    @property
    def progress(self) -> str:
        return self.id("progress")

    @property
    def live_panel(self) -> str:
        return self.id("live-panel")

    @property
    def live_graph(self) -> str:
        return self.id("live-graph")

    @property
    def live_status(self) -> str:
        return self.id("live-status")

    @property
    def message(self) -> str:
        return self.id("message")

    @property
    def export(self) -> str:
        """The type of the download buttons' pattern-matching ids ({"type", "format"})."""
        return self.id("export")

    @property
    def download(self) -> str:
        return self.id("download")

    @property
    def estimate(self) -> str:
        """The line beside Run: how long a run of these settings should take."""
        return self.id("estimate")

    @property
    def estimate_store(self) -> str:
        """The estimate that line shows, as Run keeps it (webapp.runs.shown_estimate)."""
        return self.id("estimate-store")

    @property
    def outcome(self) -> str:
        """Where the run's job answers its result's handle, copied into the panel's result
        store in the browser (webapp.run_strip.register_strip)."""
        return self.id("run-outcome")

    @property
    def after_cancel(self) -> str:
        """The poll after a Cancel, for the cancelled run's partial heatmap."""
        return self.id("after-cancel")

    @property
    def cancelled_at(self) -> str:
        """When the server heard this tab's last Cancel (its clock, seconds)."""
        return self.id("cancelled-at")

    @property
    def busy(self) -> str:
        """True while a run of this tab is queued or running (Run follows it)."""
        return self.id("run-busy")

    def buttons(self) -> list:
        """Run and Cancel."""
        return [
            html.Button("Run", id=self.run, n_clicks=0, className="primary"),
            html.Button("Cancel", id=self.cancel, n_clicks=0, disabled=True),
        ]

    def estimate_line(self) -> html.Div:
        return html.Div(id=self.estimate, className="estimate")

    def progress_bar(self) -> html.Progress:
        return html.Progress(id=self.progress, value="0", max="1")

    def live(self) -> html.Div:
        """The picture so far and its status line, shown while a run computes."""
        return html.Div(
            [
                dcc.Graph(id=self.live_graph, config={"displaylogo": False}),
                html.Div(id=self.live_status, className="status"),
            ],
            id=self.live_panel,
            style={"display": "none"},
        )

    def downloads(self, exports) -> list:
        """The download buttons, one per (text, format, title) of ``exports``, off until a
        result is shown, and the download they fill."""
        buttons = [
            html.Button(text, id={"type": self.export, "format": fmt}, disabled=True, title=title)
            for text, fmt, title in exports
        ]
        return [html.Div([html.Span("Download: "), *buttons], className="row exports"),
                dcc.Download(id=self.download)]  # fmt: skip

    def message_box(self) -> html.Div:
        return html.Div(id=self.message, className="message", role="alert")

    def stores(self) -> list:
        """The busy flag, the estimate shown, the run's outcome and the poll after a
        Cancel (off until one)."""
        return [dcc.Store(id=self.busy, data=False), dcc.Store(id=self.estimate_store),
                dcc.Store(id=self.outcome), dcc.Store(id=self.cancelled_at),
                dcc.Interval(id=self.after_cancel, interval=AFTER_CANCEL_POLL_MS,
                             disabled=True)]  # fmt: skip


logger = logging.getLogger("krypton.app")
LIVE_UPDATE_SECONDS = 0.3
# The live picture before the first positions come in: one figure, built once (it is
# only ever serialised, never changed)
FIRST_PICTURE = placeholder_figure("Computing the first positions…")

# the picture so far as the panel draws it (None: keep the last one)
Draw = Callable[["runs.Partial"], object]


@dataclass(frozen=True)
class Prepared:
    """A panel's run, ready to queue: its request, how the panel draws the picture so
    far, and the model's class names (the Compare steps name them)."""

    request: runs.RunRequest
    draw: Draw
    classes: list[str]


def values(*components: str) -> list[State]:
    """The ``value`` of each of ``components``, as a callback's states."""
    return [State(component, "value") for component in components]


def register_strip(
    panel: Any,  # a webapp.panel_scope.PanelScope (which holds this strip)
    app,
    job: Callable,
    *,
    manager,
    settings: list[State],
    services,
    rank: int,
    hidden_while_running: tuple[str, ...] = (),
) -> None:
    """The background Run callback of ``panel``'s strip: ``job(set_progress, n_clicks,
    session, the panel's subject (its store's data), the model, *settings, shown)``
    (``shown``: the estimate the panel showed, :func:`webapp.runs.shown_estimate`) keeps
    the run's handle in the panel's result and says why not in the message. A new subject
    or model stops it, as Cancel does (Dash cancels a background job when one of those
    inputs changes); ``hidden_while_running`` go while it runs. Also: Run off while busy,
    what Cancel did, in words, and the cancelled run's partial heatmap (``services``'
    results of ``rank``: :func:`partial_after_cancel`)."""
    strip, result, source, model = panel.strip, panel.result, panel.store, panel.model
    # The job answers into the strip's outcome, copied into the panel's result in the
    # browser: the result store is then no output of a job in flight, so a Compare run's
    # early handles, set into it while the job goes on (:func:`run_job`), reach the
    # panel's readers at once (Dash holds a callback whose input a job in flight writes).
    app.callback(
        Output(strip.outcome, "data"),
        Output(strip.message, "children", allow_duplicate=True),
        Input(strip.run, "n_clicks"),
        State(ids.SESSION, "data"),
        State(source, "data"),
        State(model, "value"),
        *settings,
        State(strip.estimate_store, "data"),
        background=True,
        manager=manager,
        prevent_initial_call=True,
        interval=LIVE_UPDATE_SECONDS * 1000,
        running=[
            # Run's own state follows this and the panel's show rule (binding.js)
            (Output(strip.busy, "data"), True, False),
            (Output(strip.cancel, "disabled"), False, True),
            (Output(strip.live_panel, "style"), {"display": "block"}, {"display": "none"}),
            *[
                (Output(part, "style"), {"display": "none"}, {"display": "block"})
                for part in hidden_while_running
            ],
        ],
        cancel=[Input(strip.cancel, "n_clicks"), Input(source, "data"), Input(model, "value")],
        progress=[
            Output(strip.progress, "value"),
            Output(strip.progress, "max"),
            Output(strip.live_graph, "figure"),
            Output(strip.live_status, "children"),
        ],
        progress_default=["0", "1", placeholder_figure("Starting…"), ""],
    )(job)
    off_while_running(app, strip.busy, strip.run)
    app.clientside_callback(
        "function(handle) { return handle || window.dash_clientside.no_update; }",
        Output(result, "data", allow_duplicate=True),
        Input(strip.outcome, "data"),
        prevent_initial_call=True,
    )
    # A Compare run's heatmap is shown while its gradient maps are still coming: a handle
    # that arrives while the run is busy puts the result back in view and the live
    # picture away (the progress bar goes on with the maps).
    app.clientside_callback(
        """function(handle, busy) {
            const none = window.dash_clientside.no_update;
            const shown = busy && handle && handle.maps_left !== undefined;
            const parts = dash_clientside.callback_context.outputs_list.length - 1;
            return shown ? [{"display": "none"}, ...Array(parts).fill({"display": "block"})]
                         : Array(parts + 1).fill(none);
        }""",
        Output(strip.live_panel, "style", allow_duplicate=True),
        *[Output(part, "style", allow_duplicate=True) for part in hidden_while_running],
        Input(result, "data"),
        State(strip.busy, "data"),
        prevent_initial_call=True,
    )
    app.callback(
        Output(strip.message, "children", allow_duplicate=True),
        Output(strip.cancelled_at, "data"),
        Output(strip.after_cancel, "disabled"),
        Output(strip.after_cancel, "n_intervals"),
        Input(strip.cancel, "n_clicks"),
        State(result, "data"),
        prevent_initial_call=True,
    )(cancelled)
    app.callback(
        Output(result, "data", allow_duplicate=True),
        Output(strip.message, "children", allow_duplicate=True),
        Output(strip.after_cancel, "disabled", allow_duplicate=True),
        Input(strip.after_cancel, "n_intervals"),
        State(ids.SESSION, "data"),
        State(strip.cancelled_at, "data"),
        prevent_initial_call=True,
    )(partial_after_cancel(services, rank))


def register_estimate(app, panel: Any, estimate_shown: Callable, *more) -> None:
    """The line beside ``panel``'s Run and the estimate the strip keeps for it:
    ``estimate_shown(model, patch, stride, mode, region, *more)`` returns both (the line,
    webapp.runs.shown_estimate's record or None); ``more``: the panel's own inputs and
    states after the five both panels have."""
    app.callback(
        Output(panel.strip.estimate, "children"),
        Output(panel.strip.estimate_store, "data"),
        Input(panel.model, "value"),
        Input(panel.patch, "value"),
        Input(panel.stride, "value"),
        Input(panel.mode, "value"),
        Input(panel.region, "data"),
        *more,
    )(estimate_shown)


def result_handle(result: runs.ResultRecord) -> dict:
    """What the page holds of a kept result, for either panel: its id (the server's
    readers check it: webapp.runs.kept_result) and its provenance (the PACS Send reads
    which input it explains); never its values."""
    return {"id": result["id"], "provenance": result["provenance"]}


def run_job(
    services, set_progress, session: str, prepare: Callable[[], Prepared], result_store: str
) -> tuple:
    """One run of either panel, queued, computed and kept: (the page's handle of the
    result, or no_update; the message). A run whose every cell is known computes
    nothing and does not queue (a Compare run only once every gradient map is kept too).
    The lifecycle says queued, running, done (as the queue moves it), failed or
    cancelled. A Compare run's handle reaches the panel's ``result_store`` before the
    job ends: once its heatmap is done, and again as each gradient map joins it
    (:func:`early_handle`)."""
    lifecycle = RunLifecycle()

    def waiting(ahead: int) -> None:
        check_cancelled()
        text = f"Queued: {ahead} run{'s' if ahead > 1 else ''} ahead of yours"
        set_progress(("0", "1", placeholder_figure(text), text))

    try:
        prepared = prepare()
        request = prepared.request
        lifecycle.chunked = request.mode in ("exact", "naive")  # webapp.runs.run_cells
        client = (ctx.headers or {}).get(CLIENT_HEADER) or "unknown"
        light = runs.is_light(services, request, session)
        # the queue moves the lifecycle: queued, running, done (webapp.jobs.JobQueue.slot)
        with services.job() as once:
            earlier = None if once is None else once.outcome()  # a team job sent again
            if earlier is not None:  # after it was computed: its outcome, not a new run
                return earlier[0], earlier[1]
            with services.jobs.slot(session, waiting, client, light, lifecycle):
                reporter, stage = live_reporter(
                    set_progress, prepared.draw, lifecycle, prepared.classes
                )
                result = runs.execute(
                    services, session, request, reporter, stage,
                    lambda found: set_props(result_store, {"data": early_handle(found)}),
                )  # fmt: skip
            if once is not None:
                once.keep([result_handle(result), ""])
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
    # server's copy, and the panel shows it only beside what it explains.
    return result_handle(result), ""


def early_handle(result: runs.ResultRecord) -> dict:
    """The handle a Compare run sends the page before its job ends (its heatmap done, its
    gradient maps coming): :func:`result_handle`, how many maps are still to come and
    whether it is the run's first (its heatmap alone)."""
    pending = result.get("methods_pending") or {}
    left = len(pending.get("steps", []))
    first = not any(entry.get("labels") for entry in (result.get("methods") or {}).values())
    return {**result_handle(result), "maps_left": left, "first": first}


def live_reporter(
    set_progress, draw: Draw, lifecycle: RunLifecycle, classes: list[str]
) -> tuple[runs.Reporter, comparison.Stage]:
    """Progress to the page: the bar, the count, the time left and the live picture.
    Every update carries the latest picture (a progress output cannot be left unchanged:
    Dash would blank it), redrawn by ``draw`` when new values arrive, at most every
    LIVE_UPDATE_SECONDS. A picture without a count (approximate mode's coarse picture)
    keeps the last count, so the bar never jumps back. The second callable reports the
    Compare steps after the occlusion (webapp.comparison), over the finished picture."""
    state: dict[str, Any] = {"figure": FIRST_PICTURE, "sent": 0.0}
    planned: dict[str, int] = {}

    def report(done: int, total: int, partial: runs.Partial | None = None) -> None:
        check_cancelled()
        if total:
            planned.setdefault("total", total)
            lifecycle.progress(done, total, picture=partial is not None)
        now = time.perf_counter()
        if partial is None and now - state["sent"] < LIVE_UPDATE_SECONDS:
            return
        if partial is not None:
            figure = draw(partial)
            if figure is not None:
                state["figure"] = figure
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
    """What Cancel did, in words (the image and the volume panels alike), when the
    server heard it, and the poll for the run's partial heatmap started."""
    if not n_clicks:
        return no_update, no_update, no_update, no_update
    poll = (time.time(), False, 0)
    if not handle:
        return "Run cancelled.", *poll
    if handle.get("maps_left"):  # cancelled while its gradient maps were coming
        return (
            "Run cancelled after its heatmap: Compare keeps the maps done before the "
            "cancel; press Run for the rest (nothing done is computed again).",
            *poll,
        )
    return (
        "Run cancelled; the heatmap below, if any, is the previous run's (shown only while "
        "it matches these settings).",
        *poll,
    )


# how long the page asks for a cancelled run's partial heatmap: the run stops at its next
# batch, which on a busy host can take a while
AFTER_CANCEL_SECONDS = 30.0
# team mode's workers stamp the partial with their own clock
CLOCK_SLACK_SECONDS = 2.0


def partial_after_cancel(services, rank: int) -> Callable:
    """The callback that polls, after a Cancel, for the cancelled run's partial heatmap:
    a run stopped by Cancel keeps the cells it computed (webapp.runs.execute), stamped
    when it stopped; once one stopped after the click is kept, the panel's result is it
    and the message says it is partial. The poll ends then, or after
    AFTER_CANCEL_SECONDS (a run cancelled before its first batch keeps nothing). Each
    poll reads the store once and never waits in a server thread."""

    def poll(n_intervals, session, cancelled_at):
        if not cancelled_at:
            return no_update, no_update, True
        key = runs.results_key(str(session or ""), rank)
        try:
            kept = services.results.get(key)
        except InputError:  # team mode: Redis is away (the panel says so on its own)
            kept = None
        stopped = ((kept or {}).get("partial") or {}).get("stopped_at", 0.0)
        if kept is not None and stopped >= float(cancelled_at) - CLOCK_SLACK_SECONDS:
            return result_handle(kept), runs.partial_text(kept), True
        polled = (n_intervals or 0) * AFTER_CANCEL_POLL_MS / 1000
        return no_update, no_update, polled >= AFTER_CANCEL_SECONDS

    return poll


def off_while_running(app, busy: str, run: str) -> None:
    """``run`` goes off as soon as the panel's ``busy`` flag (its Run callback's running
    output) is set, by a rule of its own: the panel's show rule also listens to the
    estimate, which the run's result feeds, so Dash holds that rule until the run ends,
    and with busy alone there Run stayed enabled through every run (pressed, it queued a
    second run that replaced the first's summary). The show rule turns Run on again."""
    app.clientside_callback(
        ClientsideFunction("krypton_binding", "offWhileRunning"),
        Output(run, "disabled", allow_duplicate=True),
        Input(busy, "data"),
        prevent_initial_call=True,
    )
