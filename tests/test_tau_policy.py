"""One τ policy and the localisation metric (approximate mode's quality, beside SSIM)."""

import numpy as np
import pytest
from engine_helpers import same_cells

from krypton.approximate.tuning import TauTuning, choose_tau, localisation

CURVE = (-1.2, 2.6, -0.4)  # concave, like the paper's Fig 9a


def test_choose_tau_policy():
    assert choose_tau(None).tau == 1.0 and "not tuned" in choose_tau(None).source
    assert choose_tau(None, tau=0.7).tau == 0.7
    with pytest.raises(ValueError, match="tuned SSIM"):
        choose_tau(None, target_ssim=0.9)
    with pytest.raises(ValueError, match="not both"):
        choose_tau(TauTuning(CURVE), tau=0.5, target_ssim=0.9)
    curve_only = TauTuning(CURVE)  # an older record: the curve decides
    assert choose_tau(curve_only).tau == curve_only.tau_for(0.9)
    assert choose_tau(curve_only).source == "tuned for SSIM 0.9"
    # the tuned τ (SSIM and localisation) wins for the default target; other targets
    # still come from the curve
    tuned = TauTuning(CURVE, chosen_tau=0.95, minimum_kept=0.97, lowest_overlap=0.8)
    assert choose_tau(tuned) == choose_tau(tuned, target_ssim=0.9)
    assert choose_tau(tuned).tau == 0.95
    assert choose_tau(tuned).source == "tuned for SSIM 0.9 and localisation"
    assert choose_tau(tuned, target_ssim=0.8).tau == tuned.tau_for(0.8)
    assert "97%" in tuned.describe() and "80%" in tuned.describe()


def test_from_record_reads_old_and_new_records():
    assert TauTuning.from_record(None) is None
    old = TauTuning.from_record({"coefficients": list(CURVE)})
    assert old.chosen_tau is None
    new = TauTuning.from_record(
        {
            "coefficients": list(CURVE),
            "chosen": {"tau": 0.93, "target_ssim": 0.9, "minimum_kept": 1.0, "lowest_overlap": 0.7},
        }
    )
    assert new.chosen_tau == 0.93 and new.lowest_overlap == 0.7


def test_localisation_metric():
    exact = np.ones((10, 10), dtype=np.float32)
    exact[2, 3] = 0.1  # the evidence
    exact[2, 4] = 0.2
    same = localisation(exact, exact.copy())
    assert same.minimum_kept and same.lowest_overlap == 1.0
    moved = exact.copy()
    moved[2, 3] = 1.0  # the approximate map lost the lowest cell ...
    moved[8, 8] = 0.05  # ... and shows evidence elsewhere
    lost = localisation(exact, moved)
    assert not lost.minimum_kept
    assert lost.lowest_overlap < 1.0
    # k = max(3, 1% of cells): the minimum may sit third-lowest and still count
    close = exact.copy()
    close[7, 7], close[7, 8], close[2, 3] = 0.01, 0.02, 0.15
    assert localisation(exact, close).minimum_kept
    # saturated maps: cells tied at the minimum (within 1% of the range) all count
    flat = np.ones((10, 10))
    flat[5:8, 5:8] = 1e-7
    shifted = np.ones((10, 10))
    shifted[7:9, 7:9] = 2e-7  # shares only cell (7, 7) with the exact minimum
    assert localisation(flat, shifted).minimum_kept
    elsewhere = np.ones((10, 10))
    elsewhere[0:2, 0:2] = 1e-7
    assert not localisation(flat, elsewhere).minimum_kept
    # NaN cells (outside a region) are never "lowest"
    with_nan = exact.copy()
    with_nan[0, :] = np.nan
    assert localisation(with_nan, with_nan).minimum_kept
    with pytest.raises(ValueError, match="shape"):
        localisation(exact, exact[:5])


def test_model_card_states_the_tuned_tau_and_its_localisation():
    import krypton
    from webapp.panels.image.estimate import model_card as _model_card

    loaded = krypton.load_model("fundus-demo")
    card = str(_model_card(loaded))
    tuning = loaded.tuning  # what `make tune` measured for the shipped weights
    assert f"τ = {tuning.chosen_tau:.2f} (tuned for SSIM 0.9 and localisation)" in card
    kept = f"{tuning.minimum_kept:.0%}"
    assert f"lowest cell stayed among the approximate map's lowest in {kept}" in card


def test_approximate_settings_are_one_record_with_one_set_of_defaults(tmp_path):
    """The defaults 0.25 / 3.0 were literals in ten places; the app built its explainer
    from the bare module and re-derived τ."""
    import inspect

    import torch

    import krypton
    from krypton.approximate import DEFAULTS, ApproximateSettings
    from webapp.services import Services

    signature = inspect.signature(krypton.explain).parameters
    for name in ("tau", "target_ssim", "r_drill_down", "target_speedup", "s1", "refine_by"):
        assert signature[name].default == getattr(DEFAULTS, name), name
    model = krypton.load_model("fundus-demo")
    image = torch.rand(3, *model.input_size)
    settings = ApproximateSettings(tau=0.9, r_drill_down=0.4, target_speedup=1.8)
    together = krypton.explain(model, image, patch=16, stride=8, mode="approximate",
                               region=(0, 0, 96, 96), approximate=settings)  # fmt: skip
    apart = krypton.explain(model, image, patch=16, stride=8, mode="approximate",
                            region=(0, 0, 96, 96), tau=0.9, r_drill_down=0.4,
                            target_speedup=1.8)  # fmt: skip
    same_cells(together.values, apart.values)
    assert together.extra["tau"] == 0.9 and together.extra["r_drill_down"] == 0.4
    with pytest.raises(ValueError, match="not both"):
        krypton.explain(model, image, mode="approximate", tau=0.8, approximate=settings)
    services = Services(tmp_path / "cache")
    assert services.explainer("fundus-demo").loaded is not None  # τ from the model's tuning
