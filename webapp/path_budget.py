"""Integrated Gradients' budget on the page: the choices of gradient evaluations a path
may spend (krypton.methods.IG_STEP_CHOICES), and what the Compare view says of a map
whose path stopped short of completeness — by how much, and what more steps would cost
at the run's own pace."""

from __future__ import annotations

from krypton.estimator import format_duration
from krypton.methods import IG_GAP, IG_MAX_STEPS, IG_STEP_CHOICES

from .result_schema import ResultRecord

__all__ = ["budget_options", "chosen_budget", "more_steps_note"]


def budget_options() -> list[dict]:
    """The Compare settings' choices of Integrated Gradients' most gradient evaluations
    per map (the first is the default)."""
    return [
        {"label": f"{steps:,}" + (" (default)" if steps == IG_MAX_STEPS else ""), "value": steps}
        for steps in IG_STEP_CHOICES
    ]


def chosen_budget(value) -> int | None:
    """The page's choice as a budget: one of IG_STEP_CHOICES, or None (the library's
    default) for none or the default. A value the page does not offer is refused
    (ValueError)."""
    if value in (None, ""):
        return None
    offered = f"Integrated Gradients' steps are one of {', '.join(map(str, IG_STEP_CHOICES))}"
    try:
        budget = int(value)
    except (TypeError, ValueError):
        raise ValueError(offered) from None
    if budget not in IG_STEP_CHOICES:
        raise ValueError(offered)
    return None if budget == IG_MAX_STEPS else budget


def more_steps_note(result: ResultRecord) -> str:
    """The Compare view's line for the class on screen where Integrated Gradients' path
    stopped short of IG_GAP: how far, after how many evaluations, and the next budget
    with its time at this map's own pace (seconds per evaluation); "" where it reached
    completeness or no path is kept."""
    entry = (result.get("methods") or {}).get("integrated_gradients") or {}
    label = int(result["label"])
    if label not in entry.get("labels", ()) or not entry.get("paths"):
        return ""
    index = entry["labels"].index(label)
    used, gap, budget = entry["paths"][index]
    if gap <= IG_GAP:
        return ""
    head = (
        f"Integrated Gradients for {result['label_name']} stopped {gap:.1%} from completeness "
        f"(its map should add up to the class score's change from the fill to the image; "
        f"{IG_GAP:.0%} is aimed at) after "
        f"{used:,} gradient evaluations."
    )
    larger = [steps for steps in IG_STEP_CHOICES if steps > max(budget, used)]
    if not larger:
        return f"{head} That is the most the page allows; the map is shown as computed."
    pace = float(entry["seconds"][index]) / max(used, 1)
    return (
        f'{head} For more, choose {larger[0]:,} under "Integrated Gradients steps" and '
        f"press Run: at most about {format_duration(pace * larger[0])} per class at this "
        f"map's pace (the heatmap, Grad-CAM and maps that reached completeness are kept)."
    )
