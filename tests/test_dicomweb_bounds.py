"""The PACS client's bounds in the library (krypton.pacs.dicomweb and its transport), fast
and in-process, against the hostile DICOMweb server of tests/security: UIDs checked
before a URL, the root and the sign-in settings checked, a deadline that a drip in the
headers cannot outlive, answers held to their budget and listings to their caps."""

from __future__ import annotations

import time

import pytest
from security.hostile_pacs import HostilePacs

from krypton.pacs import dicomweb
from krypton.pacs.transport import PacsBudgets

# The drip tests' clock: a 2 s per-read timeout that a byte every 0.5 s never trips, and
# a 3 s deadline that does. Only they use it: beside a busy test suite (load 7 on 2 cores)
# the hostile server's thread once sent nothing for 2 s in a listing of 500 rows, and a
# test of the row cap then failed on a timeout it was not about.
SHORT = PacsBudgets(read_timeout=2.0, deadline=3.0, answer_bytes=2**20, pages=20)
# every other test's: the product's own default timeouts, a small answer budget
ROOMY = PacsBudgets(answer_bytes=2**20, pages=20)


@pytest.fixture
def hostile():
    pacs = HostilePacs("redirect", drip=0.5)
    yield pacs
    pacs.close()


def _connect(pacs: HostilePacs, budgets: PacsBudgets = ROOMY) -> dicomweb.Pacs:
    return dicomweb.connect(
        dicomweb.PacsSettings(pacs.url, timeout=budgets.read_timeout, budgets=budgets)
    )


@pytest.mark.parametrize(
    "value",
    ["1.2.840.10008.5.1.4.1.1.2", "1", "0.0", "1.2.826.0.1.3680043.8.498." + "1" * 35],
)
def test_a_uid_passes(value):
    assert dicomweb.check_uid(value, "the series") == value


@pytest.mark.parametrize(
    "value",
    [
        "../../instances?",
        "1.2.3/../x",
        "1.2.3?expand",
        "1..2",
        ".1",
        "1.",
        "",
        None,
        "1 2",
        "1.2.a",
        "1" * 65,
        "１.２",
    ],  # fmt: skip
)
def test_what_is_not_a_uid_is_refused_by_name(value):
    with pytest.raises(dicomweb.PacsError, match="the series UID .* is not a DICOM UID"):
        dicomweb.check_uid(value, "the series")


@pytest.mark.parametrize(
    "url, expected",
    [
        ("http://user:pw@127.0.0.1/dicom-web", "must not hold a user or password"),
        ("http://user@127.0.0.1/dicom-web", "must not hold a user or password"),
        ("http://127.0.0.1/dicom-web?x=1", r"no \? or #"),
        ("http://127.0.0.1/dicom-web#top", r"no \? or #"),
        ("ftp://127.0.0.1/dicom-web", "must start with http:// or https://"),
        ("http://127.0.0.1:port/dicom-web", "not a valid address"),
    ],
)
def test_a_root_that_is_not_a_plain_address_is_refused(url, expected):
    with pytest.raises(dicomweb.PacsError, match=expected) as refused:
        dicomweb.PacsSettings.from_environment({"KRYPTON_DICOMWEB_URL": url})
    assert "pw" not in str(refused.value).replace("password", "")


def test_a_drip_in_the_headers_ends_at_the_deadline(hostile):
    """A byte every 0.5 s never trips a 2 s per-read timeout; the watchdog's deadline
    (3 s here) shuts the socket mid-headers."""
    hostile.mode = "drip"
    started = time.monotonic()
    with pytest.raises(dicomweb.PacsError, match="did not finish the study search within 3 s"):
        dicomweb.find_studies(_connect(hostile, SHORT))
    assert 2.9 < time.monotonic() - started < 8


def test_the_deadline_of_one_request_does_not_touch_the_next(hostile):
    """After a request ended at its deadline the same client asks again and is answered
    (a connection the watchdog shut is not reused)."""
    pacs = _connect(hostile, SHORT)
    hostile.mode = "drip"
    with pytest.raises(dicomweb.PacsError, match="did not finish"):
        dicomweb.find_studies(pacs)
    hostile.mode = "rows-over"
    assert len(dicomweb.find_studies(pacs, limit=7)) == 7


def test_endless_pages_stop_one_row_past_the_cap(hostile):
    hostile.mode = "endless"
    pacs = _connect(hostile)
    with pytest.raises(dicomweb.PacsError, match="lists more than 2048 instances"):
        dicomweb.fetch_series(pacs, "1.2.3", "1.2.3.4", None)  # type: ignore[arg-type]
    listings = [path for path in hostile.requests if "/instances" in path]
    assert len(listings) == 5  # 4 full pages of 500, and 49 rows of the fifth: 2,049
    assert not any("/instances/" in path for path in hostile.requests)  # no pixel asked


def test_a_listing_past_its_pages_is_refused(hostile):
    hostile.mode = "endless"
    pacs = _connect(hostile, PacsBudgets(answer_bytes=2**20, pages=2))
    with pytest.raises(dicomweb.PacsError, match="did not end within 2 pages"):
        dicomweb.find_series(pacs, "1.2.3")


def test_an_answer_over_its_budget_is_cut_off(hostile):
    hostile.mode = "rows"  # 9 MB of rows
    with pytest.raises(dicomweb.PacsError, match=r"sent more than 1 MB .* for the study search"):
        dicomweb.find_studies(_connect(hostile))


def test_the_study_search_is_held_to_its_limit(hostile):
    hostile.mode = "rows-over"
    assert len(dicomweb.find_studies(_connect(hostile), limit=50)) == 50
    with pytest.raises(dicomweb.PacsError, match="1 to 1000 studies"):
        dicomweb.find_studies(_connect(hostile), limit=100_000)


def test_a_redirect_is_refused_and_not_followed(hostile):
    target = HostilePacs("rows-over")
    hostile.mode, hostile.redirect_to = "redirect", target.url.rsplit("/", 1)[0] + "/"
    try:
        with pytest.raises(dicomweb.PacsError, match=r"redirect \(HTTP 302\)"):
            dicomweb.find_studies(_connect(hostile))
        assert target.requests == []
    finally:
        target.close()


def test_an_instance_without_its_preamble_is_read_as_a_volume(hostile):
    hostile.mode = "no-preamble"
    first = hostile.datasets[0]
    volume, headers = dicomweb.load_series(
        _connect(hostile, PacsBudgets(answer_bytes=4 * 2**20, pages=20)),
        str(first.StudyInstanceUID), str(first.SeriesInstanceUID),
    )  # fmt: skip
    assert volume.shape == (48, 48, 48) and len(headers) == 48
    assert volume.modality == "CT"


def test_malformed_rows_are_read_or_refused_with_a_sentence(hostile):
    hostile.mode = "bad-numbers"
    (series,) = dicomweb.find_series(_connect(hostile), "1.2.3")
    assert series.number is None and series.instances is None and series.description == ""
    hostile.mode = "strings"
    with pytest.raises(dicomweb.PacsError, match="is not a list of DICOM JSON objects"):
        dicomweb.find_series(_connect(hostile), "1.2.3")
