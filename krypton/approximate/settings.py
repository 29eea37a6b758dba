"""The one home of approximate mode's defaults (every caller's defaults come from here:
the explainer, the CLI, the app's controls and requests, the runtime estimator)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ApproximateSettings", "DEFAULTS"]


@dataclass(frozen=True)
class ApproximateSettings:
    """How approximate mode trades quality for speed.

    Args:
        tau: the projective-field threshold τ (eqs 21-27); None: the τ policy decides
            (krypton.approximate.tuning.choose_tau: the model's tuned τ, else 1.0).
        target_ssim: the visual quality to reach instead of a τ: the model's tuned
            SSIM(τ) curve gives the τ (needs a tuned model).
        r_drill_down: the share of the region refined at full resolution (eq 28).
        target_speedup: the drill-down speedup that sets the stage-one stride (eq 29).
        s1: a stage-one stride, overriding ``target_speedup``.
        refine_by: which stage-one cells drill-down refines ("drop+variation", or
            "drop": the paper's rule).
        freeze_gates: keep global-context gates (squeeze-excitation) at their
            unoccluded values; None: approximate mode's default (frozen).
    """

    tau: float | None = None
    target_ssim: float | None = None
    r_drill_down: float = 0.25
    target_speedup: float = 3.0
    s1: int | None = None
    refine_by: str = "drop+variation"
    freeze_gates: bool | None = None

    @classmethod
    def resolve(cls, given: ApproximateSettings | None, **individual) -> ApproximateSettings:
        """``given``, or the settings the individual keyword arguments spell out (those
        left at their defaults are the defaults); not both."""
        spelled = cls(**individual)
        if given is None:
            return spelled
        if spelled != DEFAULTS:
            raise ValueError(
                "give approximate=ApproximateSettings(...) or the individual approximate "
                "settings (tau, target_ssim, r_drill_down, ...), not both"
            )
        return given


DEFAULTS = ApproximateSettings()
