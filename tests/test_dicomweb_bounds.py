"""The PACS client's bounds in the library (krypton.pacs.dicomweb and its transport), fast
and in-process, against the hostile DICOMweb server of tests/security: UIDs checked
before a URL, the root and the sign-in settings checked, a deadline that a drip in the
headers cannot outlive, answers held to their budget and listings to their caps."""

from __future__ import annotations

import io
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import psutil
import pydicom
import pydicom.data
import pytest
from security.hostile_pacs import HostilePacs

import krypton
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
    target = krypton.registry.load_model("chestct-demo").volume_target()
    prepared, volume = dicomweb.load_series(
        _connect(hostile, PacsBudgets(answer_bytes=4 * 2**20, pages=20)),
        str(first.StudyInstanceUID), str(first.SeriesInstanceUID), target,
    )  # fmt: skip
    assert volume.shape == (48, 48, 48) and len(volume.headers) == 48
    assert volume.modality == "CT" and prepared.tensor.shape == (1, 48, 48, 48)


def test_malformed_rows_are_read_or_refused_with_a_sentence(hostile):
    hostile.mode = "bad-numbers"
    (series,) = dicomweb.find_series(_connect(hostile), "1.2.3")
    assert series.number is None and series.instances is None and series.description == ""
    hostile.mode = "strings"
    with pytest.raises(dicomweb.PacsError, match="is not a list of DICOM JSON objects"):
        dicomweb.find_series(_connect(hostile), "1.2.3")


# -- below the byte count: the HTTP layer ---------------------------------------------------


@contextmanager
def peak_growth() -> Iterator[list[float]]:
    """This process's RSS sampled every 10 ms while the block runs: [growth in MB] at the
    end (the peak over the baseline, not the end's size)."""
    process, stop, peak = psutil.Process(), threading.Event(), [0]
    baseline = process.memory_info().rss

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            stop.wait(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    growth: list[float] = []
    try:
        yield growth
    finally:
        stop.set()
        sampler.join()
        growth.append(max(0, peak[0] - baseline) / 2**20)


HTTP_LAYER_CASES = [
    # mode, what the sentence says
    ("gzip-stack", r"compressed 2 times over \(gzip, gzip\): Krypton reads one gzip or deflate"),
    ("deflate-stack", r"compressed 2 times over \(deflate, deflate\)"),
    ("gzip-bomb", r"more than 1 MB \(KRYPTON_DICOMWEB_ANSWER_MB\) for the study search"),
    ("brotli", r"in an encoding Krypton does not read \(br\)"),
    ("chunk-line", r"with a protocol line \(a status, header or chunk-size line\) over 8 KB"),
    ("long-header", r"with a protocol line \(a status, header or chunk-size line\) over 8 KB"),
    ("header-flood", "with more than 64 header lines"),
    ("trailers", "with more than 16 trailer lines"),
]


@pytest.mark.parametrize("mode, expected", HTTP_LAYER_CASES, ids=[c[0] for c in HTTP_LAYER_CASES])
def test_the_http_layer_is_bounded_below_the_byte_count(hostile, mode, expected):
    """Before: ``gzip, gzip`` of 12 kB inflated to 1 GB inside one read (+1.7 GB at the
    peak), an endless chunk-size line was read whole (+4.6 GB) and endless trailers held
    the request to its 20 s deadline. Now each is refused at once, in one sentence that
    names the study search, within a few MB."""
    from security.hostile_pacs import ready

    ready(mode)
    hostile.mode = mode
    started = time.monotonic()
    with peak_growth() as growth, pytest.raises(dicomweb.PacsError) as refused:
        dicomweb.find_studies(_connect(hostile))
    took = time.monotonic() - started
    assert re.search(f"^the PACS (answered|sent) .*{expected}", str(refused.value)), refused.value
    assert "study search" in str(refused.value)
    assert growth[0] < 100, f"{mode}: +{growth[0]:.0f} MB"
    assert took < 10, f"{mode}: {took:.1f} s"  # at once, not at the 20 s deadline


def test_krypton_asks_for_identity_and_reads_one_gzip_layer(hostile):
    """A PACS that compresses its answer once is read (within the budget), and the
    request says it wants none."""
    import gzip as gzip_module

    seen: list[str] = []
    original = HostilePacs._send

    def send_gzipped(handler, status, body, content_type, **headers):  # type: ignore[no-untyped-def]
        seen.append(handler.headers.get("Accept-Encoding", ""))
        original(handler, status, gzip_module.compress(body), content_type,
                 Content_Encoding="gzip", **headers)  # fmt: skip

    hostile._send = send_gzipped  # type: ignore[method-assign]
    hostile.mode = "strings"
    with pytest.raises(dicomweb.PacsError, match="is not a list of DICOM JSON objects"):
        dicomweb.find_studies(_connect(hostile))  # decoded: the JSON was read
    assert seen == ["identity"]


def test_slow_pages_end_at_the_actions_deadline_not_after_every_page(hostile):
    """Before: each page just inside the request's deadline, a listing took every page
    (20 x 19 s: 379.6 s in the CLI). Now the listing is one action with one deadline:
    here pages of 1.5 s against a 3 s request deadline end at the 5 s action deadline."""
    hostile.mode, hostile.drip = "slow-pages", 1.5
    budgets = PacsBudgets(deadline=3.0, answer_bytes=2**20, pages=20, action_seconds=5.0)
    started = time.monotonic()
    with pytest.raises(dicomweb.PacsError) as refused:
        dicomweb.find_series(_connect(hostile, budgets), "1.2.3")
    took = time.monotonic() - started
    assert str(refused.value) == (
        "the PACS did not finish the series listing of study 1.2.3 within 5 s "
        "(KRYPTON_DICOMWEB_ACTION_SECONDS)"
    )
    assert 4.5 < took < 7 and len(hostile.requests) <= 4


def test_a_slow_series_download_ends_at_its_actions_deadline(hostile, tmp_path):
    """Before: one request per instance, each with its own deadline (12 instances in
    240 s). Now the download is one action: its deadline, plus a second per 4 MB its
    listing declares (48 instances of 48 x 48: 0.2 MB), ends it."""
    hostile.mode, hostile.drip = "slow-instances", 1.0
    first = hostile.datasets[0]
    budgets = PacsBudgets(deadline=3.0, answer_bytes=2**20, pages=20, action_seconds=4.0)
    started = time.monotonic()
    with pytest.raises(dicomweb.PacsError, match="did not finish the download of series .* 4 s"):
        dicomweb.fetch_series(_connect(hostile, budgets), str(first.StudyInstanceUID),
                              str(first.SeriesInstanceUID), tmp_path)  # fmt: skip
    assert 3.5 < time.monotonic() - started < 6
    asked = sum("/instances/" in path for path in hostile.requests)
    assert dicomweb.IN_FLIGHT <= asked <= 5 * dicomweb.IN_FLIGHT  # at most four at once


def test_an_action_shares_one_byte_budget_across_its_pages(hostile):
    """Each page within its own 1 MB: the action's bytes (here 128 kB, a page of 500
    series rows is about 80 kB) end the listing at its second page."""
    hostile.mode = "endless"
    budgets = PacsBudgets(answer_bytes=2**20, pages=20, action_bytes=2**17)
    with pytest.raises(dicomweb.PacsError, match=r"sent more than 0.125 MB for the series listing"):
        dicomweb.find_series(_connect(hostile, budgets), "1.2.3")


def test_a_deadline_is_said_in_whole_seconds():
    """Before: a store's deadline grew by its bytes and the message said "within
    20.0316 s"."""
    from krypton.pacs.transport import RequestBudget

    late = RequestBudget("storing the result", 0.0, 20.0316, 1, "").late()
    assert late == (
        "the PACS did not finish storing the result within 20 s (KRYPTON_DICOMWEB_DEADLINE_SECONDS)"
    )


def test_a_pacs_that_hangs_up_is_not_called_unreachable(hostile):
    """Before: a PACS that took the request and closed the connection without answering
    "cannot be reached"; it was reached."""
    hostile.mode = "hang-up"
    with pytest.raises(dicomweb.PacsError, match="closed the connection before it finished"):
        dicomweb.find_studies(_connect(hostile))


def test_a_series_over_the_budget_is_refused_from_its_listing_before_any_instance(
    hostile, tmp_path, monkeypatch
):
    """Before: the budget was asked only after every instance was downloaded (84
    instances, 68 s, then refused). Now the listing's rows x columns x bits decide
    before the first WADO request."""
    from krypton.io import _decoding

    hostile.mode = "no-preamble"
    first = hostile.datasets[0]
    monkeypatch.setattr(_decoding.DECODE_BUDGET, "limit_bytes", 2**20)
    with pytest.raises(dicomweb.PacsError, match="decode budget of 1 MB"):
        dicomweb.fetch_series(_connect(hostile), str(first.StudyInstanceUID),
                              str(first.SeriesInstanceUID), tmp_path)  # fmt: skip
    assert sum("/instances/" in path for path in hostile.requests) == 0
    assert list(tmp_path.iterdir()) == []


def test_a_series_is_fetched_four_at_a_time_in_instance_order_with_progress(hostile, tmp_path):
    hostile.mode = "no-preamble"
    first = hostile.datasets[0]
    seen = []
    files = dicomweb.fetch_series(_connect(hostile), str(first.StudyInstanceUID),
                                  str(first.SeriesInstanceUID), tmp_path,
                                  progress=lambda *n: seen.append(n))  # fmt: skip
    assert seen == [(n, 48) for n in range(1, 49)]
    numbers = [int(pydicom.dcmread(path, stop_before_pixels=True).InstanceNumber) for path in files]
    assert numbers == sorted(numbers)


def test_the_stow_body_carries_each_dataset_as_its_file_and_a_map_s_values_in_pieces():
    """The body is made as it is sent: a map's float values pass in 1 MB pieces from the
    dataset's own bytes (dicomweb-client's encoder held a 512 x 512 x 300 map four times
    over). Each part reads back as the dataset it was."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    values = np.arange(3 * 512 * 512, dtype=np.float32)
    made = Dataset()
    made.SOPClassUID, made.SOPInstanceUID = "1.2.840.10008.5.1.4.1.1.30", generate_uid()
    made.Rows, made.Columns, made.NumberOfFrames = 512, 512, 3
    made.FloatPixelData = values.tobytes()
    made.file_meta = FileMetaDataset()
    made.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    made.file_meta.MediaStorageSOPClassUID = made.SOPClassUID
    made.file_meta.MediaStorageSOPInstanceUID = made.SOPInstanceUID
    capture = pydicom.dcmread(pydicom.data.get_testdata_file("CT_small.dcm"))
    pieces = list(dicomweb._stow_body([made, capture], "edge"))
    assert max(len(piece) for piece in pieces) <= max(dicomweb.STOW_CHUNK, 40_000)
    assert "FloatPixelData" in made  # the dataset keeps its values
    body = b"".join(pieces)
    parts = body.split(b"\r\n--edge")[1:-1]
    read = [pydicom.dcmread(io.BytesIO(part.split(b"\r\n\r\n", 1)[1])) for part in parts]
    assert np.array_equal(np.frombuffer(read[0].FloatPixelData, np.float32), values)
    assert read[0].SOPInstanceUID == made.SOPInstanceUID
    assert np.array_equal(read[1].pixel_array, capture.pixel_array)
    assert body.endswith(b"\r\n--edge--")
