"""``krypton compare``: three methods on one image or volume, one PNG and one JSON, the
methods' agreement and deletion/insertion areas, and clear errors."""

from __future__ import annotations

import json

import nibabel
import numpy as np
from PIL import Image

from krypton.chestct import ChestCTGenerator
from krypton.registry import load_model


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
