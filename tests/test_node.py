"""Krypton as an AI node, fed as a site feeds one: Debian's Orthanc with a modality entry
for the node and a Lua ``OnStableSeries`` rule that sends it each new CT series; the node
(a pynetdicom Storage SCP) explains the series once it is stable and stores the map and
the finding back in the study, without a click. Refusals (a caller not on the
allow-list, a non-image SOP class, a spool over its quota, a malformed instance) are
each answered, logged, and the node serves on."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import pytest
from test_pacs import PASSWORD, USER, _free_port

from demo.pacs import DICOMWEB_PLUGIN, ORTHANC, ct_series, node_routing, start_orthanc
from krypton.node import Node, NodeSettings, Spool
from krypton.pacs import dicomweb

pytestmark = [
    pytest.mark.skipif(
        not (Path(ORTHANC).exists() and Path(DICOMWEB_PLUGIN).exists()),
        reason="Debian's orthanc and orthanc-dicomweb are not installed (.ci/run installs them)",
    ),
    pytest.mark.xdist_group("node"),  # one Orthanc and one node, the tests in order
]
STRUCTURED_REPORT = "1.2.840.10008.5.1.4.1.1.88.34"
PARAMETRIC_MAP = "1.2.840.10008.5.1.4.1.1.30"
PACS_AE = "SITEPACS"


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    """Orthanc routing stable CT series to a node, and the node: (Orthanc's DICOMweb
    root, the node)."""
    folder = tmp_path_factory.mktemp("routed")
    node_port = _free_port()
    extra = node_routing(folder, node_port, PACS_AE, stable_seconds=2)  # what make pacs does
    process, root = start_orthanc(folder / "pacs", _free_port(), USER, PASSWORD, extra)
    pacs = dicomweb.connect(dicomweb.PacsSettings(root, USER, PASSWORD))
    settings = NodeSettings(port=node_port, callers=(PACS_AE,), spool=folder / "spool",
                            stable_seconds=2.0)  # fmt: skip
    node = Node(settings, pacs)
    node.start()
    yield root, node
    node.stop()
    process.terminate()
    process.wait(timeout=30)


ROUTED: dict = {}  # the first test's series, for the restart test after it


def _count(root: str, study: str, sop_class: str) -> int:
    client = dicomweb.connect(dicomweb.PacsSettings(root, USER, PASSWORD)).client
    return len(client.search_for_instances(study, search_filters={"SOPClassUID": sop_class}))


def test_a_series_stored_in_the_pacs_comes_back_explained_without_a_click(routed):
    from krypton.synthetic.chestct import ChestCTGenerator

    root, node = routed
    hu = ChestCTGenerator(seed=21).sample(label=1).volume
    datasets = ct_series(hu, (5.0, 5.0, 5.0), "Routed^Patient")
    study, series = str(datasets[0].StudyInstanceUID), str(datasets[0].SeriesInstanceUID)
    pacs = dicomweb.connect(dicomweb.PacsSettings(root, USER, PASSWORD))
    dicomweb.store(pacs, datasets, study)
    ROUTED["datasets"] = datasets
    stored_at = time.monotonic()
    while time.monotonic() - stored_at < 120 and _count(root, study, STRUCTURED_REPORT) == 0:
        time.sleep(1.0)
    took = time.monotonic() - stored_at
    print(f"the finding was in the study {took:.1f} s after the series was stored")
    assert _count(root, study, STRUCTURED_REPORT) == 1, "no finding came back in 120 s"
    assert _count(root, study, PARAMETRIC_MAP) == 1
    (row,) = [r for r in node.spool.rows() if r.series == series]
    assert row.state == "done" and "chestct-demo" in row.reason, row
    assert row.instances == len(datasets)  # counted as they came, each once
    assert not node.spool.series_folder(series).exists()  # cleared once stored
    # Orthanc routes Krypton's own new series too (its rule sees CT): they are skipped,
    # and the study holds one result
    time.sleep(6.0)
    assert _count(root, study, STRUCTURED_REPORT) == 1


def test_a_node_stopped_mid_run_explains_again_on_restart_and_stores_nothing_twice(
    routed, tmp_path
):
    """A node killed while a series was queued or running finds it again in its spool
    on restart and explains it; the study holds its result already (the same key), so
    nothing is stored twice."""
    import io
    import json

    root, node = routed
    if "datasets" not in ROUTED:
        pytest.skip("the routed series did not come back")
    datasets = ROUTED["datasets"]
    study, series = str(datasets[0].StudyInstanceUID), str(datasets[0].SeriesInstanceUID)
    spool = Spool(tmp_path / "spool", 2**30, 0.0)
    for dataset in datasets:
        buffer = io.BytesIO()
        dataset.save_as(buffer, enforce_file_format=True)
        spool.receive(buffer.getvalue(), series, study, str(dataset.SOPInstanceUID), "CT",
                      PACS_AE)  # fmt: skip
    spool.take_stable()  # queued, and then the node died
    state = json.loads((tmp_path / "spool" / "state.json").read_text())
    assert [row["state"] for row in state] == ["queued"]
    settings = NodeSettings(port=_free_port(), callers=(PACS_AE,), spool=tmp_path / "spool",
                            stable_seconds=0.0)  # fmt: skip
    restarted = Node(settings, node.pacs)
    (again,) = restarted.spool.take_stable()
    restarted.explain(again)
    (row,) = restarted.spool.rows()
    assert row.state == "done" and "holds its result already" in row.reason, row
    assert _count(root, study, STRUCTURED_REPORT) == 1
    assert _count(root, study, PARAMETRIC_MAP) == 1


def test_a_one_image_series_is_explained_by_the_2d_model_made_for_it(routed):
    """A CT series of one slice goes to the 2-D model whose card names CT
    (chestct-slice-demo): a one-frame map at the slice's pixels and the finding, keyed
    as `krypton explain --send` keys an image."""
    from krypton.synthetic.chestct import ChestCTGenerator

    root, node = routed
    hu = ChestCTGenerator(seed=21).sample(label=1).volume[20:21]
    datasets = ct_series(hu, (5.0, 5.0, 5.0), "Slice^Routed", origin=(5, 6, 7))
    study, series = str(datasets[0].StudyInstanceUID), str(datasets[0].SeriesInstanceUID)
    pacs = dicomweb.connect(dicomweb.PacsSettings(root, USER, PASSWORD))
    dicomweb.store(pacs, datasets, study)
    stored_at = time.monotonic()
    while time.monotonic() - stored_at < 120 and _count(root, study, STRUCTURED_REPORT) == 0:
        time.sleep(1.0)
    assert _count(root, study, STRUCTURED_REPORT) == 1, "no finding came back in 120 s"
    assert _count(root, study, PARAMETRIC_MAP) == 1
    (row,) = [r for r in node.spool.rows() if r.series == series]
    assert row.state == "done" and "chestct-slice-demo" in row.reason, row


def _association(port: int, caller: str, contexts: list[str]):
    from pynetdicom import AE

    ae = AE(ae_title=caller)
    for context in contexts:
        ae.add_requested_context(context)
    return ae.associate("127.0.0.1", port, ae_title="KRYPTON")


def test_a_caller_off_the_list_is_refused_and_the_node_serves_on(routed, caplog):
    _, node = routed
    assoc = _association(node.settings.port, "STRANGER", ["1.2.840.10008.1.1"])
    assert assoc.is_rejected
    assert "refused an association from AE 'STRANGER'" in caplog.text
    assoc = _association(node.settings.port, PACS_AE, ["1.2.840.10008.1.1"])
    assert assoc.is_established and assoc.send_c_echo().Status == 0x0000
    assoc.release()


def test_other_classes_malformed_instances_and_a_full_spool_are_refused(routed, caplog):
    import pydicom
    from pydicom.data import get_testdata_file

    _, node = routed
    report = pydicom.dcmread(get_testdata_file("test-SR.dcm"))
    ct = pydicom.dcmread(get_testdata_file("CT_small.dcm"))
    broken = copy.deepcopy(ct)
    del broken.SeriesInstanceUID
    assoc = _association(node.settings.port, PACS_AE, [report.SOPClassUID, ct.SOPClassUID])
    assert assoc.is_established
    assert assoc.send_c_store(report).Status == 0x0122  # not an image: refused
    assert "is not an image the node explains" in caplog.text
    assert assoc.send_c_store(broken).Status == 0xC210  # malformed: refused
    assert "refused a malformed instance" in caplog.text
    quota = node.spool.quota_bytes
    node.spool.quota_bytes = node.spool.used_bytes() + 1000  # fuller than one slice
    try:
        assert assoc.send_c_store(ct).Status == 0xA700
        assert "the spool is full" in caplog.text
    finally:
        node.spool.quota_bytes = quota
    assert assoc.send_c_store(ct).Status == 0x0000  # room again: kept
    assoc.release()
    assert any(r.series == ct.SeriesInstanceUID for r in node.spool.rows())


def test_node_status_lists_each_series_with_its_state(routed, capsys):
    from krypton.cli import main

    _, node = routed
    assert main(["node", "status", "--spool", str(node.settings.spool)]) == 0
    printed = capsys.readouterr().out
    assert "done" in printed and "instances" in printed, printed


def test_krypton_node_without_a_pacs_or_a_caller_says_so(tmp_path, monkeypatch, capsys):
    from krypton.cli import main

    monkeypatch.delenv("KRYPTON_DICOMWEB_URL", raising=False)
    spool = str(tmp_path / "spool")
    assert main(["node", "--allow", PACS_AE, "--spool", spool]) == 2
    assert "no PACS is configured" in capsys.readouterr().err
    monkeypatch.setenv("KRYPTON_DICOMWEB_URL", "http://127.0.0.1:9/dicom-web")
    assert main(["node", "--spool", spool, "--port", str(_free_port())]) == 2
    assert "accepts no caller" in capsys.readouterr().err
    assert main(["node", "status", "--spool", str(tmp_path / "empty")]) == 0
    assert "no series received yet" in capsys.readouterr().out


def test_the_node_refuses_to_start_without_an_allow_list(tmp_path):
    node = Node(NodeSettings(port=_free_port(), spool=tmp_path / "spool"), None)
    with pytest.raises(ValueError, match="accepts no caller"):
        node.start()
