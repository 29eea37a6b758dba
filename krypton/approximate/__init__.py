"""Approximate mode: projective-field thresholding (τ, §4.1) and adaptive drill-down
(§4.2). settings.py holds its defaults, tuning.py the tuned SSIM(τ) curve and the one τ
policy (choose_tau), tune.py the offline tuning (krypton tune), drilldown.py the
drill-down arithmetic (eqs 28-30) and _plan.py one call's plan."""

from .settings import DEFAULTS, ApproximateSettings
from .tuning import TauChoice, TauTuning, choose_tau

__all__ = ["DEFAULTS", "ApproximateSettings", "TauChoice", "TauTuning", "choose_tau"]
