"""Hostile volumes through the library (read_volume, prepare_for_model): every file of
bench.hostile_volumes is refused with a message that says what was found and what the
limit is, within 10 s and well under 400 MB; and the bounded paths that replaced the
unbounded ones (resampling only the model's block, the bounded inflater) compute what the
unbounded ones did."""

from __future__ import annotations

import threading
import time
import tracemalloc

import nibabel
import numpy as np
import psutil
import pytest
import torch
import torch.nn.functional as F

from bench import hostile_volumes
from krypton.io import _decoding
from krypton.io._decoding import ImageLoadError
from krypton.io.volumes import (
    MAX_SLICES,
    Volume,
    nifti_bytes_per_voxel,
    prepare_for_model,
    read_nifti,
    read_volume,
    resample,
)

LIMIT_MB = 400
LIMIT_S = 10.0


class PeakRss:
    """This process's peak RSS growth over the block (psutil, every 10 ms)."""

    def __enter__(self):
        self.process = psutil.Process()
        self.start = self.peak = self.process.memory_info().rss
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.stop.wait(0.01)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def test_every_hostile_volume_says_what_its_refusal_names():
    assert set(hostile_volumes.REFUSALS) == set(hostile_volumes.HOSTILE_VOLUMES)


@pytest.mark.parametrize("name", sorted(hostile_volumes.REFUSALS))
def test_a_hostile_volume_is_refused_cheaply_with_what_was_found(tmp_path, name):
    filename, data, expected = hostile_volumes.for_tests(name)
    path = tmp_path / filename
    path.write_bytes(data)
    started = time.perf_counter()
    with PeakRss() as rss, pytest.raises(ImageLoadError, match=expected):
        read_volume(path)
    seconds = time.perf_counter() - started
    print(f"{name}: {len(data) / 1024:.1f} KB, +{rss.growth_mb:.0f} MB, {seconds:.2f} s")
    assert rss.growth_mb < LIMIT_MB and seconds < LIMIT_S


@pytest.mark.parametrize("name", ["JPEG 2000 series hiding 16384²", "JPEG-LS series hiding 16384²"])
def test_a_series_hiding_large_codestreams_is_refused_when_it_is_opened(tmp_path, name):
    """The page opens an upload with read_source (headers only, pixels streamed later):
    its codestreams are checked against their headers there, from the same read of each
    file, so the series is refused at upload, not at the model's first read."""
    from krypton.io.series_intake import read_source

    filename, data, expected = hostile_volumes.for_tests(name)
    path = tmp_path / filename
    path.write_bytes(data)
    with PeakRss() as rss, pytest.raises(ImageLoadError, match=expected):
        read_source(path)
    assert rss.growth_mb < LIMIT_MB


def test_an_analyze_pair_is_read_through_the_same_checks(tmp_path):
    for filename, data in hostile_volumes.analyze_pair().items():
        (tmp_path / filename).write_bytes(data)
    with pytest.raises(ImageLoadError, match="312.5 x 312.5 x 312.5 mm"):
        read_volume(tmp_path / "pair.hdr")
    voxels = np.arange(16**3, dtype=np.int16).reshape(16, 16, 16)
    image = nibabel.AnalyzeImage(voxels, np.diag([1.0, 2.0, 3.0, 1.0]))
    nibabel.save(image, tmp_path / "fine.hdr")
    volume = read_volume(tmp_path / "fine.img")
    assert volume.spacing == (3.0, 2.0, 1.0) and volume.shape == (16, 16, 16)


def test_a_volume_within_the_frame_limit_reads_in_about_a_second(tmp_path):
    filename, data = hostile_volumes.many_frames(MAX_SLICES)
    (tmp_path / filename).write_bytes(data)
    started = time.perf_counter()
    volume = read_volume(tmp_path / filename)
    assert volume.shape == (MAX_SLICES, 8, 8) and volume.spacing == pytest.approx((2.5, 1, 1))
    assert time.perf_counter() - started < LIMIT_S


@pytest.mark.parametrize("dtype", ["uint8", "int16", "int32", "float32", "float64"])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
def test_a_nifti_read_allocates_no_more_than_the_budget_charges(tmp_path, dtype, scaled, suffix):
    """complex128 300x320x320 once took +956 MB against 245 MB charged (8 bytes a voxel
    whatever the type)."""
    shape = (64, 64, 48)
    image = nibabel.Nifti1Image(np.ones(shape, dtype), np.eye(4))
    if scaled:
        image.header.set_slope_inter(2.0, 1.5)
    path = tmp_path / f"volume{suffix}"
    nibabel.save(image, path)
    tracemalloc.start()
    try:
        read_nifti(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    charged = np.prod(shape) * nifti_bytes_per_voxel(np.dtype(dtype).itemsize)
    assert peak <= charged, (peak / np.prod(shape), charged / np.prod(shape))


def test_the_budget_is_asked_at_the_stored_type(tmp_path, monkeypatch):
    """A float64 volume costs more than an int16 one of the same shape."""
    shape = (64, 64, 64)
    for dtype in ("int16", "float64"):
        nibabel.save(
            nibabel.Nifti1Image(np.ones(shape, dtype), np.eye(4)), tmp_path / f"{dtype}.nii"
        )
    limit = int(np.prod(shape) * (nifti_bytes_per_voxel(2) + 1))
    monkeypatch.setattr(_decoding.DECODE_BUDGET, "limit_bytes", limit)
    assert read_volume(tmp_path / "int16.nii").shape == shape
    with pytest.raises(ImageLoadError, match="64x64x64 NIfTI volume of float64 voxels"):
        read_volume(tmp_path / "float64.nii")


def interpolated(voxels: np.ndarray, shape) -> np.ndarray:
    grid = torch.from_numpy(voxels)[None, None]
    return F.interpolate(grid, size=shape, mode="trilinear", align_corners=False)[0, 0].numpy()


@pytest.mark.parametrize(
    "source_shape, spacing, target",
    [
        ((7, 9, 11), (2.0, 1.0, 3.0), (1.0, 1.5, 0.7)),
        ((16, 12, 10), (5.0, 5.0, 5.0), (1.3, 4.0, 9.0)),
    ],
)
def test_resampling_computes_what_trilinear_interpolation_does(source_shape, spacing, target):
    voxels = np.random.default_rng(0).normal(size=source_shape).astype(np.float32)
    volume = Volume(voxels, spacing, "random")
    resampled = resample(volume, target)
    np.testing.assert_allclose(resampled.voxels, interpolated(voxels, resampled.shape), atol=1e-5)
    # the model's block alone is the same block of the whole resampled volume
    size = (8, 8, 8)
    prepared = prepare_for_model(volume, target, (-1.0, 1.0), size, 0.0, 1.0)
    corner = prepared.corner
    inside = tuple(
        slice(max(c, 0), min(c + s, h)) for c, s, h in zip(corner, size, resampled.shape)
    )
    placed = tuple(slice(i.start - c, i.stop - c) for i, c in zip(inside, corner))
    np.testing.assert_allclose(prepared.values[placed], resampled.voxels[inside], atol=1e-5)


def test_resampling_for_a_model_costs_the_block_not_the_source_spacing():
    """A 64³ volume of 20 mm voxels at a 0.5 mm model grid is 2560³ (67 GB of float32)
    resampled whole; the model's 32³ block is computed alone. Resampled whole it is
    refused by the decode budget instead of allocated."""
    voxels = np.random.default_rng(1).normal(size=(64, 64, 64)).astype(np.float32)
    volume = Volume(voxels, (20.0, 20.0, 20.0), "coarse")
    started = time.perf_counter()
    with PeakRss() as rss:
        prepared = prepare_for_model(volume, (0.5, 0.5, 0.5), (-1.0, 1.0), (32, 32, 32), 0.0, 1.0)
    assert prepared.resampled_shape == (2560, 2560, 2560)
    assert rss.growth_mb < 100 and time.perf_counter() - started < 2.0
    with pytest.raises(ImageLoadError, match="resampled to 2560x2560x2560.*decode budget"):
        resample(volume, (0.5, 0.5, 0.5))


def test_a_deflated_slice_within_the_budget_still_reads(tmp_path):
    """The bounded inflater, a megabyte a step (2 MB slices: three steps each), gives the
    bytes pydicom's own inflation does."""
    import io

    import pydicom

    from bench.hostile import _deflated

    slices = {}
    for index in range(3):
        dataset = hostile_volumes._slice(index, 1024, 1024)
        values = np.arange(1024 * 1024, dtype=np.int64) * (index + 1) % 4093
        dataset.PixelData = values.astype(np.uint16).tobytes()
        slices[f"s{index}.dcm"] = _deflated(hostile_volumes._saved(dataset))
    path = tmp_path / "series.zip"
    path.write_bytes(hostile_volumes.zipped(slices))
    volume = read_volume(path)
    expected = [
        pydicom.dcmread(io.BytesIO(slices[f"s{i}.dcm"])).pixel_array.astype(np.float32)
        for i in range(3)
    ]
    dataset = pydicom.dcmread(io.BytesIO(slices["s0.dcm"]))
    slope, intercept = float(dataset.RescaleSlope), float(dataset.RescaleIntercept)
    np.testing.assert_allclose(volume.voxels, np.stack(expected) * slope + intercept)


def test_every_reader_error_is_a_load_error(tmp_path):
    """Whatever a reader library raises on a malformed file reaches the caller as a
    message, never as its own exception type (the CLI printed tracebacks)."""
    path = tmp_path / "garbage.nii.gz"
    path.write_bytes(b"\x1f\x8b" + bytes(range(256)) * 4)
    with pytest.raises(ImageLoadError):
        read_volume(path)
    empty = tmp_path / "empty.dcm"
    empty.write_bytes(b"\0" * 128 + b"DICM" + b"\x02\x00\x10\x00UI\xff\xff")
    with pytest.raises(ImageLoadError):
        read_volume(empty)
    assert isinstance(ImageLoadError("x"), ValueError)


def test_a_volume_object_refuses_an_absurd_spacing():
    with pytest.raises(ImageLoadError, match="at most 20 mm"):
        Volume(np.zeros((2, 2, 2), np.float32), (1.0, 25.0, 1.0), "made")
    assert Volume(np.zeros((2, 2, 2), np.float32), (20.0, 0.01, 1.0), "made").spacing[0] == 20.0


@pytest.mark.parametrize(
    "name",
    ["resample 312.5 mm (NIfTI-1 .nii.gz)", "RGB24 NIfTI", "spacing inf", "truncated .nii.gz",
     "gzip seek 8 GiB (NIfTI-2)", "deflated multi-frame 1 GB"],
)  # fmt: skip
def test_the_cli_refuses_a_hostile_volume_with_a_message_not_a_traceback(tmp_path, name):
    """`krypton explain` exited 0 on the resample bomb after peaking at 2,694 MB, and
    printed tracebacks for an RGB24 file (DTypePromotionError) and an infinite spacing
    (OverflowError)."""
    import subprocess
    import sys

    filename, data = hostile_volumes.HOSTILE_VOLUMES[name]()
    (tmp_path / filename).write_bytes(data)
    command = [sys.executable, "-m", "krypton", "explain", str(tmp_path / filename),
               "--model", "chestct-demo", "--out", str(tmp_path / "out.png")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.startswith("error: "), done.stderr
    assert filename in done.stderr and not (tmp_path / "out.png").exists()


def test_a_reservation_grows_only_into_what_others_leave():
    """A read holds little while it reads a header and grows to its decode's cost; the
    pool never holds more than its limit, and the growth waits for others to finish."""
    budget = _decoding.DecodeBudget(100, wait_seconds=5)
    order = []
    with budget.reserve(30) as mine:
        other_entered = threading.Event()

        def other():
            with budget.reserve(50):
                other_entered.set()
                time.sleep(0.3)
                order.append("other done")

        thread = threading.Thread(target=other)
        thread.start()
        assert other_entered.wait(5)
        budget.grow(mine, 80)  # 30 + 50 held: waits for the other's 50
        order.append("grown")
        assert mine.cost == 80 and budget._in_use == 80
        thread.join()
    assert order == ["other done", "grown"] and budget._in_use == 0
    with budget.reserve(90) as alone:
        waiting = _decoding.DecodeBudget(100, wait_seconds=0.2)
        with waiting.reserve(60) as held, waiting.reserve(40):
            with pytest.raises(ImageLoadError, match="decoding other large images"):
                waiting.grow(held, 70)
        budget.grow(alone, 10)  # never shrinks
        assert alone.cost == 90


def test_the_dicom_export_reads_its_source_header_through_the_bounded_inflater():
    """The volume DICOM export's header read called pydicom on each member, which inflated
    a deflated one whole (512 MB here) to read one tag."""

    from krypton.render.dicom_series import first_dicom_header

    plain = hostile_volumes._saved(hostile_volumes._slice(0, 16, 16, PixelData=bytes(512)))
    source = hostile_volumes.zipped(
        {"a-bomb.dcm": hostile_volumes.deflate_bomb(16384, 16384), "b-slice.dcm": plain}
    )
    with PeakRss() as rss:
        header = first_dicom_header(source)
    assert header.Rows == 16 and rss.growth_mb < 200, rss.growth_mb
