"""Patch geometry against brute force: no changed output escapes the computed patch."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from krypton.engine.geometry import (
    AxisOp,
    Window,
    bounding_window,
    ceil_div,
    local_step,
    padding_needed,
)


def output_size(in_size, kernel, stride, pad, dilation, ceil_mode=False):
    """PyTorch's output size formula (pooling's ceil_mode rule included)."""
    span = in_size + 2 * pad - dilation * (kernel - 1) - 1
    size = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (size - 1) * stride >= in_size + pad:
        size -= 1
    return size


@st.composite
def axis_ops(draw, allow_ceil=True):
    kernel = draw(st.integers(1, 7))
    stride = draw(st.integers(1, 4))
    dilation = draw(st.integers(1, 3))
    pad = draw(st.integers(0, (dilation * (kernel - 1) + 1) // 2))
    extent = dilation * (kernel - 1) + 1
    in_size = draw(st.integers(max(1, extent - 2 * pad), 40))
    ceil_mode = allow_ceil and draw(st.booleans())
    out = output_size(in_size, kernel, stride, pad, dilation, ceil_mode)
    return AxisOp(kernel, stride, dilation, pad, in_size, out)


def reads(op: AxisOp, output: int) -> set[int]:
    start = output * op.stride - op.pad_before
    return {start + op.dilation * j for j in range(op.kernel)}


@settings(max_examples=400, deadline=None)
@given(op=axis_ops(), data=st.data())
def test_changed_outputs_lie_in_output_patch_and_reads_in_context(op, data):
    length = data.draw(st.integers(1, op.in_size))
    starts = np.array(
        data.draw(st.lists(st.integers(0, op.in_size - length), min_size=1, max_size=6))
    )
    step = local_step(op, Window(starts, length))
    assert 1 <= step.output.length <= op.out_size
    assert step.read.length == op.extent + (step.output.length - 1) * op.stride  # eq 16
    low, high = padding_needed(op)
    for i, start in enumerate(starts):
        changed = set(range(start, start + length))
        affected = {o for o in range(op.out_size) if reads(op, o) & changed}
        out_lo = step.output.start[i]
        assert 0 <= out_lo and out_lo + step.output.length <= op.out_size
        assert affected <= set(range(out_lo, out_lo + step.output.length))
        needed = set().union(*(reads(op, o) for o in range(out_lo, out_lo + step.output.length)))
        read_lo = step.read.start[i]
        assert needed <= set(range(read_lo, read_lo + step.read.length))
        assert read_lo >= -low and read_lo + step.read.length <= op.in_size + high
    # No longer than the positions need: the most outputs whose window touches a patch.
    touching = [
        sum(1 for o in range(op.out_size) if reads_span(op, o) & set(range(s, s + length)))
        for s in starts
    ]
    assert step.output.length == max(1, *touching)
    assert step.output.length <= local_step(op, Window(starts, length), tight=False).output.length


def reads_span(op, out):
    """Input cells between the first and last that output ``out`` reads (eq 13's notion)."""
    start = out * op.stride - op.pad_before
    return set(range(start, start + op.extent))


@settings(max_examples=200, deadline=None)
@given(
    op=axis_ops(allow_ceil=False),
    data=st.data(),
    tau=st.sampled_from([0.4, 0.5, 0.6, 0.7, 0.8, 0.9]),
)
def test_thresholding_truncates_and_centre_crops(op, data, tau):
    length = data.draw(st.integers(1, op.in_size))
    starts = np.array(
        data.draw(st.lists(st.integers(0, op.in_size - length), min_size=1, max_size=4))
    )
    exact = local_step(op, Window(starts, length), tight=False)  # eq 14, as tuned
    approx = local_step(op, Window(starts, length), tau)
    limit = max(round(tau * op.out_size), -(-op.extent // op.stride))
    assert approx.output.length == min(exact.output.length, limit)
    assert approx.input.length <= length
    # The cropped input stays inside the original patch and its changes stay in the window.
    assert np.all(approx.input.start >= starts)
    assert np.all(approx.input.stop <= starts + length)
    for i in range(len(starts)):
        changed = set(range(approx.input.start[i], approx.input.stop[i]))
        affected = {o for o in range(op.out_size) if reads(op, o) & changed}
        lo = approx.output.start[i]
        assert affected <= set(range(lo, lo + approx.output.length))


def test_tau_one_is_exact():
    op = AxisOp(3, 1, 1, 1, 56, 56)
    window = Window(np.array([0, 20, 40]), 16)
    first, second = local_step(op, window, 1.0), local_step(op, window)
    for a, b in (
        (first.input, second.input),
        (first.read, second.read),
        (first.output, second.output),
    ):
        assert a.length == b.length and np.array_equal(a.start, b.start)
    assert first.input.length == 16 and np.array_equal(first.input.start, window.start)


def test_paper_example_dimensions():
    # 3x3 conv, stride 1, pad 1 on a 224 input: a 16-wide patch at 100 grows to 18 (eq 14).
    step = local_step(AxisOp(3, 1, 1, 1, 224, 224), Window(np.array([100]), 16))
    assert step.output.length == 18 and step.output.start[0] == 99
    assert step.read.start[0] == 98 and step.read.length == 20
    # At the right border the patch is shifted inside the tensor (eq 31).
    step = local_step(AxisOp(3, 1, 1, 1, 224, 224), Window(np.array([208]), 16))
    assert step.output.start[0] + step.output.length == 224


def test_exact_windows_hold_only_what_the_positions_need():
    """Eq 14 sizes an output patch for an input patch at any offset to the stride: a 2x2/2
    pool of a 20-cell patch starting on an even cell changes 10 cells, eq 14 says 11, and
    every later layer inherited the extra row and column (16% of VGG16's incremental MACs
    at patch 16, stride 4). Exact mode sizes for the positions it runs."""
    pool = AxisOp(2, 2, 1, 0, 224, 112)
    even = Window(np.array([98, 102, 106]), 20)
    assert local_step(pool, even).output.length == 10
    assert local_step(pool, even, tight=False).output.length == 11  # the paper's bound
    odd = Window(np.array([98, 101]), 20)  # offsets differ: one position needs 11
    assert local_step(pool, odd).output.length == 11


def test_exact_windows_are_the_changed_cells_of_a_real_network():
    """Positive weights and a bright occluder change every cell whose window touches the
    patch, so the changed cells' bounding box is what exact mode must compute."""
    from krypton.engine import IncrementalGraph, NodeKind

    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(
            torch.nn.Conv2d(1, 2, 3, padding=1),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(2, 2, 3, padding=1),
            torch.nn.MaxPool2d(3, stride=2, padding=1),
            torch.nn.Conv2d(2, 2, 3, stride=2, padding=1),
            torch.nn.Conv2d(2, 2, 1),
        )
        .double()
        .eval()
    )
    for parameter in model.parameters():
        parameter.data.abs_()
    image = torch.rand(1, 48, 48, dtype=torch.float64)
    ys, xs = np.array([9, 13, 17, 21]), np.array([13, 17, 21, 25])  # even after the 3x3
    with torch.inference_mode():
        graph = IncrementalGraph(model, image)
        geometry = graph.geometry((ys, xs), (8, 8))
        paper = graph.geometry((ys, xs), (8, 8), tight=False)
        outputs, clean = {}, {}
        for batch, store in ((_occluded(image, ys, xs), outputs), (image[None], clean)):
            value = batch
            for index, layer in enumerate(model):
                value = layer(value)
                store[f"_{index}"] = value  # the graph's names for Sequential's layers
    steps = [s for s in graph.steps if s.kind == NodeKind.LOCAL]
    looser = 0
    for step in steps:
        changed = (outputs[step.node.name] != clean[step.node.name]).any(dim=1)
        rows, cols = geometry.windows[step.node]
        need_rows = max(_span(c.any(dim=1)) for c in changed)
        need_cols = max(_span(c.any(dim=0)) for c in changed)
        assert (rows.length, cols.length) == (need_rows, need_cols), step.node.name
        looser += paper.windows[step.node][0].length > rows.length
    assert looser >= 2  # eq 14 alone would compute cells no position changes


def _span(flags):
    where = flags.nonzero().flatten()
    return int(where[-1] - where[0]) + 1


def _occluded(image, ys, xs):
    batch = image.repeat(len(ys), 1, 1, 1)
    for item, (y, x) in enumerate(zip(ys, xs)):
        batch[item, :, y : y + 8, x : x + 8] = 100.0
    return batch


def test_bounding_window_is_union_and_clamped():
    first = Window(np.array([0, 10, 50]), 5)
    second = Window(np.array([2, 4, 58]), 6)
    union = bounding_window([first, second], 64)
    assert union.length == 14  # 4..18 -> 14 cells for the second position
    for i in range(3):
        for window in (first, second):
            assert union.start[i] <= window.start[i]
            assert window.stop[i] <= union.start[i] + union.length
    assert np.all(union.start + union.length <= 64)


def test_ceil_div_negative():
    assert ceil_div(-5, 2) == -2 and ceil_div(5, 2) == 3
    assert list(ceil_div(np.array([-3, 0, 3]), 3)) == [-1, 0, 1]


def test_window_rejects_empty():
    with pytest.raises(ValueError):
        Window(np.array([0]), 0)


@pytest.mark.parametrize("seed", range(12))
def test_against_real_torch_ops(seed):
    """2-D conv/pool on real tensors: every changed output cell is inside the patch."""
    rng = np.random.default_rng(seed)
    kernel, stride, dilation = (
        int(rng.integers(1, 6)),
        int(rng.integers(1, 4)),
        int(rng.integers(1, 3)),
    )
    pad = int(rng.integers(0, (dilation * (kernel - 1) + 1) // 2 + 1))
    kind = ["conv", "max", "avg"][seed % 3]
    if kind != "conv":
        dilation = dilation if kind == "max" else 1
        pad = min(pad, kernel // 2)
    ceil_mode = kind != "conv" and bool(rng.integers(0, 2))
    size = int(rng.integers(dilation * (kernel - 1) + 1, 33))
    x = torch.randn(1, 2, size, size, dtype=torch.float64)

    def run(t):
        if kind == "conv":
            weight = torch.ones(3, 2, kernel, kernel, dtype=torch.float64)
            return F.conv2d(t, weight, None, stride, pad, dilation)
        if kind == "max":
            return F.max_pool2d(t, kernel, stride, pad, dilation, ceil_mode)
        return F.avg_pool2d(t, kernel, stride, pad, ceil_mode)

    base = run(x)
    op = AxisOp(kernel, stride, dilation, pad, size, base.shape[-1])
    for _ in range(5):
        length = int(rng.integers(1, size + 1))
        y0, x0 = (int(v) for v in rng.integers(0, size - length + 1, size=2))
        changed = x.clone()
        changed[..., y0 : y0 + length, x0 : x0 + length] += 10 + torch.rand(
            1, 2, length, length, dtype=torch.float64
        )
        diff = (run(changed) - base).abs().sum(dim=(0, 1)) > 0
        rows = local_step(op, Window(np.array([y0]), length)).output
        cols = local_step(op, Window(np.array([x0]), length)).output
        inside = torch.zeros_like(diff)
        inside[
            rows.start[0] : rows.start[0] + rows.length, cols.start[0] : cols.start[0] + cols.length
        ] = True
        assert not (diff & ~inside).any()
