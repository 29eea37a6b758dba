"""``krypton explain`` for volumes: a DICOM series (folder or zip) or a NIfTI file, explained
by a volume model (one whose registry input size is [D, H, W], e.g. chestct-demo).

Writes, next to ``--out``'s stem: ``STEM.nii.gz`` (the heatmap's cells in the scanner's
frame, :func:`krypton.render.volumes.heatmap_nifti`), ``STEM.axial.png``,
``STEM.coronal.png`` and ``STEM.sagittal.png`` (the three views through the lowest cell,
or with ``--slices middle`` through the input's centre) and ``STEM.npy`` (the values).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from .. import explainer as explain_module
from ..io.dicom import is_dicom
from ..io.images import ImageLoadError
from ..render.volumes import VIEWS

__all__ = [
    "default_volume_model",
    "is_volume_model",
    "is_volume_source",
    "wants_volume",
    "stem_of",
    "run_explain_volume",
    "print_ood",
    "print_host",
]

VOLUME_SUFFIXES = (".nii", ".nii.gz", ".zip")


def is_volume_source(source: str | Path) -> bool:
    """A folder (a DICOM series), a zip of one, or a NIfTI file."""
    path = Path(source)
    return path.is_dir() or path.name.lower().endswith(VOLUME_SUFFIXES)


def is_volume_model(name: str | None) -> bool:
    """Whether the registered model ``name`` is a volume model."""
    from ..registry import available_models

    return any(info.name == name and info.is_volume for info in available_models())


def wants_volume(source: str | Path, model: str | None) -> bool:
    """Whether ``krypton explain`` takes the volume path: the source is a volume
    (:func:`is_volume_source`), or the model named is a volume model (then a single DICOM
    file is read as a multi-frame volume)."""
    return is_volume_source(source) or is_volume_model(model)


def default_volume_model() -> str | None:
    """The first available volume model (the shipped chestct-demo unless a user's comes
    first), or None."""
    from ..registry import available_models

    for info in available_models():
        if info.available and info.is_volume:
            return info.name
    return None


def stem_of(out: Path) -> Path:
    """``out`` without its suffix (.png, .nii, .nii.gz)."""
    name = out.name
    for suffix in (".nii.gz", ".nii", ".png"):
        if name.lower().endswith(suffix):
            return out.with_name(name[: -len(suffix)])
    return out


def _outputs(stem: Path) -> dict[str, Path]:
    views = {f".{view}.png": stem.with_name(f"{stem.name}.{view}.png") for view in VIEWS}
    return {
        ".nii.gz": stem.with_name(stem.name + ".nii.gz"),
        **views,
        ".npy": stem.with_suffix(".npy"),
    }


def _progress_bar(mode: str):
    from tqdm import tqdm

    bar = tqdm(total=0, unit="pos", desc=mode, file=sys.stderr, leave=False, disable=None)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    return bar, progress


def run_explain_volume(args: argparse.Namespace, model, options: dict, after=None) -> int:
    """Explain the volume at ``args.image`` with the volume ``model``; ``options`` are
    explain()'s keyword arguments from the command line. ``after(model, prepared,
    heatmap)``, if
    given, runs once the files are written (a PACS source stores its result); its
    ImageLoadError is the command's error."""
    from ..render.volumes import view_centre, volume_files

    if not model.is_volume:
        print(
            f"error: {args.image} is a volume but {model.name} is a 2-D model; name a "
            f"volume model with --model (`krypton models` lists them as D x H x W)",
            file=sys.stderr,
        )
        return 2
    path = Path(args.image)
    if path.is_file() and not is_volume_source(path) and not is_dicom(path):
        print(
            f"error: {model.name} is a volume model; give it a volume (a DICOM series folder "
            f"or zip, a multi-frame DICOM file or NIfTI), or name a 2-D model for {path}",
            file=sys.stderr,
        )
        return 2
    try:
        prepared, volume = model.read_volume(args.image)
    except (ImageLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bar, progress = _progress_bar(args.mode)
    try:
        heatmap = explain_module.explain(
            model, prepared.tensor, label=args.label, progress=progress, **options
        )
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    from ..registry.ood import caveat

    files = volume_files(
        heatmap, prepared, model, args.slices, warning=caveat(heatmap.extra.get("ood"))
    )
    at = view_centre(heatmap, model.input_size, args.slices)
    stem = stem_of(Path(args.out))
    stem.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for suffix, data in files.items():  # a flagged volume's warning beside its .npy too
        path = _outputs(stem).get(suffix, stem.with_name(stem.name + suffix))
        path.write_bytes(data)
        written.append(path)
    _report(model, volume, prepared, heatmap, at, args.slices, written)
    if after is not None:
        try:
            after(model, prepared, heatmap)
        except (ImageLoadError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


def print_speed(heatmap, model_name: str | None = None) -> None:
    """The exact run's speed line, worded as the page's (krypton.speed_line.speed_claim),
    its naive figure bounded by the model's logged or calibrated naive pace at the load
    now (:func:`krypton.speed_line.stated_speed`)."""
    from ..estimator import host_load
    from ..speed_line import speed_claim, stated_speed

    speed = stated_speed(heatmap, model_name, host_load())
    if speed is not None:
        print(f"speed      {speed_claim(speed)}")


def print_host(share: dict | None) -> None:
    """The threads line: how many torch threads the run took, and why."""
    from ..host import describe_share

    if share:
        print(f"threads    {describe_share(share)}")


def print_ood(ood: dict | None) -> None:
    """The out-of-distribution line (and, when flagged, the warning, also on stderr)."""
    if ood is None:
        return
    verdict = "OUT OF DISTRIBUTION" if ood["flagged"] else "like the training images"
    print(
        f"ood score  {ood['score']:.2f} (threshold {ood['threshold']:.2f}; most unusual "
        f"at {ood['stage']}): {verdict}"
    )
    if ood["flagged"]:
        print(f"WARNING    {ood['warning']}")
        print(f"warning: {ood['warning']}", file=sys.stderr)


def _report(model, volume, prepared, heatmap, at, slices: str, written: list[Path]) -> None:
    lowest = float(np.nanmin(heatmap.values))
    d, h, w = heatmap.values.shape
    print(f"model      {model.name} (trained weights)")
    print(
        f"volume     {volume.source}: {'x'.join(map(str, volume.shape))} voxels at "
        f"{'x'.join(f'{s:g}' for s in volume.spacing)} mm; resampled to "
        f"{'x'.join(map(str, prepared.resampled_shape))} at the model's "
        f"{'x'.join(f'{s:g}' for s in model.volume['spacing_mm'])} mm, its centred "
        f"{'x'.join(map(str, model.input_size))} block explained (corner {prepared.corner})"
    )
    print(f"orientation {prepared.orientation}")
    print(f"label      {heatmap.label} {model.class_name(heatmap.label)}")
    print(f"probability {heatmap.prob:.4f} (lowest with occlusion {lowest:.4f})")
    print(
        f"positions  {heatmap.positions_evaluated} evaluated on a {d}x{h}x{w} grid (patch "
        f"{heatmap.patch}, stride {heatmap.stride}), mode {heatmap.mode}"
    )
    print_ood(heatmap.extra.get("ood"))
    print_host(heatmap.extra.get("host"))
    if heatmap.mode == "exact":
        print(f"plan       {heatmap.extra['plan']}")
        print_speed(heatmap, model.name)
    print(f"views      through voxel (z, y, x) = {at} ({slices})")
    if prepared.affine is None:
        print("frame      the source gave no scanner frame: the NIfTI is in model voxels")
    print(f"time       {heatmap.seconds:.2f} s; FLOPs {heatmap.flops_ratio:.2f}x fewer than naive")
    print(f"wrote      {', '.join(str(p) for p in written)}")
