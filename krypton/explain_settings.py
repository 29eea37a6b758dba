"""What one explain() call is told beside the model and the input, held once.

``krypton.explain`` and ``OcclusionExplainer.explain`` took the same 21 keyword arguments,
written out twice with their defaults and forwarded one by one; both now take an
:class:`ExplainSettings` (MONAI's settings-at-construction), or its fields as keywords,
and their signatures are built from this record (``inspect.signature`` and ``help``
show every field with its default).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._inputs import Region
from .approximate.settings import DEFAULTS, ApproximateSettings

__all__ = ["ExplainSettings", "ProgressCallback", "PartialCallback", "StopRun"]

ProgressCallback = Callable[[int, int], None]
PartialCallback = Callable[[np.ndarray], None]


class StopRun(Exception):
    """Raised by a ``progress`` callback to end a run early and keep what it computed:
    a one-pass run (exact, naive, approximate without drill-down) returns its heatmap so
    far, NaN at the positions not computed, ``extra["stopped"]`` saying how many were and
    why (this exception's text). Any other exception from ``progress`` ends the run and
    goes on to the caller, as does this one in drill-down (whose ``partial`` has shown the
    stage-one values so far). A caller that counts positions from ``progress`` then keeps
    every position it counted: the app's Cancel kept 16 of the 32 cells it had shown as
    done, the rest lost with the batch values inside the call."""


@dataclass(frozen=True)
class ExplainSettings:
    """How to explain: where the patch goes, what it hides, which mode runs it.

    Args:
        patch: side of the square occluding patch, in pixels, or (height, width); for a
            volume, the side of a cube or (depth, height, width) in voxels.
        stride: step between patch positions on the grid (S2 in approximate mode): one
            step, or one per axis ((height, width); (depth, height, width)).
        mode: "naive" (batched full re-inference), "exact" (incremental, same numbers) or
            "approximate" (incremental with projective-field thresholding and adaptive
            drill-down).
        fill: occluding value in the input space, a float or one per channel (0.0 is mean
            gray under the usual mean/std normalisation).
        label: class to explain; default the class predicted on the unoccluded image.
        region: (x0, y0, x1, y1) to restrict the grid to; default the whole image. For a
            volume (z0, y0, x0, z1, y1, x1). For either, (low, high) per axis in tensor
            order also: ((y0, x0), (y1, x1)); :func:`krypton.explainer.grid` gives the
            positions.
        positions: explicit list of (x, y) top-left corners (for a volume (z, y, x) first
            voxels, as its region) instead of a grid (approximate mode then applies
            thresholding only: drill-down needs a grid).
        batch_size: occluded images per batch; default 16 on CPU, 128 on CUDA.
        progress: called as progress(done, total) after each batch; raising stops the run.
            Raising :class:`StopRun` returns the positions computed so far (one pass).
            In drill-down the total is an estimate until stage one has finished.
        tau: projective-field threshold in (0, 1] (eqs 21-27); 1 changes nothing.
        target_ssim: pick τ from the model's tuned SSIM(τ) curve instead. With neither, τ
            is the tuned value for SSIM 0.9, else 1.0 with a warning.
        r_drill_down: fraction of the stage-one heatmap refined at full resolution; 1
            skips drill-down.
        target_speedup: drill-down speedup that sets the stage-one stride S1 (eq 29);
            infeasible targets (eq 30) raise an error stating the largest achievable one.
        s1: stage-one stride, overriding target_speedup.
        partial: approximate mode with drill-down calls ``partial(values)`` after each
            stage-one batch but the last (each grid cell shows its stage-one block's
            value; NaN where none is computed yet) and once stage one has run, with the
            stage-one heatmap interpolated to the whole grid.
        strategy: how exact mode computes its (identical) numbers: "auto" (default) runs
            incremental inference where it is faster on this host and naive inference
            where it is not (``heatmap.extra["plan"]`` says which and why); "measure"
            does so after timing both again in this call instead of following a plan
            this explainer measured before (a caller that states a speed from its own
            run, under the host's load now); "incremental" or "naive" forces one.
        freeze_gates: approximate mode keeps global-context gates (squeeze-excitation,
            ECA) at their values on the unoccluded image, so computation stays
            incremental past them; default on where the model has gates, False turns it
            off. ``heatmap.extra["frozen_gates"]`` lists the gates kept.
        refine_by: which stage-one cells drill-down refines: "drop+variation" (default)
            half by the largest drops, half by the largest disagreement with neighbours;
            "drop" the paper's largest drops only. Both refine the same number of cells.
        approximate: all of approximate mode's settings as one
            :class:`krypton.approximate.ApproximateSettings` (instead of tau, target_ssim,
            r_drill_down, target_speedup, s1, freeze_gates and refine_by; not with them).
        precision: "fp32" (default: TF32 off, so exact equals naive to ~1e-6 on a card
            as on the CPU), or "tf32", "bf16", "fp16" for speed; naive runs at the same
            precision. ``heatmap.extra`` says the device and precision that ran.
        threads: torch's threads for this run (restored after it). None (default): the
            caller's own setting where it made one (``OMP_NUM_THREADS``,
            ``KRYPTON_TORCH_THREADS``, ``torch.set_num_threads``), else the cores this
            host's other work leaves free (:func:`krypton.host.host_share`).
            ``heatmap.extra["host"]`` says what was chosen, by whom, beside what load.
    """

    patch: int | tuple[int, ...] = 16
    stride: int | tuple[int, ...] = 4
    mode: str = "exact"
    fill: Any = 0.0
    label: int | None = None
    region: Region | None = None
    positions: Iterable | None = None
    batch_size: int | None = None
    progress: ProgressCallback | None = None
    tau: float | None = DEFAULTS.tau
    target_ssim: float | None = DEFAULTS.target_ssim
    r_drill_down: float = DEFAULTS.r_drill_down
    target_speedup: float = DEFAULTS.target_speedup
    s1: int | None = DEFAULTS.s1
    partial: PartialCallback | None = None
    strategy: str = "auto"
    freeze_gates: bool | None = DEFAULTS.freeze_gates
    refine_by: str = DEFAULTS.refine_by
    approximate: ApproximateSettings | None = None
    precision: str = "fp32"
    threads: int | None = None

    @classmethod
    def of(cls, settings: ExplainSettings | None, options: dict[str, Any]) -> ExplainSettings:
        """``settings`` (default: the defaults) with ``options`` changed; anything but an
        ExplainSettings in its place is refused (the settings after the input are
        keywords, as they always were)."""
        if settings is not None and not isinstance(settings, cls):
            raise TypeError(
                f"the argument after the input must be an ExplainSettings, got "
                f"{settings!r}; give patch, stride, mode, ... as keywords"
            )
        return (settings or cls()).with_options(**options)

    def with_options(self, **options: Any) -> ExplainSettings:
        """These settings with ``options`` (any of its fields) changed; an unknown name
        is refused as a mistyped keyword argument is."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(
                f"explain() got unexpected keyword argument(s) {', '.join(unknown)}; "
                f"the settings are {', '.join(f.name for f in dataclasses.fields(self))}"
            )
        return dataclasses.replace(self, **options) if options else self

    def approximate_settings(self) -> ApproximateSettings:
        """Approximate mode's settings: ``approximate``, or the individual fields."""
        individual = {f.name: getattr(self, f.name) for f in dataclasses.fields(DEFAULTS)}
        return ApproximateSettings.resolve(self.approximate, **individual)


def settings_signature(function: Callable, leading: list[inspect.Parameter]) -> inspect.Signature:
    """``function``'s signature with :class:`ExplainSettings`'s fields spelled out as
    keyword-only parameters with their defaults (after ``leading``), so ``help`` and
    ``inspect.signature`` show what ``**options`` takes."""
    fields = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
        for f in dataclasses.fields(ExplainSettings)
    ]
    original = inspect.signature(function)
    return original.replace(parameters=[*leading, *fields])
