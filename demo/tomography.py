"""CT and MR slices as a 2-D model sees them: drawn ones to learn from, real ones to test on.

A fundus model shown a chest CT slice sees a bright round body on a dark ground with a
textured inside — which is what a fundus photograph is. Its out-of-distribution check
therefore learns what tomography looks like from slices this project draws itself
(:func:`drawn_slices`): the chest-CT generator's volumes and the head and abdomen phantoms
(:mod:`demo.chestct`), cut along any axis, at the app's DICOM window presets or through an
MR-like contrast (a random monotone or inverted tissue curve), whole or cropped.

It is tested on real scans nobody tuned it for (:func:`real_slices`): every distinct CT or
MR image in pydicom's test files and slices of the MR volumes in nibabel's test data, both
shipped inside the installed packages (no download), rendered as the app renders them (a
DICOM file at its own window; a volume's slice between its 1st and 99th percentiles, as a
viewer's export of it to PNG would be).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["APP_SAMPLES", "drawn_slices", "real_slices"]

# the CT and MR samples the app's gallery offers (webapp/samples.py DICOM_SAMPLES)
APP_SAMPLES = ("CT_small.dcm", "MR_small.dcm", "examples_overlay.dcm")
# pydicom's other distinct CT and MR images (MR_small's re-encodings are the same pixels)
_PYDICOM_HELD_OUT = ("693_J2KI.dcm", "J2K_pixelrep_mismatch.dcm")
# nibabel's MR volumes big enough to cut (each side >= 16 voxels on the slice)
_NIBABEL_VOLUMES = ("anatomical.nii", "example4d.nii.gz", "reoriented_anat_moved.nii")
_SLICE_SHARES = (0.35, 0.5, 0.65)  # where along an axis the real volumes are cut
_MIN_SIDE = 16  # the app's smallest image side


def _window(values: np.ndarray, low: float, high: float) -> np.ndarray:
    return (np.clip((values - low) / max(high - low, 1e-6), 0, 1) * 255).astype(np.uint8)


def _percentile_picture(plane: np.ndarray) -> Image.Image:
    low, high = np.percentile(plane, (1, 99))
    return Image.fromarray(_window(plane.astype(np.float64), low, high)).convert("RGB")


def _mr_like(rng: np.random.Generator, volume: np.ndarray) -> np.ndarray:
    """HU through a random tissue curve: air stays dark, tissues get other contrasts
    (fat bright or dark, fluid bright or dark), as MR sequences do."""
    knots = np.array([-1000.0, -500.0, -100.0, 0.0, 60.0, 400.0, 1500.0])
    levels = np.r_[0.0, rng.uniform(0.0, 1.0, len(knots) - 1)]
    return np.interp(volume, knots, levels) * 1000.0


def _drawn_volume(rng: np.random.Generator, side: int) -> np.ndarray:
    from scipy.ndimage import gaussian_filter

    from krypton.synthetic.chestct import ChestCTGenerator

    from .chestct.train import abdomen_phantom, head_phantom

    kind = rng.uniform()
    if kind < 0.6:
        generator = ChestCTGenerator(seed=int(rng.integers(2**31)), side=side, varied=True)
        volume = generator.sample().volume
    elif kind < 0.8:
        volume = head_phantom(rng, side)
    else:
        volume = abdomen_phantom(rng, side)
    if kind < 0.6 or kind >= 0.8:  # chests and abdomens have a spine
        _add_vertebra(rng, volume)
    # tissue texture: real scans are not flat regions under white noise
    texture = gaussian_filter(rng.normal(0.0, 1.0, volume.shape), rng.uniform(0.7, 2.5))
    return volume + texture / (texture.std() + 1e-9) * rng.uniform(10.0, 60.0)


def _add_vertebra(rng: np.random.Generator, volume: np.ndarray) -> None:
    """A vertebra along the body's axis (z), behind its centre: a body of trabecular bone
    (150-350 HU) in a cortical shell (600-1200 HU), the spinal canal behind it, and the
    arch around the canal; drawn over what is there."""
    side = volume.shape[1]
    _, y, x = np.ogrid[: volume.shape[0], :side, :side]
    centre_x = side / 2 + rng.normal(0, 1)
    body_y, radius = side * rng.uniform(0.62, 0.72), side * rng.uniform(0.07, 0.11)
    shell = rng.uniform(0.12, 0.25) * radius
    body = np.hypot((y - body_y) / 0.85, x - centre_x)
    canal_y = body_y + radius * 1.6
    canal = np.hypot(y - canal_y, x - centre_x)
    arch = (canal <= radius * 1.1) & (y > canal_y - radius * 0.2)
    plane = np.zeros((side, side))
    plane = np.where(arch[0], rng.uniform(500, 900), plane)
    plane = np.where(canal[0] <= radius * 0.55, rng.uniform(0, 30), plane)
    plane = np.where(body[0] <= radius, rng.uniform(600, 1200), plane)
    plane = np.where(body[0] <= radius - shell, rng.uniform(150, 350), plane)
    drawn = (arch | (canal <= radius * 0.55) | (body <= radius))[0]
    volume[:, drawn] = plane[drawn]


def drawn_slices(count: int, size: int, seed: int = 0, side: int = 64) -> list[np.ndarray]:
    """``count`` (size, size, 3) uint8 slices of drawn CT volumes: 4 slices per volume,
    each along a random axis, at a window preset (or MR-like) and a random crop."""
    from krypton.io.dicom import WINDOW_PRESETS

    rng = np.random.default_rng(seed)
    windows = list(WINDOW_PRESETS.values())
    pictures: list[np.ndarray] = []
    volume = None
    while len(pictures) < count:
        if len(pictures) % 4 == 0:
            volume = _drawn_volume(rng, side)
        axis = int(rng.integers(3))
        plane = np.take(volume, int(rng.uniform(0.25, 0.75) * side), axis=axis)
        if rng.uniform() < 0.3:
            mr = _mr_like(rng, plane)
            gray = _window(mr, *np.percentile(mr, (1, 99)))
        else:
            centre, width = windows[int(rng.integers(len(windows)))]
            gray = _window(plane, centre - width / 2, centre + width / 2)
        crop = int(side * rng.uniform(0.25, 1.0))
        top, left = rng.integers(0, side - crop + 1, 2)
        gray = gray[top : top + crop, left : left + crop]
        picture = Image.fromarray(gray).convert("RGB").resize((size, size), Image.BILINEAR)
        pictures.append(np.asarray(picture))
    return pictures


def _volume_slices(path: Path) -> list[tuple[str, Image.Image]]:
    import nibabel

    volume = np.asanyarray(nibabel.load(path).dataobj).astype(np.float64)
    while volume.ndim > 3:  # a time series: its middle frame
        volume = volume[..., volume.shape[-1] // 2]
    slices = []
    for axis in range(3):
        for share in _SLICE_SHARES:
            plane = np.rot90(np.take(volume, int(volume.shape[axis] * share), axis=axis))
            if min(plane.shape) >= _MIN_SIDE:
                slices.append((f"{path.name} axis {axis} at {share:.0%}", plane))
    return [(name, _percentile_picture(plane)) for name, plane in slices]


def real_slices(held_out_only: bool = False) -> list[tuple[str, Image.Image]]:
    """(name, picture) of real CT and MR images shipped in pydicom's and nibabel's test
    data; ``held_out_only`` leaves out the app's own gallery samples (:data:`APP_SAMPLES`)."""
    import nibabel
    import pydicom

    from krypton.io.images import load_image

    dicom_dir = Path(pydicom.__file__).resolve().parent / "data" / "test_files"
    nifti_dir = Path(nibabel.__file__).resolve().parent / "tests" / "data"
    names = _PYDICOM_HELD_OUT if held_out_only else (*APP_SAMPLES, *_PYDICOM_HELD_OUT)
    pictures = [(name, load_image(dicom_dir / name)) for name in names]
    for volume in _NIBABEL_VOLUMES:
        pictures.extend(_volume_slices(nifti_dir / volume))
    return pictures
