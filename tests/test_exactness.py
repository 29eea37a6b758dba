"""Exact (incremental) equals naive (full re-inference) within 1e-4, everywhere."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

import krypton
from krypton.engine import IncrementalGraph, NodeKind

GLOBAL, LOCAL = NodeKind.GLOBAL, NodeKind.LOCAL

TOLERANCE = 1e-4


def assert_same_heatmap(model, image, **kwargs):
    naive = krypton.explain(model, image, mode="naive", **kwargs)
    exact = krypton.explain(model, image, mode="exact", strategy="incremental", **kwargs)
    assert naive.values.shape == exact.values.shape
    assert np.array_equal(np.isnan(naive.values), np.isnan(exact.values))
    np.testing.assert_allclose(exact.values, naive.values, atol=TOLERANCE, rtol=0)
    assert exact.label == naive.label and abs(exact.prob - naive.prob) < TOLERANCE
    assert_same_logits(
        model, image, kwargs.get("patch", 16), kwargs.get("fill", 0.0), naive.position_values()
    )
    return naive, exact


def assert_same_logits(model, image, patch, fill, position_values):
    """Stronger than probabilities (an untrained net's softmax can be flat): every logit
    of every occluded image, relative to the logits' scale, and the occlusion must move
    them measurably or the comparison would prove nothing."""
    explainer = krypton.OcclusionExplainer(model)
    xs = np.array([x for x, _, _ in position_values])
    ys = np.array([y for _, y, _ in position_values])
    with torch.inference_mode():
        graph, views = explainer.views_for(image)
        geometry = graph.geometry((ys, xs), (patch, patch))
        occluder = (
            torch.as_tensor(fill, dtype=image.dtype)
            .reshape(-1, 1, 1)
            .expand(image.shape[0], patch, patch)
            .contiguous()
        )
        incremental = graph.run_batch(views, geometry, slice(0, len(xs)), occluder)
        full = model(explainer._occluded_batch(image, occluder, np.stack([ys, xs], axis=1)))
    scale = float(full.abs().max())
    assert float((full - views.logits).abs().max()) > 1e-4 * scale, "occlusion changed nothing"
    torch.testing.assert_close(incremental, full, rtol=0, atol=1e-5 * scale + 1e-6)


def border_and_centre_positions(height, width, patch):
    xs = [0, (width - patch) // 2, width - patch, 1, width - patch - 3]
    ys = [0, (height - patch) // 2, height - patch, height - patch - 1, 2]
    return list(zip(xs, ys)) + [(xs[1], 0), (0, ys[1]), (width - patch, 0)]


def torchvision_model(name, **kwargs):
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None, **kwargs).eval()


@pytest.mark.parametrize(
    "name, size, patch",
    [
        ("vgg16", (224, 224), 16),
        ("resnet18", (224, 224), 16),
        ("resnet18", (97, 131), 9),  # odd image size and patch
        ("inception_v3", (299, 299), 16),
        ("densenet121", (96, 96), 8),
        ("mobilenet_v2", (123, 97), 11),
        ("efficientnet_b0", (112, 112), 16),
    ],
)
def test_torchvision_architectures(name, size, patch):
    # torchvision's own init: with PyTorch's default one Inception3's activations vanish
    # and occlusion would change nothing, making the comparison vacuous.
    kwargs = {"aux_logits": False, "init_weights": True} if name == "inception_v3" else {}
    model = torchvision_model(name, **kwargs)
    torch.manual_seed(1)
    image = torch.randn(3, *size)
    naive, exact = assert_same_heatmap(
        model,
        image,
        patch=patch,
        positions=border_and_centre_positions(size[0], size[1], patch),
        batch_size=3,
    )
    assert naive.positions_evaluated == exact.positions_evaluated == 8
    assert exact.flops_spent <= exact.flops_naive


def test_inception_with_input_transform_stays_incremental():
    # ImageNet weights enable transform_input: channel indexing, unsqueeze and concat
    # before the first conv must be handled as element-wise, not as global ops.
    model = torchvision_model(
        "inception_v3", aux_logits=False, init_weights=True, transform_input=True
    )
    image = torch.randn(3, 299, 299)
    with torch.inference_mode():
        graph = IncrementalGraph(model, image)
    kinds = [s.kind for s in graph.steps]
    assert GLOBAL not in kinds[:40]
    assert_same_heatmap(model, image, patch=16, positions=[(0, 0), (141, 141), (283, 283)])


def test_region_grid_with_odd_stride_and_channel_fill():
    model = torchvision_model("resnet18")
    image = torch.randn(3, 64, 80)
    naive, exact = assert_same_heatmap(
        model, image, patch=12, stride=7, region=(5, 3, 60, 50), fill=(0.5, -1.0, 2.0), batch_size=4
    )
    assert exact.values.shape == (len(range(3, 50 - 12 + 1, 7)), len(range(5, 60 - 12 + 1, 7)))
    assert list(exact.xs) == list(range(5, 60 - 12 + 1, 7))
    assert not np.isnan(exact.values).any()


class EveryOpNet(nn.Module):
    """Exercises each op class and the awkward geometry cases."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 5, stride=2, padding=2)
        self.bn = nn.BatchNorm2d(8)
        self.pool_ceil = nn.MaxPool2d(3, stride=2, padding=1, ceil_mode=True)
        self.dilated = nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=4)
        self.same = nn.Conv2d(8, 8, 4, padding="same")  # asymmetric implicit padding
        self.skip = nn.Conv2d(8, 8, 1, stride=3)  # stride larger than the kernel
        self.after_skip = nn.Conv2d(8, 8, 3, stride=3, padding=0)
        self.avg = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        self.position = nn.Parameter(torch.randn(1, 16, 1, 1))
        self.spatial_bias = nn.Parameter(torch.randn(1, 8, 1, 1))
        self.reflect = nn.Conv2d(16, 16, 3, padding=1, padding_mode="reflect")
        self.head = nn.Linear(16, 7)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)), inplace=True)
        x = self.pool_ceil(x)
        y = torch.sigmoid(self.dilated(x)) * x + 0.5
        y = F.leaky_relu(self.same(y), 0.1).add_(1.0)
        strided = self.after_skip(self.skip(y))  # stride 3 with a 1x1 kernel skips cells
        z = torch.cat([y, x + self.spatial_bias], dim=1)  # channel concat (eq 20)
        z = F.dropout(z, 0.3, training=False)
        z = self.avg(z) + self.position
        gate = torch.sigmoid(F.adaptive_avg_pool2d(z, 1))  # squeeze-excitation: global
        z = self.reflect(z * gate)
        z = z.view(z.size(0), z.shape[1], -1).mean(-1)
        return self.head(z) + strided.mean() * 0.1


class SkipNet(nn.Module):
    """Residual merges whose branches have different windows, and a spatial static."""

    def __init__(self, size):
        super().__init__()
        self.a = nn.Conv2d(3, 6, 3, padding=1)
        self.b = nn.Conv2d(6, 6, 7, stride=2, padding=3)
        self.down = nn.Conv2d(6, 6, 1, stride=2)
        self.embed = nn.Parameter(torch.randn(1, 6, size // 2, size // 2))
        self.pool = nn.AvgPool2d(2)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        x = F.relu(self.a(x))
        x = self.b(x) + self.down(x) + self.embed
        x = self.pool(F.hardswish(x))
        return self.head(torch.flatten(F.adaptive_max_pool2d(x, 1), 1))


@pytest.mark.parametrize("size", [33, 40])
def test_every_op_class(size):
    torch.manual_seed(size)
    model = EveryOpNet().eval()
    model.bn.running_mean.uniform_(-1, 1)
    model.bn.running_var.uniform_(0.5, 2)
    image = torch.randn(3, size, size + 3)
    with torch.inference_mode():
        graph = IncrementalGraph(model, image)
    kinds = {s.node.name: s.kind for s in graph.steps}
    assert kinds["stem"] == kinds["pool_ceil"] == kinds["dilated"] == kinds["same"] == LOCAL
    assert kinds["skip"] == kinds["after_skip"] == kinds["avg"] == LOCAL
    assert kinds["reflect"] == GLOBAL
    assert_same_heatmap(model, image, patch=5, stride=3, batch_size=7)


def test_merges_with_different_windows_and_spatial_static():
    torch.manual_seed(3)
    model = SkipNet(30).eval()
    image = torch.randn(3, 30, 30)
    assert_same_heatmap(model, image, patch=4, stride=2, batch_size=16)


def test_exact_is_deterministic_across_batch_sizes():
    model = torchvision_model("resnet18")
    image = torch.randn(3, 64, 64)
    first = krypton.explain(model, image, patch=8, stride=8, batch_size=5)
    second = krypton.explain(model, image, patch=8, stride=8, batch_size=64)
    np.testing.assert_allclose(first.values, second.values, atol=1e-6)


def test_views_refresh_when_weights_change():
    model = torchvision_model("resnet18")
    image = torch.randn(3, 64, 64)
    before = krypton.explain(model, image, patch=16, positions=[(0, 0), (24, 24)])
    with torch.no_grad():
        model.fc.weight.mul_(3.0)
        model.layer1[0].conv1.weight.add_(0.1)
    after = krypton.explain(
        model, image, patch=16, positions=[(0, 0), (24, 24)], label=before.label
    )
    naive = krypton.explain(
        model, image, patch=16, positions=[(0, 0), (24, 24)], label=before.label, mode="naive"
    )
    np.testing.assert_allclose(after.values, naive.values, atol=TOLERANCE)
    assert np.nanmax(np.abs(after.values - before.values)) > 1e-3


def test_sparse_positions_give_nan_elsewhere():
    model = torchvision_model("resnet18")
    image = torch.randn(3, 64, 64)
    heatmap = krypton.explain(model, image, patch=8, positions=[(0, 0), (8, 16), (8, 16)])
    assert heatmap.positions_evaluated == 2
    assert list(heatmap.xs) == [0, 8] and list(heatmap.ys) == [0, 16]
    assert np.isnan(heatmap.values[0, 1]) and np.isnan(heatmap.values[1, 0])
    assert {(x, y) for x, y, _ in heatmap.position_values()} == {(0, 0), (8, 16)}


class InPlaceOnInput(nn.Module):
    """In-place activations: one straight on the image (its patch is the occluder itself,
    which later batches read again), one on a fresh convolution output. ELU is not
    idempotent, so an overwritten occluder would change every later batch."""

    def __init__(self):
        super().__init__()
        self.first = nn.ELU(inplace=True)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.second = nn.ELU(inplace=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.second(self.conv(self.first(x)))
        return self.head(x.mean((2, 3)))


def test_in_place_activations_never_overwrite_the_occluder_or_the_views():
    """Activations written in place run in place on a patch nobody else reads (a DenseNet
    run spent 13% of its time allocating ReLU outputs), never on the occluder, a
    per-position patch or a cached view."""
    torch.manual_seed(5)
    model = InPlaceOnInput().eval()
    image = torch.randn(3, 20, 20)
    original = image.clone()
    assert_same_heatmap(model, image, patch=4, stride=2, batch_size=3, fill=-2.0)
    assert torch.equal(image, original)  # the model's first ELU ran on a copy
    explainer = krypton.OcclusionExplainer(model)
    ys, xs = np.array([0, 4, 8, 12, 16]), np.array([16, 0, 8, 4, 12])
    patches = -1.0 - torch.rand(5, 3, 4, 4)
    given = patches.clone()
    with torch.inference_mode():
        graph, views = explainer.views_for(image)
        cached = {
            node: value.clone()
            for node, value in views.values.items()
            if isinstance(value, torch.Tensor)
        }
        exact = explainer.occluded_outputs(image, ys, xs, patches, batch_size=2)
        full = model(_pasted(image, ys, xs, patches))
    assert torch.equal(patches, given)
    torch.testing.assert_close(exact, full, rtol=0, atol=1e-5)
    assert all(torch.equal(views.values[node], value) for node, value in cached.items())
    in_place = [step.node.name for step in graph.steps if step.in_place_call is not None]
    assert len(in_place) == 2, in_place  # both ELUs may run in place where it is safe


def _pasted(image, ys, xs, patches):
    batch = image.unsqueeze(0).repeat(len(ys), 1, 1, 1)
    for index, (y, x) in enumerate(zip(ys, xs)):
        batch[index, :, y : y + patches.shape[2], x : x + patches.shape[3]] = patches[index]
    return batch


class ReadAfterInPlace(nn.Module):
    """Reads a tensor again after an activation overwrote it in place: eager PyTorch
    sees the overwritten values there, in each of the three ways a model can write one."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.ELU(inplace=True)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = self.conv(x)
        if self.how == "module":
            z = self.act(y)
        elif self.how == "function":
            z = F.elu(y, inplace=True)
        else:
            z = y.mul_(2.0)
        return self.head((z * y + y).mean((2, 3)))


@pytest.mark.parametrize("how", ["module", "function", "method"])
def test_a_tensor_read_after_an_in_place_write_reads_the_written_values(how):
    """The engine ran such writes out of place, so exact mode's later readers saw the old
    values: the heatmap was 0.006 off naive's, and the unoccluded probability too (a
    method write was refused instead)."""
    torch.manual_seed(0)
    model = ReadAfterInPlace(how).eval()
    naive, exact = assert_same_heatmap(model, torch.randn(3, 20, 20), patch=4, stride=4)
    assert abs(exact.prob - naive.prob) < 1e-6


class WriteThroughView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        y = self.conv(x)
        y[:, :2].relu_()  # overwrites part of y, which the head then reads
        return self.head(y.mean((2, 3)))


def test_an_in_place_write_through_a_view_read_later_is_refused_not_run_differently():
    torch.manual_seed(0)
    model = WriteThroughView().eval()
    image = torch.randn(3, 20, 20)
    with pytest.raises(krypton.UnsupportedModelError, match="writes a view of 'conv'"):
        krypton.explain(model, image, patch=4, stride=4, mode="exact")
    naive = krypton.explain(model, image, patch=4, stride=4, mode="naive")
    assert np.isfinite(naive.values).all()
