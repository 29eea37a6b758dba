"""`make viewer`'s nginx proxy in front of the PACS (demo/viewer.py) signs requests in as
the PACS's user, so it passes reads only: QIDO and WADO through it are served, a STOW
(or a DELETE) is refused and nothing is stored. Before, an upload through the viewer's
port was stored in the PACS. Debian's nginx and Orthanc, as `make viewer` and `make pacs`
start them; the viewer's own files are a stand-in page (the proxy is what is tested)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import requests
from test_pacs import PASSWORD, USER, _free_port, orthanc  # noqa: F401

from demo.pacs import ct_series
from demo.viewer import start_viewer
from krypton.pacs import dicomweb

from .costs import needs_nginx

pytestmark = [pytest.mark.security, needs_nginx]


@pytest.fixture(scope="module")
def stored(orthanc):  # noqa: F811
    """A small CT stored in Orthanc: (study, series, instance)."""
    volume = np.linspace(-1000, 400, 4 * 16 * 16, dtype=np.float32).reshape(4, 16, 16)
    datasets = ct_series(volume, (2.0, 2.0, 2.0), "Viewer^Proxy")
    client = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD))
    dicomweb.store(client, datasets, str(datasets[0].StudyInstanceUID))
    first = datasets[0]
    return str(first.StudyInstanceUID), str(first.SeriesInstanceUID), str(first.SOPInstanceUID)


@pytest.fixture(scope="module")
def viewer(orthanc, tmp_path_factory):  # noqa: F811
    dist = tmp_path_factory.mktemp("dist")
    (dist / "index.html").write_text("<html><body>viewer</body></html>")
    process, url = start_viewer(
        dist, tmp_path_factory.mktemp("viewer"), _free_port(), orthanc, USER, PASSWORD
    )
    yield url
    process.terminate()
    process.wait(timeout=30)


def _stow_body(dataset) -> tuple[bytes, str]:  # type: ignore[no-untyped-def]
    buffer = io.BytesIO()
    dataset.save_as(buffer, enforce_file_format=True)
    boundary = "viewer-proxy-test"
    body = (
        f"--{boundary}\r\nContent-Type: application/dicom\r\n\r\n".encode()
        + buffer.getvalue()
        + f"\r\n--{boundary}--\r\n".encode()
    )
    return body, f'multipart/related; type="application/dicom"; boundary={boundary}'


def test_the_viewers_proxy_serves_reads_and_refuses_stores(viewer, orthanc, stored):  # noqa: F811
    study, series, instance = stored
    found = requests.get(f"{viewer}/dicom-web/studies", params={"StudyInstanceUID": study},
                         timeout=30)  # fmt: skip
    assert found.status_code == 200 and study in found.text  # QIDO, signed in by nginx
    wado = requests.get(
        f"{viewer}/dicom-web/studies/{study}/series/{series}/instances/{instance}",
        headers={"Accept": 'multipart/related; type="application/dicom"'}, timeout=30,
    )  # fmt: skip
    assert wado.status_code == 200 and len(wado.content) > 512  # WADO

    intruder = ct_series(np.zeros((1, 8, 8), np.float32), (1.0, 1.0, 1.0), "Intruder^Upload")[0]
    body, kind = _stow_body(intruder)
    for url in (f"{viewer}/dicom-web/studies", f"{viewer}/dicom-web/studies/{study}"):
        refused = requests.post(url, data=body, headers={"Content-Type": kind}, timeout=30)
        assert refused.status_code == 403, (refused.status_code, refused.text[:200])
    deleted = requests.delete(f"{viewer}/dicom-web/studies/{study}", timeout=30)
    assert deleted.status_code == 403
    client = dicomweb.connect(dicomweb.PacsSettings(orthanc, USER, PASSWORD))
    names = [row.patient_name for row in dicomweb.find_studies(client, limit=100)]
    assert "Intruder^Upload" not in names and "Viewer^Proxy" in names
