"""The run strip's parts — Run, Cancel, the progress bar, the live picture, the busy flag,
the downloads and the panel's message — one component for the image and the volume panel (Dash's
All-in-One pattern: a widget used twice is one class with a scope). Its callbacks are
webapp.panels.run_strip's, registered once per strip; each panel's is its
webapp.panel_scope.PanelScope's ``strip``."""

from __future__ import annotations

from dataclasses import dataclass

from dash import dcc, html

__all__ = ["RunStrip", "AFTER_CANCEL_POLL_MS"]

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
        store in the browser (webapp.panels.run_strip.register_strip)."""
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
