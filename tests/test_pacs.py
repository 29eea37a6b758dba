"""Krypton and a PACS: Debian's Orthanc with its DICOMweb plugin, started as an operator
starts it (a configuration file, basic authentication), on a free local port. A CT
series is stored in it; `krypton pacs` finds it, `krypton explain dicomweb:…` explains it
and `--send` stores the heatmap back as a DICOM Parametric Map on the source's frame."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from test_volume_cli import SPACING, volume_model  # noqa: F401

import krypton
from demo.pacs import DICOMWEB_PLUGIN, ORTHANC, ct_series, start_orthanc
from krypton.cli import main
from krypton.pacs import dicomweb

USER, PASSWORD = "radiologist", "pacs-s3cret-word"

pytestmark = pytest.mark.skipif(
    not (Path(ORTHANC).exists() and Path(DICOMWEB_PLUGIN).exists()),
    reason="Debian's orthanc and orthanc-dicomweb are not installed (.ci/run installs them)",
)

STRUCTURED_REPORT = "1.2.840.10008.5.1.4.1.1.88.34"  # Comprehensive 3D SR


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def orthanc(tmp_path_factory):
    """Orthanc's DICOMweb root, with basic authentication, as `make pacs` starts it. A
    free port can be taken by another test's server before Orthanc binds it (seen
    beside the team suite): then Orthanc says so and another port is tried."""
    for attempt in range(3):
        folder = tmp_path_factory.mktemp("orthanc")
        try:
            process, root = start_orthanc(folder, _free_port(), USER, PASSWORD)
            break
        except RuntimeError as exc:
            if "already in use" not in str(exc) or attempt == 2:
                raise
    yield root
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture
def pacs_env(orthanc, monkeypatch):
    monkeypatch.setenv("KRYPTON_DICOMWEB_URL", orthanc)
    monkeypatch.setenv("KRYPTON_DICOMWEB_USER", USER)
    monkeypatch.setenv("KRYPTON_DICOMWEB_PASSWORD", PASSWORD)
    return orthanc


@pytest.fixture(scope="module")
def stored_series(orthanc, tmp_path_factory, hu_volume):  # noqa: F811
    """A CT series stored in Orthanc (STOW-RS), as `make pacs` stores the sample:
    (study, series, its datasets)."""
    datasets = ct_series(hu_volume, (SPACING,) * 3, "Test^Patient")
    settings = dicomweb.PacsSettings(orthanc, USER, PASSWORD)
    dicomweb.store(dicomweb.connect(settings), datasets, datasets[0].StudyInstanceUID)
    return datasets[0].StudyInstanceUID, datasets[0].SeriesInstanceUID, datasets


@pytest.fixture(scope="module")
def hu_volume():  # noqa: F811
    from krypton.synthetic.chestct import ChestCTGenerator

    return ChestCTGenerator(seed=21).sample(label=1).volume


def test_the_pacs_lists_its_studies_and_series(pacs_env, stored_series, capsys):
    study, series, datasets = stored_series
    assert main(["pacs", "studies", "--modality", "CT"]) == 0
    listed = capsys.readouterr().out
    assert study in listed
    assert main(["pacs", "series", study]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if series in row)
    assert f"CT  {len(datasets)} instances  chest CT sample" in line


def test_a_series_from_the_pacs_is_explained_and_sent_back_as_a_parametric_map(
    pacs_env,
    stored_series,
    volume_model,  # noqa: F811
    tmp_path,
    capsys,
):
    study, series, _ = stored_series
    out = tmp_path / "pacs-heatmap"
    code = main([
        "explain", f"dicomweb:{study}/{series}", "--model", "ct-test", "--patch", "8",
        "--stride", "8", "--label", "1", "--out", str(out), "--send",
    ])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "sent       a Parametric Map" in printed.out and "48 Secondary Captures" in printed.out
    assert "a Structured Report of the finding" in printed.out
    values = np.load(out.with_suffix(".npy"))
    client = dicomweb.connect(dicomweb.PacsSettings(pacs_env, USER, PASSWORD)).client
    added = {}  # SOP class -> (series, its instances)
    for row in client.search_for_series(study):
        uid = row["0020000E"]["Value"][0]
        if uid != series:
            instances = client.search_for_instances(study, uid, fields=["SOPClassUID"])
            added[instances[0]["00080016"]["Value"][0]] = (uid, instances)
    parametric_map, secondary_capture = "1.2.840.10008.5.1.4.1.1.30", "1.2.840.10008.5.1.4.1.1.7"
    assert set(added) == {parametric_map, secondary_capture, STRUCTURED_REPORT}
    assert len(added[secondary_capture][1]) == 48  # one per axial slice of the block
    map_uid = added[parametric_map][0]
    (instance,) = client.search_for_instances(study, map_uid)
    stored = client.retrieve_instance(study, map_uid, instance["00080018"]["Value"][0])
    assert stored.SOPClassUID == "1.2.840.10008.5.1.4.1.1.30"  # Parametric Map Storage
    source = stored_series[2][0]
    assert stored.FrameOfReferenceUID == source.FrameOfReferenceUID
    assert stored.StudyInstanceUID == study and int(stored.NumberOfFrames) == 48
    assert "ct-test" in stored.SeriesDescription and "patch 8" in stored.SeriesDescription
    drops = np.asarray(stored.pixel_array, dtype=np.float32)
    heatmap_prob = float(printed.out.split("probability ")[1].split()[0])
    # the largest drop is the class's probability less the lowest cell's
    assert drops.max() == pytest.approx(heatmap_prob - values.min(), abs=2e-3)
    mapping = stored.SharedFunctionalGroupsSequence[0].RealWorldValueMappingSequence[0]
    assert mapping.LUTLabel == "DROP" and "drop in P(" in mapping.LUTExplanation
    assert stored.ContentLabel.startswith("KRYPTON_")  # the result key a batch looks for
    # each capture names the source slice nearest its own, in the source series
    capture_uid, captures = added[secondary_capture]
    first = next(row for row in captures if row["00200013"]["Value"][0] == 1)
    capture = client.retrieve_instance(study, capture_uid, first["00080018"]["Value"][0])
    source_uids = {d.SOPInstanceUID for d in stored_series[2]}
    assert capture.SourceImageSequence[0].ReferencedSOPInstanceUID in source_uids
    assert capture.ReferencedSeriesSequence[0].SeriesInstanceUID == series
    assert capture.PatientID == source.PatientID  # the study's patient module, as DICOM asks
    assert dciodvfy_errors(stored, tmp_path) == []
    assert dciodvfy_errors(capture, tmp_path) == []
    # the finding, as the PACS holds it: its region on a slice of the source series
    (report,) = _stored_in_study(pacs_env, study, STRUCTURED_REPORT)
    assert report.ContentTemplateSequence[0].TemplateIdentifier == "1500"
    drawn = [item for item in _content_items(report) if item.ValueType == "SCOORD"]
    (image,) = drawn[0].ContentSequence
    assert image.ReferencedSOPSequence[0].ReferencedSOPInstanceUID in source_uids
    assert dciodvfy_errors(report, tmp_path) == []


def _content_items(node):
    """Every content item of a Structured Report, depth first."""
    for item in node.get("ContentSequence", []):
        yield item
        yield from _content_items(item)


def dciodvfy_errors(dataset, folder: Path) -> list[str]:
    """dicom3tools' IOD verifier's error lines for ``dataset`` (warnings pass: the
    empty Laterality of a body part that may be paired is one)."""
    if shutil.which("dciodvfy") is None:
        pytest.skip("dicom3tools is not installed (.ci/run installs it)")
    path = folder / f"{dataset.SOPInstanceUID}.dcm"
    dataset.save_as(path, enforce_file_format=True)
    checked = subprocess.run(["dciodvfy", str(path)], capture_output=True, text=True, timeout=60)
    lines = (checked.stdout + checked.stderr).splitlines()
    return [line for line in lines if line.startswith(("Error", "Abort"))]


def test_wrong_credentials_are_refused_and_never_shown(
    pacs_env, stored_series, monkeypatch, capsys
):
    monkeypatch.setenv("KRYPTON_DICOMWEB_PASSWORD", "not-the-password-7x")
    study, series, _ = stored_series
    assert main(["pacs", "series", study]) == 2
    printed = capsys.readouterr()
    assert "HTTP 401" in printed.err and "check the PACS user and password" in printed.err
    assert "not-the-password-7x" not in printed.err + printed.out
    settings = dicomweb.PacsSettings.from_environment()
    assert "not-the-password-7x" not in repr(settings)


def test_no_pacs_configured_and_send_without_a_pacs_source_say_so(
    monkeypatch, capsys, tmp_path, fundus_png
):
    monkeypatch.delenv("KRYPTON_DICOMWEB_URL", raising=False)
    assert main(["pacs", "studies"]) == 2
    assert "no PACS is configured" in capsys.readouterr().err
    assert main(["explain", str(fundus_png), "--out", str(tmp_path / "x.png"), "--send"]) == 2
    assert "--send, --study and --series are for a PACS source" in capsys.readouterr().err
    assert main(["batch", "--out", str(tmp_path / "b"), "--send"]) == 2
    assert "a PACS study with --dicomweb --study UID" in capsys.readouterr().err
    monkeypatch.setenv("KRYPTON_DICOMWEB_URL", "ftp://pacs")
    assert main(["pacs", "studies"]) == 2
    assert "must start with http:// or https://" in capsys.readouterr().err


def test_a_series_listed_over_the_slice_limit_is_refused_before_any_pixel(
    pacs_env, stored_series, monkeypatch
):
    study, series, _ = stored_series
    monkeypatch.setattr(dicomweb, "MAX_SLICES", 3)
    pacs = dicomweb.connect(dicomweb.PacsSettings.from_environment())
    fetched = []
    monkeypatch.setattr(dicomweb, "_retrieve", lambda *a, **k: fetched.append(a) or None)
    with pytest.raises(dicomweb.PacsError, match="lists more than 3 instances, over the slice"):
        dicomweb.fetch_series(pacs, study, series, None)
    assert not fetched


class _LyingPacs:
    """A hostile DICOMweb server (an attacker's, so not Orthanc): it lists one 2x2
    instance and then sends a megabyte for it, or stalls."""

    def __init__(self, stall: float = 0.0, html: bool = False, side: int = 2, parts: int = 1):
        import http.server
        import threading

        stall_for = stall
        fetched = self.fetched = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path.split("?")[0].endswith("/instances"):
                    listing = [{
                        "00080018": {"vr": "UI", "Value": ["1.2.3.4"]},
                        "00280010": {"vr": "US", "Value": [side]},
                        "00280011": {"vr": "US", "Value": [side]},
                        "00280100": {"vr": "US", "Value": [16]},
                    }]  # fmt: skip
                    if "offset=" in self.path and "offset=0" not in self.path:
                        listing = []  # the one page there is (a client asks for more)
                    body = json.dumps(listing).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/dicom+json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                fetched.append(self.path)
                time.sleep(stall_for)
                if html:  # a login page or a proxy's error page where DICOM was asked for
                    page = b"<html><body>Please sign in</body></html>"
                    self.send_response(200)
                    self.send_header("Content-Type", "text/html")
                    self.send_header("Content-Length", str(len(page)))
                    self.end_headers()
                    self.wfile.write(page)
                    return
                boundary = "lie"
                part = (
                    f"--{boundary}\r\nContent-Type: application/dicom\r\n\r\n".encode()
                    + b"\0" * (2**20 if parts == 1 else 200_000) + b"\r\n"
                )  # fmt: skip
                end = f"--{boundary}--\r\n".encode()
                self.send_response(200)
                self.send_header(
                    "Content-Type",
                    f'multipart/related; type="application/dicom"; boundary={boundary}',
                )
                self.send_header("Content-Length", str(len(part) * parts + len(end)))
                self.end_headers()
                try:  # part after part, as a PACS streams them (parts x 200 kB: a gigabyte)
                    for _ in range(parts):
                        self.wfile.write(part)
                    self.wfile.write(end)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()


@pytest.mark.parametrize("stall", [0.0, 3.0])
def test_a_pacs_that_sends_more_than_it_listed_or_stalls_is_refused(tmp_path, stall):
    lying = _LyingPacs(stall)
    try:
        pacs = dicomweb.connect(dicomweb.PacsSettings(lying.url, timeout=1.0))
        expected = "did not answer" if stall else "sent more than the 8 pixel bytes it declared"
        with pytest.raises(dicomweb.PacsError, match=expected):
            dicomweb.fetch_series(pacs, "1.2", "1.2.3", tmp_path)
        assert not list(tmp_path.iterdir())  # nothing kept
    finally:
        lying.close()


def test_a_pacs_that_streams_thousands_of_instances_for_one_is_cut_off_early(tmp_path):
    """The listing declares one 2x2 instance; the answer streams 5,000 instances of 200 kB
    (a gigabyte). The download stops past the declared bytes: in seconds, and the
    process grows by far less than the answer (sampled while it runs)."""
    import threading

    import psutil

    lying = _LyingPacs(parts=5000)
    process = psutil.Process()
    before, peak, running = process.memory_info().rss, [0], [True]

    def sample():
        while running[0]:
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        pacs = dicomweb.connect(dicomweb.PacsSettings(lying.url, timeout=5.0))
        started = time.monotonic()
        with pytest.raises(dicomweb.PacsError, match="sent more than the 8 pixel bytes"):
            dicomweb.fetch_series(pacs, "1.2", "1.2.3", tmp_path)
        assert time.monotonic() - started < 10
        assert not list(tmp_path.iterdir())
    finally:
        running[0] = False
        sampler.join()
        lying.close()
    assert peak[0] - before < 400 * 2**20, f"grew {(peak[0] - before) / 2**20:.0f} MB"


def test_a_pacs_that_answers_with_another_content_type_is_refused(tmp_path):
    lying = _LyingPacs(html=True)
    try:
        pacs = dicomweb.connect(dicomweb.PacsSettings(lying.url, timeout=1.0))
        started = time.monotonic()
        with pytest.raises(dicomweb.PacsError, match="cannot be read .it sent text/html, not"):
            dicomweb.fetch_series(pacs, "1.2", "1.2.3", tmp_path)
        assert time.monotonic() - started < 10
        assert not list(tmp_path.iterdir())
    finally:
        lying.close()


def test_a_pacs_that_lists_a_gigabyte_frame_is_refused_before_any_pixel(tmp_path):
    lying = _LyingPacs(side=32768)  # 32768² 16-bit: 2 GB declared for one instance
    try:
        pacs = dicomweb.connect(dicomweb.PacsSettings(lying.url, timeout=1.0))
        with pytest.raises(dicomweb.PacsError, match="MB"):
            dicomweb.fetch_series(pacs, "1.2", "1.2.3", tmp_path)
        assert lying.fetched == []  # refused from the listing: not one pixel asked for
    finally:
        lying.close()


def test_a_store_the_pacs_takes_only_in_part_says_what_it_kept(orthanc, hu_volume):
    """Orthanc answers 409 when it stores some instances of a STOW-RS request and refuses
    others (here one of another study): the message says how many, why, and which series
    now hold part of the result, rather than a bare "HTTP 409"."""
    ours = ct_series(hu_volume[:2], (SPACING,) * 3, "Part^Stored")
    stray = ct_series(hu_volume[:1], (SPACING,) * 3, "Other^Study")
    pacs = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD))
    with pytest.raises(dicomweb.PacsError) as refused:
        dicomweb.store(pacs, [ours[0], stray[0]], ours[0].StudyInstanceUID)
    message = str(refused.value)
    assert "refused 1 of the result's 2 instances (failure reason 0x" in message
    assert f"it stored 1 (series {ours[0].SeriesInstanceUID})" in message
    assert "remove those there before sending again" in message


def test_make_pacs_loads_the_chest_ct_sample_as_a_ct_series(orthanc):
    from demo.pacs import load_demo_study

    study = load_demo_study(orthanc, USER, PASSWORD)
    pacs = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD))
    (series,) = dicomweb.find_series(pacs, study)
    assert series.modality == "CT" and series.instances and series.instances > 10
    found = {row.study_uid: row for row in dicomweb.find_studies(pacs, patient_id="KRYPTON-DEMO")}
    assert found[study].patient_name == "Demo^Chest" and found[study].modalities == ("CT",)
    from demo.pacs import FUNDUS_SAMPLES, PYDICOM_FILES, load_demo_photographs

    studies = load_demo_photographs(orthanc, USER, PASSWORD)
    assert len(studies) == len(FUNDUS_SAMPLES) + len(PYDICOM_FILES)
    photos = dicomweb.find_studies(pacs, patient_id="KRYPTON-FUNDUS")
    assert len(photos) == len(FUNDUS_SAMPLES) and all(row.modalities == ("OT",) for row in photos)


def test_a_series_loads_as_a_volume_with_its_headers(pacs_env, stored_series):
    study, series, datasets = stored_series
    pacs = dicomweb.connect(dicomweb.PacsSettings.from_environment())
    target = krypton.registry.load_model("chestct-demo").volume_target()
    seen = []
    _, volume = dicomweb.load_series(pacs, study, series, target, lambda *n: seen.append(n))
    headers = volume.headers
    assert seen[-1] == (len(datasets), len(datasets)) and len(seen) == len(datasets)
    assert volume.shape == (len(datasets), *datasets[0].pixel_array.shape)
    assert volume.series_uid == series and volume.modality == "CT"
    assert {h.SOPInstanceUID for h in headers} == {d.SOPInstanceUID for d in datasets}
    assert "PixelData" not in headers[0]  # headers only: what a stored result references


BATCH_REGION = "16,16,16,32,32,32"  # model voxels: 8 cells at patch 8, stride 8


@pytest.fixture(scope="module")
def five_series_study(orthanc, hu_volume):
    """One study of five CT series (thin copies of the sample, every third slice)."""
    from pydicom.uid import generate_uid

    study = generate_uid()
    pacs = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD))
    for number in range(5):
        datasets = ct_series(
            hu_volume[number::3], (3 * SPACING, SPACING, SPACING), "Five^Series", study_uid=study,
            description=f"series {number + 1}",
        )  # fmt: skip
        dicomweb.store(pacs, datasets, study)
    return study


def _parametric_maps(orthanc: str, study: str) -> list[str]:
    pacs = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD))
    return sorted(dicomweb.content_labels(pacs, study, "1.2.840.10008.5.1.4.1.1.30"))


def test_a_study_batch_sends_one_map_per_series_and_nothing_when_run_again(
    pacs_env,
    five_series_study,
    volume_model,  # noqa: F811
    tmp_path,
    capsys,
):
    study = five_series_study
    command = [
        "batch", "--dicomweb", "--study", study, "--model", "ct-test", "--patch", "8",
        "--stride", "8", "--region", BATCH_REGION, "--out", str(tmp_path / "out"), "--send",
    ]  # fmt: skip
    assert main(command) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "5 series explained" in printed and "sent       5 Parametric Maps" in printed
    labels = _parametric_maps(pacs_env, study)
    assert len(labels) == 5  # one key per series: the same model and settings, five sources
    assert _count(pacs_env, study, STRUCTURED_REPORT) == 5  # one finding per result
    summary = (tmp_path / "out" / "summary.csv").read_text().splitlines()
    assert len(summary) == 6 and all(",exact," in line for line in summary[1:])

    # again, the same settings: every result is there already. Its class is the predicted
    # one, which the key names as the class index the run found (as the app's and the
    # CLI's do), so each series is explained again and nothing is sent
    assert main(command) == 0
    printed = capsys.readouterr().out
    assert "sent       0 Parametric Maps" in printed and "5 series had theirs already" in printed
    assert _parametric_maps(pacs_env, study) == labels
    assert _count(pacs_env, study, STRUCTURED_REPORT) == 5  # re-sent: no second report
    # nothing lost locally: the summary still lists the five
    assert len((tmp_path / "out" / "summary.csv").read_text().splitlines()) == 6

    assert main([*command, "--modality", "CT", "--mode", "naive"]) == 0  # other settings
    assert "sent       5 Parametric Maps" in capsys.readouterr().out
    assert len(_parametric_maps(pacs_env, study)) == 10


@pytest.mark.team
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_a_study_batch_on_the_teams_workers_reads_and_sends_through_their_own_pacs(
    pacs_env,
    hu_volume,
    volume_model,  # noqa: F811
    tmp_path,
    capsys,
):
    """`krypton batch --dicomweb --study --send --broker`: a real Celery worker (Redis,
    `make worker`'s command) fetches each series from its own configured PACS and sends
    the map itself; the files are those a local run writes, a re-run sends nothing, and
    the sign-in never travels through Redis."""
    from pydicom.uid import generate_uid

    from bench.dash_client import free_port
    from webapp.cluster import Cluster

    study = generate_uid()
    pacs = dicomweb.connect(dicomweb.PacsSettings.from_environment())
    for number in range(2):
        datasets = ct_series(
            hu_volume[number::3], (3 * SPACING, SPACING, SPACING), "Team^Series",
            study_uid=study, description=f"series {number + 1}",
        )  # fmt: skip
        dicomweb.store(pacs, datasets, study)
    options = ["--model", "ct-test", "--patch", "8", "--stride", "8", "--region", BATCH_REGION]
    assert main(["batch", "--dicomweb", "--study", study, *options,
                 "--out", str(tmp_path / "local")]) == 0  # fmt: skip
    capsys.readouterr()
    cluster = Cluster(tmp_path / "cluster", free_port(), torch_threads=1)  # this environment
    try:
        cluster.start_redis()
        cluster.start_worker("pacs")
        command = [
            "batch", "--dicomweb", "--study", study, *options, "--send",
            "--out", str(tmp_path / "team"), "--broker", cluster.url,
        ]  # fmt: skip
        assert main(command) == 0, capsys.readouterr().err
        printed = capsys.readouterr().out
        assert "2 series explained" in printed and "sent       2 Parametric Maps" in printed
        assert len(_parametric_maps(pacs_env, study)) == 2
        log = cluster.log_text("worker-pacs")
        assert log.count("krypton.pacs_series[") >= 2 and "succeeded" in log
        assert PASSWORD not in log
        assert not any(PASSWORD.encode() in (cluster.client().dump(key) or b"")
                       for key in cluster.client().scan_iter())  # fmt: skip
        for local in (tmp_path / "local").glob("*.npy"):
            assert (tmp_path / "team" / local.name).read_bytes() == local.read_bytes()
        assert main(command) == 0  # again: both results are there, nothing is sent
        assert "2 series had theirs already" in capsys.readouterr().out
        assert len(_parametric_maps(pacs_env, study)) == 2
    finally:
        cluster.stop()


def test_a_worker_without_the_batchs_pacs_says_so(pacs_env, volume_model, monkeypatch):  # noqa: F811
    from krypton.batch import broker
    from krypton.explainer import model_fingerprint

    checksum = model_fingerprint(volume_model.module)[1]
    args = ("w1", "ct-test", checksum, pacs_env, "1.2", "1.2.3", None, {}, True, "KRYPTON_X")
    monkeypatch.delenv("KRYPTON_DICOMWEB_URL")
    answer = broker._pacs_series(*args)
    assert (
        "worker w1 has no PACS configured; give it KRYPTON_DICOMWEB_URL=" in answer["row"]["error"]
    )
    monkeypatch.setenv("KRYPTON_DICOMWEB_URL", "http://elsewhere:8042/dicom-web")
    assert "has another PACS configured" in broker._pacs_series(*args)["row"]["error"]
    assert (
        "different weights" in broker._pacs_series(*args[:2], "0" * 64, *args[3:])["row"]["error"]
    )


def test_explain_names_a_pacs_study_with_flags(
    pacs_env,
    stored_series,
    five_series_study,
    volume_model,  # noqa: F811
    tmp_path,
    capsys,
):
    study, series, _ = stored_series
    out = tmp_path / "flags"
    command = [
        "explain", "--dicomweb", pacs_env, "--study", study, "--model", "ct-test",
        "--patch", "8", "--stride", "8", "--region", BATCH_REGION, "--out", str(out),
    ]  # fmt: skip
    assert main(command) == 0, capsys.readouterr().err  # its one image series, found
    assert "positions  8 evaluated" in capsys.readouterr().out
    assert out.with_suffix(".npy").exists()
    command[4] = five_series_study
    assert main(command) == 2
    assert "has 5 image series: name one with --series" in capsys.readouterr().err


def _count(root: str, study: str, sop_class: str) -> int:
    """How many instances of one SOP class the study holds."""
    client = dicomweb.connect(dicomweb.PacsSettings(root, USER, PASSWORD)).client
    return len(client.search_for_instances(study, search_filters={"SOPClassUID": sop_class}))


def _stored_in_study(root: str, study: str, sop_class: str):
    """The instances of one SOP class in the study, read back (WADO-RS)."""
    client = dicomweb.connect(dicomweb.PacsSettings(root, USER, PASSWORD)).client
    found = client.search_for_instances(study, search_filters={"SOPClassUID": sop_class})
    return [
        client.retrieve_instance(study, row["0020000E"]["Value"][0], row["00080018"]["Value"][0])
        for row in found
    ]


def test_a_slice_explained_by_a_2d_model_is_sent_as_a_map_over_its_own_pixels(
    pacs_env, hu_volume, tmp_path, capsys
):
    datasets = ct_series(hu_volume[20:21], (SPACING,) * 3, "Slice^Patient", origin=(5, 6, 7))
    study, source = datasets[0].StudyInstanceUID, datasets[0]
    dicomweb.store(dicomweb.connect(dicomweb.PacsSettings.from_environment()), datasets, study)
    out = tmp_path / "slice.png"
    code = main([
        "explain", "--dicomweb", "--study", study, "--model", "fundus-demo", "--patch", "56",
        "--stride", "56", "--out", str(out), "--send",
    ])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "sent       a Parametric Map" in printed.out and "a Secondary Capture" in printed.out
    (stored,) = _stored_in_study(pacs_env, study, "1.2.840.10008.5.1.4.1.1.30")
    (report,) = _stored_in_study(pacs_env, study, STRUCTURED_REPORT)
    assert dciodvfy_errors(report, tmp_path) == []
    assert stored.FrameOfReferenceUID == source.FrameOfReferenceUID
    assert (stored.Rows, stored.Columns) == (source.Rows, source.Columns)  # the source's pixels
    position = stored.PerFrameFunctionalGroupsSequence[0].PlanePositionSequence[0]
    assert [float(v) for v in position.ImagePositionPatient] == [5.0, 6.0, 7.0]  # the source's
    drops = np.asarray(stored.pixel_array, dtype=np.float32)
    values = np.load(out.with_suffix(".npy"))
    prob = float(printed.out.split("probability ")[1].split()[0])
    assert drops.max() == pytest.approx(prob - values.min(), abs=2e-3)
    assert dciodvfy_errors(stored, tmp_path) == []
    (capture,) = _stored_in_study(pacs_env, study, "1.2.840.10008.5.1.4.1.1.7")
    assert capture.SourceImageSequence[0].ReferencedSOPInstanceUID == source.SOPInstanceUID
    assert dciodvfy_errors(capture, tmp_path) == []


def test_a_photograph_gets_a_capture_and_says_why_no_map(pacs_env, tmp_path, capsys):
    import pydicom
    from pydicom.data import get_testdata_file
    from pydicom.uid import generate_uid

    from krypton.synthetic.fundus import FundusGenerator

    # a fundus photograph as a secondary capture: no frame of reference
    photo = pydicom.dcmread(get_testdata_file("SC_rgb_small_odd.dcm"))
    pixels = FundusGenerator(seed=3).sample().image
    photo.Rows, photo.Columns = pixels.shape[:2]
    photo.PixelData = np.ascontiguousarray(pixels, dtype=np.uint8).tobytes()
    photo.StudyInstanceUID, photo.SeriesInstanceUID = generate_uid(), generate_uid()
    photo.SOPInstanceUID = photo.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    assert "FrameOfReferenceUID" not in photo
    pacs = dicomweb.connect(dicomweb.PacsSettings.from_environment())
    dicomweb.store(pacs, [photo], photo.StudyInstanceUID)
    code = main([
        "explain", "--dicomweb", "--study", photo.StudyInstanceUID, "--model", "fundus-demo",
        "--patch", "56", "--stride", "56", "--out", str(tmp_path / "photo.png"), "--send",
    ])  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "no Parametric Map (the image has no frame of reference" in printed.out
    assert _stored_in_study(pacs_env, photo.StudyInstanceUID, "1.2.840.10008.5.1.4.1.1.30") == []
    assert len(_stored_in_study(pacs_env, photo.StudyInstanceUID, "1.2.840.10008.5.1.4.1.1.7")) == 2
