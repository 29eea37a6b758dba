"""The widgets and stores both the image and the volume panel have — the subject's upload,
its stores, its region line, the run settings, Compare, the summary — as one component with
a scope (Dash's All-in-One pattern: a widget used twice is one class with a scope). Each
panel is one instance: :data:`IMAGE_PANEL` and :data:`VOLUME_PANEL`; its run strip is
:attr:`PanelScope.strip`. Ids only one panel has stay in webapp.ids."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dash import dcc, html

from .compare_layout import layer_picker, steps_picker
from .run_strip import RunStrip

__all__ = ["PanelScope", "IMAGE_PANEL", "VOLUME_PANEL", "SAMPLES_DIR", "mode_options",
           "size_checked", "tick"]  # fmt: skip


# where both panels' shipped samples are (written by the demos' `gallery` commands)
SAMPLES_DIR = Path(__file__).resolve().parents[1] / "assets" / "samples"


def mode_options(traceable: bool = True) -> list[dict]:
    """Naive always; Exact and Approximate only for models torch.fx can capture."""
    why = "" if traceable else " (needs a model Krypton can trace layer by layer)"
    return [
        {"label": "Naive", "value": "naive"},
        {"label": "Exact" + why, "value": "exact", "disabled": not traceable},
        {"label": "Approximate" + why, "value": "approximate", "disabled": not traceable},
    ]


def tick(component_id: str, label: str, on: bool = False, value: str = "") -> dcc.Checklist:
    """A one-option checklist (its value: [``value`` or component_id] when ticked, else
    [])."""
    value = value or component_id
    return dcc.Checklist(
        id=component_id,
        value=[value] if on else [],
        className="help",
        options=[{"label": label, "value": value}],
    )


def size_checked(upload: dcc.Upload, max_bytes: int, ticket: str) -> html.Div:
    """An upload whose oversized files the page names with the limit, in ``ticket``
    (assets/uploads.js: dcc.Upload's max_size alone drops them without a word)."""
    return html.Div(upload, **{"data-max-bytes": str(max_bytes), "data-ticket": ticket})


COMPARE_WORDS = (
    " compare with Grad-CAM and Integrated Gradients (computed after the occlusion, on its grid)"
)


@dataclass(frozen=True)
class PanelScope:
    """One panel's shared widgets. ``scope`` prefixes their ids ("" for the image panel:
    "model", "patch", ...; "volume": "volume-model", ...); ``named``: (part, id) pairs for
    the parts whose id predates the scope (the image panel's stores)."""

    scope: str
    named: tuple[tuple[str, str], ...] = ()

    def id(self, part: str) -> str:
        """The id of the panel's ``part``."""
        for named_part, component_id in self.named:
            if named_part == part:
                return component_id
        return f"{self.scope}-{part}" if self.scope else part

    @property
    def strip(self) -> RunStrip:
        """The panel's run strip (Run, Cancel, progress, live picture, downloads)."""
        return RunStrip(self.scope)

    # The subject: its upload, the server's ticket for it, and what the page keeps
    @property
    def upload(self) -> str:
        return self.id("upload")

    @property
    def ticket(self) -> str:
        """The server's token for an uploaded file (assets/uploads.js sets it)."""
        return self.id("ticket")

    @property
    def store(self) -> str:
        """The subject on the page: its key and description."""
        return self.id("store")

    @property
    def wanted(self) -> str:
        """The request the user made last (set in the browser at the click)."""
        return self.id("wanted")

    @property
    def answered(self) -> str:
        """The request the server answered last: while the two differ, nothing beside the
        picture is shown (assets/binding.js)."""
        return self.id("answered")

    @property
    def region(self) -> str:
        return self.id("region")

    @property
    def region_text(self) -> str:
        return self.id("region-text")

    @property
    def reset_region(self) -> str:
        return self.id("reset-region")

    @property
    def sample(self) -> str:
        """The type of the sample buttons' pattern-matching ids ({"type", "name"})."""
        return self.id("sample")

    @property
    def compare_sample(self) -> str:
        """... and of their Compare buttons."""
        return self.id("compare-sample")

    @property
    def compare_pending(self) -> str:
        """A sample loaded by its Compare button: Run is pressed once it is shown."""
        return self.id("compare-pending")

    # The PACS (only with a configured PACS): open what the search found into this panel,
    # and send this panel's result back to its study
    @property
    def pacs_open(self) -> str:
        return self.id("pacs-open")

    @property
    def pacs_send(self) -> str:
        return self.id("pacs-send")

    @property
    def pacs_sent(self) -> str:
        return self.id("pacs-sent")

    # The run's settings
    @property
    def model(self) -> str:
        return self.id("model")

    @property
    def mode(self) -> str:
        return self.id("mode")

    @property
    def patch(self) -> str:
        return self.id("patch")

    @property
    def stride(self) -> str:
        return self.id("stride")

    @property
    def label(self) -> str:
        """The class to explain."""
        return self.id("label")

    @property
    def compare(self) -> str:
        """Also compute Grad-CAM and Integrated Gradients."""
        return self.id("compare")

    @property
    def compare_layer(self) -> str:
        """The layer Grad-CAM reads (None: the default rule)."""
        return self.id("compare-layer")

    @property
    def compare_steps(self) -> str:
        """Integrated Gradients' most gradient evaluations per map (webapp.path_budget)."""
        return self.id("compare-steps")

    # The result
    @property
    def result(self) -> str:
        """The handle of the result shown (webapp.runs.result_record)."""
        return self.id("result")

    @property
    def summary(self) -> str:
        return self.id("summary")

    @property
    def result_shown(self) -> str:
        """What the result on screen explains: its subject's key and model, and which of
        its downloads are off (None: no result on screen). assets/binding.js's showResult
        shows the result only beside that subject."""
        return self.id("result-shown")

    @property
    def result_area(self) -> str:
        """The result's summary, picture and downloads: hidden at the click that changes
        the subject or the model, in the same update, and shown again only beside the
        subject it explains."""
        return self.id("result-area")

    @property
    def compare_panel(self) -> str:
        """The three methods side by side."""
        return self.id("compare-panel")

    def stores(self) -> list[dcc.Store]:
        """The subject's stores, the result's and the run strip's."""
        parts = (self.ticket, self.store, self.wanted, self.answered, self.region,
                 self.result, self.result_shown, self.compare_pending)  # fmt: skip
        return [*(dcc.Store(id=part) for part in parts), *self.strip.stores()]

    def upload_zone(self, what: str, formats: str, max_bytes: int) -> html.Div:
        """The upload (``what``: "an image", ...; ``formats``: the files it reads), size
        checked. No accept filter: DICOM files often have no extension."""
        words = [f"Drop {what} here or ", html.A("choose a file"),
                 html.Small(f" ({formats}; up to {max_bytes / 2**20:g} MB)")]  # fmt: skip
        upload = dcc.Upload(html.Div(words), id=self.upload, className="upload",
                            max_size=max_bytes)  # fmt: skip
        return size_checked(upload, max_bytes, self.ticket)

    def region_line(self, whole: str) -> html.Div:
        """The region in words and the button back to the ``whole`` subject."""
        return html.Div(
            [html.Span(id=self.region_text, className="region-text"),
             html.Button(whole, id=self.reset_region, n_clicks=0)],
            className="row",
        )  # fmt: skip

    def mode_radio(self) -> dcc.RadioItems:
        return dcc.RadioItems(id=self.mode, value="exact", inline=True, options=mode_options())

    def compare_controls(self) -> list:
        """The Compare tick (ticked: ["compare"], in both panels; panels.compare ticks it),
        Grad-CAM's layer and Integrated Gradients' steps."""
        return [
            tick(self.compare, COMPARE_WORDS, value="compare"),
            layer_picker(self.compare_layer),
            steps_picker(self.compare_steps),
        ]

    def compare_sample_button(self, name: str, settings: str) -> html.Button:
        """A sample's Compare button (``settings``: where the settings it uses are)."""
        return html.Button(
            "Compare methods", id={"type": self.compare_sample, "name": name},
            className="compare-sample", n_clicks=0,
            title="load this sample and run occlusion, Grad-CAM and Integrated Gradients on "
            f"it at once, with the settings {settings}",
        )  # fmt: skip

    def summary_box(self) -> html.Div:
        return html.Div(id=self.summary, className="summary")


IMAGE_PANEL = PanelScope(
    "",
    named=(("store", "image-store"), ("wanted", "image-wanted"), ("answered", "image-answered"),
           ("ticket", "upload-ticket"), ("region", "region-store"), ("result", "result-store"),
           ("summary", "result-summary"), ("pacs-open", "pacs-open-image")),
)  # fmt: skip
VOLUME_PANEL = PanelScope("volume", named=(("pacs-open", "pacs-open"),))
