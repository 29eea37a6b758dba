"""Plain words for the page's technical terms, shown as tooltips on their labels (one
place for the image and the volume panels)."""

from __future__ import annotations

from dash import html

GLOSSARY = {
    "Patch size": "The side, in pixels, of the gray square slid over the image. Larger "
    "patches hide larger structures and need fewer positions.",
    "Cube (voxels)": "The side, in voxels, of the gray cube slid through the volume.",
    "Stride": "How far the patch moves between positions. Half the stride means about "
    "four times the positions (eight for a volume) and a sharper, slower heatmap.",
    "Mode": "Naive re-runs the whole model at every position. Exact gives the same "
    "numbers sooner by recomputing only what the patch changes. Approximate is faster "
    "still and close to exact, within the target below.",
    "Target SSIM": "How alike the approximate heatmap must be to the exact one (1 = the "
    "same picture). It sets τ, the share of each layer's changed region that is "
    "recomputed.",
    "Drill-down fraction": "Approximate mode first computes a coarse heatmap, then "
    "recomputes this share of it (where the probability drops most) at full detail.",
    "Target speedup": "How much faster than exact the coarse first pass should be.",
    "Occlusion colour": "The colour of the patch. Gray hides without adding an edge on "
    "most images; the heatmap shows how far the probability drops under it.",
    "Class to explain": "The class whose probability the heatmap follows. Switching it "
    "re-colours an exact or naive heatmap at once.",
    "Display window": "How scanner values map to gray on screen. It changes the picture, "
    "not what the model sees.",
    "Class": "The class whose probability the heatmap follows.",
    "Grad-CAM layer": "Which block of the network Grad-CAM reads. Deeper blocks see "
    "more of the image but have fewer, coarser cells; the map's title names the block "
    "that was read.",
    "Integrated Gradients steps": "The most gradient evaluations Integrated Gradients may "
    "spend per class. It stops sooner once its attributions add up (within 1%) to the "
    "change in the model's output; where they do not, the Compare view says by how much "
    "and what more steps would take.",
}


def term_label(text: str) -> html.Label:
    """A control's label; a term in :data:`GLOSSARY` gets its explanation as a tooltip
    and a marker that says one is there."""
    tip = GLOSSARY.get(text)
    if tip is None:
        return html.Label(text, className="control-label")
    return html.Label([text, html.Span("?", className="tip-mark")], title=tip,
                      className="control-label has-tip")  # fmt: skip
