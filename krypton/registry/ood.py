"""Out-of-distribution warning: is this image like the model's training images?

Features are taken where the network sees the image: at the end of every spatial stage
(the last layer producing each feature-map size: edges and colour early, parts later) the
per-channel mean and standard deviation of the activations, and the penultimate layer
(the input of the classifier head). For each, in-distribution reference images give a
mean and a shrunk covariance (Ledoit-Wolf, scikit-learn), and an image's distance is
its Mahalanobis distance from that mean. Each distance becomes a p-value against
held-out in-distribution images (the share of them at least as far), and the image's
score is -log10 of the smallest p-value: how unusual it is at the stage where it is most
unusual. The threshold is the 99th percentile of the scores of a second held-out set, so
about 1% of genuine images are flagged by construction. A share of N held-out images is
at least 1 / (N + 1), so with many stages and few held-out images more than 1% of genuine
images reach the highest score there is and the threshold lands on it, where nothing can
pass; such a check takes each p-value from a normal fitted to the held-out values instead
and its threshold from Sidak's correction for the number of stages, not a percentile a
handful of images cannot place (:attr:`FeatureDensity.fitted_tails`, named in its
reference text).

The penultimate layer alone is the textbook choice, and it is kept, but on the demo model
it flagged almost none of scikit-image's photographs: a network trained on one kind of
image maps a cat into its class space as confidently as a fundus. Early stages see that a
cat's edges and colours are nothing like a retina's (README gives the measured rates).

Densities only know what genuine images look like. A gray photograph of the moon or a page
of text falls inside every stage's spread of a model trained on gray fundus renderings, so
the check also learns a boundary (outlier exposure, Hendrycks et al., ICLR 2019): a
logistic regression (scikit-learn) between the reference images' features, all stages
together, and those of synthetic images no domain owns (:mod:`krypton.registry._outliers`: dead
leaves and 1/f noise). Its decision value is one more "stage" with its own held-out
p-value; it is fitted when outlier features are given (the demo model, registration with
a reference folder); checks stored without it still load and score as before.

Stored next to the model (``NAME.ood.npz``) and named in its registry entry; :func:`check`
is what the app, the CLI and ``Heatmap.extra`` report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = [
    "THRESHOLD_PERCENTILE",
    "MIN_REFERENCE_IMAGES",
    "OUTLIER_IMAGES",
    "FeatureDensity",
    "StageDensity",
    "OutlierBoundary",
    "OodResult",
    "feature_statistics",
    "penultimate_features",
    "fit_density",
    "outlier_features",
    "check",
    "warning_text",
]

THRESHOLD_PERCENTILE = 99.0
MIN_REFERENCE_IMAGES = 20
MIN_HELD_OUT_IMAGES = 5
# synthetic counter-examples for the outlier boundary, and its regularisation (inverse
# strength, scikit-learn's C). On the demo model 1,000 images gave 91-96% of the natural
# photographs flagged depending on the draw; 3,000 and 4,500 gave 93-94% for C 0.003-0.1.
OUTLIER_IMAGES = 3000
OUTLIER_REGULARISATION = 0.01
OUTLIER_STAGE = "outlier boundary"


def warning_text(model_name: str) -> str:
    """The plain warning shown for a flagged image."""
    return (
        f"this image does not look like {model_name}'s training images; its prediction and "
        f"heatmap are not meaningful"
    )


def caveat(ood: dict | None) -> str:
    """The warning a flagged image's result carries wherever it goes (page, PNG title and
    metadata, JSON, DICOM Image Comments, batch summary); "" when not flagged.
    ``ood``: :meth:`OodResult.as_dict`."""
    if not ood or not ood.get("flagged"):
        return ""
    return (
        f"{ood['warning']} (unusualness {ood['score']:.1f} at {ood.get('stage') or '?'}; "
        f"the threshold is {ood['threshold']:.1f})"
    )


@dataclass(frozen=True)
class OodResult:
    """An image's out-of-distribution check."""

    score: float  # -log10 of the smallest per-stage p-value
    threshold: float  # 99th percentile of held-out in-distribution scores
    flagged: bool
    warning: str  # empty when not flagged
    stage: str = ""  # where the image is most unusual

    def as_dict(self) -> dict:
        return {
            "score": self.score,
            "threshold": self.threshold,
            "flagged": self.flagged,
            "warning": self.warning,
            "stage": self.stage,
        }


@dataclass(frozen=True)
class StageDensity:
    """One stage's in-distribution features: mean, precision, held-out distances."""

    name: str
    mean: np.ndarray  # (D,)
    precision: np.ndarray  # (D, D), inverse of the shrunk covariance
    held_out: np.ndarray  # sorted Mahalanobis distances of held-out images

    def distance(self, features: np.ndarray) -> np.ndarray:
        """Mahalanobis distance of each row of ``features`` (N, D)."""
        centred = np.asarray(features, dtype=np.float64) - self.mean
        return np.sqrt(np.maximum(np.einsum("nd,de,ne->n", centred, self.precision, centred), 0))

    def p_value(self, features: np.ndarray, fitted: bool = False) -> np.ndarray:
        """Share of held-out images at least as far (with the image itself counted), or
        with ``fitted`` the tail of a normal fitted to the held-out log-distances."""
        distances = self.distance(features)
        if fitted:
            return _normal_tail(self.held_out, distances, log=True)
        return _tail_share(self.held_out, distances)


def _tail_share(held_out: np.ndarray, values: np.ndarray) -> np.ndarray:
    """(count of sorted ``held_out`` values >= each value, + 1) / (len + 1): a p-value."""
    beyond = len(held_out) - np.searchsorted(held_out, values, side="left")
    return (beyond + 1) / (len(held_out) + 1)


def _normal_tail(held_out: np.ndarray, values: np.ndarray, log: bool = False) -> np.ndarray:
    """The survival function of a normal fitted to ``held_out`` (to their logarithms with
    ``log``) at each value: a p-value that goes on below 1 / (len + 1), where a few
    held-out values leave :func:`_tail_share` no room to."""
    from scipy.stats import norm

    if log:
        held_out, values = np.log(np.maximum(held_out, 1e-12)), np.log(np.maximum(values, 1e-12))
    spread = float(np.std(held_out, ddof=1)) if len(held_out) > 1 else 0.0
    standard = (values - float(np.mean(held_out))) / (spread or 1.0)
    return np.maximum(norm.sf(standard), 1e-300)


def _boundary_input(features: list[np.ndarray]) -> np.ndarray:
    """Every stage's features side by side, compressed by sign(x) log(1 + |x|): channel
    statistics span orders of magnitude between stages."""
    joined = np.concatenate([np.asarray(f, dtype=np.float64) for f in features], 1)
    return np.sign(joined) * np.log1p(np.abs(joined))


@dataclass(frozen=True)
class OutlierBoundary:
    """A linear boundary between in-distribution features and synthetic outliers'
    (logistic regression on standardised :func:`_boundary_input`); larger is less like
    the reference images."""

    centre: np.ndarray  # (D,) standardisation
    scale: np.ndarray  # (D,)
    weights: np.ndarray  # (D,)
    bias: float
    held_out: np.ndarray  # sorted decision values of held-out in-distribution images

    def decision(self, features: list[np.ndarray]) -> np.ndarray:
        """The logistic regression's decision value for each image (all stages' features)."""
        return ((_boundary_input(features) - self.centre) / self.scale) @ self.weights + self.bias

    def p_value(self, features: list[np.ndarray], fitted: bool = False) -> np.ndarray:
        decisions = self.decision(features)
        return (_normal_tail if fitted else _tail_share)(self.held_out, decisions)


@dataclass(frozen=True)
class FeatureDensity:
    """Per-stage densities of in-distribution features and the flagging threshold."""

    stages: tuple[StageDensity, ...]
    threshold: float
    reference: str = ""  # what the in-distribution images were
    fitted_on: int = 0
    held_out: int = 0
    boundary: OutlierBoundary | None = None  # absent in checks fitted before it existed
    outliers: int = 0  # synthetic images the boundary was fitted against
    # p-values from normal fits to the held-out values, not their shares: set when too few
    # held-out images left the empirical threshold at the highest score (see can_flag)
    fitted_tails: bool = False

    @property
    def stage_names(self) -> list[str]:
        """What each p-value measures, in :meth:`scores`' index order."""
        names = [s.name for s in self.stages]
        return names + [OUTLIER_STAGE] if self.boundary is not None else names

    def scores(self, features: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(score, index into :attr:`stage_names` of the most unusual stage) for each
        image; ``features`` as :func:`feature_statistics` returns them."""
        fitted = self.fitted_tails
        p_values = [s.p_value(f, fitted) for s, f in zip(self.stages, features)]
        if self.boundary is not None:
            p_values.append(self.boundary.p_value(features, fitted))
        stacked = np.stack(p_values)
        return -np.log10(stacked.min(axis=0)), stacked.argmin(axis=0)

    def score(self, features: list[np.ndarray]) -> np.ndarray:
        return self.scores(features)[0]

    @property
    def can_flag(self) -> bool:
        """Whether any image can score above the threshold. A p-value is at least
        1 / (calibration images + 1), so scores stop at -log10 of that; when more than
        1% of the threshold's held-out images already reach it (many stages, few
        calibration images), the threshold sits there and nothing is ever flagged.
        Fitted tails have no such ceiling."""
        if self.fitted_tails:
            return bool(np.isfinite(self.threshold))
        calibration = max(len(s.held_out) for s in self.stages)
        if self.boundary is not None:
            calibration = max(calibration, len(self.boundary.held_out))
        return self.threshold < -np.log10(1 / (calibration + 1)) - 1e-9

    def save(self, path) -> None:
        arrays = {
            "threshold": np.float64(self.threshold),
            "reference": np.array(self.reference),
            "fitted_on": np.int64(self.fitted_on),
            "held_out": np.int64(self.held_out),
            "names": np.array([s.name for s in self.stages]),
            "fitted_tails": np.bool_(self.fitted_tails),
        }
        for index, stage in enumerate(self.stages):
            arrays[f"mean{index}"] = stage.mean.astype(np.float32)
            arrays[f"precision{index}"] = stage.precision.astype(np.float32)
            arrays[f"distances{index}"] = stage.held_out.astype(np.float32)
        if self.boundary is not None:
            arrays["outliers"] = np.int64(self.outliers)
            for field in ("centre", "scale", "weights", "held_out"):
                arrays[f"boundary_{field}"] = getattr(self.boundary, field).astype(np.float32)
            arrays["boundary_bias"] = np.float64(self.boundary.bias)
        np.savez_compressed(path, **arrays)

    @classmethod
    def load(cls, path: Path) -> FeatureDensity:
        with np.load(path, allow_pickle=False) as data:
            stages = tuple(
                StageDensity(
                    str(name),
                    data[f"mean{index}"].astype(np.float64),
                    data[f"precision{index}"].astype(np.float64),
                    np.sort(data[f"distances{index}"].astype(np.float64)),
                )
                for index, name in enumerate(data["names"])
            )
            boundary = None
            if "boundary_weights" in data.files:
                boundary = OutlierBoundary(
                    data["boundary_centre"].astype(np.float64),
                    data["boundary_scale"].astype(np.float64),
                    data["boundary_weights"].astype(np.float64),
                    float(data["boundary_bias"]),
                    np.sort(data["boundary_held_out"].astype(np.float64)),
                )
            return cls(
                stages,
                float(data["threshold"]),
                str(data["reference"]),
                int(data["fitted_on"]),
                int(data["held_out"]),
                boundary,
                int(data["outliers"]) if boundary is not None else 0,
                bool(data["fitted_tails"]) if "fitted_tails" in data.files else False,
            )


def _stage_modules(module: nn.Module, probe: torch.Tensor) -> list[tuple[str, nn.Module]]:
    """The last leaf module producing each feature-map size, in execution order."""
    calls: list[tuple[str, nn.Module, tuple]] = []
    names = {m: n for n, m in module.named_modules()}
    hooks = [
        leaf.register_forward_hook(
            lambda m, _, out: (
                calls.append((names.get(m, type(m).__name__), m, tuple(out.shape[2:])))
                # 1 x 1 maps are pooled already: the penultimate layer covers them
                if isinstance(out, torch.Tensor) and out.dim() in (4, 5) and out[0, 0].numel() > 1
                else None
            )
        )
        for leaf in module.modules()
        if not list(leaf.children())
    ]
    try:
        module(probe)
    finally:
        for hook in hooks:
            hook.remove()
    last: dict[tuple, tuple[int, str, nn.Module]] = {}
    for order, (name, leaf, size) in enumerate(calls):
        last[size] = (order, name, leaf)
    chosen = sorted(last.values(), key=lambda v: v[0])
    # a module shared across sizes (one activation reused everywhere) keeps its last use
    return [
        (name, leaf)
        for position, (_, name, leaf) in enumerate(chosen)
        if all(leaf is not other for _, _, other in chosen[position + 1 :])
    ]


def _last_linear(module: nn.Module) -> nn.Linear:
    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ValueError("the model has no linear layer: no penultimate features to score")
    return linears[-1]


@torch.inference_mode()
def feature_statistics(
    module: nn.Module, images: torch.Tensor | Iterable[torch.Tensor], batch_size: int = 32
) -> tuple[list[str], list[np.ndarray]]:
    """Stage names and, per stage, (N, 2C) channel means and standard deviations of its
    output, then the (N, D) penultimate features, for preprocessed ``images``
    ((N, 3, H, W) or an iterable of (3, H, W) tensors; volumes (N, 1, D, H, W) or
    (1, D, H, W) each).

    It hooks the module's layers while it runs: no other thread may run the same module
    meanwhile (:meth:`krypton.LoadedModel.check_ood` holds the capture lock exclusively).
    """
    batches = images.split(batch_size) if isinstance(images, torch.Tensor) else None
    iterator = iter(batches if batches is not None else _batched(images, batch_size))
    first = next(iterator, None)
    if first is None:
        raise ValueError("no images")
    stages = _stage_modules(module, first[:1])
    captured: list[list[torch.Tensor]] = [[] for _ in range(len(stages) + 1)]
    # a module called several times in one forward (a shared ReLU) counts its last call
    latest: dict[int, torch.Tensor] = {}

    def remember(index):
        def hook(_, __, out):
            spatial = tuple(range(2, out.dim()))  # (H, W), or (D, H, W) for volumes
            latest[index] = torch.cat([out.mean(spatial), out.std(spatial)], 1).float()

        return hook

    hooks = [leaf.register_forward_hook(remember(i)) for i, (_, leaf) in enumerate(stages)]
    hooks.append(
        _last_linear(module).register_forward_pre_hook(
            lambda _, args: latest.__setitem__(len(stages), args[0].flatten(1).float())
        )
    )
    try:
        for batch in (first, *iterator):
            latest.clear()
            module(batch)
            for index in range(len(stages) + 1):
                captured[index].append(latest[index])
    finally:
        for hook in hooks:
            hook.remove()
    names = [name for name, _ in stages] + ["penultimate"]
    return names, [torch.cat(parts).cpu().numpy().astype(np.float64) for parts in captured]


def penultimate_features(
    module: nn.Module, images: torch.Tensor | Iterable[torch.Tensor], batch_size: int = 32
) -> np.ndarray:
    """(N, D) inputs of the model's last linear layer (its classifier head)."""
    return feature_statistics(module, images, batch_size)[1][-1]


def _batched(images: Iterable[torch.Tensor], size: int):
    chunk: list[torch.Tensor] = []
    for image in images:
        chunk.append(image)
        if len(chunk) == size:
            yield torch.stack(chunk)
            chunk = []
    if chunk:
        yield torch.stack(chunk)


def fit_density(
    names: list[str],
    reference: list[np.ndarray],
    held_out: list[np.ndarray],
    description: str = "",
    percentile: float = THRESHOLD_PERCENTILE,
    outliers: list[np.ndarray] | None = None,
) -> FeatureDensity:
    """Per-stage means and Ledoit-Wolf covariances of ``reference`` features; half of
    ``held_out`` calibrates the p-values, the other half sets the threshold at its
    ``percentile`` (all in-distribution; features as :func:`feature_statistics` gives).
    With ``outliers`` (features of synthetic non-images, :func:`outlier_features`) an
    :class:`OutlierBoundary` between them and ``reference`` is one more stage. When the
    empirical threshold could flag nothing (:attr:`FeatureDensity.can_flag`), the check
    is fitted with normal tails instead (:attr:`FeatureDensity.fitted_tails`)."""
    from sklearn.covariance import LedoitWolf

    count, spare = len(reference[0]), len(held_out[0])
    if count < MIN_REFERENCE_IMAGES or spare < MIN_HELD_OUT_IMAGES:
        raise ValueError(
            f"an out-of-distribution check needs at least {MIN_REFERENCE_IMAGES} reference "
            f"and {MIN_HELD_OUT_IMAGES} held-out images; got {count} and {spare}"
        )
    half = max(spare // 2, 1)
    stages = []
    for name, fit, calibrate in zip(names, reference, held_out):
        estimate = LedoitWolf().fit(fit)
        stage = StageDensity(name, estimate.location_, estimate.precision_, np.zeros(0))
        distances = np.sort(stage.distance(calibrate[:half]))
        stages.append(StageDensity(name, stage.mean, stage.precision, distances))
    boundary = None
    if outliers is not None:
        boundary = _fit_boundary(reference, outliers, [f[:half] for f in held_out])
    spare_features = [f[half:] for f in held_out]
    unfitted = FeatureDensity(tuple(stages), 0.0, boundary=boundary)
    threshold = float(np.percentile(unfitted.score(spare_features), percentile))
    density = FeatureDensity(
        tuple(stages), threshold, description, count, spare, boundary,
        len(outliers[0]) if outliers is not None else 0,
    )  # fmt: skip
    if density.can_flag:
        return density
    # Too few held-out images for empirical p-values at this percentile: the threshold is
    # the highest score there is. Normal fits to the same held-out values have no ceiling;
    # and since a handful of images cannot place a 99th percentile either, the threshold
    # is Sidak's: the smallest of k independent p-values falls below 1 - q^(1/k) with
    # probability 1 - q (fewer flags than that when the stages agree, as they do).
    tests = len(stages) + (boundary is not None)
    threshold = float(-np.log10(1 - (percentile / 100) ** (1 / tests)))
    note = f"; p-values from normal fits: {half} calibration images are too few for shares"
    return replace(density, threshold=threshold, reference=description + note, fitted_tails=True)


def _fit_boundary(
    reference: list[np.ndarray], outliers: list[np.ndarray], calibrate: list[np.ndarray]
) -> OutlierBoundary:
    """Logistic regression, reference (0) against outliers (1), classes weighted alike."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    genuine, synthetic = _boundary_input(reference), _boundary_input(outliers)
    if len(synthetic) < MIN_REFERENCE_IMAGES:
        raise ValueError(
            f"the outlier boundary needs at least {MIN_REFERENCE_IMAGES} synthetic images; "
            f"got {len(synthetic)}"
        )
    inputs = np.vstack([genuine, synthetic])
    scaler = StandardScaler().fit(inputs)
    regression = LogisticRegression(
        C=OUTLIER_REGULARISATION, class_weight="balanced", max_iter=5000
    ).fit(scaler.transform(inputs), np.r_[np.zeros(len(genuine)), np.ones(len(synthetic))])
    scale = np.where(scaler.scale_ > 0, scaler.scale_, 1.0)
    boundary = OutlierBoundary(
        scaler.mean_, scale, regression.coef_[0], float(regression.intercept_[0]), np.zeros(0)
    )
    return replace(boundary, held_out=np.sort(boundary.decision(calibrate)))


def outlier_features(
    module: nn.Module,
    input_size: Sequence[int],  # (height, width)
    preprocess: Callable[[np.ndarray], torch.Tensor],
    count: int = OUTLIER_IMAGES,
    batch_size: int = 32,
) -> list[np.ndarray]:
    """:func:`feature_statistics` of ``count`` synthetic outliers
    (:mod:`krypton.registry._outliers`) drawn at the model's input size; ``preprocess``
    turns each (H, W, 3) uint8 picture into the model's (3, H, W) input, as the model's
    own images are."""
    from ._outliers import synthetic_outliers

    height, width = input_size
    images = map(preprocess, synthetic_outliers(count, height, width))
    return feature_statistics(module, images, batch_size)[1]


def check(
    density: FeatureDensity, module: nn.Module, image: torch.Tensor, model_name: str
) -> OodResult:
    """Score one preprocessed image (3, H, W) or volume (1, D, H, W) against ``density``."""
    _, features = feature_statistics(module, image.unsqueeze(0))
    scores, stages = density.scores(features)
    score = float(scores[0])
    flagged = score > density.threshold
    return OodResult(
        score,
        density.threshold,
        flagged,
        warning_text(model_name) if flagged else "",
        density.stage_names[int(stages[0])],
    )
