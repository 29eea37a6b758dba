"""Projective-field thresholding never drops what the patch changed most.

The crop of eq 25 used to be centred on the incoming window, which near a border has been
shifted by the clamp of eq 31: at τ 0.91 a lesion under the patch vanished from the
approximate heatmap in a band about 25 px wide along the borders of a 128 px input.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image
from torch import nn

import krypton
from krypton.engine import IncrementalGraph, NodeKind
from krypton.registry import load_model
from krypton.synthetic.fundus import FundusGenerator, Lesion


class PositiveStack(nn.Module):
    """Convs with positive weights and a spatial mean: a bright cell raises the output,
    so occluding it lowers the output — in exact and, if it keeps the evidence, in
    approximate inference."""

    def __init__(self, layers):
        super().__init__()
        convs = []
        channels = 1
        for kernel, stride in layers:
            conv = nn.Conv2d(channels, 3, kernel, stride, kernel // 2)
            with torch.no_grad():
                conv.weight.uniform_(0.05, 1.0)
                conv.bias.zero_()
            convs.append(conv)
            channels = 3
        self.convs = nn.ModuleList(convs)

    def forward(self, x):
        for conv in self.convs:
            x = F.relu(conv(x))
        return x.mean((2, 3))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    layers=st.lists(
        st.tuples(st.sampled_from([3, 5, 7]), st.sampled_from([1, 2])), min_size=3, max_size=6
    ),
    size=st.integers(32, 64),
    patch=st.integers(3, 9),
    tau=st.floats(0.5, 0.95),
    where=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    edge=st.sampled_from(["top", "bottom", "left", "right", "corner", "anywhere"]),
)
def test_a_feature_under_the_patch_moves_the_output_the_same_way(
    layers, size, patch, tau, where, edge
):
    model = PositiveStack(layers).eval()
    last = size - patch
    y, x = int(where[0] * last), int(where[1] * last)
    offset = int(where[0] * min(last, 28))  # inside a 28-px band along the edge
    y, x = {
        "top": (offset, x),
        "bottom": (last - offset, x),
        "left": (y, offset),
        "right": (y, last - offset),
        "corner": (last - offset, last - int(where[1] * min(last, 28))),
        "anywhere": (y, x),
    }[edge]
    image = torch.zeros(1, size, size)
    image[0, y + patch // 2, x + patch // 2] = 10.0  # the evidence, under the patch
    occluder = torch.zeros(1, patch, patch)
    with torch.inference_mode():
        graph = IncrementalGraph(model, image)
        views = graph.materialize(image)
        base = float(views.logits.sum())
        outputs = {}
        for label, t in (("exact", 1.0), ("approximate", tau)):
            geometry = graph.geometry((np.array([y]), np.array([x])), (patch, patch), t)
            outputs[label] = float(graph.run_batch(views, geometry, slice(0, 1), occluder).sum())
    exact_drop = base - outputs["exact"]
    approximate_drop = base - outputs["approximate"]
    assert exact_drop > 0
    # The same direction: the crop keeps the cells nearest the patch (the old crop, centred
    # on the clamped window, kept none of them near borders: a drop of exactly 0).
    assert approximate_drop > 1e-4 * exact_drop, (exact_drop, approximate_drop)


def test_the_crop_always_holds_the_patch_centre_on_resnet18():
    """Every local layer of a 128-px ResNet18 at τ 0.91, every row offset: the cropped
    input window contains the patch's centre as projected into that layer."""
    import torchvision

    model = torchvision.models.resnet18(num_classes=3).eval()
    ys = np.arange(0, 113)
    xs = np.full_like(ys, 56)
    with torch.inference_mode():
        graph = IncrementalGraph(model, torch.zeros(3, 128, 128))
    geometry = graph.geometry((ys, xs), (16, 16), 0.91)
    centre = {graph.input_node: ys + 7.5}
    for step in graph.steps:
        if step.kind == NodeKind.LOCAL:
            incoming = centre[step.node.args[0]]
            rows, _ = geometry.local_steps[step.node]
            inside = (incoming >= rows.input.start - 0.5) & (incoming <= rows.input.stop - 0.5)
            assert inside.all(), (step.node.name, ys[~inside].tolist())
            centre[step.node] = rows.centre
        elif step.kind == NodeKind.POINTWISE:
            centre[step.node] = np.mean([centre[a] for a in step.patched_args], axis=0)


# lesion position: None = the middle; a negative number counts from the far edge
@pytest.mark.parametrize("at_x, at_y", [(-26, None), (None, -26), (-22, 29)])
def test_a_microaneurysm_in_the_border_band_stays_visible(at_x, at_y):
    """The reported case: the demo model, one microaneurysm 22-26 px from an edge (on the
    128-px model: at (102, 64), (64, 102), (106, 29)), every stride-4 patch position that
    covers it. Occluding it makes the exact probability collapse; approximate at τ 0.91
    used to keep 0.6-0.94 there."""
    loaded = load_model("fundus-demo")
    size = loaded.input_size[0]
    lesion_x, lesion_y = (
        size // 2 if v is None else size + v if v < 0 else v for v in (at_x, at_y)
    )
    background = FundusGenerator(seed=5, size=size).sample(label=0).image / 255.0
    yy, xx = np.mgrid[0:size, 0:size]
    profile = np.exp(-((xx - lesion_x) ** 2 + (yy - lesion_y) ** 2) / (2 * 1.875**2))
    alpha = (profile * 0.7)[..., None]
    image = background * (1 - alpha) + np.array([0.42, 0.06, 0.05]) * alpha
    tensor = loaded.preprocess(Image.fromarray((np.clip(image, 0, 1) * 255).astype(np.uint8)))
    lesion = Lesion("MICROANEURYSM", lesion_x, lesion_y, 2.5)
    covering = [
        (x, y)
        for x in range(0, size - 15, 4)
        for y in range(0, size - 15, 4)
        if lesion.covered_by(x, y, 16)
    ]
    explainer = krypton.OcclusionExplainer(loaded.module)
    common = dict(patch=16, label=loaded.classes.index("MICROANEURYSM"), positions=covering)
    exact = explainer.explain(tensor, mode="exact", **common)
    approximate = explainer.explain(tensor, mode="approximate", tau=0.91, **common)
    # the evidence (one lesion: the model is trained toward p 0.70 for it), and its loss
    assert int(np.argmax(exact.base_probs)) == common["label"] and exact.prob > 0.5
    assert np.nanmin(exact.values) < 0.1
    # Approximate mode keeps it: the probability falls to under half. (On the 224-px
    # model the old crop kept 0.57-0.80 at these positions; the new one 0.09-0.25, the
    # same approximation error as in the image's interior: 0.24 at (60, 150), exact 0.07.)
    assert np.nanmin(approximate.values) < 0.5 * exact.prob
