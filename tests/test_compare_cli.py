"""``krypton compare``: three methods on one image or volume, one PNG and one JSON, the
methods' agreement and deletion/insertion areas, and clear errors."""

from __future__ import annotations

import json

import nibabel
import numpy as np
import pytest
from PIL import Image

from krypton.registry import load_model
from krypton.synthetic.chestct import ChestCTGenerator

pytestmark = pytest.mark.usefixtures("quick_integrated_gradients")


def test_compare_writes_three_maps_on_one_grid_for_an_image(tmp_path, cli_here):
    out = tmp_path / "c.png"
    done = cli_here(
        "compare", "assets/samples/fundus-exudates.png", "--stride", "32", "--out", str(out)
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(out.with_suffix(".json").read_text())
    assert list(record["methods"]) == ["occlusion", "gradcam", "integrated_gradients"]
    shapes = {np.asarray(m["importance"]).shape for m in record["methods"].values()}
    assert shapes == {(7, 7)}  # (224 - 12) / 32 + 1 cells a side, the same for each method
    assert record["class"] == load_model("fundus-demo").class_name(record["label"])
    assert len(record["agreement"]) == 3
    for entry in record["methods"].values():
        assert 0 <= entry["deletion_auc"] <= 1 and 0 <= entry["insertion_auc"] <= 1
        assert entry["seconds"] > 0
    assert "layer layer4" in record["methods"]["gradcam"]["detail"]
    assert Image.open(out).size[0] > 600  # three panels side by side
    assert "Grad-CAM" in done.stdout and "Spearman" in done.stdout


def test_compare_takes_a_volume_and_refuses_unknown_methods(tmp_path, cli_here):
    sample = ChestCTGenerator(seed=40).sample(label=1, nodules=1)
    path = tmp_path / "chest.nii.gz"
    affine = np.diag([5.0, 5.0, 5.0, 1.0])
    nibabel.save(nibabel.Nifti1Image(np.transpose(sample.volume, (2, 1, 0)), affine), str(path))
    out = tmp_path / "v.png"
    done = cli_here("compare", str(path), "--model", "chestct-demo", "--stride", "16",
                    "--methods", "occlusion,gradcam", "--out", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    record = json.loads(out.with_suffix(".json").read_text())
    assert list(record["methods"]) == ["occlusion", "gradcam"]
    assert np.asarray(record["methods"]["gradcam"]["importance"]).shape == (3, 3, 3)
    assert out.exists()
    bad = cli_here("compare", str(path), "--methods", "occlusion,lime", "--out", str(out))
    assert bad.returncode == 2 and "unknown methods ['lime']" in bad.stderr


def test_batch_sets_the_gradient_methods_beside_occlusion_for_each_image(tmp_path, cli_here):
    import csv
    import shutil

    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("fundus-exudates.png", "fundus-microaneurysms.png"):
        shutil.copy(f"assets/samples/{name}", folder / name)
    out = tmp_path / "out"
    done = cli_here("batch", str(folder), "--out", str(out), "--stride", "32",
                    "--methods", "occlusion,gradcam,ig")  # fmt: skip
    assert done.returncode == 0, done.stderr
    with (out / "summary.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2
    for row in rows:
        stem = row["outputs"].split(";")[0].rsplit(".", 1)[0]
        assert {f"{stem}.methods.png", f"{stem}.methods.json", f"{stem}.npy"} <= set(
            row["outputs"].split(";")
        )
        assert float(row["gradcam_seconds"]) > 0 and float(row["ig_seconds"]) > 0
        assert -1 <= float(row["gradcam_spearman"]) <= 1 and -1 <= float(row["ig_spearman"]) <= 1
        record = json.loads((out / f"{stem}.methods.json").read_text())
        assert list(record["methods"]) == ["occlusion", "gradcam", "integrated_gradients"]
        # occlusion's map is the batch's own heatmap, not computed again
        values = np.load(out / f"{stem}.npy")
        occlusion = np.asarray(record["methods"]["occlusion"]["importance"], np.float64)
        np.testing.assert_allclose(occlusion, record["prob"] - values, atol=1e-6)
    plain = cli_here("batch", str(folder), "--out", str(tmp_path / "plain"), "--stride", "32")
    assert plain.returncode == 0 and not list((tmp_path / "plain").glob("*.methods.*"))
    bad = cli_here("batch", str(folder), "--out", str(out), "--methods", "lime")
    assert bad.returncode == 2 and "unknown methods ['lime']" in bad.stderr


def test_batch_takes_the_layer_grad_cam_reads_and_names_it(tmp_path, cli_here):
    """The layer choice reached `krypton compare` only: batch now takes --layer too, and
    each image's JSON names the layer Grad-CAM read (the default rule's layer is
    tests/test_methods.py's)."""
    import shutil

    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy("assets/samples/fundus-exudates.png", folder / "a.png")
    out = tmp_path / "out"
    done = cli_here("batch", str(folder), "--out", str(out), "--stride", "32",
                    "--methods", "occlusion,gradcam", "--layer", "layer3")  # fmt: skip
    assert done.returncode == 0, done.stderr
    (found,) = out.glob("*.methods.json")
    assert json.loads(found.read_text())["methods"]["gradcam"]["detail"] == "layer layer3"


def test_compare_reads_a_dicom_slice_in_the_window_asked_for(tmp_path, cli_here):
    """--window and --frame as `krypton explain` takes them: another window is another
    input, so other maps; a window that does not parse is refused by name."""
    from pydicom.data import get_testdata_file

    source = get_testdata_file("CT_small.dcm")
    records = {}
    for window in (None, "lung"):
        out = tmp_path / f"{window}.png"
        extra = [] if window is None else ["--window", window]
        done = cli_here("compare", source, "--stride", "32", "--methods", "occlusion,gradcam",
                        "--out", str(out), *extra)  # fmt: skip
        assert done.returncode == 0, done.stderr
        records[window] = json.loads(out.with_suffix(".json").read_text())
    own, lung = (np.asarray(records[w]["methods"]["gradcam"]["importance"]) for w in records)
    assert own.shape == lung.shape and not np.allclose(own, lung)
    bad = cli_here("compare", source, "--window", "sideways", "--out", str(tmp_path / "b.png"))
    assert bad.returncode == 2 and "sideways" in bad.stderr
