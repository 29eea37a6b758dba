"""The web app's pure helpers and its threaded job manager, without a browser."""

import html
import io
import os
import threading
import time

import numpy as np
import pytest
from PIL import Image

from webapp import exports, figures, helpers, image_store
from webapp.helpers import InputError
from webapp.image_store import ImageStore
from webapp.jobs import JobCancelled, ThreadedDiskcacheManager, check_cancelled
from webapp.panels.image import parse_colour
from webapp.runs.cells import order_coarse_to_fine
from webapp.runs.regions import check_region
from webapp.runs.request import fill_for_display
from webapp.runs.subjects import normalised_fill


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_decode_upload_modes_and_errors():
    gray16 = Image.fromarray((np.arange(256).reshape(16, 16) * 200).astype(np.uint16))
    image = helpers.decode_upload(png_bytes(gray16), "scan.png")
    assert image.mode == "RGB" and image.size == (16, 16)
    with pytest.raises(InputError, match="scan.png is 8x8 pixels; images need at least 16"):
        helpers.decode_upload(png_bytes(gray16.crop((0, 0, 8, 8))), "scan.png")
    with pytest.raises(InputError, match="notes.txt is not an image file"):
        helpers.decode_upload(b"hello", "notes.txt")
    with pytest.raises(InputError, match="truncated"):
        helpers.decode_upload(png_bytes(Image.new("RGB", (64, 64)))[:60], "t.png")
    with pytest.raises(InputError, match="x.png: the file is empty|the file is empty"):
        helpers.decode_upload(b"", "x.png")


def test_image_store_round_trip_and_bad_keys(tmp_path):
    store = ImageStore(tmp_path)
    image = Image.new("RGB", (10, 6), (1, 2, 3))
    key = store.put(image)
    assert key == image_store.image_key(image) and store.put(image) == key
    assert store.get(key).tobytes() == image.tobytes()
    with pytest.raises(InputError, match="unknown image"):
        store.get("../../etc/passwd")
    with pytest.raises(InputError, match="no longer on the server"):
        store.get("0" * 24)


def test_region_from_selection_clamps_and_rounds():
    selection = {"range": {"x": [60.2, -5.0], "y": [10.4, 200.0]}}
    assert helpers.region_from_selection(selection, (128, 128)) == [0, 10, 61, 128]
    assert helpers.region_from_selection(None, (128, 128)) is None
    assert helpers.region_from_selection({"points": []}, (128, 128)) is None


def test_check_region_and_colours():
    check_region([0, 0, 16, 16], (128, 128), 16, 4)
    with pytest.raises(InputError, match="smaller than the 16-pixel patch"):
        check_region([0, 0, 15, 40], (128, 128), 16, 4)
    assert parse_colour("gray", None) == (0.5, 0.5, 0.5)
    assert parse_colour("custom", "#ff0080") == (1.0, 0.0, 128 / 255)
    with pytest.raises(InputError, match="#808080"):
        parse_colour("custom", "red")
    fill = normalised_fill((0.5, 0.5, 0.5), (0.5, 0.25, 0.0), (0.5, 0.25, 1.0))
    assert fill == (0.0, 1.0, 0.5)


def test_coarse_to_fine_order_covers_region_first():
    ys, xs = np.meshgrid(np.arange(0, 64, 4), np.arange(0, 64, 4), indexing="ij")
    cells = np.stack([ys.ravel() // 4, xs.ravel() // 4], axis=1)  # grid rows and columns
    order = order_coarse_to_fine(cells)
    assert sorted(order.tolist()) == list(range(256))
    first = order[:4]
    assert set(zip(ys.ravel()[first], xs.ravel()[first])) == {(0, 0), (0, 32), (32, 0), (32, 32)}
    # a volume's grid the same way: the coarse corners of the block first
    block = np.stack([g.ravel() for g in np.indices((9, 9, 9))], axis=1)
    first = block[order_coarse_to_fine(block)[:8]]
    assert {tuple(c) for c in first} == {(z, y, x) for z in (0, 8) for y in (0, 8) for x in (0, 8)}


def test_fill_for_display_uses_nearest_known():
    values = np.array([[0.1, np.nan, np.nan], [np.nan, np.nan, 0.9]], dtype=np.float32)
    filled = fill_for_display(values)
    assert not np.isnan(filled).any()
    assert filled[0, 1] == pytest.approx(0.1) and filled[1, 1] == pytest.approx(0.9)


def test_exports_for_the_record():
    image = Image.new("RGB", (300, 200), (200, 100, 50))
    result = {
        "values": np.array([[0.5, np.nan], [0.25, 0.75]], dtype=np.float32),
        "xs": [0, 16],
        "ys": [0, 16],
        "patch": 16,
        "stride": 16,
        "prob": 0.6,
        "model": "m",
        "label": 1,
        "label_name": "<b>EXU DATE</b>",
        "mode": "exact",
        "image": "../scan 1.png",
        "region": [0, 0, 32, 32],
        "input_size": [32, 32],
        "date": "2026-11-22 10:00",
    }
    png = Image.open(io.BytesIO(exports.export_png(image, result)))
    assert max(png.size) >= 512 and png.size[0] > png.size[1]  # image shape, colour bar
    assert np.load(io.BytesIO(exports.export_npy(result))).shape == (2, 2)
    rows = exports.export_csv(result).strip().splitlines()
    assert rows[0] == "x,y,probability" and len(rows) == 4  # the NaN cell is left out
    assert exports.export_stem(result) == "krypton-m-scan_1-exact-p16s16-x0-32_y0-32-b_EXU_DATE_b"
    with pytest.raises(helpers.InputError, match="only the explained class"):
        exports.export_all_classes(result)
    every = dict(
        result,
        class_values=np.zeros((2, 2, 3)),
        classes=["a", "b", "c"],
        base_probs=[0.2, 0.6, 0.2],
    )
    archive = np.load(io.BytesIO(exports.export_all_classes(every)))
    assert archive["probabilities"].shape == (2, 2, 3) and list(archive["classes"]) == [
        "a",
        "b",
        "c",
    ]


def test_threaded_manager_runs_and_cancels(tmp_path):
    import diskcache

    manager = ThreadedDiskcacheManager(diskcache.Cache(str(tmp_path)))
    started, outcome = threading.Event(), {}

    def job_fn(key, progress_key, args, context):
        started.set()
        try:
            for _ in range(200):
                check_cancelled()
                time.sleep(0.01)
            outcome["result"] = "finished"
        except JobCancelled:
            outcome["result"] = "cancelled"

    job = manager.call_job_fn("key", job_fn, (), {})
    started.wait(5)
    assert manager.job_running(job)
    manager.terminate_job(job)
    for _ in range(100):
        if not manager.job_running(job):
            break
        time.sleep(0.02)
    assert outcome["result"] == "cancelled" and not manager.job_running(job)
    check_cancelled()  # outside a job it never raises


def test_overlay_styles_colour_what_they_say():
    from krypton.render.overlay import OverlayStyle, styled_heatmap

    values = np.array([[0.2, 0.5], [0.79, 0.8]])
    relative = styled_heatmap(values, 0.8, OverlayStyle())
    assert (relative.low, relative.high) == (0.6000000000000001, 1.0)
    assert relative.colormap == "jet_r"
    assert "75% to 125% of the prediction's 0.800" in relative.label
    np.testing.assert_array_equal(relative.values, values)
    absolute = styled_heatmap(values, 0.8, OverlayStyle(scale="absolute", threshold=0.05))
    assert (absolute.low, absolute.high, absolute.colormap) == (0.0, 1.0, "jet")
    assert "absolute scale 0–1" in absolute.label and "only drops > 0.05" in absolute.label
    np.testing.assert_allclose(absolute.values, [[0.6, 0.3], [np.nan, np.nan]])
    with pytest.raises(ValueError, match="scale"):
        OverlayStyle(scale="log")
    with pytest.raises(helpers.InputError, match="opacity"):
        figures.overlay_style({"opacity": 2})


def test_a_threshold_that_hides_every_cell_says_so():
    """Plotly drew nothing, colour bar included, and the page said nothing."""
    from krypton.render.overlay import OverlayStyle

    image = Image.new("RGB", (32, 32), "gray")
    values = np.array([[0.7, 0.75], [0.78, 0.8]])  # largest drop 0.1
    hiding = OverlayStyle(scale="absolute", threshold=0.5)
    figure = figures.heatmap_figure(image, values, [0, 16], [0, 16], 16, 0.8, "A", hiding)
    assert np.isnan(np.asarray(figure.data[1].z, dtype=float)).all()
    notes = " ".join(a.text for a in figure.layout.annotations).replace("<br>", " ")
    notes = html.unescape(notes)
    assert "No cell's drop exceeds the threshold 0.50 (the largest is 0.100)" in notes
    some = figures.heatmap_figure(
        image, values, [0, 16], [0, 16], 16, 0.8, "A", OverlayStyle(threshold=0.05)
    )
    assert not some.layout.annotations  # cells are coloured: nothing to say


def test_heatmap_figure_side_by_side_hidden_and_labelled():
    from krypton.render.overlay import OverlayStyle

    image = Image.new("RGB", (32, 32), "gray")
    values = np.array([[0.2, 0.5], [0.7, 0.8]])
    figure = figures.heatmap_figure(image, values, [0, 16], [0, 16], 16, 0.8, "A")
    assert [t.type for t in figure.data] == ["image", "heatmap"]
    assert figure.data[1].opacity == 0.55 and figure.data[1].visible
    assert "relative" in figure.data[1].colorbar.title.text
    side = figures.heatmap_figure(
        image, values, [0, 16], [0, 16], 16, 0.8, "A", OverlayStyle(show=False), True
    )
    assert [t.type for t in side.data] == ["image", "image", "heatmap"]
    assert side.data[2].xaxis == "x2" and side.data[2].visible is False


def test_overlay_at_the_source_resolution_and_threshold():
    from krypton.render.overlay import OverlayStyle, overlay

    image = Image.new("RGB", (256, 256), "black")  # the source; the model saw 64 x 64
    values = np.array([[0.1, 0.9], [0.9, 0.9]], dtype=np.float32)
    drawn = np.asarray(
        overlay(image, values, np.array([0, 32]), np.array([0, 32]), 32, 0.9, input_size=(64, 64))
    )
    assert drawn[:128, :128].any() and drawn[128:, 128:].any()  # cells scaled 4x
    only_drop = np.asarray(
        overlay(
            image,
            values,
            np.array([0, 32]),
            np.array([0, 32]),
            32,
            0.9,
            input_size=(64, 64),
            style=OverlayStyle(threshold=0.5),
        )
    )
    assert only_drop[:128, :128].any() and not only_drop[128:, 128:].any()


def test_dicom_windows_and_description():
    assert helpers.requested_window("file") is None
    assert helpers.requested_window("bone") == "bone"
    assert helpers.requested_window("manual", 40, 400) == (40.0, 400.0)
    with pytest.raises(helpers.InputError, match="at least 1"):
        helpers.requested_window("manual", 40, 0)
    with pytest.raises(helpers.InputError, match="numbers"):
        helpers.requested_window("manual", "x", 400)
    record = {
        "source": "0" * 24,
        "requested": "lung",
        "window": [-600.0, 1500.0],
        "window_source": "preset lung",
        "frame": 7,
        "frames": 15,
        "pixel_spacing": [0.5, 0.3],
        "info": {
            "modality": "CT",
            "body_part": "CHEST",
            "study_date": "20040119",
            "size": "512x256",
            "frames": 15,
        },
    }
    text = helpers.dicom_description(record, (128, 128), 16)
    assert "CT · chest · study 2004-01-19 · 512x256 px" in text
    assert "C -600 / W 1500 (preset lung)" in text and "frame 8 of 15" in text
    assert "patch 16 px ≈ 19.2 × 16.0 mm" in text  # 0.3*512/128*16 across, 0.5*256/128*16 down
    assert helpers.dicom_name(record) == "CT-00000000-frame8"


def test_the_patch_menu_offers_the_models_own_default():
    """A model whose registry entry names a patch the estimator is not calibrated for
    (say 10) still finds it in the menu: the callback sets the value, and a value the menu
    does not offer would show as blank."""
    from webapp.layout import PATCH_SIZES, patch_options

    assert [o["value"] for o in patch_options()] == list(PATCH_SIZES)
    assert [o["value"] for o in patch_options(12)] == list(PATCH_SIZES)  # no duplicate
    values = [o["value"] for o in patch_options(10)]
    assert 10 in values and values == sorted(values)
    assert {"label": "10x10", "value": 10} in patch_options(10)


def test_one_client_cannot_evict_another_clients_stored_files(tmp_path):
    """Two 130 MB volumes from one client evicted other users' stored uploads (their
    volume DICOM export then said "no longer on the server"): a client's new file now
    evicts its own older ones first, and it holds at most a quarter of the store."""
    store = ImageStore(tmp_path, max_bytes=4000, max_count=100)
    mine = store.put_source(b"a" * 900, "tab-a", "address:127.0.0.1")
    for index in range(6):  # another client, over and over, near its whole share
        store.put_source(bytes([index]) * 900, f"tab-b{index}", "address:127.0.0.2")
        assert store.source(mine, "tab-a") == b"a" * 900
    files, stored = store.usage()
    assert stored <= 2 * 900 and files == 2  # a's file and b's newest (b's share: 1,000)
    with pytest.raises(InputError, match="no longer on the server"):
        store.source(helpers_key(bytes([4]) * 900), "tab-b4")
    assert store.source(helpers_key(bytes([5]) * 900), "tab-b5") == bytes([5]) * 900


def test_a_full_store_never_evicts_a_file_another_client_may_have_on_screen(tmp_path):
    """Five clients' 900 bytes overflow the store's 4,000: the fifth's file evicted the
    first client's, which that user had just opened. Now the newcomer is told to try
    again, and once the first file has not been used for ON_SCREEN_SECONDS it goes."""
    store = ImageStore(tmp_path, max_bytes=4000, max_count=100)
    keys = [store.put_source(bytes([i]) * 900, f"t{i}", f"address:10.0.0.{i}") for i in range(4)]
    with pytest.raises(InputError, match="full of files other users have open"):
        store.put_source(bytes([4]) * 900, "t4", "address:10.0.0.4")
    for index, key in enumerate(keys):
        assert store.source(key, f"t{index}") == bytes([index]) * 900
    assert store.usage() == (4, 3600)  # the refused file is not kept
    stale = time.time() - image_store.ON_SCREEN_SECONDS - 60
    os.utime(next(tmp_path.glob(f"{keys[0]}.*")), (stale, stale))
    key = store.put_source(bytes([4]) * 900, "t4", "address:10.0.0.4")
    with pytest.raises(InputError, match="no longer on the server"):
        store.source(keys[0], "t0")  # not used for half an hour: the least recently used
    assert store.source(key, "t4") == bytes([4]) * 900


def test_only_a_clients_latest_files_count_as_on_screen(tmp_path):
    """A client holding several files keeps its two latest safe, not all of them: a full
    store still makes room from the largest holder's older files."""
    store = ImageStore(tmp_path, max_bytes=10_000, max_count=12)  # 3 files a client
    held = [store.put_source(bytes([i]) * 100, f"h{i}", "address:10.0.0.1") for i in range(3)]
    for other in range(10):  # ten more clients, a file each: the store's 12 overflow
        store.put_source(bytes([9, other]) * 50, f"o{other}", f"address:10.0.1.{other}")
    assert store.usage()[0] == 12
    assert not any(tmp_path.glob(f"{held[0]}.*"))  # the largest holder's oldest went
    assert all(any(tmp_path.glob(f"{key}.*")) for key in held[1:])  # its two latest stay


def helpers_key(data: bytes) -> str:
    import hashlib

    return hashlib.blake2b(data, digest_size=12).hexdigest()


def test_a_message_in_place_of_a_figure_is_wrapped_inside_the_plot_and_escaped():
    """A long message over a hidden result ran past the plot's edges in one line."""
    from webapp.figures import PLACEHOLDER_LINE, placeholder_figure

    message = (
        "This heatmap was computed for another volume, model or setting; press Run to "
        "explain <b>scan.nii.gz</b> as it is now on screen"
    )
    shown = placeholder_figure(message)["layout"]["annotations"][0]["text"]
    lines = shown.split("<br>")
    assert len(lines) > 2 and all(len(line) <= PLACEHOLDER_LINE + 12 for line in lines)
    assert "<b>" not in shown and "&lt;b&gt;scan.nii.gz&lt;/b&gt;" in shown
    assert placeholder_figure("")["layout"]["annotations"][0]["text"] == ""


def test_a_job_that_ends_between_dash_reading_its_result_and_asking_if_it_runs_is_kept(
    tmp_path,
):
    """Dash polls a background job by reading its result and then asking whether the job
    still runs; a job thread that wrote its result and ended between the two was taken
    for a cancelled job (no result, the page stopped polling): a volume run in the
    switching test finished and the panel never showed it (1 of 5 runs under load)."""
    import diskcache

    manager = ThreadedDiskcacheManager(diskcache.Cache(str(tmp_path)))
    release = threading.Event()

    def job_fn(key, progress_key, args, context):
        release.wait(5)
        manager.handle.set(key, "the result")

    job = manager.call_job_fn("key", job_fn, (), {})
    assert manager.get_result("key", job) is manager.UNDEFINED  # Dash reads first ...
    release.set()
    deadline = time.monotonic() + 5
    while any(t.name == f"krypton-job-{job}" for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert manager.job_running(job)  # ... then asks: its result is still to be delivered
    assert manager.get_result("key", job) == "the result"
    assert not manager.job_running(job)  # delivered: done


def test_a_full_store_evicts_from_the_client_holding_the_most(tmp_path):
    """Five addresses storing many small files evicted another user's one image (the
    oldest of anyone's went first): the client holding the most loses its oldest first."""
    store = ImageStore(tmp_path, max_bytes=100_000, max_count=20)  # 5 files a client
    victim = store.put_source(b"v" * 100, "victim-tab", "address:10.0.0.9")
    for round_ in range(8):
        for attacker in range(5):
            data = bytes([attacker, round_]) * 50
            store.put_source(data, f"tab-{attacker}-{round_}", f"address:10.0.0.{attacker}")
            assert store.source(victim, "victim-tab") == b"v" * 100  # never the victim's
    assert store.usage()[0] <= 20
