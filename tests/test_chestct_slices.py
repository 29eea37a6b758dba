"""The CT slice demo model (chestct-slice-demo): one axial slice of a chest CT series, as
a scanner writes it, explained from the command line as a user would — the nodule found
under the lowest cell, a fundus photograph flagged as not what it knows — and the
training targets that make occluding a nodule lower p(NODULE)."""

from pathlib import Path

import numpy as np
import pytest

from demo.chestct.slices import (
    SIDE,
    nodule_cut,
    slice_label,
    to_input,
    visible_share,
    window_slice,
)
from demo.pacs import ct_series
from krypton.cli import main
from krypton.registry import available_models
from krypton.registry.models import DEFAULT_STRIDE
from krypton.synthetic.chestct import ChestCTGenerator

SHIPPED = {info.name for info in available_models() if info.available}
needs_model = pytest.mark.skipif(
    "chestct-slice-demo" not in SHIPPED, reason="chestct-slice-demo is not shipped here"
)


def _slice_file(folder: Path, volume: np.ndarray, z: int) -> Path:
    """Slice ``z`` of ``volume`` as one file of a CT series (the lung window in its
    header, as demo.pacs writes the PACS's series)."""
    dataset = ct_series(volume, (5.0, 5.0, 5.0), "Slice^Test")[z]
    path = folder / "slice.dcm"
    dataset.save_as(path, enforce_file_format=True)
    return path


def test_a_slice_is_labelled_by_how_near_it_cuts_a_nodule_and_a_box_hides_the_cut():
    sample = ChestCTGenerator(seed=62).sample(label=1, nodules=1)
    nodule = sample.nodules[0]
    middle = int(round(nodule.z))
    assert slice_label(sample, middle) == 1
    far = next(z for z in range(48) if abs(z - nodule.z) > nodule.radius + 1)
    assert slice_label(sample, far) == 0 and nodule_cut(sample, far) == []
    (cut,) = nodule_cut(sample, middle)
    row, column, radius = cut
    assert visible_share([cut], None) == 1.0
    side = int(2 * radius + 4)
    over = (int(row - side / 2), int(column - side / 2), side)
    assert visible_share([cut], over) == 0.0  # the whole cut hidden: the target drops
    beside = (0, 0, 4) if row > 12 and column > 12 else (SIDE - 4, SIDE - 4, 4)
    assert visible_share([cut], beside) == 1.0
    tensor = to_input(window_slice(sample.volume[middle], None))
    assert tuple(tensor.shape) == (3, SIDE, SIDE)


@needs_model
def test_the_shipped_slice_model_points_at_the_nodule_in_a_ct_file(tmp_path, capsys):
    sample = ChestCTGenerator(seed=61).sample(label=1, nodules=1)
    nodule = sample.nodules[0]
    path = _slice_file(tmp_path, sample.volume, int(round(nodule.z)))
    code = main(["explain", str(path), "--model", "chestct-slice-demo",
                 "--out", str(tmp_path / "h.png")])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0 and "label      1 NODULE" in printed, printed
    assert "like the training images" in printed
    values = np.load(tmp_path / "h.npy")
    i, j = np.unravel_index(np.argmin(values), values.shape)
    corner = np.array([i, j]) * DEFAULT_STRIDE  # patch 8, the model's, in 64-pixel input
    centre = (np.array([nodule.y, nodule.x]) + 0.5) * SIDE / 48 - 0.5
    assert np.all((corner - 0.5 <= centre) & (centre <= corner + 7.5)), (corner, centre)


@needs_model
def test_a_fundus_photograph_is_flagged_as_not_what_the_slice_model_knows(tmp_path, capsys):
    photograph = Path(__file__).parents[1] / "assets" / "samples" / "fundus-exudates.png"
    code = main(["explain", str(photograph), "--model", "chestct-slice-demo", "--stride", "16",
                 "--out", str(tmp_path / "h.png")])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0 and "OUT OF DISTRIBUTION" in captured.out
