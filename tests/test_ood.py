"""The out-of-distribution check (krypton.registry.ood): Mahalanobis distance with a Ledoit-Wolf
covariance on penultimate features, a 99th-percentile threshold, stored with the model,
reported by explain(), the CLI and batch; and built from a user's reference folder."""

import json

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

import krypton
from krypton.registry import RegistryError, load_model, register_model
from krypton.registry.ood import (
    OUTLIER_IMAGES,
    FeatureDensity,
    feature_statistics,
    fit_density,
    penultimate_features,
)
from krypton.synthetic.fundus import FundusGenerator


def test_threshold_is_the_held_out_percentile_and_far_points_are_flagged():
    rng = np.random.default_rng(0)
    names = ["early", "penultimate"]
    reference = [rng.normal(size=(400, 6)), rng.normal(size=(400, 8))]
    held_out = [rng.normal(size=(400, 6)), rng.normal(size=(400, 8))]
    density = fit_density(names, reference, held_out, "gaussian")
    spare = [f[200:] for f in held_out]  # the half that set the threshold
    scores = density.score(spare)
    assert density.threshold == pytest.approx(np.percentile(scores, 99))
    fresh = density.score([rng.normal(size=(2000, 6)), rng.normal(size=(2000, 8))])
    assert (fresh > density.threshold).mean() < 0.03
    # far at one stage only: still flagged, and that stage is named
    far = density.scores([rng.normal(size=(50, 6)) + 6.0, rng.normal(size=(50, 8))])
    assert (far[0] > density.threshold).all() and (far[1] == 0).all()
    with pytest.raises(ValueError, match="at least 20"):
        fit_density(names, [f[:10] for f in reference], held_out)


def test_too_few_held_out_images_for_shares_give_a_check_that_still_flags(tmp_path):
    """Eight stages and 30 calibration images: more than 1% of genuine images lie beyond
    all 30 at some stage, so the 99th percentile of empirical scores is the highest score
    there is and `score > threshold` could never hold, not even for an image far off at
    every stage. Such a check takes its p-values from normal fits instead, says so, flags
    the far images and few genuine ones, and keeps that through its npz."""
    rng = np.random.default_rng(1)
    names = [f"stage{k}" for k in range(8)]
    reference = [rng.normal(size=(200, 4)) for _ in names]
    far_points = [rng.normal(size=(20, 4)) + 8.0 for _ in names]
    few = fit_density(names, reference, [rng.normal(size=(60, 4)) for _ in names], "x")
    assert few.fitted_tails and few.can_flag and "normal fits" in few.reference
    assert (few.score(far_points) > few.threshold).all()
    genuine = few.score([rng.normal(size=(4000, 4)) for _ in names])
    assert (genuine > few.threshold).mean() < 0.05
    few.save(tmp_path / "few.npz")
    again = FeatureDensity.load(tmp_path / "few.npz")
    assert again.fitted_tails
    np.testing.assert_allclose(again.score(far_points), few.score(far_points), rtol=1e-4)
    # with enough calibration images the shares themselves are kept
    enough = fit_density(names, reference, [rng.normal(size=(4000, 4)) for _ in names])
    assert not enough.fitted_tails and enough.can_flag
    assert (enough.score(far_points) > enough.threshold).all()


def test_density_round_trips_through_npz(tmp_path):
    rng = np.random.default_rng(1)
    density = fit_density(["a"], [rng.normal(size=(100, 4))], [rng.normal(size=(30, 4))], "x")
    density.save(tmp_path / "d.npz")
    loaded = FeatureDensity.load(tmp_path / "d.npz")
    points = [rng.normal(size=(5, 4))]
    np.testing.assert_allclose(loaded.score(points), density.score(points), rtol=1e-4)
    assert loaded.reference == density.reference and loaded.reference.startswith("x")
    assert loaded.fitted_on == 100 and loaded.held_out == 30
    assert loaded.fitted_tails == density.fitted_tails
    assert loaded.threshold == pytest.approx(density.threshold)


def test_the_outlier_boundary_flags_what_lies_between_the_densities_and_the_outliers(
    tmp_path,
):
    """Points each stage's density finds ordinary (within its spread) but that lie on
    the synthetic outliers' side: the densities alone miss most, the boundary flags them;
    genuine points stay at about 1%; the boundary survives the npz."""
    rng = np.random.default_rng(3)
    names = ["early", "penultimate"]

    def genuine(count):
        return [rng.normal(size=(count, 8)), rng.normal(size=(count, 8))]

    def outlying(count):
        return [rng.normal(size=(count, 8)) + 1.0, rng.normal(size=(count, 8)) + 1.0]

    reference, held_out = genuine(600), genuine(600)
    densities_only = fit_density(names, reference, held_out)
    with_boundary = fit_density(names, reference, held_out, outliers=outlying(600))
    assert densities_only.boundary is None and densities_only.stage_names == names
    assert with_boundary.stage_names == names + ["outlier boundary"]
    assert with_boundary.outliers == 600
    fresh_outliers, fresh_genuine = outlying(500), genuine(2000)
    flagged_by_densities = densities_only.score(fresh_outliers) > densities_only.threshold
    assert flagged_by_densities.mean() < 0.4
    scores, stages = with_boundary.scores(fresh_outliers)
    assert (scores > with_boundary.threshold).mean() > 0.8
    assert (stages == 2).mean() > 0.6  # the boundary is where most are most unusual
    assert (with_boundary.score(fresh_genuine) > with_boundary.threshold).mean() < 0.03
    with_boundary.save(tmp_path / "b.npz")
    loaded = FeatureDensity.load(tmp_path / "b.npz")
    assert loaded.outliers == 600 and loaded.stage_names == with_boundary.stage_names
    np.testing.assert_allclose(
        loaded.score(fresh_outliers), with_boundary.score(fresh_outliers), rtol=1e-4
    )


def test_synthetic_outliers_are_seeded_sized_and_varied():
    from krypton.registry._outliers import synthetic_outliers

    first = list(synthetic_outliers(12, 48, 80, seed=5))
    again = list(synthetic_outliers(12, 48, 80, seed=5))
    other = list(synthetic_outliers(12, 48, 80, seed=6))
    assert all(a.shape == (48, 80, 3) and a.dtype == np.uint8 for a in first)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))
    assert all(a.std() > 1 for a in first)  # pictures, not flat fills
    gray = [bool(np.array_equal(a[..., 0], a[..., 1])) for a in first]
    assert any(gray) and not all(gray)


def test_features_are_stage_statistics_and_the_classifier_heads_input():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=3).eval()
    images = torch.randn(3, 3, 64, 64)
    names, features = feature_statistics(model, images, batch_size=2)
    assert names == ["relu", "layer1.1.relu", "layer2.1.relu", "layer3.1.relu",
                     "layer4.1.relu", "penultimate"]  # fmt: skip
    with torch.inference_mode():
        stem = model.relu(model.bn1(model.conv1(images)))
        # in the batches of two feature_statistics uses: float32 convolutions round
        # differently for another batch size (1.3e-6 apart on this host's CPU)
        block4 = torch.cat(
            [
                model.layer4(model.layer3(model.layer2(model.layer1(model.maxpool(part)))))
                for part in (model.relu(model.bn1(model.conv1(x))) for x in images.split(2))
            ]
        )
    np.testing.assert_allclose(
        features[0], torch.cat([stem.mean((2, 3)), stem.std((2, 3))], 1).numpy(), rtol=1e-4,
        atol=1e-5,
    )  # fmt: skip
    np.testing.assert_allclose(
        features[-1], torch.flatten(model.avgpool(block4), 1).numpy(), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        features[-1], penultimate_features(model, images), rtol=1e-4, atol=1e-5
    )


@pytest.fixture
def reference_folder(tmp_path):
    folder = tmp_path / "reference"
    folder.mkdir()
    generator = FundusGenerator(seed=21, size=64)
    for index in range(30):
        Image.fromarray(generator.sample(label=index % 3).image).save(folder / f"{index}.png")
    return folder


def test_a_user_model_registered_with_reference_images_warns(tmp_path, reference_folder):
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=2).eval()
    torch.save(model.state_dict(), tmp_path / "w.pt")
    home = tmp_path / "models"
    loaded = register_model(
        "eye", tmp_path / "w.pt", ["A", "B"], architecture="resnet18", input_size=(64, 64),
        directory=home, reference_images=reference_folder,
    )  # fmt: skip
    # 6 held-out images leave no room for shares at the 99th percentile: fitted tails,
    # so the check can flag at all (with shares its threshold was the highest score)
    assert loaded.ood.fitted_tails and loaded.ood.can_flag
    noise = loaded.preprocess(
        Image.fromarray(np.random.default_rng(2).integers(0, 255, (64, 64, 3), np.uint8))
    )
    assert krypton.explain(loaded, noise, patch=32, stride=32).extra["ood"]["flagged"]
    entry = json.loads((home / "eye.json").read_text())
    assert entry["ood"]["path"] == "eye.ood.npz" and (home / "eye.ood.npz").is_file()
    assert "30 reference images" in entry["ood"]["reference"]
    assert loaded.ood is not None and load_model("eye", home).ood is not None
    assert load_model("eye", home).ood.outliers == OUTLIER_IMAGES  # synthetic counter-examples
    image = loaded.preprocess(Image.open(reference_folder / "0.png"))
    heatmap = krypton.explain(loaded, image, patch=32, stride=32)
    ood = heatmap.extra["ood"]
    assert set(ood) == {"score", "threshold", "flagged", "warning", "stage"}
    assert ood["threshold"] == pytest.approx(loaded.ood.threshold)
    assert ood["flagged"] == (ood["score"] > ood["threshold"])
    assert (ood["warning"] != "") == ood["flagged"]
    # an explainer built from the registry model checks the image too
    direct = krypton.OcclusionExplainer(loaded).explain(image, patch=32, stride=32)
    assert direct.extra["ood"] == ood


def test_too_few_or_unreadable_reference_images_are_refused(tmp_path, reference_folder):
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet18(num_classes=2).state_dict(), tmp_path / "w.pt")
    for path in sorted(reference_folder.iterdir())[:10]:
        path.unlink()
    with pytest.raises(RegistryError, match="needs at least 25"):
        register_model(
            "eye", tmp_path / "w.pt", ["A", "B"], architecture="resnet18",
            input_size=(64, 64), directory=tmp_path / "m", reference_images=reference_folder,
        )  # fmt: skip
    assert not (tmp_path / "m" / "eye.json").exists()  # nothing half-written
    (reference_folder / "broken.png").write_bytes(b"not a png")
    for index in range(10):
        (reference_folder / f"copy{index}.png").write_bytes(
            (reference_folder / "29.png").read_bytes()
        )
    with pytest.raises(RegistryError, match="broken.png"):
        register_model(
            "eye", tmp_path / "w.pt", ["A", "B"], architecture="resnet18",
            input_size=(64, 64), directory=tmp_path / "m", reference_images=reference_folder,
        )  # fmt: skip


def test_models_without_a_reference_set_say_so():
    from webapp.model_card import model_card_lines

    torch.manual_seed(0)
    module = torchvision.models.resnet18(num_classes=2).eval()
    loaded = krypton.LoadedModel("plain", module, ["A", "B"], (64, 64))
    assert loaded.check_ood(torch.zeros(3, 64, 64)) is None
    heatmap = krypton.explain(loaded, torch.zeros(3, 64, 64), patch=32, stride=32)
    assert "ood" not in heatmap.extra
    assert any("Out-of-distribution check: none" in line for line in model_card_lines(loaded))


def test_the_default_model_warns_for_the_cat_in_the_cli_and_not_for_a_generated_fundus(
    tmp_path, cli_here
):
    """Issue: the warning shows in the CLI for the cat, not for generated fundus images."""
    from demo.fundus.train import GALLERY

    run_cli = cli_here  # krypton.cli.main in this process (the warning is its output)
    cat = run_cli(
        "explain", "assets/samples/chelsea.png", "--stride", "32", "--out", str(tmp_path / "c.png")
    )
    assert cat.returncode == 0, cat.stderr
    assert "OUT OF DISTRIBUTION" in cat.stdout
    assert "does not look like fundus-demo's training images" in cat.stdout
    for name in GALLERY:
        fundus = run_cli(
            "explain", f"assets/samples/{name}", "--stride", "32", "--out", str(tmp_path / "f.png")
        )
        assert fundus.returncode == 0, fundus.stderr
        assert "like the training images" in fundus.stdout and "WARNING" not in fundus.stdout


def test_the_check_is_safe_beside_a_run_of_the_same_model_in_another_thread():
    """The check hooks the model's layers; a run in another thread (another tab) must
    neither trip those hooks (it used to fail with KeyError in the run) nor feed them."""
    import threading
    import time

    loaded = load_model("fundus-demo")
    image = loaded.preprocess(Image.open("assets/samples/fundus-exudates.png"))
    alone = loaded.check_ood(image)
    explainer = krypton.OcclusionExplainer(loaded.module)
    errors, results = [], []

    def run():
        try:
            for _ in range(3):
                explainer.explain(image, patch=16, stride=16, mode="exact")
        except Exception as exc:  # noqa: BLE001 - the test reports any failure
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    for _ in range(6):  # as pages do: a check now and then while the run goes on
        results.append(loaded.check_ood(image))
        time.sleep(0.2)
    worker.join(timeout=300)
    assert not worker.is_alive()
    assert not errors, errors
    assert results and all(r.score == pytest.approx(alone.score) for r in results)


def test_the_default_models_card_states_its_pointing_setting_and_real_photo_flags():
    """The card says at which stride the pointing game was played and whether the check
    flags the real fundus photographs, as the record measured them."""
    from webapp.model_card import model_card_lines

    loaded = krypton.load_model("fundus-demo")
    evaluation = loaded.extra["entry"]["evaluation"]
    card = " ".join(model_card_lines(loaded))
    pointing = evaluation["pointing_game_strict"]
    stride, patch = pointing["stride"], pointing["patch"]
    assert f"patch {patch}, stride {stride}: within 8 px of the lesion" in card
    assert f"images with 2-4, patch {evaluation['multi_lesion_coverage']['patch']}:" in card
    real = evaluation["ood"]["real_flagged"]
    flagged = {True: "flagged", False: "not flagged"}
    assert f"the real Retina sample {flagged[real['retina']]}" in card
    assert f"Microaneurysms sample {flagged[real['microaneurysms']]}" in card
    assert f"{real['microaneurysm_tiles']} of its 9 tiles flagged" in card
    rates = evaluation["ood"]
    assert (
        f"flags {rates['natural_whole_flagged']} of 18 natural photographs as shipped and "
        f"{rates['natural_flagged']:.0%} of 90 natural photographs and crops, "
        f"{rates['documents_flagged']:.0%} of 30 typeset text pages" in card
    )
    assert f"the side of {loaded.ood.outliers:,} synthetic counter-examples" in card
    scans = rates["tomography"]
    assert (
        f"real CT and MR: 3 of the 3 CT and MR samples here flagged, "
        f"{scans['held_out_flagged']:.0%} of {scans['held_out_slices']} held-out slices" in card
    )


def test_the_default_model_flags_the_natural_photographs_and_not_fundus_images():
    """Issue 12's check, measured on the shipped model: of scikit-image's 90 photographs
    (whole and corner crops) the densities alone missed 7 (92.2%: gray crops of the moon
    and of the page of text); with the outlier boundary the stage-3 model missed 5
    (94.4%), the stage-4 model misses at most 4 (95.6%, the target 95%; every whole
    photograph is flagged), while fresh generated fundus images (a seed none of the
    check's sets used) stay at most 2% flagged and the real Retina and Microaneurysms
    samples are not flagged; typeset text pages are flagged."""
    from demo.fundus.evaluate import (
        TOMOGRAPHY_OUTLIERS,
        _generated_features,
        _picture_tensor,
        _real_photographs,
        document_pages,
        natural_photo_set,
    )

    loaded = load_model("fundus-demo")
    density, module = loaded.ood, loaded.module
    assert density.boundary is not None
    assert density.outliers == OUTLIER_IMAGES + TOMOGRAPHY_OUTLIERS
    names, pictures = natural_photo_set()
    assert len(pictures) == 90
    natural = density.score(feature_statistics(module, map(_picture_tensor, pictures))[1])
    missed = [name for name, score in zip(names, natural) if score <= density.threshold]
    assert len(missed) <= 4, missed
    assert all("(crop" in name for name in missed), missed
    assert {"chelsea.png", "astronaut.png", "rocket.jpg", "coffee.png"}.isdisjoint(missed)
    fresh = density.score(_generated_features(module, 31, 200)[1])
    assert (fresh > density.threshold).mean() <= 0.02
    real = density.score(feature_statistics(module, map(_picture_tensor, _real_photographs()))[1])
    assert (real <= density.threshold).all()
    pages = density.score(feature_statistics(module, map(_picture_tensor, document_pages(10)))[1])
    assert (pages > density.threshold).all()


def test_the_default_model_flags_ct_and_mr_slices_nobody_tuned_it_on():
    """The fundus model called the app's CT chest sample in-distribution (score 1.28 under
    a threshold of 2.40: "NORMAL 59.2%" and no warning anywhere). Its check now learns
    from CT/MR slices this project draws (demo.tomography) and is measured on real ones it
    never saw: the app's three CT and MR samples, and at least 20 held-out slices from
    pydicom's and nibabel's test data, all flagged in the same breath as genuine fundus
    images stay under 2% (the test above)."""
    from demo.fundus.evaluate import _picture_tensor
    from demo.tomography import APP_SAMPLES, real_slices

    loaded = load_model("fundus-demo")
    named = real_slices()
    held_out = [name for name, _ in named if name not in APP_SAMPLES]
    assert len(held_out) >= 20 and set(APP_SAMPLES) <= {name for name, _ in named}
    pictures = (_picture_tensor(picture) for _, picture in named)
    scores = loaded.ood.score(feature_statistics(loaded.module, pictures)[1])
    missed = [name for (name, _), s in zip(named, scores) if s <= loaded.ood.threshold]
    assert not set(APP_SAMPLES) & set(missed), missed
    assert len(missed) <= 0.05 * len(held_out), missed
    # the page's path: the sample as the gallery loads it, checked by the model
    from krypton.io.images import load_image
    from webapp.samples import sample_path

    ct = loaded.check_ood(loaded.preprocess(load_image(sample_path("CT_small.dcm"))))
    assert ct.flagged and "does not look like fundus-demo's training images" in ct.warning
