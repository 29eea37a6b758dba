"""The page's state without a browser: the run lifecycle's every transition, what a result
may be shown beside, the component ids the panels listen to, and the models panel's
messages (they name the user's file, never the server's)."""

from __future__ import annotations

import io
import itertools
import time

import pytest
import torch
from dash import html

from webapp import ids
from webapp.jobs import (
    TRANSITIONS,
    IllegalTransition,
    Phase,
    RunLifecycle,
    format_duration,
)
from webapp.panel_scope import IMAGE_PANEL, VOLUME_PANEL
from webapp.panels.models import ModelsPanel, users_words
from webapp.runs.provenance import Provenance, result_view
from webapp.services import Services

STEPS = {
    Phase.QUEUED: RunLifecycle.queue,
    Phase.RUNNING: RunLifecycle.start,
    Phase.DONE: RunLifecycle.finish,
    Phase.CANCELLED: lambda run: run.cancel("stopped"),
    Phase.FAILED: lambda run: run.fail("broken"),
}
PATHS = {  # how a run reaches each phase from idle
    Phase.IDLE: [],
    Phase.QUEUED: [Phase.QUEUED],
    Phase.RUNNING: [Phase.QUEUED, Phase.RUNNING],
    Phase.DONE: [Phase.QUEUED, Phase.RUNNING, Phase.DONE],
    Phase.CANCELLED: [Phase.QUEUED, Phase.CANCELLED],
    Phase.FAILED: [Phase.FAILED],
}


def reach(phase: Phase) -> RunLifecycle:
    run = RunLifecycle()
    for step in PATHS[phase]:
        STEPS[step](run)
    return run


@pytest.mark.parametrize("start,target", list(itertools.product(Phase, STEPS)))
def test_every_transition_is_allowed_or_refused_as_the_table_says(start, target):
    run = reach(start)
    assert run.phase is start
    if target in TRANSITIONS[start]:
        STEPS[target](run)
        assert run.phase is target and run.history[-1][0] is target
        assert run.final == (target in (Phase.DONE, Phase.CANCELLED, Phase.FAILED))
    else:
        with pytest.raises(IllegalTransition):
            STEPS[target](run)
        assert run.phase is start  # a refused step changes nothing


def test_a_finished_run_accepts_nothing_and_keeps_its_reason():
    run = reach(Phase.CANCELLED)
    assert run.reason == "stopped"
    for step in STEPS.values():
        with pytest.raises(IllegalTransition):
            step(run)
    with pytest.raises(IllegalTransition, match="progress reported while cancelled"):
        run.progress(1, 2)


def test_progress_counts_only_while_running_and_time_left_comes_from_the_rate():
    run = reach(Phase.QUEUED)
    with pytest.raises(IllegalTransition):
        run.progress(1, 10)
    run.start()
    assert run.seconds_left() is None and run.status() == "0 of 0 positions"
    for done in (2, 4, 6):
        time.sleep(0.05)
        run.progress(done, 10)
    left = run.seconds_left()
    # about 25 ms per position, 4 positions to go: ~0.1 s (loose: a busy machine)
    assert left is not None and 0.02 < left < 2.0
    assert run.status().startswith("6 of 10 positions · about ")
    run.progress(12, 12)  # the total was revised; the end is reached
    assert run.seconds_left() == 0.0 and run.status() == "12 of 12 positions"
    run.finish()
    assert run.seconds_left() is None


def test_time_left_counts_only_positions_the_run_computed_itself():
    """Cells known from earlier runs arrive in the first report, at once; the pace is the
    run's own from there (before: the first figure counted them as computed in no time
    and promised 3.1 s for a run of 93 s)."""
    run = reach(Phase.QUEUED)
    run.start()
    run.progress(90, 100)  # 90 cells known from an earlier run, reported at once
    assert run.seconds_left() is None  # no pace yet: nothing was computed
    time.sleep(0.2)
    run.progress(92, 100)  # two positions computed in 0.2 s: 0.8 s for the last eight
    left = run.seconds_left()
    assert left is not None and left >= 0.75, left


def test_a_chunked_runs_time_left_starts_after_its_first_chunk_at_its_pace_from_there():
    """Exact's first chunk warms the model and times naive inference beside it: a pace
    taken from it gave a first time-left 1.6-1.8x the time the run still took in 7 of 10
    runs on an idle host (bench.time_left). Replayed with the run's own times."""
    run = reach(Phase.QUEUED)
    run.chunked = True
    run.start()
    run.progress(0, 116, now=0.0)
    run.progress(8, 116, now=4.0)  # the first chunk: 0.5 s a position (probes, naive)
    assert run.seconds_left() is None  # no figure from the first chunk's pace
    run.progress(16, 116, picture=True, now=8.0)  # its picture: the first chunk is done
    assert run.seconds_left() is None
    run.progress(66, 116, now=13.0)  # 50 positions in 5 s: 0.1 s each from here
    assert run.seconds_left() == pytest.approx(5.0)  # the first chunk's pace said 25 s
    # an approximate run reports no chunk pictures with its counts: its pace as before
    plain = reach(Phase.QUEUED)
    plain.start()
    plain.progress(0, 116, now=0.0)
    plain.progress(16, 116, now=8.0)
    assert plain.seconds_left() == pytest.approx(50.0)


def test_the_queue_moves_a_run_through_queued_running_and_done():
    """The run strip told a run's lifecycle "queued" before the queue had admitted it and
    "running" beside the queue's own step; the queue moves it now
    (webapp.jobs.JobQueue.slot). Queued once admitted, running with its place (a light
    run at once), done when the block ends normally; a failure inside stays running
    for the caller to end with its reason, and a refused run was never queued."""
    from webapp.jobs import JobQueue, QueueFull

    queue = JobQueue(running=1, waiting=0, per_session=1, per_client=1)
    for light in (False, True):
        run = RunLifecycle()
        with queue.slot("tab", lambda ahead: None, "a", light, lifecycle=run):
            assert run.phase is Phase.RUNNING
        assert [phase for phase, _ in run.history] == [Phase.QUEUED, Phase.RUNNING, Phase.DONE]
    broken = RunLifecycle()
    with pytest.raises(ValueError):
        with queue.slot("tab", lambda ahead: None, "a", lifecycle=broken):
            raise ValueError("the run's own error")
    assert broken.phase is Phase.RUNNING
    broken.fail("the run's own error")
    refused = RunLifecycle()
    with queue.slot("tab", lambda ahead: None, "a"):  # this client's one place
        with pytest.raises(QueueFull):
            with queue.slot("tab 2", lambda ahead: None, "a", lifecycle=refused):
                pass
    assert refused.phase is Phase.IDLE and refused.history == []


def test_durations_are_written_in_one_unit():
    assert format_duration(4.26) == "4.3 s"
    assert format_duration(45) == "45 s"
    assert format_duration(150) == "2.5 min"
    assert format_duration(3 * 3600) == "3.0 h"


def provenance(**changes) -> Provenance:
    fields = dict(
        image="a" * 24,
        model="fundus-demo",
        weights="w1",
        region=[0, 0, 64, 64],
        patch=16,
        stride=8,
        mode="exact",
        colour=(0.5, 0.5, 0.5),
        label=2,
    )
    fields.update(changes)
    return Provenance.make(**fields)


def test_a_result_is_shown_only_beside_what_it_explains():
    shown = provenance()
    assert result_view(shown, provenance(region=(0, 0, 64, 64))).show  # list or tuple
    assert result_view(shown, Provenance.from_dict(shown.as_dict())).show
    assert not result_view(None, shown).show
    hidden = result_view(shown, None)
    assert not hidden.show and "another image" in hidden.reason
    for change, words in [
        ({"image": "b" * 24}, "the image"),
        ({"model": "other", "weights": "w2"}, "the model"),
        ({"weights": "w2"}, "the model's weights"),
        ({"region": None}, "the region"),
        ({"patch": 32}, "the patch size"),
        ({"stride": 16}, "the stride"),
        ({"mode": "naive"}, "the mode"),
        ({"colour": (0, 0, 0)}, "the occluder colour"),
        ({"label": 0}, "the class"),
    ]:
        view = result_view(shown, provenance(**change))
        assert not view.show and words in view.reason, (change, view.reason)
    assert (
        "the model's weights" not in result_view(shown, provenance(model="x", weights="y")).reason
    )
    relabelled = shown.with_label(0)
    assert result_view(relabelled, provenance(label=0)).show


PANELS = (IMAGE_PANEL, VOLUME_PANEL)
STRIPS = tuple(panel.strip for panel in PANELS)
# the panels' parts (webapp.panel_scope), and the types of their pattern-matching ids
# ({"type": ..., "name": ...})
PANEL_PARTS = ("upload", "ticket", "store", "wanted", "answered", "region", "region_text",
               "reset_region", "compare_pending", "model", "mode", "patch", "stride", "label",
               "compare", "compare_layer", "result", "summary", "compare_panel")  # fmt: skip
PACS_PARTS = ("pacs_open", "pacs_send", "pacs_sent")  # only where the server has a PACS
PATTERN_TYPES = ("sample", "compare_sample")
STRIP_PARTS = ("run", "cancel", "progress", "live_panel", "live_graph", "live_status",
               "message", "busy", "download", "estimate", "estimate_store")  # fmt: skip


@pytest.mark.parametrize("pacs", [False, True])
def test_every_id_a_callback_uses_is_on_the_page(tmp_path, monkeypatch, pacs):
    """Every id the page declares is on it and every callback's ids are there; the PACS
    search and Send only where the server has a PACS (and then all of them)."""
    from app import create_app

    if pacs:  # nothing is asked of the PACS until a search
        monkeypatch.setenv("KRYPTON_DICOMWEB_URL", "http://127.0.0.1:9/dicom-web")
    else:
        monkeypatch.delenv("KRYPTON_DICOMWEB_URL", raising=False)
    app = create_app(tmp_path / "cache")
    layout = app.layout() if callable(app.layout) else app.layout
    on_page, types = set(), set()

    def walk(component):
        if isinstance(component, (list, tuple)):
            for child in component:
                walk(child)
            return
        if not hasattr(component, "to_plotly_json"):
            return
        identity = getattr(component, "id", None)
        if isinstance(identity, dict):
            types.add(identity["type"])
        elif identity:
            on_page.add(identity)
        walk(getattr(component, "children", None))

    walk(layout)
    declared = {
        value
        for name, value in vars(ids).items()
        if name.isupper()
        and name not in ("OOD_WARNING", "REUSE_INFO")
        and isinstance(value, str)
        and (pacs or not name.startswith("PACS_"))
    }
    # the panels' and their run strips' ids are their component's, one set per panel
    declared |= {getattr(panel, part) for panel in PANELS for part in PANEL_PARTS}
    declared |= {getattr(panel, part) for panel in PANELS for part in PACS_PARTS if pacs}
    declared |= {getattr(strip, part) for strip in STRIPS for part in STRIP_PARTS}
    assert declared <= on_page, declared - on_page
    assert pacs or not {i for i in on_page if i.startswith("pacs-")}  # no PACS: no search
    assert {getattr(panel, part) for panel in PANELS for part in PATTERN_TYPES} <= types
    assert {strip.export for strip in STRIPS} <= types
    used = set()
    for key, spec in app.callback_map.items():
        for dependency in spec["inputs"] + spec.get("state", []):
            used.add(dependency["id"])
        outputs = key[2:-2].split("...") if key.startswith("..") else [key]
        used.update(output.rsplit(".", 1)[0] for output in outputs)
    used = {u for u in used if not u.startswith("{")}  # pattern-matching ids: types above
    assert used <= on_page, used - on_page


KIND_WORDS = {"image", "volume", "images", "volumes"}


def kind_twins(names) -> list[set[str]]:
    """Groups of ids (or names) that differ only by a kind word ("pacs-send" and
    "pacs-image-send", "MODEL" and "VOLUME_MODEL"): the words of each, split on "-" or
    "_", with the kind words left out, are the same."""
    groups: dict[tuple[str, ...], set[str]] = {}
    for name in names:
        words = tuple(w for w in name.lower().replace("_", "-").split("-") if w not in KIND_WORDS)
        groups.setdefault(words, set()).add(name)
    return [group for group in groups.values() if len(group) > 1]


def test_the_twin_finder_finds_ids_that_differ_only_by_a_kind_word():
    """The twin check looked only for a volume- prefix, so "pacs-send" beside
    "pacs-image-send" (and "pacs-open" beside "pacs-open-image") passed it."""
    assert kind_twins(["pacs-send", "pacs-image-send", "pacs-sent"]) == [
        {"pacs-send", "pacs-image-send"}
    ]
    assert kind_twins(["MODEL", "VOLUME_MODEL", "MODEL_CARD"]) == [{"MODEL", "VOLUME_MODEL"}]
    assert kind_twins(["image-graph", "volume-graph-axial", "dicom-info"]) == []


def test_what_both_panels_have_is_one_component_and_ids_holds_one_panels_own():
    """A widget both panels have is the panel component's (webapp.panel_scope), one
    instance per panel: webapp.ids keeps no twin pair (once 37 VOLUME_* ids, 27 of them
    twins of image ids: "model" and "volume-model", ...; then "pacs-open" and
    "pacs-open-image", each panel's Open from the PACS), and the two instances' ids
    never meet."""
    constants = {name: value for name, value in vars(ids).items()
                 if name.isupper() and isinstance(value, str)}  # fmt: skip
    assert kind_twins(constants.values()) == [], kind_twins(constants.values())
    assert kind_twins(constants) == [], kind_twins(constants)  # and by the names
    parts = (*PANEL_PARTS, *PACS_PARTS, *PATTERN_TYPES, "compare_pending")
    image = {getattr(IMAGE_PANEL, part) for part in parts}
    volume = {getattr(VOLUME_PANEL, part) for part in parts}
    assert len(image) == len(volume) == len(set(parts)) and not image & volume
    assert not (image | volume) & set(constants.values())
    strip_ids = {getattr(strip, part) for strip in STRIPS for part in STRIP_PARTS}
    assert not strip_ids & (image | volume | set(constants.values()))


@pytest.fixture
def models_panel(tmp_path) -> tuple[ModelsPanel, Services]:
    services = Services(tmp_path / "cache")
    return ModelsPanel(services), services


def upload(services: Services, data: bytes, filename: str, session: str = "tab") -> dict:
    token = services.uploads.save(io.BytesIO(data), len(data), "model", session, filename, 1 << 30)
    return {"token": token, "name": filename, "bytes": len(data)}


def message_text(answer) -> str:
    message = answer[-1]
    return message.children if isinstance(message, html.Span) else str(message)


def test_model_messages_name_the_users_file_and_no_server_path(models_panel, tmp_path):
    panel, services = models_panel
    ticket = upload(services, b"these bytes are not a checkpoint", "my-oct-weights.pt")
    text = message_text(
        panel.register_model(1, ticket, "my-oct-weights.pt", "tab", "oct", "resnet18", "a,b", 64)
    )
    assert "my-oct-weights.pt" in text, text
    assert ticket["token"] not in text and ".model" not in text and "/" not in text, text

    import torchvision

    from krypton.registry import user_models_dir

    user_models_dir().mkdir(parents=True, exist_ok=True)
    (user_models_dir() / "taken.pt").write_bytes(b"left from an earlier attempt")
    state = torchvision.models.resnet18(num_classes=2).state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)
    ticket = upload(services, buffer.getvalue(), "resnet-2.pt")
    text = message_text(
        panel.register_model(1, ticket, "resnet-2.pt", "tab", "taken", "resnet18", "a,b", 64)
    )
    assert "already exists" in text and "taken.pt" in text, text
    assert str(user_models_dir()) not in text and "/" not in text, text


def test_users_words_keeps_file_names_and_drops_folders(tmp_path):
    upload_path = tmp_path / "abc123.model"
    message = f"cannot read {upload_path}: bad; /srv/krypton/home/models/x.json exists"
    assert users_words(message, upload_path, "mine.pt") == "cannot read mine.pt: bad; x.json exists"


def test_approximate_results_are_bound_to_their_quality_and_drill_down_settings():
    """The provenance check ignored approximate mode's sliders: a heatmap computed at one
    quality target stayed up, downloads enabled, after the slider moved."""
    shown = provenance(mode="approximate", approximate=(0.9, 0.25, 3.0))
    assert result_view(shown, provenance(mode="approximate", approximate=[0.9, 0.25, 3.0])).show
    for moved in ((0.8, 0.25, 3.0), (0.9, 0.5, 3.0), (0.9, 0.25, 5.0)):
        hidden = result_view(shown, provenance(mode="approximate", approximate=moved))
        assert not hidden.show and "the approximate-mode settings" in hidden.reason
    # the other modes do not read the sliders: moving them leaves an exact result up
    exact = provenance(approximate=(0.9, 0.25, 3.0))
    assert result_view(exact, provenance(approximate=(0.5, 1.0, 2.0))).show
    assert Provenance.from_dict(shown.as_dict()) == shown


def test_a_volume_result_is_bound_to_its_patch_stride_mode_and_region():
    """The volume panel compared only the run's id, the volume and the model: a changed
    patch, stride, mode or region left the old heatmap up. Volumes now share the image
    panel's provenance (a six-number region, no occluder colour)."""
    shown = provenance(region=(0, 8, 8, 16, 40, 40), colour=(), patch=8, stride=4)
    same = provenance(region=[0, 8, 8, 16, 40, 40], colour=(), patch=8, stride=4)
    assert result_view(shown, same).show
    for change, words in [
        (dict(patch=12), "the patch size"),
        (dict(stride=8), "the stride"),
        (dict(mode="naive"), "the mode"),
        (dict(region=(0, 0, 0, 16, 48, 48)), "the region"),
        (dict(label=1), "the class"),
    ]:
        fields = dict(region=(0, 8, 8, 16, 40, 40), colour=(), patch=8, stride=4)
        fields.update(change)
        hidden = result_view(shown, provenance(**fields))
        assert not hidden.show and words in hidden.reason


def test_the_model_card_keeps_run_in_view():
    """The card ran to about 250 words ("unusualness … at relu", every measured number)
    and pushed Run below the fold: a few words stay in view, the rest behind "more"."""
    from dash import html

    from krypton.registry import load_model
    from webapp.model_card import model_card_lines
    from webapp.panels.image.estimate import model_card

    loaded = load_model("fundus-demo")
    card = model_card(loaded)
    *shown, more = card.children
    words = " ".join(part.children for part in shown).split()
    assert len(words) <= 30, words
    assert "Out-of-distribution check: on." in [part.children for part in shown]
    assert isinstance(more, html.Details) and more.children[0].children == "more about this model"
    hidden = [part.children for part in more.children[1:]]
    assert all(line in hidden for line in model_card_lines(loaded)[2:])
