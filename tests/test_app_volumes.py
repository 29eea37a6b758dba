"""The volume panel without a browser (webapp.runs at rank 3, webapp.volume_views): an
uploaded volume is explained exactly as the library explains the same prepared input,
a region reuses the cells of the last run, another class comes from the kept
probabilities, the exports read back (NIfTI with nibabel, the DICOM series with pydicom),
bad files are refused by name, and the views' boxes and clicks map to voxels."""

import io
import zipfile

import nibabel
import numpy as np
import pydicom
import pytest
from test_volume_cli import hu_volume, volume_model, write_nifti, write_series  # noqa: F401

import krypton
from webapp import runs, volume_views
from webapp.helpers import InputError
from webapp.panel_scope import VOLUME_PANEL
from webapp.runs import volumes
from webapp.services import Services

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def services(tmp_path, volume_model):  # noqa: F811
    return Services(tmp_path / "cache")


@pytest.fixture
def nifti_bytes(tmp_path, hu_volume):  # noqa: F811
    path = tmp_path / "chest.nii.gz"
    write_nifti(path, hu_volume)
    return path.read_bytes()


def stored(services, data, session="tab-1"):
    return services.images.put_source(data, session)


def request(key, **changes):
    settings = dict(
        key=key, name="chest.nii.gz", model="ct-test", patch=8, stride=8, mode="exact", rank=3
    )
    settings.update(changes)
    return runs.RunRequest(**settings)


def library(services, key, region, label=None, stride=8):
    prepared = services.prepared_volume(key, "tab-1", "ct-test")
    model = services.model("ct-test", rank=3)
    return krypton.explain(
        model, prepared.model_input.tensor, patch=8, stride=stride, mode="naive",
        fill=model.gray_fill(), region=region, label=label,
    )  # fmt: skip


def test_a_run_equals_the_library_on_the_same_block_and_reports_live_pictures(
    services, nifti_bytes
):
    key = stored(services, nifti_bytes)
    reports = []
    region = (8, 8, 8, 40, 40, 32)
    result = runs.execute(
        services, "tab-1", request(key, region=region), lambda *a: reports.append(a)
    )
    expected = library(services, key, region)
    assert result["label"] == expected.label
    assert result["reused"] == 0 and result["reuse_note"] == ""  # nothing was known: no note
    np.testing.assert_allclose(result["values"], expected.values, atol=1e-5)
    assert result["zs"] == expected.zs.tolist() and result["xs"] == expected.xs.tolist()
    pictures = [r[2].values for r in reports if r[2] is not None]
    # the image panel's loop: chunks of 16 positions, doubling, coarse first (48: 16 + 32)
    assert expected.values.size == 48 and len(pictures) == 2
    assert np.isnan(pictures[0]).any() and not np.isnan(pictures[-1]).any()
    assert reports[-1][0] == reports[-1][1] == expected.values.size
    other = runs.relabel(result, 1 - result["label"])
    np.testing.assert_allclose(other["values"], 1 - result["values"], atol=1e-5)


def test_a_cancelled_volume_run_keeps_its_cells_as_a_partial_heatmap(services, nifti_bytes):
    """The image panel's rule for the volume panel: a Cancel keeps the cells computed."""
    from webapp.jobs import JobCancelled

    key = stored(services, nifti_bytes)
    region = (8, 8, 8, 40, 40, 32)

    def cancel_after_the_first_chunk(done, total, partial=None):
        if partial is not None:
            raise JobCancelled("cancelled")

    with pytest.raises(JobCancelled):
        runs.execute(services, "tab-1", request(key, region=region), cancel_after_the_first_chunk)
    kept = services.results.get(runs.results_key("tab-1", 3))
    assert kept["partial"]["known"] == 16 and kept["partial"]["positions"] == 48
    assert kept["kind"] == "volume" and np.isnan(np.asarray(kept["values"])).sum() == 32
    assert runs.summary_lines(kept)[1].startswith("Partial heatmap")
    expected = library(services, key, region)
    finite = np.isfinite(np.asarray(kept["values"]))
    np.testing.assert_allclose(
        np.asarray(kept["values"])[finite], expected.values[finite], atol=1e-5
    )
    whole = runs.execute(services, "tab-1", request(key, region=region), lambda *a: None)
    assert whole["reused"] == 16 and whole["evaluated"] == 32 and not whole.get("partial")


def test_a_volume_result_whose_classes_were_dropped_says_so_on_a_class_switch(
    services, nifti_bytes
):
    """relabel_volume ignored ``classes_dropped``: an exact volume run whose per-class
    values the result store dropped (over half its byte budget) claimed it had been
    "computed for one class only (approximate mode ...)". It now says what the image
    panel says: why they were not kept."""
    from webapp.helpers import ResultStore

    key = stored(services, nifti_bytes)
    result = runs.execute(services, "tab-1", request(key), lambda *a: None)
    assert result["mode"] == "exact" and result["class_values"] is not None
    store = ResultStore(max_bytes=int(np.asarray(result["class_values"]).nbytes))
    store.put("tab-1", result)
    kept = store.get("tab-1")
    with pytest.raises(InputError, match="were not kept") as refused:
        runs.relabel(kept, 1 - result["label"])
    assert "approximate mode" not in str(refused.value)


def test_a_new_stride_reuses_the_volume_cells_that_lie_on_its_grid(services, nifti_bytes):
    """The volume cell key held the stride, so a new stride never reused a volume's
    cells (an image's does): every position of a stride-8 run lies on the stride-4 grid
    from the same corner, and is reused, with the values a fresh run gives."""
    key = stored(services, nifti_bytes)
    region = (8, 8, 8, 40, 40, 32)
    coarse = runs.execute(services, "tab-1", request(key, region=region, stride=8), lambda *a: None)
    fine = runs.execute(services, "tab-1", request(key, region=region, stride=4), lambda *a: None)
    assert coarse["evaluated"] > 0 and fine["reused"] == coarse["values"].size
    expected = library(services, key, region, stride=4)
    np.testing.assert_allclose(fine["values"], expected.values, atol=1e-5)


def test_an_exact_volume_run_states_its_whole_run_speed_once(services, nifti_bytes):
    """The volume panel said only the plan's per-position ratio of its first chunk (3.3x
    while the whole run was 1.8x a naive one); it now says what the image panel says."""
    key = stored(services, nifti_bytes)
    result = runs.execute(services, "tab-1", request(key, stride=6), lambda *a: None)
    lines = runs.summary_lines(result)
    whole = result["speed"]["whole"]
    assert whole["positions"] == result["evaluated"] == 7**3
    assert whole["seconds"] == pytest.approx(result["seconds"])
    claim = [line for line in lines if "than naive" in line or line.startswith("About as")]
    assert len(claim) == 1 and "the whole run" in claim[0], lines
    assert sum("ms/position" in line for line in lines) == 1, lines  # one measurement
    assert any(line.startswith("Plan: incremental") for line in lines)


def test_a_region_after_a_whole_run_reuses_its_cells_on_the_same_grid(services, nifti_bytes):
    key = stored(services, nifti_bytes)
    first = runs.execute(services, "tab-1", request(key), lambda *a: None)
    assert first["reused"] == 0 and first["evaluated"] == 6**3
    # a region not on the grid: moved forward onto it (inside the region), every cell known
    pictures = []
    second = runs.execute(
        services, "tab-1", request(key, region=(10, 3, 17, 40, 30, 48)),
        lambda done, total, partial=None: pictures.append(partial.axes) if partial else None,
    )  # fmt: skip
    assert second["region"][:3] == [16, 8, 24] and "moved onto" in second["reuse_note"]
    # the live picture is drawn on the grid the run computed, not the region as drawn
    assert pictures and all(
        [list(map(int, a)) for a in axes] == [second[n] for n in ("zs", "ys", "xs")]
        for axes in pictures
    )
    assert second["evaluated"] == 0 and second["reused"] == second["values"].size
    expected = library(services, key, tuple(second["region"]), label=first["label"])
    np.testing.assert_allclose(second["values"], expected.values, atol=1e-5)
    # a finer stride: the cells of the stride-8 grid that lie on it are reused (2 of 3
    # per axis), the rest computed
    third = runs.execute(
        services, "tab-1", request(key, stride=4, region=(16, 16, 16, 32, 32, 32)),
        lambda *a: None,
    )  # fmt: skip
    assert third["reused"] == 8 and third["evaluated"] == 19


def test_the_nifti_and_json_exports_read_back_as_the_result(services, nifti_bytes):
    from krypton.render.volumes import cell_affine, heatmap_nifti

    key = stored(services, nifti_bytes)
    result = runs.execute(
        services, "tab-1", request(key, region=(8, 8, 8, 40, 40, 40)), lambda *a: None
    )
    heatmap = runs.result_heatmap(result)
    image = nibabel.Nifti1Image.from_bytes(
        __import__("gzip").decompress(heatmap_nifti(heatmap, np.asarray(result["affine"])))
    )
    np.testing.assert_allclose(
        np.transpose(image.get_fdata(), (2, 1, 0)), result["values"], atol=1e-6
    )
    np.testing.assert_allclose(
        image.affine[:, [2, 1, 0, 3]], cell_affine(heatmap, np.asarray(result["affine"]))
    )
    text = runs.export_json(result)
    assert '"kind": "volume"' in text and '"class_values"' not in text
    # the server's stored-file key never leaves it (the image export strips its own)
    assert key not in text and '"source_key"' not in text and '"warnings"' in text
    from webapp.exports import export_stem

    expected = f"krypton-ct-test-chest-exact-p8s8-z8-40_y8-40_x8-40-{result['label_name']}"
    assert export_stem(result) == expected


def test_a_dicom_series_exports_a_capture_series_in_its_study(tmp_path, services, hu_volume):  # noqa: F811
    folder = tmp_path / "series"
    write_series(folder, hu_volume)
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path in sorted(folder.iterdir()):
            archive.write(path, path.name)
    data = buffer.getvalue()
    key = stored(services, data)
    result = runs.execute(
        services, "tab-1", request(key, name="series.zip", region=(16, 16, 16, 32, 32, 32)),
        lambda *a: None,
    )  # fmt: skip
    assert result["dicom"]["source"] == key  # its DICOM source, as an image's is named
    prepared = services.prepared_volume(key, "tab-1", "ct-test")
    exported = volumes.export_dicom_series(result, data, prepared)
    source = pydicom.dcmread(next(folder.iterdir()), stop_before_pixels=True)
    with zipfile.ZipFile(io.BytesIO(exported)) as archive:
        names = sorted(archive.namelist())
        captures = [pydicom.dcmread(io.BytesIO(archive.read(n))) for n in names]
    assert len(captures) == 48  # one per axial slice of the model's block
    assert {c.StudyInstanceUID for c in captures} == {source.StudyInstanceUID}
    assert len({c.SeriesInstanceUID for c in captures}) == 1
    assert captures[0].SeriesInstanceUID != source.SeriesInstanceUID
    assert [int(c.InstanceNumber) for c in captures] == list(range(1, 49))
    reference = captures[20].ReferencedSeriesSequence[0]
    assert reference.SeriesInstanceUID == source.SeriesInstanceUID
    assert "PatientName" not in captures[0] or not str(captures[0].PatientName)
    # inside the region the overlay colours the slice; far outside it is the gray slice
    inside, outside = captures[24].pixel_array, captures[2].pixel_array
    coloured = (inside[..., 0] != inside[..., 1]) | (inside[..., 1] != inside[..., 2])
    rows, cols = np.nonzero(coloured)
    assert 14 <= rows.min() and rows.max() <= 33 and 14 <= cols.min() and cols.max() <= 33
    assert coloured.sum() >= 14 * 14
    assert np.all(outside[..., 0] == outside[..., 1]) and np.all(outside[..., 1] == outside[..., 2])
    with pytest.raises(InputError, match="no DICOM export"):
        volumes.export_dicom_series(result, b"not dicom at all" * 20, prepared)


@pytest.mark.parametrize(
    "data, name, message",
    [
        (b"\x89PNG\r\n\x1a\n" + b"0" * 400, "photo.png", "is not a volume"),
        (b"PK\x03\x04" + b"0" * 400, "series.zip", "not a readable zip"),
        (b"\x1f\x8b" + b"0" * 400, "scan.nii.gz", "scan.nii.gz"),
    ],
)
def test_bad_volume_files_are_refused_by_name(data, name, message):
    with pytest.raises(InputError, match=message):
        volumes.read_uploaded_source(data, name)  # what the page reads an upload with


def test_a_2d_model_is_refused_for_a_volume_and_a_volume_model_for_an_image(services):
    with pytest.raises(InputError, match="volume model"):
        services.model("ct-test")


def test_boxes_on_two_views_make_a_3d_region_and_clicks_move_the_crosshair():
    shape = (48, 40, 32)
    axial = volume_views.region_from_view(
        "axial", {"range": {"x": [3.6, 20.2], "y": [5.1, 30.4]}}, shape
    )
    assert axial == [0, 5, 4, 48, 31, 21]  # z untouched: the whole depth
    both = volume_views.region_from_view(
        "coronal", {"range": {"x": [0.2, 10.0], "y": [40.0, 12.0]}}, shape, axial
    )
    assert both == [12, 5, 0, 41, 31, 11]  # z from the coronal box, y kept from the axial
    assert volume_views.region_from_view("sagittal", {"points": []}, shape) is None
    assert volume_views.clicked_voxel("sagittal", {"points": [{"x": 7, "y": 30}]}, [1, 2, 3]) == [
        30, 7, 3,
    ]  # fmt: skip
    figure = volume_views.view_figure(np.zeros(shape, np.float32), "coronal", (10, 20, 5))
    assert figure.data[0].z.shape == (48, 32)  # rows z, columns x


def test_a_display_window_changes_the_views_but_not_what_the_model_sees(services, nifti_bytes):
    key = stored(services, nifti_bytes)
    prepared = services.prepared_volume(key, "tab-1", "ct-test")
    hu = prepared.model_input.values
    assert hu.shape == (48, 48, 48) and hu.min() < -900 and hu.max() > 0  # HU, not the unit
    model = volume_views.displayed(prepared.unit, hu, "model")
    assert model is prepared.unit
    bone = volume_views.displayed(prepared.unit, hu, "bone")
    centre, width = volume_views.WINDOW_PRESETS["bone"]
    np.testing.assert_allclose(bone, np.clip((hu - centre + width / 2) / width, 0, 1), atol=1e-6)
    assert not np.allclose(bone, prepared.unit)
    with pytest.raises(ValueError, match="unknown window"):
        volume_views.displayed(prepared.unit, hu, "sunset")


def test_the_panel_draws_a_heatmap_only_beside_the_volume_and_model_it_explains(
    services,
    nifti_bytes,
    hu_volume,  # noqa: F811
):
    from webapp.panels.volume import VolumePanel

    key = stored(services, nifti_bytes)
    result = runs.execute(
        services, "tab-1", request(key, region=(16, 16, 16, 32, 32, 32)), lambda *a: None
    )
    panel = VolumePanel(services, None)
    record = {"key": key, "name": "chest.nii.gz"}
    handle = {"id": result["id"]}
    region = [16, 16, 16, 32, 32, 32]
    settings = (result["patch"], result["stride"], "exact", None)  # patch, stride, mode, class

    def drawn_layers(record, region, settings):
        drawn = panel.draw_views(
            record, "ct-test", 24, 24, 24, region, handle, "model", *settings, "tab-1"
        )
        return [len(f.data) for f in drawn[:3]]

    def summary(record, region, settings, session="tab-1"):  # the marker for the page's rule
        return panel.show_result(handle, record, "ct-test", region, *settings, session)[:-1]

    assert drawn_layers(record, region, settings) == [2, 2, 2]  # gray block + heatmap
    # no DICOM source; no Compare (the run was not asked to compare)
    assert summary(record, region, settings)[1:] == (False, False, True, True)
    # the panel compared only the volume and the model: a changed patch, stride, mode,
    # region or class left the old heatmap and its downloads up
    changed = {
        "the patch size": (region, (result["patch"] + 2, *settings[1:])),
        "the stride": (region, (settings[0], result["stride"] + 1, *settings[2:])),
        "the mode": (region, (*settings[:2], "naive", None)),
        "the region": ([16, 16, 16, 40, 40, 40], settings),
    }
    for words, (other_region, other_settings) in changed.items():
        text, *disabled = summary(record, other_region, other_settings)
        assert disabled == [True] * 4 and words in str(text), (words, text)
        assert drawn_layers(record, other_region, other_settings) == [1, 1, 1]  # no heatmap
    # another class the run kept: that class's heatmap, at once (the class switch's new
    # handle follows), not "the class changed ... press Run"
    other = (*settings[:3], 1 - result["label"])
    text, *disabled = summary(record, region, other)
    assert f"{result['classes'][1 - result['label']]}: p = " in str(text), text
    assert drawn_layers(record, region, other) == [2, 2, 2]
    # another volume on screen (the same tab loaded a new one): no heatmap, no downloads
    other = stored(services, nifti_bytes[:-8] + b"\x00" * 8)
    text, *disabled = summary({"key": other, "name": "other.nii.gz"}, region, settings)
    assert "another volume or model" in str(text) and disabled == [True] * 4
    # another tab never sees this tab's result
    assert summary({"key": key}, region, settings, "tab-2")[1:] == (True,) * 4


def test_a_volume_heatmap_of_weights_no_longer_loaded_is_hidden_as_an_images_is(
    services, nifti_bytes, monkeypatch
):
    """The volume panel once checked a kept result against the weights it recorded, not
    the weights the server has now: after the model's file was replaced (the demo
    retrained, a model re-registered) the old heatmap stayed up as this model's. The
    image panel's rule compares the weights now; both panels share it."""
    from webapp.panels.volume import VolumePanel

    key = stored(services, nifti_bytes)
    result = runs.execute(services, "tab-1", request(key), lambda *a: None)
    panel = VolumePanel(services, None)
    record, handle = {"key": key, "name": "chest.nii.gz"}, {"id": result["id"]}
    settings = (None, 8, 8, "exact", None)  # region, patch, stride, mode, class
    shown = panel.show_result(handle, record, "ct-test", *settings, "tab-1")
    assert shown[1:-1] == (False, False, True, True)
    # what it explains, for the browser's rule that keeps it beside that volume alone
    assert shown[-1] == {"key": key, "model": "ct-test", "disabled": [False, False, True, True]}
    monkeypatch.setattr(services, "weights_checksum", lambda name: "other weights")
    text, *disabled, shown = panel.show_result(handle, record, "ct-test", *settings, "tab-1")
    assert disabled == [True] * 4 and "the model's weights" in str(text), text
    assert shown is None
    drawn = panel.draw_views(record, "ct-test", 24, 24, 24, None, handle, "model",
                             *settings[1:], "tab-1")  # fmt: skip
    assert [len(f.data) for f in drawn[:3]] == [1, 1, 1]  # the block, no heatmap


def test_a_volume_result_the_server_let_go_says_so(services, nifti_bytes):
    """The volume panel showed a result the result store had dropped (its byte budget,
    least recently used first) as a blank with no message; the image panel says why and
    what to do. Both now say the same."""
    from webapp.helpers import ResultStore
    from webapp.panels.volume import VolumePanel
    from webapp.runs import DROPPED_RESULT

    key = stored(services, nifti_bytes)
    result = runs.execute(
        services, "tab-1", request(key, region=(16, 16, 16, 32, 32, 32)), lambda *a: None
    )
    services.results = ResultStore(max_sessions=1)
    services.results.put(runs.results_key("tab-1", 3), result)
    services.results.put("another tab", {"id": "x"})  # the tab's result goes
    panel = VolumePanel(services, None)
    settings = ([16, 16, 16, 32, 32, 32], result["patch"], result["stride"], "exact", None)
    text, *disabled, _ = panel.show_result(
        {"id": result["id"]}, {"key": key}, "ct-test", *settings, "tab-1"
    )
    assert DROPPED_RESULT in str(text) and disabled == [True] * 4


def hostile_volumes() -> dict[str, bytes]:
    """A few hundred kilobytes each that would cost gigabytes read naively: a zipped
    'series' inflating to 300 MB, and a NIfTI header declaring 2048³ float32 voxels."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for i in range(3):
            archive.writestr(f"slice{i}.dcm", b"\0" * (100 * 2**20))
    header = nibabel.Nifti1Header()
    header.set_data_shape((2048, 2048, 2048))
    header.set_data_dtype(np.float32)
    nifti = __import__("gzip").compress(header.binaryblock + b"\0" * 4 + b"\0" * 4096)
    return {"series.zip": buffer.getvalue(), "huge.nii.gz": nifti}


@pytest.mark.parametrize("name", ["series.zip", "huge.nii.gz"])
def test_an_uploaded_volume_that_would_cost_too_much_memory_is_refused_by_the_panel(services, name):
    from webapp.panels.volume import VolumePanel

    data = hostile_volumes()[name]
    assert len(data) < 2 * 2**20
    token = services.uploads.save(io.BytesIO(data), len(data), "volume", "tab-1", name, 1 << 30)
    panel = VolumePanel(services, None)
    record, region, message, _ = panel.upload_volume({"token": token, "name": name}, "tab-1")
    assert "decode budget" in message and name in message
    assert services.images.usage()[0] == 0  # nothing kept


def test_approximate_runs_show_their_stage_one_picture_and_refuse_another_class(
    services, nifti_bytes
):
    key = stored(services, nifti_bytes)
    pictures = []
    result = runs.execute(
        services, "tab-1", request(key, mode="approximate", stride=4),
        lambda done, total, partial=None: pictures.append(partial.values) if partial else None,
    )  # fmt: skip
    assert result["mode"] == "approximate" and result["class_values"] is None
    assert result["values"].shape == tuple(len(result[a]) for a in ("zs", "ys", "xs"))
    assert pictures and all(p.shape == result["values"].shape for p in pictures)
    with pytest.raises(InputError, match="press Run"):
        runs.relabel(result, 0)


def test_a_cancelled_run_keeps_the_cells_it_computed_for_the_next(services, nifti_bytes):
    from webapp.jobs import JobCancelled

    key = stored(services, nifti_bytes)
    seen = []

    def cancel_after_two_pictures(done, total, partial=None):
        if partial is not None:
            seen.append(done)
            if len(seen) == 2:
                raise JobCancelled("cancelled")

    with pytest.raises(JobCancelled):
        runs.execute(services, "tab-1", request(key), cancel_after_two_pictures)
    # kept as a partial heatmap, not as a result
    assert services.results.get(runs.results_key("tab-1", 3))["partial"]["known"] == 16 + 32
    again = runs.execute(services, "tab-1", request(key), lambda *a: None)
    assert again["reused"] == seen[-1] == 16 + 32  # the first two chunks
    assert again["evaluated"] == 6**3 - again["reused"]


def test_a_loaded_volume_is_read_once_and_its_source_voxels_are_not_kept_per_model(
    services, nifti_bytes, monkeypatch
):
    from webapp.panels.volume import VolumePanel

    reads = []
    real = volumes.read_uploaded_source
    monkeypatch.setattr(volumes, "read_uploaded_source", lambda *a: reads.append(a) or real(*a))
    token = services.uploads.save(
        io.BytesIO(nifti_bytes), len(nifti_bytes), "volume", "tab-1", "chest.nii.gz", 1 << 30
    )
    panel = VolumePanel(services, None)
    record, _, message, _ = panel.upload_volume({"token": token, "name": "chest.nii.gz"}, "tab-1")
    assert message == "" and record["shape"] == [48, 48, 48]
    shown = panel.show_volume(record, "ct-test", "tab-1")
    assert shown[:6] == (47, 47, 47, 24, 24, 24) and "48x48x48 voxels" in shown[6]
    assert len(reads) == 1  # the upload's read served the preparation too
    prepared = services.prepared_volume(record["key"], "tab-1", "ct-test")
    assert isinstance(prepared.source, volumes.SourceInfo)  # no second copy of voxels


def test_kept_volume_cells_are_bounded_by_bytes():
    from webapp.runs import CellCache

    cache = CellCache(max_keys=8, max_bytes=1000)  # the images' cache holds volumes' cells
    first = cache.get(("volume", "a"))
    first.add({(0, 0, k): np.zeros(10, np.float32) for k in range(30)})  # 1200 bytes
    assert first.nbytes == 1200
    first.add({(1, 0, 0): np.zeros(10, np.float32)})  # past the limit: not kept
    assert first.nbytes == 1200
    second = cache.get(("volume", "b"))  # the older setting goes to make room
    second.add({(0, 0, 0): np.zeros(10, np.float32)})
    assert cache.usage() == (1, 40)


def test_a_run_served_from_known_cells_still_carries_the_ood_verdict(tmp_path, nifti_bytes):
    """chestct-demo (shipped, with its reference set): the second run computes nothing,
    and still says whether the volume is like its training volumes."""
    services = Services(tmp_path / "cache")
    key = stored(services, nifti_bytes)
    settings = dict(model="chestct-demo", stride=16)
    first = runs.execute(services, "tab-1", request(key, **settings), lambda *a: None)
    second = runs.execute(
        services, "tab-1", request(key, region=(0, 0, 0, 24, 24, 24), **settings),
        lambda *a: None,
    )  # fmt: skip
    assert second["evaluated"] == 0 and second["reused"] == 2**3
    assert first["ood"] is not None and second["ood"] == first["ood"]


def test_the_panel_estimates_a_run_from_this_hosts_volume_runs(services, nifti_bytes):
    size = (48, 48, 48)
    before = volumes.volume_estimate("ct-test", size, 8, 8, "exact", None)
    assert before.startswith("216 positions on a 6x6x6 grid; no time estimate yet")
    key = stored(services, nifti_bytes)
    # the process's first run loads the model and captures its graph: not learnt from
    first = (0, 0, 0, 8, 8, 48)
    for region in (first, (0, 0, 0, 16, 16, 48), (0, 0, 0, 24, 24, 48), (0, 0, 0, 32, 48, 48)):
        runs.execute(services, "tab-1", request(key, region=region), lambda *a: None)
    after = volumes.volume_estimate("ct-test", size, 8, 8, "exact", None)
    assert after.startswith("216 positions on a 6x6x6 grid; estimated ")
    # fitted to the three runs, or (where they do not fit a line) at their own pace, "in
    # proportion": which depends on how long each took here, so either may be said
    assert "from this machine's last 3 runs" in after, after
    small = volumes.volume_estimate("ct-test", size, 8, 8, "exact", (0, 0, 0, 8, 8, 8))
    assert small.startswith("1 position on a 1x1x1 grid; estimated ")
    assert "smaller than the 8-voxel cube" in volumes.volume_estimate(
        "ct-test", size, 8, 8, "exact", (0, 0, 0, 4, 48, 48)
    )


def test_a_run_in_many_calls_checks_out_of_distribution_once(tmp_path, nifti_bytes, monkeypatch):
    """Each chunk of positions is one explain call, and each call reports the verdict;
    the check itself (a forward pass under the exclusive capture lock) runs once."""
    import krypton.explainer

    checks = []
    real = krypton.explainer._ood_report
    monkeypatch.setattr(krypton.explainer, "_ood_report", lambda *a: checks.append(1) or real(*a))
    services = Services(tmp_path / "cache")
    key = stored(services, nifti_bytes)
    result = runs.execute(
        services, "tab-1", request(key, model="chestct-demo", stride=16), lambda *a: None
    )
    assert result["evaluated"] == 27 and result["ood"] is not None  # two calls, one check
    assert len(checks) == 1


def test_cancel_in_the_volume_panel_says_what_it_did(tmp_path):
    """Cancel in the volume panel said nothing (the image panel's said what it did)."""
    from app import create_app
    from webapp.run_strip import cancelled

    app = create_app(tmp_path / "cache")
    wired = [
        callback
        for callback in app.callback_map.values()
        if any(i["id"] == VOLUME_PANEL.strip.cancel and i["property"] == "n_clicks"
               for i in callback["inputs"])
        and VOLUME_PANEL.strip.message in str(callback["output"])
    ]  # fmt: skip
    assert len(wired) == 1
    assert cancelled(1, None)[0] == "Run cancelled."
    assert "previous run's" in cancelled(1, {"id": "x"})[0]


def test_a_volume_sample_is_read_as_an_upload_and_its_compare_button_marks_it_pending(
    services,
):
    """The panel's sample goes through the uploads' one intake (decode budget, store);
    its Compare button returns the same record and marks it for the page to run."""
    from webapp.panels.volume import VolumePanel
    from webapp.volume_layout import VOLUME_SAMPLES

    panel = VolumePanel(services, None)
    name = next(iter(VOLUME_SAMPLES))
    record, region, message, pending = panel.sample_volume(name, "tab-1")
    assert message == "" and pending is None and region is None
    assert record["name"] == name and record["shape"] == [48, 48, 48]
    assert record["spacing"] == [5.0, 5.0, 5.0] and record["frame"]
    again, _, _, pending = panel.sample_volume(name, "tab-1", compare=True)
    assert pending == {"key": again["key"], "name": name} and again["key"] == record["key"]
    _, _, message, pending = panel.sample_volume("../../etc/passwd", "tab-1", compare=True)
    assert "not available" in message and pending is None


def test_the_panel_names_the_predicted_class_and_a_run_moves_the_views_to_its_strongest_cell(
    services, nifti_bytes
):
    """The class box read "predicted class" instead of the class, and after a run the views
    stayed at the centre slices, away from the strongest cell."""
    from webapp.panels.volume import VolumePanel

    key = stored(services, nifti_bytes)
    panel = VolumePanel(services, None)
    record = {"key": key, "name": "chest.nii.gz", "frame": True}
    shown = panel.show_volume(record, "ct-test", "tab-1")
    options, placeholder = shown[-4], shown[-3]
    loaded = services.model("ct-test", rank=3)
    probs = volumes.volume_prediction(loaded, panel._prepared(record, "ct-test", "tab-1"))
    top = int(np.argmax(probs))
    assert placeholder.startswith(f"{loaded.classes[top]} ({probs[top]:.1%}")
    assert [o["label"] for o in options][top].startswith(f"{top}: {loaded.classes[top]} (")

    result = runs.execute(services, "tab-1", request(key), lambda *a: None)
    moved = panel.focus_strongest({"id": result["id"]}, record, "ct-test", "tab-1")
    values = np.asarray(result["values"])
    cell = np.unravel_index(int(np.argmin(values)), values.shape)  # the largest drop
    centre = [result[a][cell[n]] + result["patch"] // 2 for n, a in enumerate(("zs", "ys", "xs"))]
    assert list(moved) == centre


def test_the_volume_run_callback_ends_its_lifecycle_as_the_image_one(monkeypatch, services):
    """The volume panel's Run never called lifecycle.fail or cancel (the image panel's
    does): a refused run left its lifecycle queued or running."""
    from webapp import run_strip
    from webapp.jobs import Phase, RunLifecycle
    from webapp.panels import volume as volume_panel

    made: list[RunLifecycle] = []

    class Recorded(RunLifecycle):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(run_strip, "RunLifecycle", Recorded)  # both panels' run strip
    panel = volume_panel.VolumePanel(services, None)
    _, message = panel.run(lambda *a: None, 1, "tab-1", None, "ct-test", 8, 8, "exact", None,
                           None, 24, 24, 24)  # fmt: skip
    assert message == "load a volume first"
    assert len(made) == 1 and made[0].phase is Phase.FAILED and made[0].reason == message


def test_a_volume_region_off_the_last_grid_says_why_its_cells_are_not_reused(services, nifti_bytes):
    """With snapping off, an image's region off the last grid said why nothing was
    reused and a volume's said nothing: one rule for both now (webapp.runs.execute)."""
    key = stored(services, nifti_bytes)
    runs.execute(services, "tab-1", request(key), lambda *a: None)
    kept = runs.execute(
        services, "tab-1", request(key, region=(3, 8, 8, 40, 40, 40), snap=False), lambda *a: None
    )
    assert kept["reused"] == 0 and kept["region"][:3] == [3, 8, 8]
    assert kept["reuse_note"].startswith("no cells reused: the new region's grid is offset by")
    assert (
        "[3, 0, 0] voxels" in kept["reuse_note"] and "snap to the last grid" in kept["reuse_note"]
    )


def test_a_volume_run_with_every_cell_known_keeps_the_estimate_of_a_run_that_computes_nothing(
    services, nifti_bytes
):
    """A volume run estimated its known cells as if it had to compute them (the image
    panel estimated such a run at its fixed cost, from this host's runs that computed
    nothing): one estimate for both now, kept with the run."""
    key = stored(services, nifti_bytes)
    runs.execute(services, "tab-1", request(key), lambda *a: None)
    runs.execute(services, "tab-1", request(key), lambda *a: None)  # the first of its kind
    again = runs.execute(services, "tab-1", request(key), lambda *a: None)  # logs a cached run
    third = runs.execute(services, "tab-1", request(key), lambda *a: None)
    assert again["evaluated"] == third["evaluated"] == 0
    assert third["estimate"] is not None and "every cell known" in third["estimate"]["source"]


def test_the_volume_panels_estimate_counts_the_cells_a_run_will_reuse(services, nifti_bytes):
    """The volume panel estimated every position of the grid, known or not, while its
    run computed only the unknown ones (and recorded another estimate than the page
    showed); the image panel counted them. The panel now plans as the run does."""
    from webapp.panels.volume import VolumePanel

    key = stored(services, nifti_bytes)
    record = {"key": key, "name": "chest.nii.gz"}
    panel = VolumePanel(services, None)
    before = panel.estimate("ct-test", 8, 8, "exact", None, None, None, record, "tab-1")
    assert before.startswith("216 positions on a 6x6x6 grid; no time estimate yet"), before
    runs.execute(services, "tab-1", request(key), lambda *a: None)
    runs.execute(services, "tab-1", request(key), lambda *a: None)  # the first of its kind
    runs.execute(services, "tab-1", request(key), lambda *a: None)  # logs a run of none
    after = panel.estimate("ct-test", 8, 8, "exact", None, None, None, record, "tab-1")
    assert "216 of them known from an earlier run" in after, after
    assert "every cell known" in after, after  # estimated as a run that computes nothing


def test_the_volume_panel_says_the_shared_store_is_away_as_the_image_panel_does(
    services, nifti_bytes
):
    """Team mode with Redis gone: the image panel said so; the volume panel's summary,
    class switch and downloads raised inside their callbacks (one reader of the kept
    result for every panel now: webapp.runs.kept_result)."""
    from webapp.panels.volume import VolumePanel
    from webapp.team import RedisResultStore, redis_client

    key = stored(services, nifti_bytes)
    result = runs.execute(services, "tab-1", request(key), lambda *a: None)
    handle = {"id": result["id"], "source_key": key, "model": "ct-test"}
    away = "redis://127.0.0.1:9/0"  # nothing listens there: the real client, refused
    services.results = RedisResultStore(redis_client(away), away)
    panel = VolumePanel(services, None)
    record = {"key": key, "name": "chest.nii.gz"}
    summary = panel.show_result(handle, record, "ct-test", None, 8, 8, "exact", None, "tab-1")
    assert "Redis" in str(summary[0]) and summary[1:] == (True, True, True, True, None)
    _, said = panel.switch_class(1 - result["label"], handle, "tab-1")
    assert "Redis" in said


def test_an_image_and_a_volume_record_have_one_schema(services, nifti_bytes):
    """The image and the volume records were two dict literals with two schemas, and
    each drift between them was a bug a panel showed. One schema now
    (webapp.result_schema.ResultRecord, type-checked against every reader in make lint):
    both runs write its required fields, nothing outside it, and only their subject's
    own fields beyond the common ones."""
    from PIL import Image

    from webapp.result_schema import ImageFields, ResultRecord, VolumeFields

    required, optional = ResultRecord.__required_keys__, ResultRecord.__optional_keys__
    key = stored(services, nifti_bytes)
    volume = runs.execute(services, "tab-1", request(key), lambda *a: None)
    picture = services.images.put(Image.new("RGB", (64, 64), (90, 40, 20)))
    image = runs.execute(
        services, "tab-1",
        runs.RunRequest(key=picture, name="p.png", model="fundus-demo", patch=32, stride=32,
                        mode="exact", fill_rgb=(0.5, 0.5, 0.5)),
        lambda *a: None,
    )  # fmt: skip
    for record, own, other in (
        (image, ImageFields, VolumeFields),
        (volume, VolumeFields, ImageFields),
    ):
        assert required <= set(record) <= required | optional, set(record) ^ required
        assert set(own.__annotations__) <= set(record)
        assert not set(other.__annotations__) & set(record)
    assert "zs" in volume and "zs" not in image


def test_a_volume_run_hands_the_page_the_image_panels_handle_and_send_reads_it(
    services, nifti_bytes
):
    """The volume panel's handle named its source and model, the image panel's its
    provenance, and the PACS Send had a rule for each. Both panels' Run callbacks hand
    the page one handle now (webapp.run_strip.result_handle), and one Send rule
    reads it: offered for the series the result explains, not for another."""
    from bench.run_path import callback_context
    from webapp.panels.pacs import PacsPanel
    from webapp.panels.volume import VolumePanel

    key = stored(services, nifti_bytes)
    with callback_context():
        handle, message = VolumePanel(services, None).run(
            lambda *a: None, 1, "tab-1", {"key": key, "name": "chest.nii.gz"}, "ct-test",
            8, 8, "exact", None, None, 24, 24, 24,
        )  # fmt: skip
    assert message == ""
    kept = services.results.get(runs.results_key("tab-1", 3))
    assert handle == {"id": kept["id"], "provenance": kept["provenance"]}
    opened = {"key": key, "name": "PACS chest", "pacs": {"study": "1.2", "series": "1.3"}}
    assert PacsPanel(services).sendable(handle, opened) == (False, "")
    assert PacsPanel(services).sendable(handle, dict(opened, key="another"))[0] is True


def test_both_panels_refuse_a_class_their_run_did_not_keep_the_same_way(services, nifti_bytes):
    """The class switch was two callbacks: the image panel handed back its handle marked
    refused, so its heatmap hid; the volume panel only said why, and left the handle as
    it was. One switch for both now (webapp.panels.subject_panel): both mark it."""
    from PIL import Image

    from webapp.panels.image import ImagePanel
    from webapp.panels.volume import VolumePanel

    picture = services.images.put(Image.new("RGB", (64, 64), (90, 40, 20)))
    image = runs.RunRequest(key=picture, name="p.png", model="fundus-demo", patch=32,
                            stride=32, mode="approximate", fill_rgb=(0.5, 0.5, 0.5))  # fmt: skip
    volume = request(stored(services, nifti_bytes), mode="approximate")
    for panel, asked in (
        (ImagePanel(services, None), image),
        (VolumePanel(services, None), volume),
    ):
        result = runs.execute(services, "tab-1", asked, lambda *a: None)
        assert result["class_values"] is None  # approximate mode keeps its own class only
        handle = {"id": result["id"], "provenance": result["provenance"]}
        other = 1 - result["label"]
        marked, said = panel.switch_class(other, handle, "tab-1")
        assert marked == dict(handle, refused=other), panel.rank
        assert "one class only" in said


def test_a_volume_file_is_written_only_of_the_result_the_screen_shows(services, nifti_bytes):
    """The image panel's downloads checked that the screen shows what the result explains;
    the volume panel's wrote the kept result whatever the panel showed (a click landing
    after a change of stride, before the summary had disabled the buttons, downloaded the
    old run). One download callback for both now (webapp.panels.subject_panel), each kind
    saying when it refuses."""
    import json

    from dash import no_update
    from dash._callback_context import context_value
    from dash._utils import AttributeDict
    from dash.exceptions import PreventUpdate

    from webapp.panels.volume import VolumePanel

    key = stored(services, nifti_bytes)
    result = runs.execute(services, "tab-1", request(key), lambda *a: None)
    handle = {"id": result["id"], "provenance": result["provenance"]}
    record = {"key": key, "name": "chest.nii.gz"}
    panel = VolumePanel(services, None)
    button = json.dumps({"format": "json", "type": VOLUME_PANEL.strip.export})
    token = context_value.set(
        AttributeDict(headers={}, triggered_inputs=[{"prop_id": f"{button}.n_clicks", "value": 1}])
    )
    try:
        shown = ("ct-test", None, 8, 8, "exact", result["label"])
        sent, said = panel.export([1], handle, "tab-1", record, *shown)
        assert said == "" and sent["filename"].endswith(".json")
        other_stride = ("ct-test", None, 8, 4, "exact", result["label"])
        sent, said = panel.export([1], handle, "tab-1", record, *other_stride)
        assert sent is no_update and "stride" in said.lower()
        another = {"key": "another", "name": "other.nii.gz"}
        sent, said = panel.export([1], handle, "tab-1", another, *shown)
        assert sent is no_update and "another volume" in said
        # the class box moved to another class the run kept (its switch still on the
        # way): that class's file, as the summary beside it shows
        other = 1 - result["label"]
        sent, said = panel.export([1], handle, "tab-1", record, *shown[:-1], other)
        assert said == "" and json.loads(sent["content"])["label_name"] == result["classes"][other]
        with pytest.raises(PreventUpdate):  # a handle naming no run of this tab
            panel.export([1], {"id": "forged"}, "tab-1", record, *shown)
    finally:
        context_value.reset(token)


def test_both_panels_show_their_result_through_one_rule_in_the_same_words(services, nifti_bytes):
    """The summary was registered per kind: the image panel's callback drew the heatmap,
    the summary and the downloads together and left the summary blank when the result
    store had let the result go (the reason only inside the picture); the volume panel's
    said why. One callback for both now (SubjectPanel.show_result): the same summary,
    the same words for a result let go, the same downloads offered."""
    from PIL import Image

    from webapp.helpers import ResultStore
    from webapp.panels.image import ImagePanel
    from webapp.panels.volume import VolumePanel
    from webapp.runs import DROPPED_RESULT

    picture = services.images.put(Image.new("RGB", (64, 64), (90, 40, 20)))
    image = runs.RunRequest(key=picture, name="p.png", model="fundus-demo", patch=32,
                            stride=32, mode="exact", fill_rgb=(0.5, 0.5, 0.5))  # fmt: skip
    volume_key = stored(services, nifti_bytes)
    volume = request(volume_key)
    screens = {  # what each panel shows: its screen, then (for the image) the overlay
        2: ({"key": picture, "name": "p.png"}, "fundus-demo", None, 32, 32, "exact", "gray",
            None, 0.9, 0.25, 2.0, None),
        3: ({"key": volume_key, "name": "chest.nii.gz"}, "ct-test", None, 8, 8, "exact"),
    }  # fmt: skip
    panels = ((ImagePanel(services, None), image), (VolumePanel(services, None), volume))
    for panel, asked in panels:
        result = runs.execute(services, "tab-1", asked, lambda *a: None)
        handle = {"id": result["id"], "provenance": result["provenance"]}
        shown = panel.show_result(handle, *screens[panel.rank], result["label"], "tab-1")
        formats = len(panel.export_formats)
        summary, offered = shown[0], shown[1 : 1 + formats]
        assert "p = " in str(summary), (panel.rank, summary)
        disabled = dict(zip(panel.export_formats, offered))
        assert disabled["dicom"] and disabled["compare"] and not disabled["json"], disabled
        kept = services.results
        services.results = ResultStore(max_sessions=1)
        services.results.put(runs.results_key("tab-1", panel.rank), result)
        services.results.put("another tab", {"id": "x"})  # the tab's result goes
        gone = panel.show_result(handle, *screens[panel.rank], result["label"], "tab-1")
        assert DROPPED_RESULT in str(gone[0]), (panel.rank, gone[0])
        assert list(gone[1 : 1 + formats]) == [True] * formats
        services.results = kept


def test_a_class_box_moved_to_a_kept_class_shows_that_class_not_press_run(services, nifti_bytes):
    """Loading a sample again (its Compare button) sets the class box to the prediction's
    class before the class switch's new handle arrives: both panels said "The last
    heatmap is hidden: the class changed since it was computed. Press Run ..." for 1-2 s
    (measured in Chromium), though the run kept every class and no run was needed. The
    panel now shows the kept run for the class on screen at once."""
    from PIL import Image

    from webapp.panels.image import ImagePanel
    from webapp.panels.volume import VolumePanel

    picture = services.images.put(Image.new("RGB", (64, 64), (90, 40, 20)))
    image = runs.RunRequest(key=picture, name="p.png", model="fundus-demo", patch=32,
                            stride=32, mode="exact", fill_rgb=(0.5, 0.5, 0.5))  # fmt: skip
    volume_key = stored(services, nifti_bytes)
    screens = {
        2: ({"key": picture, "name": "p.png"}, "fundus-demo", None, 32, 32, "exact", "gray",
            None, 0.9, 0.25, 2.0),
        3: ({"key": volume_key, "name": "chest.nii.gz"}, "ct-test", None, 8, 8, "exact"),
    }  # fmt: skip
    panels = (
        (ImagePanel(services, None), image),
        (VolumePanel(services, None), request(volume_key)),
    )
    for panel, asked in panels:
        result = runs.execute(services, "tab-1", asked, lambda *a: None)
        handle = {"id": result["id"], "provenance": result["provenance"]}
        other = (int(result["label"]) + 1) % len(result["classes"])
        summary = str(panel.show_result(handle, *screens[panel.rank], other, "tab-1")[0])
        assert "hidden" not in summary, (panel.rank, summary)
        assert f"{result['classes'][other]}: p = " in summary, (panel.rank, summary)
        # a setting other than the class still hides it, and says which
        changed = list(screens[panel.rank])
        changed[4] = 16  # the stride
        summary = str(panel.show_result(handle, *changed, other, "tab-1")[0])
        assert "the stride changed" in summary and "p = " not in summary, summary
