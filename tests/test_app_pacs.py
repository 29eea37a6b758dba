"""The volume panel's PACS without a browser: its callbacks against a real Orthanc. What
the page may ask (a series over the volume limit, a Send for a volume it uploaded, a
wrong sign-in) ends in a message, and the sign-in never reaches the page."""

from dataclasses import replace

import pytest
from dash import no_update
from test_pacs import PASSWORD, USER, hu_volume, orthanc, stored_series  # noqa: F401

from krypton.pacs.dicomweb import PacsSettings
from webapp import ids
from webapp.layout import build_layout
from webapp.panel_scope import IMAGE_PANEL, VOLUME_PANEL
from webapp.panels.pacs import PacsPanel
from webapp.panels.volume import VolumePanel
from webapp.services import Services
from webapp.settings import ServerSettings


def _services(tmp_path, root: str, password: str = PASSWORD, **limits) -> Services:
    settings = replace(ServerSettings(), pacs=PacsSettings(root, USER, password), **limits)
    return Services(tmp_path / "cache", settings)


def _ids(component) -> set:
    found = set()
    stack = [component]
    while stack:
        node = stack.pop()
        if getattr(node, "id", None) is not None:
            found.add(node.id if isinstance(node.id, str) else str(node.id))
        children = getattr(node, "children", None)
        stack.extend(children if isinstance(children, list) else [children] if children else [])
    return found


def test_the_page_shows_the_pacs_only_when_the_server_has_one():
    without = _ids(build_layout([], None))
    assert ids.PACS_SEARCH not in without and IMAGE_PANEL.pacs_send not in without
    with_pacs = _ids(build_layout([], None, pacs=True))
    assert {ids.PACS_SEARCH, VOLUME_PANEL.pacs_open, IMAGE_PANEL.pacs_send} <= with_pacs
    assert VOLUME_PANEL.pacs_send in with_pacs  # one Send per panel, one component


def test_a_series_over_the_volume_limit_is_refused_from_the_listing(
    tmp_path,
    orthanc,  # noqa: F811
    stored_series,  # noqa: F811
):
    study, series, _ = stored_series
    services = _services(tmp_path, orthanc, max_volume_mb=0.01)
    record, _, message, _ = VolumePanel(services, None).pacs_volume(
        {"study": study, "series": series}, "PACS CT", "tab-1"
    )
    assert record is no_update
    assert "MB of pixels, over the 0.01 MB a volume may have here" in message


def test_search_lists_the_study_and_its_series_and_a_wrong_sign_in_is_said_plainly(
    tmp_path,
    orthanc,  # noqa: F811
    stored_series,  # noqa: F811
):
    study, series, _ = stored_series
    panel = PacsPanel(_services(tmp_path, orthanc))
    options, chosen, message = panel.search(1, "KRYPTON-DEMO", "", "CT", "")
    assert study in [option["value"] for option in options]
    assert "found" in message
    series_options, picked, _ = panel.list_series(study)
    assert series in [option["value"] for option in series_options]
    _, _, message = panel.search(1, "KRYPTON-DEMO", "2026", "", "")
    assert "YYYYMMDD-YYYYMMDD" in message

    refused = PacsPanel(_services(tmp_path, orthanc, password="wrong-s3cret-9"))
    options, _, message = refused.search(1, "KRYPTON-DEMO", "", "", "")
    assert options == [] and "HTTP 401" in message and "wrong-s3cret-9" not in message


def test_send_stores_only_into_the_study_of_a_series_this_tab_opened(
    tmp_path,
    orthanc,  # noqa: F811
):
    services = _services(tmp_path, orthanc)
    services.results.put("tab-1/volume", {"id": "r1", "source_key": "k1", "model": "m"})
    message = PacsPanel(services).send(3, 1, {"id": "r1", "source_key": "k1"}, "tab-1")
    assert message == "This volume was not opened from the PACS; only those are sent back."
    services.pacs_sources.remember("k1", "tab-2", "1.2.3", "1.2.3.4")  # another tab's
    assert PacsPanel(services).send(3, 1, {"id": "r1", "source_key": "k1"}, "tab-1") == message


def test_one_image_of_a_series_is_named_and_held_to_the_image_limit(
    tmp_path,
    orthanc,  # noqa: F811
    stored_series,  # noqa: F811
):
    from webapp.panels.image import ImagePanel

    study, series, datasets = stored_series
    chosen = {"study": study, "series": series, "image": ""}
    panel = ImagePanel(_services(tmp_path, orthanc))
    image_data, *_, message, _, _, _, _ = panel._load_image(
        IMAGE_PANEL.ticket, {"name": "PACS CT", "pacs": chosen}, [], [], "tab-1"
    )
    assert image_data is no_update
    assert f"has {len(datasets)} images: name one by its UID or instance number" in message
    assert "type it in Image number" in message
    small = ImagePanel(_services(tmp_path, orthanc, max_image_mb=0.002))
    image_data, *_, message, _, _, _, _ = small._load_image(
        IMAGE_PANEL.ticket, {"name": "PACS CT", "pacs": {**chosen, "image": "3"}}, [], [], "t"
    )
    assert image_data is no_update and "over the 0.002 MB an image may have here" in message

    services = _services(tmp_path, orthanc)
    image_data, *_ = ImagePanel(services)._load_image(
        IMAGE_PANEL.ticket, {"name": "PACS CT", "pacs": {**chosen, "image": "3"}}, [], [], "t"
    )
    assert image_data["pacs"] and image_data["dicom"]["info"]["modality"] == "CT"
    assert services.pacs_sources.origin(image_data["dicom"]["source"], "t") == (study, series)
    assert services.pacs_sources.origin(image_data["dicom"]["source"], "other-tab") is None


def test_an_image_send_names_only_images_this_tab_opened(
    tmp_path,
    orthanc,  # noqa: F811
):
    services = _services(tmp_path, orthanc)
    services.results.put("tab-1", {"id": "r1", "dicom": {"source": "k1"}, "model": "m"})
    message = PacsPanel(services).send(2, 1, {"id": "r1"}, "tab-1")
    assert message == "This image was not opened from the PACS; only those are sent back."
    assert PacsPanel(services).send(2, 1, {"id": "r0"}, "tab-1").startswith("The heatmap is")


def test_a_sent_result_is_remembered_for_the_tab_that_sent_it():
    """A photograph's result is a capture alone, with no label the study could be asked
    for: the tab that sent it is told so on a second press; another tab asks the PACS."""
    from webapp.pacs import PacsSources

    sources = PacsSources(limit=2)
    sources.sent("KRYPTON_0000000A", "tab-1")
    assert sources.was_sent("KRYPTON_0000000A", "tab-1")
    assert not sources.was_sent("KRYPTON_0000000A", "tab-2")
    sources.sent("KRYPTON_0000000B", "tab-1")
    sources.sent("KRYPTON_0000000C", "tab-1")  # bounded: the oldest goes
    assert not sources.was_sent("KRYPTON_0000000A", "tab-1")


@pytest.mark.parametrize("url", ["ftp://pacs/dicom-web", "pacs:8042"])
def test_a_bad_pacs_url_stops_the_server_at_start_with_one_line(monkeypatch, url):
    from webapp.settings import SettingsError

    monkeypatch.setenv("KRYPTON_DICOMWEB_URL", url)
    with pytest.raises(SettingsError, match="must start with http:// or https://"):
        ServerSettings.from_environment()


@pytest.mark.parametrize(
    "value", ["../../../../instances?", "../../../system", "1.2.3/../../patients", "1.2.3?expand"]
)
def test_a_typed_value_that_is_no_uid_never_reaches_orthanc(
    tmp_path,
    orthanc,  # noqa: F811
    stored_series,  # noqa: F811
    value,
):
    """Before: a series value of '../../../../instances?' reached Orthanc's own REST list
    of every instance (which ignores offset): the listing looped for ever, holding the
    tab's intake and growing the server by 900 MB in 5 minutes."""
    study, series, _ = stored_series
    services = _services(tmp_path, orthanc)
    record, _, message, _ = VolumePanel(services, None).pacs_volume(
        {"study": study, "series": value}, "PACS CT", "tab-1"
    )
    assert record is no_update and "is not a DICOM UID" in message
    record, _, message, _ = VolumePanel(services, None).pacs_volume(
        {"study": value, "series": series}, "PACS CT", "tab-1"
    )
    assert record is no_update and "is not a DICOM UID" in message
    options, _, message = PacsPanel(services).list_series(value)
    assert options == [] and "is not a DICOM UID" in message


def test_a_pacs_url_with_a_password_stops_the_server_at_start(monkeypatch):
    from webapp.settings import ServerSettings, SettingsError

    monkeypatch.setenv(
        "KRYPTON_DICOMWEB_URL", "https://radiologist:pw-in-url@pacs.example/dicom-web"
    )
    with pytest.raises(SettingsError, match="must not hold a user or password") as refused:
        ServerSettings.from_environment()
    assert "pw-in-url" not in str(refused.value)


def test_one_send_of_a_result_at_a_time_whoever_presses_it():
    from webapp.helpers import InputError
    from webapp.pacs import SENDING, PacsSources

    sources = PacsSources()
    with sources.sending("KRYPTON_abc"):
        with pytest.raises(InputError, match="being sent to the PACS right now"):
            with sources.sending("KRYPTON_abc"):
                pass
        with sources.sending("KRYPTON_other"):  # another result is not held up
            pass
    with sources.sending("KRYPTON_abc"):  # released when the first ended
        pass
    assert "press Send again" in SENDING


def test_the_study_list_is_newest_first_and_a_name_finds_its_studies(
    orthanc,  # noqa: F811
    hu_volume,  # noqa: F811
):
    """Orthanc lists studies in its own order; the page's study list was unsorted. Three
    studies stored middle, oldest, newest are listed newest first. And a part of the
    patient's name finds them: the search's ``*`` went out as ``%2A``, which Orthanc
    matched literally, so no name search found anything."""
    from test_pacs import SPACING

    from demo.pacs import ct_series
    from krypton.pacs import dicomweb
    from webapp.pacs import study_options

    settings = PacsSettings(orthanc, USER, PASSWORD)
    client = dicomweb.connect(settings)
    for date in ("20250601", "20240101", "20261130"):
        datasets = ct_series(hu_volume[:1], (SPACING,) * 3, "Sorted^Patient")
        for dataset in datasets:
            dataset.StudyDate = date
        dicomweb.store(client, datasets, datasets[0].StudyInstanceUID)
    options = study_options(settings, "Sorted", None, None, None)
    dates = [option["label"].split()[0] for option in options]
    assert dates == ["20261130", "20250601", "20240101"], dates
