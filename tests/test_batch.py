"""krypton batch: a folder, a glob or a CSV of images; every output; resumable; bad files
listed with their error while the run goes on."""

import csv
import os
import shutil
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from test_cli import run_cli

import krypton
from krypton.batch.folder import collect_inputs, run_batch
from krypton.io.images import load_image
from webapp import exports

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ["retina.jpg", "microaneurysms.png", "chelsea.png", "coffee.png"]
# a quarter of each image: 49 positions (the files, rows and resumption are the point)
OPTIONS = dict(patch=16, stride=16, mode="exact", fill=0.0, region=(0, 0, 112, 112))


@pytest.fixture
def folder(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for name in SAMPLES:
        shutil.copy(ROOT / "assets" / "samples" / name, images / name)
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (images / "notes.txt").write_text("not an image, and not an image suffix: ignored")
    return images


class Figures(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.failures = [], 0

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs)["src"])
        if tag == "li":
            self.failures += 1


def test_folder_with_a_corrupt_file(folder, tmp_path):
    out = tmp_path / "out"
    region = ["--region", "0,0,112,112"]  # a quarter of each image: 49 positions
    result = run_cli("batch", str(folder), "--out", str(out), "--stride", "16", *region)
    assert result.returncode == 1  # one image could not be explained
    assert "4 of 5 images explained" in result.stdout
    assert "broken.png" in result.stderr and "Traceback" not in result.stderr
    with (out / "summary.csv").open() as handle:
        rows = {Path(row["image"]).name: row for row in csv.DictReader(handle)}
    assert set(rows) == set(SAMPLES) | {"broken.png"}
    assert (
        "could not be decoded" in rows["broken.png"]["error"]
        or "not an image" in rows["broken.png"]["error"]
    )
    retina = rows["retina.jpg"]
    assert retina["predicted_class"] and float(retina["lowest_probability"]) <= float(
        retina["explained_probability"]
    )
    assert retina["plan"].startswith(("incremental:", "naive:"))
    for name in SAMPLES:
        stem = Path(name).stem
        for suffix in (".png", ".npy", ".npz", ".json"):
            assert (out / f"{stem}{suffix}").exists()
    sheet = Figures()
    sheet.feed((out / "index.html").read_text())
    assert sorted(sheet.images) == sorted(f"{Path(n).stem}.png" for n in SAMPLES)
    assert sheet.failures == 1
    # the values are those of a single explain() call
    loaded = krypton.load_model("fundus-demo")
    picture = load_image(folder / "retina.jpg")
    alone = krypton.explain(
        loaded,
        loaded.preprocess(picture),
        patch=loaded.patch,
        stride=16,
        fill=loaded.gray_fill(),
        region=(0, 0, 112, 112),
    )
    np.testing.assert_allclose(np.load(out / "retina.npy"), alone.values, atol=1e-5)


def test_an_interrupted_run_resumes_without_recomputing(folder, tmp_path):
    loaded = krypton.load_model("fundus-demo")
    items = collect_inputs(str(folder))
    out = tmp_path / "out"

    def stop_after_three(done, total, name):  # broken.png, chelsea, coffee
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_batch(items, loaded, out, OPTIONS, progress=stop_after_three)
    finished = sorted(p.stem for p in out.glob("*.json"))
    assert len(finished) == 2 and not (out / "summary.csv").exists()
    stamps = {name: os.stat(out / f"{name}.npy").st_mtime_ns for name in finished}
    rows = run_batch(items, loaded, out, OPTIONS)
    assert len(rows) == 5 and sum(1 for row in rows if row.error) == 1
    for name, stamp in stamps.items():
        assert os.stat(out / f"{name}.npy").st_mtime_ns == stamp  # skipped, not recomputed
    assert len(list(out.glob("*.json"))) == 4
    # an image whose outputs went missing is done again
    (out / "coffee.npy").unlink()
    rows = run_batch(items, loaded, out, OPTIONS)
    assert (out / "coffee.npy").exists()
    # other settings: every image is explained again, not served stale
    coarser = dict(OPTIONS, stride=32)
    rows = run_batch(items, loaded, out, coarser)
    assert np.load(out / "chelsea.npy").shape == (4, 4)


def test_csv_list_with_labels_and_glob(folder, tmp_path):
    listing = tmp_path / "list.csv"
    listing.write_text(
        "path,label\nimages/retina.jpg,EXUDATE\nimages/coffee.png,0\nimages/chelsea.png,\n"
    )
    items = collect_inputs(str(listing))
    assert [item.label for item in items] == ["EXUDATE", "0", None]
    loaded = krypton.load_model("fundus-demo")
    rows = run_batch(items, loaded, tmp_path / "out", OPTIONS)
    assert [row.explained_class for row in rows] == ["EXUDATE", "NORMAL", rows[2].predicted_class]
    bad = tmp_path / "bad.csv"
    bad.write_text("path,label\nimages/retina.jpg,TUMOUR\n")
    rows = run_batch(collect_inputs(str(bad)), loaded, tmp_path / "bad", OPTIONS)
    assert "TUMOUR" in rows[0].error
    assert [item.path.name for item in collect_inputs(str(folder / "c*.png"))] == [
        "chelsea.png",
        "coffee.png",
    ]
    with pytest.raises(ValueError, match="'path' column"):
        (tmp_path / "nopath.csv").write_text("file\nx.png\n")
        collect_inputs(str(tmp_path / "nopath.csv"))
    result = run_cli("batch", str(tmp_path / "missing"), "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "no such folder" in result.stderr


def test_batch_and_the_app_write_the_same_value_files():
    """The .npy/.npz/CSV writers were written twice (batch.py and webapp/helpers.py)."""
    import io

    from PIL import Image

    from krypton.batch.folder import heatmap_files
    from krypton.render.exports import NPZ_KEYS

    model = krypton.load_model("fundus-demo")
    picture = Image.open(ROOT / "assets" / "samples" / "retina.jpg").convert("RGB")
    heatmap = krypton.explain(model, model.preprocess(picture), patch=16, stride=16,
                              region=(0, 0, 64, 64))  # fmt: skip
    files = heatmap_files(picture, heatmap, model)
    result = {
        "values": heatmap.values, "class_values": heatmap.class_values, "xs": heatmap.xs,
        "ys": heatmap.ys, "classes": model.classes, "base_probs": heatmap.base_probs,
    }  # fmt: skip
    assert files[".npy"] == exports.export_npy(result)
    batch, app = (
        np.load(io.BytesIO(data)) for data in (files[".npz"], exports.export_all_classes(result))
    )
    assert tuple(batch.files) == tuple(app.files) == NPZ_KEYS
    for key in NPZ_KEYS:
        np.testing.assert_array_equal(batch[key], app[key])
    rows = list(csv.reader(io.StringIO(exports.export_csv(result))))
    assert rows[0] == ["x", "y", "probability"] and len(rows) == 1 + heatmap.values.size
