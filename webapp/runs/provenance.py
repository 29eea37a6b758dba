"""What a run explains and what a kept result may show beside the page
(:class:`Provenance`, :func:`result_view`): the run's record of its request, decided
without a browser. Every result carries the provenance of its request; the page shows a
result, its summary and its downloads only while what is on screen has the same
provenance."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["Provenance", "ResultView", "result_view"]

_NAMES = {
    "image": "the image",
    "model": "the model",
    "weights": "the model's weights",
    "region": "the region",
    "patch": "the patch size",
    "stride": "the stride",
    "mode": "the mode",
    "colour": "the occluder colour",
    "label": "the class",
    "approximate": "the approximate-mode settings",
}


@dataclass(frozen=True)
class Provenance:
    """What a heatmap explains; two are equal exactly when they explain the same thing."""

    image: str  # the image's (or volume's) content key
    model: str
    weights: str  # the weights checksum of the model that ran
    # as requested (None: the whole input): (x0, y0, x1, y1), a volume's (z0, y0, x0, z1, y1, x1)
    region: tuple[int, ...] | None
    patch: int
    stride: int
    mode: str
    colour: tuple[float, ...]  # the occluder's; () where the model's own fill is used
    label: int | None  # None: the top class, before the run decides it
    # approximate mode's quality target, drill-down fraction and speedup target (None in
    # the other modes, which do not read them)
    approximate: tuple[float | None, ...] | None = None

    @classmethod
    def make(cls, **fields) -> Provenance:
        """Normalised: a region as a tuple of ints, numbers rounded to 6 places, the
        approximate settings only in approximate mode."""
        region = fields.get("region")
        fields["region"] = None if not region else tuple(int(v) for v in region)
        fields["colour"] = tuple(round(float(c), 6) for c in fields.get("colour") or ())
        fields["patch"], fields["stride"] = int(fields["patch"]), int(fields["stride"])
        label = fields.get("label")
        fields["label"] = None if label is None else int(label)
        approximate = fields.get("approximate")
        fields["approximate"] = (
            tuple(None if v is None else round(float(v), 6) for v in approximate)
            if fields["mode"] == "approximate" and approximate is not None
            else None
        )
        return cls(**fields)

    @classmethod
    def from_dict(cls, data: dict) -> Provenance:
        return cls.make(**{f.name: data.get(f.name) for f in dataclasses.fields(cls)})

    def as_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["region"] = None if self.region is None else list(self.region)
        data["colour"] = list(self.colour)
        data["approximate"] = None if self.approximate is None else list(self.approximate)
        return data

    def with_label(self, label: int) -> Provenance:
        return dataclasses.replace(self, label=int(label))

    def differences(self, other: Provenance) -> list[str]:
        """What differs from ``other``, in the page's words ('the image', 'the stride')."""
        return [
            _NAMES[f.name]
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
            and not (f.name == "weights" and self.model != other.model)
        ]


@dataclass(frozen=True)
class ResultView:
    """Whether the result panel shows the kept result, and if not, why."""

    show: bool
    reason: str = ""


def result_view(result: Provenance | None, screen: Provenance | None) -> ResultView:
    """The page shows a result only beside what it explains: the same image, model,
    weights, region, patch, stride, mode, colour and class as on screen."""
    if result is None:
        return ResultView(False, "")
    if screen is None:
        return ResultView(False, "The last heatmap is hidden: it explained another image.")
    differ = result.differences(screen)
    if not differ:
        return ResultView(True)
    if "the image" in differ or "the model" in differ or "the model's weights" in differ:
        what = [d for d in differ if d in ("the image", "the model", "the model's weights")]
        return ResultView(
            False,
            f"The last heatmap is hidden: it explained {_and(what)} that is no longer "
            f"on screen. Press Run to explain this one.",
        )
    return ResultView(
        False,
        f"The last heatmap is hidden: {_and(differ)} changed since it was computed. "
        f"Press Run for these settings, or set them back to see it.",
    )


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
