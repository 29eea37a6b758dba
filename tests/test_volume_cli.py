"""`krypton explain` on volumes: a NIfTI file or a DICOM series in, the heatmap out as NIfTI
in the source's scanner frame (checked with nibabel against the library's own result), and
a PNG of each view. Volume models in the registry, and clear refusals across 2-D / 3-D."""

import io
import json

import nibabel
import numpy as np
import pydicom
import pytest
import torch
from PIL import Image
from pydicom.uid import generate_uid

import krypton
from demo.pacs import ct_series
from krypton.cli import main
from krypton.io.volumes import Volume, read_volume
from krypton.registry import load_model
from krypton.registry.architectures import build
from krypton.registry.entries import RegistryError, validate_entry
from krypton.synthetic.chestct import ChestCTGenerator
from webapp.panel_scope import IMAGE_PANEL, VOLUME_PANEL

SPACING = 4.0  # mm: the model's 5 mm makes 48 voxels 38 (padded back to 48)
ORIGIN_LPS = np.array([-90.0, -110.0, 40.0])
REGION = "16,16,16,32,32,32"  # model voxels: 3 x 3 x 3 cells at patch 8, stride 4


@pytest.fixture
def volume_model(krypton_home):
    """A user-registered ct3d-small with seeded random weights, as chestct-demo is made."""
    torch.manual_seed(0)
    module = build("ct3d-small", 2).eval()
    for layer in module.modules():  # non-trivial batch-norm statistics
        if isinstance(layer, torch.nn.BatchNorm3d):
            layer.running_mean.uniform_(-0.1, 0.1)
            layer.running_var.uniform_(0.5, 1.5)
    folder = krypton_home / "models"
    folder.mkdir(parents=True)
    torch.save(module.state_dict(), folder / "ct-test.pt")
    entry = {
        "name": "ct-test",
        "architecture": "ct3d-small",
        "weights": {"source": "file", "path": "ct-test.pt", "format": "state_dict"},
        "input_size": [48, 48, 48],
        "mean": [0.4],
        "std": [0.35],
        "volume": {"spacing_mm": [5.0, 5.0, 5.0], "window_hu": [-1000, 400], "fill_hu": -850},
        "classes": ["NORMAL", "NODULE"],
        "patch": 8,
    }
    (folder / "ct-test.json").write_text(json.dumps(entry))
    return load_model("ct-test")


@pytest.fixture(scope="module")
def hu_volume():
    return ChestCTGenerator(seed=21).sample(label=1).volume  # (z, y, x) HU


def ras_affine() -> np.ndarray:
    """(x, y, z) index -> RAS mm of a series with identity orientation (LPS), SPACING apart."""
    affine = np.diag([-SPACING, -SPACING, SPACING, 1.0])
    affine[:3, 3] = ORIGIN_LPS * [-1, -1, 1]
    return affine


def write_nifti(path, hu):
    nibabel.save(nibabel.Nifti1Image(np.transpose(hu, (2, 1, 0)), ras_affine()), str(path))


def write_series(folder, hu):
    """The same volume as a DICOM CT series (demo.pacs.ct_series: identity orientation,
    SPACING mm apart from ORIGIN_LPS), its files named out of slice order."""
    folder.mkdir()
    for k, dataset in enumerate(ct_series(hu, (SPACING,) * 3, "Test^Volume", ORIGIN_LPS)):
        dataset.save_as(folder / f"slice{(k * 7) % len(hu):03d}.dcm", enforce_file_format=True)


def explain_cli(source, out, *extra):
    return main(
        ["explain", str(source), "--model", "ct-test", "--patch", "8", "--stride", "4",
         "--region", REGION, "--label", "1", "--out", str(out), *extra]
    )  # fmt: skip


def test_a_nifti_volume_is_explained_into_a_nifti_heatmap_in_the_scanner_frame(
    tmp_path, volume_model, hu_volume, capsys
):
    write_nifti(tmp_path / "chest.nii.gz", hu_volume)
    assert explain_cli(tmp_path / "chest.nii.gz", tmp_path / "out" / "heat.png") == 0
    printed = capsys.readouterr().out
    assert "resampled to 38x38x38" in printed and "mode exact" in printed
    written = nibabel.load(str(tmp_path / "out" / "heat.nii.gz"))
    values = np.transpose(np.asarray(written.dataobj), (2, 1, 0))  # back to (z, y, x)
    # the library's own result on the same input
    prepared = volume_model.prepare_volume(read_volume(tmp_path / "chest.nii.gz"))
    expected = krypton.explain(
        volume_model, prepared.tensor, patch=8, stride=4, label=1,
        region=(16, 16, 16, 32, 32, 32), fill=volume_model.gray_fill(),
    )  # fmt: skip
    assert values.shape == (3, 3, 3)
    np.testing.assert_allclose(values, expected.values, atol=1e-6)
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "heat.npy"), values)
    # Cell (k, i, j) is the patch centred at model voxel 16 + 4 k + 3.5 (each axis); the
    # model voxel m is resampled voxel m + corner (-5: 38 padded to 48), which lies at
    # source index (r + 0.5) * 48 / 38 - 0.5 (trilinear, half-voxel centres).
    for cell in [(0, 0, 0), (2, 1, 0), (1, 2, 2)]:
        model_voxel = 16 + 4 * np.array(cell) + 3.5
        source_zyx = (model_voxel - 5 + 0.5) * 48 / 38 - 0.5
        world = ras_affine() @ np.append(source_zyx[::-1], 1.0)
        np.testing.assert_allclose(written.affine @ np.append(cell[::-1], 1.0), world, atol=1e-6)
    for view in ("axial", "coronal", "sagittal"):
        with Image.open(tmp_path / "out" / f"heat.{view}.png") as picture:
            assert picture.format == "PNG" and min(picture.size) >= 400


def test_a_dicom_series_of_the_same_volume_gives_the_same_heatmap_and_frame(
    tmp_path, volume_model, hu_volume
):
    write_nifti(tmp_path / "chest.nii.gz", np.round(hu_volume))  # what DICOM can store
    write_series(tmp_path / "series", hu_volume)
    assert explain_cli(tmp_path / "chest.nii.gz", tmp_path / "a.png") == 0
    assert explain_cli(tmp_path / "series", tmp_path / "b.nii.gz") == 0
    from_nifti, from_dicom = (nibabel.load(str(tmp_path / f"{n}.nii.gz")) for n in "ab")
    np.testing.assert_allclose(from_dicom.affine, from_nifti.affine, atol=1e-6)
    np.testing.assert_allclose(
        np.asarray(from_dicom.dataobj), np.asarray(from_nifti.dataobj), atol=1e-6
    )


def test_an_enhanced_multiframe_file_is_explained_as_its_series(tmp_path, volume_model, hu_volume):
    import highdicom

    write_series(tmp_path / "series", hu_volume)
    slices = [pydicom.dcmread(p) for p in sorted((tmp_path / "series").glob("*.dcm"))]
    highdicom.legacy.LegacyConvertedEnhancedCTImage(
        slices, generate_uid(), 1, generate_uid(), 1
    ).save_as(tmp_path / "enhanced.dcm")
    assert explain_cli(tmp_path / "series", tmp_path / "a.png") == 0
    assert explain_cli(tmp_path / "enhanced.dcm", tmp_path / "b.png") == 0
    from_series, from_file = (nibabel.load(str(tmp_path / f"{n}.nii.gz")) for n in "ab")
    np.testing.assert_allclose(from_file.affine, from_series.affine, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(from_file.dataobj), np.asarray(from_series.dataobj))


def test_the_views_go_through_the_lowest_cell_or_the_middle(
    tmp_path, volume_model, hu_volume, capsys
):
    write_nifti(tmp_path / "chest.nii.gz", hu_volume)
    assert explain_cli(tmp_path / "chest.nii.gz", tmp_path / "low.png") == 0
    values = np.load(tmp_path / "low.npy")
    k, i, j = np.unravel_index(np.argmin(values), values.shape)
    lowest = tuple(16 + 4 * int(n) + 3 for n in (k, i, j))
    assert f"through voxel (z, y, x) = {lowest} (lowest)" in capsys.readouterr().out
    assert explain_cli(tmp_path / "chest.nii.gz", tmp_path / "mid.png", "--slices", "middle") == 0
    assert "through voxel (z, y, x) = (24, 24, 24) (middle)" in capsys.readouterr().out


def test_volumes_and_images_are_not_mixed_up(tmp_path, volume_model, hu_volume, capsys):
    write_nifti(tmp_path / "chest.nii.gz", hu_volume)
    code = main(["explain", str(tmp_path / "chest.nii.gz"), "--model", "resnet18",
                 "--random-weights", "--out", str(tmp_path / "x.png")])  # fmt: skip
    assert code == 2 and "is a 2-D model" in capsys.readouterr().err
    Image.new("RGB", (64, 64)).save(tmp_path / "photo.png")
    code = main(["explain", str(tmp_path / "photo.png"), "--model", "ct-test",
                 "--out", str(tmp_path / "y.png")])  # fmt: skip
    assert code == 2 and "ct-test is a volume model" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    code = explain_cli(tmp_path / "empty", tmp_path / "z.png")
    assert code == 2 and "holds no DICOM files" in capsys.readouterr().err
    assert not (tmp_path / "z.nii.gz").exists()


def test_the_registry_lists_volume_models_and_never_makes_one_the_default(volume_model, capsys):
    from krypton.registry import available_models, default_model_name

    info = next(i for i in available_models() if i.name == "ct-test")
    assert info.is_volume and info.input_size == (48, 48, 48)
    assert default_model_name() != "ct-test"
    assert main(["models"]) == 0
    assert "ct-test: 2 classes, input 48x48x48 (volumes)" in capsys.readouterr().out
    # the occluder: fill_hu (-850 HU) in the model's input space
    assert volume_model.gray_fill() == pytest.approx((((-850 + 1000) / 1400 - 0.4) / 0.35,))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"volume": None}, "a volume model needs 'volume'"),
        ({"volume": {"spacing_mm": [5, 5], "window_hu": [-1000, 400], "fill_hu": 0}}, "needs"),
        ({"volume": {"spacing_mm": [5, 5, 5], "window_hu": [400, -1000], "fill_hu": 0}}, "needs"),
        ({"mean": [0.4, 0.4, 0.4]}, "'mean' must be 1 number"),
        ({"input_size": [48, 48, 4]}, "each from 8 to 256 voxels"),
        ({"architecture": "ct3d-huge"}, "unknown architecture 'ct3d-huge'"),
    ],
)
def test_bad_volume_entries_are_refused(change, message):
    entry = {
        "name": "bad", "architecture": "ct3d-small", "classes": ["A", "B"],
        "weights": {"source": "file", "path": "bad.pt"}, "input_size": [48, 48, 48],
        "mean": [0.4], "std": [0.35],
        "volume": {"spacing_mm": [5, 5, 5], "window_hu": [-1000, 400], "fill_hu": -850},
    }  # fmt: skip
    entry.update(change)
    with pytest.raises(RegistryError, match=message):
        validate_entry(entry, "bad.json")


def test_view_pictures_show_the_heatmap_where_its_cells_reach(volume_model, hu_volume):
    from krypton.render.volumes import view_pngs, voxel_values

    tensor = volume_model.prepare_volume(Volume(hu_volume, (5.0, 5.0, 5.0), "generated")).tensor
    heatmap = krypton.explain(volume_model, tensor, patch=8, stride=4, region=(16,) * 3 + (32,) * 3)
    per_voxel = voxel_values(heatmap, (48, 48, 48))
    # cells centred at 19.5, 23.5, 27.5: they reach 17.5..29.5 on each axis
    reached = np.argwhere(np.isfinite(per_voxel))
    assert reached.min() == 18 and reached.max() == 29
    assert per_voxel[19, 19, 19] == pytest.approx(heatmap.values[0, 0, 0])
    assert per_voxel[28, 24, 20] == pytest.approx(heatmap.values[2, 1, 0])
    pngs = view_pngs(np.zeros((48, 48, 48)), heatmap, (24, 24, 24), "t")
    assert set(pngs) == {"axial", "coronal", "sagittal"}
    assert all(Image.open(io.BytesIO(data)).format == "PNG" for data in pngs.values())


def test_batch_explains_a_folder_of_volumes_and_resumes(tmp_path, volume_model, hu_volume, capsys):
    folder = tmp_path / "scans"
    folder.mkdir()
    write_nifti(folder / "first.nii.gz", hu_volume)
    write_series(folder / "second", hu_volume)
    (folder / "broken.nii").write_bytes(b"not a nifti")
    (folder / "notes.txt").write_text("not a volume: not an input")
    args = ["batch", str(folder), "--model", "ct-test", "--out", str(tmp_path / "out"),
            "--patch", "8", "--stride", "4", "--region", REGION]  # fmt: skip
    assert main(args) == 1  # one input failed, and says so
    captured = capsys.readouterr()
    assert "2 of 3 images explained" in captured.out and "broken.nii" in captured.err
    out = tmp_path / "out"
    for stem in ("first", "second"):
        assert (out / f"{stem}.nii.gz").exists() and (out / f"{stem}.axial.png").exists()
    np.testing.assert_allclose(
        np.asarray(nibabel.load(str(out / "second.nii.gz")).dataobj),
        np.asarray(nibabel.load(str(out / "first.nii.gz")).dataobj),
        atol=1e-2,  # the series stores whole HU, the NIfTI the generator's floats
    )
    rows = (out / "summary.csv").read_text().splitlines()
    header = rows[0].split(",")
    first = dict(zip(header, rows[1 + [r.split(",")[0] for r in rows[1:]].index(
        str(folder / "first.nii.gz"))].split(",")))  # fmt: skip
    values = np.load(out / "first.npy")
    k, i, j = np.unravel_index(np.argmin(values), values.shape)
    assert (first["lowest_at_z"], first["lowest_at_y"], first["lowest_at_x"]) == tuple(
        str(16 + 4 * n) for n in (k, i, j)
    )
    assert 'src="first.axial.png"' in (out / "index.html").read_text()
    stamp = (out / "first.nii.gz").stat().st_mtime_ns
    main(args)  # done volumes are skipped
    assert (out / "first.nii.gz").stat().st_mtime_ns == stamp


def test_the_page_lists_a_volume_model_disabled_and_refuses_a_request_for_it(
    tmp_path, volume_model
):
    from webapp.helpers import InputError
    from webapp.panels.models import model_options
    from webapp.services import Services

    option = next(o for o in model_options() if o["value"] == "ct-test")
    assert option["disabled"] and "volume model" in option["title"]
    with pytest.raises(InputError, match="ct-test is a volume model"):
        Services(tmp_path / "cache").model("ct-test")


def test_the_cli_and_the_app_share_their_default_strides(volume_model):
    """The app's volume stride was 5 and the CLI's 4: the same volume explained at
    defaults gave different grids in the two."""
    import plotly

    from bench.dash_client import find
    from krypton.cli import build_parser, explain_options
    from webapp.layout import build_layout

    args = build_parser().parse_args(["explain", "chest.nii.gz", "--model", "ct-test"])
    image_model = load_model("fundus-demo")
    assert explain_options(args, volume_model)["stride"] == volume_model.default_stride == 5
    assert explain_options(args, image_model)["stride"] == image_model.default_stride == 4
    page = json.loads(json.dumps(build_layout([], None), cls=plotly.utils.PlotlyJSONEncoder))
    assert find(page, VOLUME_PANEL.stride)["props"]["value"] == 5
    assert find(page, IMAGE_PANEL.stride)["props"]["value"] == 4
