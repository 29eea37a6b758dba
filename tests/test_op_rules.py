"""Property tests for the engine's op rules: for random shapes, channel splits, permutes,
pads and functional spellings, the incremental result equals the full recomputation at
random positions, border offsets included — and the ops really stay incremental."""

import torch
import torch.nn.functional as F
from engine_helpers import assert_incremental_matches
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from krypton.engine import NodeKind

SETTINGS = settings(max_examples=12, deadline=None, derandomize=True)


class ChannelsLastBlock(nn.Module):
    """ConvNeXt's block: NCHW -> NHWC, LayerNorm and Linear over channels, layer scale."""

    def __init__(self, channels: int, transpose: bool):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.dw = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.up = nn.Linear(channels, 2 * channels)
        self.down = nn.Linear(2 * channels, channels)
        self.gamma = nn.Parameter(torch.rand(channels) + 0.5)
        self.transpose = transpose
        self.head = nn.Linear(channels, 4)

    def forward(self, x):
        x = self.stem(x)
        y = self.dw(x)
        if self.transpose:
            y = y.transpose(1, 3).transpose(1, 2)  # NCHW -> NHWC in two swaps
        else:
            y = y.permute(0, 2, 3, 1)
        y = F.gelu(self.up(self.norm(y)))
        y = self.gamma * self.down(y)
        y = F.layer_norm(y, y.shape[-1:])
        x = x + torch.permute(y, (0, 3, 1, 2))
        return self.head(x.mean((2, 3)))


class SplitShuffleNet(nn.Module):
    """Channel split/chunk, getitem, narrow, cat and ShuffleNet's channel shuffle."""

    def __init__(self, channels: int, groups: int, use_chunk: bool):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, stride=2, padding=1)
        self.branch = nn.Conv2d(channels // 2, channels // 2, 3, padding=1)
        self.groups, self.use_chunk = groups, use_chunk
        self.head = nn.Linear(channels + 1, 3)

    def forward(self, x):
        x = F.relu(self.stem(x))
        if self.use_chunk:
            a, b = x.chunk(2, dim=1)
        else:
            a, b = torch.split(x, x.shape[1] // 2, dim=1)
        x = torch.cat([a, F.relu(self.branch(b))], dim=1)
        n, c, h, w = x.size()
        x = x.view(n, self.groups, c // self.groups, h, w).transpose(1, 2).contiguous()
        x = x.view(n, c, h, w)
        first = x[:, :1, :, :]
        rest = x.narrow(1, 1, c - 1)
        x = torch.cat([rest, first.unsqueeze(2)[:, :, 0]], dim=1)
        x = torch.cat([x, x[:, ..., :, :][:, -1:] * 2.0], dim=1)
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class PadNet(nn.Module):
    """F.pad in every mode (negative padding crops) and the pad modules."""

    def __init__(self, pads, mode: str, module_pad: bool):
        super().__init__()
        self.pads, self.mode = pads, mode
        self.conv = nn.Conv2d(3, 6, 3)
        self.zero = nn.ZeroPad2d((1, 0, 2, 1)) if module_pad else nn.Identity()
        self.reflect = nn.ReflectionPad2d(1) if module_pad else nn.Identity()
        self.conv2 = nn.Conv2d(6, 6, 3, stride=2)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        if self.mode == "constant":
            x = F.pad(x, self.pads, mode="constant", value=0.25)
        else:
            x = F.pad(x, self.pads, mode=self.mode)
        x = F.relu(self.conv(x))
        x = self.reflect(self.zero(x))
        x = self.conv2(x)
        return self.head(x.mean((2, 3)))


class FunctionalNet(nn.Module):
    """timm's spellings: F.conv2d, F.batch_norm in eval (BatchNormAct2d), F.max_pool2d."""

    def __init__(self, stride: int, dilation: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 3, 3, 3) * 0.3)
        self.register_buffer("mean", torch.randn(8) * 0.1)
        self.register_buffer("var", torch.rand(8) + 0.5)
        self.scale = nn.Parameter(torch.rand(8) + 0.5)
        self.shift = nn.Parameter(torch.randn(8) * 0.1)
        self.stride, self.dilation = stride, dilation
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        x = F.conv2d(x, self.weight, None, self.stride, self.dilation, self.dilation)
        x = F.batch_norm(x, self.mean, self.var, self.scale, self.shift, False, 0.1, 1e-5)
        x = F.silu(x)
        x = F.max_pool2d(x, 3, 2, 1)
        return self.head(x.mean((2, 3)))


positions = st.lists(
    st.tuples(st.integers(0, 100), st.integers(0, 100)), min_size=1, max_size=5
).map(lambda items: items + [(0, 0), (100, 100), (0, 100), (7, 6)])


def clip(items, height, width, patch):
    return [(min(y, height - patch), min(x, width - patch)) for y, x in items]


def kinds(graph):
    return {step.kind for step in graph.steps}


@SETTINGS
@given(
    channels=st.sampled_from([4, 8]),
    transpose=st.booleans(),
    size=st.integers(17, 30),
    patch=st.integers(1, 7),
    where=positions,
)
def test_channels_last_layer_norm_linear_layer_scale(channels, transpose, size, patch, where):
    torch.manual_seed(channels + size)
    model = ChannelsLastBlock(channels, transpose).eval()
    image = torch.randn(3, size, size + 2)
    graph = assert_incremental_matches(model, image, patch, clip(where, size, size + 2, patch))
    first, share = graph.first_global()
    assert share > 0.99 and first.startswith("mean"), first  # only the head is global


@SETTINGS
@given(
    groups=st.sampled_from([2, 4]),
    use_chunk=st.booleans(),
    size=st.integers(16, 28),
    patch=st.integers(2, 6),
    where=positions,
)
def test_channel_split_cat_shuffle_narrow_getitem(groups, use_chunk, size, patch, where):
    torch.manual_seed(groups + size)
    model = SplitShuffleNet(8, groups, use_chunk).eval()
    image = torch.randn(3, size, size)
    graph = assert_incremental_matches(model, image, patch, clip(where, size, size, patch))
    assert graph.first_global()[0].startswith("adaptive_avg_pool2d")


@SETTINGS
@given(
    pads=st.tuples(*[st.integers(0, 3)] * 4),
    crop=st.booleans(),
    mode=st.sampled_from(["constant", "reflect", "replicate", "circular"]),
    module_pad=st.booleans(),
    size=st.integers(14, 24),
    patch=st.integers(1, 5),
    where=positions,
)
def test_padding_every_mode(pads, crop, mode, module_pad, size, patch, where):
    torch.manual_seed(size)
    if crop and mode == "constant":
        pads = (pads[0], -1, -2, pads[3])  # negative padding removes border cells
    model = PadNet(pads, mode, module_pad).eval()
    image = torch.randn(3, size, size + 1)
    graph = assert_incremental_matches(model, image, patch, clip(where, size, size + 1, patch))
    assert NodeKind.REMAP in kinds(graph)
    assert graph.first_global()[0].startswith("mean")


@SETTINGS
@given(
    stride=st.integers(1, 2),
    dilation=st.integers(1, 2),
    size=st.integers(16, 26),
    patch=st.integers(1, 6),
    where=positions,
)
def test_functional_conv_batch_norm_pool(stride, dilation, size, patch, where):
    torch.manual_seed(size)
    model = FunctionalNet(stride, dilation).eval()
    image = torch.randn(3, size, size)
    graph = assert_incremental_matches(model, image, patch, clip(where, size, size, patch))
    assert graph.first_global()[0].startswith("mean")
    assert graph.first_global()[1] > 0.99


def test_spatial_mixing_ops_stay_global():
    """Ops that mix cells are global however they are spelt: normalising over the
    spatial dims, a linear over the width, flattening H and W together."""

    class Mixing(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.over_width = nn.Linear(12, 12)

        def forward(self, x):
            x = self.conv(x)
            a = F.layer_norm(x, x.shape[-2:])  # over H and W: global
            b = self.over_width(x)  # over W: global
            n = x.shape[0]
            c = x.reshape(n, 4, 144)[..., :12].reshape(n, 4, 1, 12)  # merges H and W
            return (a + b + c).mean((2, 3))

    model = Mixing().eval()
    graph = assert_incremental_matches(model, torch.randn(3, 12, 12), 3, [(0, 0), (9, 4)])
    by_name = {step.node.name: step.kind for step in graph.steps}
    assert by_name["layer_norm"] == NodeKind.GLOBAL
    assert by_name["over_width"] == NodeKind.GLOBAL
    assert by_name["reshape"] == NodeKind.GLOBAL
