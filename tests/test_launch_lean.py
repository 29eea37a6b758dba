"""Incremental inference dispatches no more operators than naive inference can justify.

Every aten operator an eager run dispatches is a kernel launch on a card and interpreter
time on a CPU. A ``TorchDispatchMode`` counts them around ``krypton.explain`` at
bench.op_count's settings (the bench nets at their bench regions, CPU batch 16):
forced incremental inference may dispatch at most twice naive's operators over the whole
run, compilation of its indices included, and after the first batch no operator that
waits for the host (``.item()``, ``nonzero``, ...) nor any tensor built from Python data.
Each count follows an uncounted warm-up call, so capture is not counted; the counted runs
are whole runs. They skip the convolutions' arithmetic
(``OpCount.skip_convolutions``: zeros of the meta kernel's shape and strides; a run's
operators do not depend on values — the label is given, the strategy forced — and a
test here checks the counts are the same both ways), which keeps the four nets
inside a minute of the suite.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.op_count import SETTINGS, OpCount, measure

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.mark.parametrize("name", ["resnet18", "vgg16", "inception3", "r3d_18"])
def test_forced_incremental_dispatches_at_most_twice_naives_operators(name: str) -> None:
    counts = measure(SETTINGS[name], skip_convolutions=True)
    naive, incremental = counts["naive"], counts["incremental"]
    assert incremental.batches_seen >= 3  # several batches: compilation is not the run
    assert incremental.total <= 2 * naive.total, (
        f"{name}: {incremental.total} operators incremental against {naive.total} naive; "
        f"most frequent {incremental.counts.most_common(8)}"
    )
    assert incremental.syncs_after_first_batch() == {}


def test_skipping_the_convolutions_arithmetic_dispatches_the_same_operators() -> None:
    # ResNet18 on two batches (25 positions): what is compared is each operator's count
    setting = dataclasses.replace(SETTINGS["resnet18"], region=(80, 80, 112, 112))
    real, skipped = measure(setting), measure(setting, skip_convolutions=True)
    for mode in ("naive", "incremental"):
        assert skipped[mode].counts == real[mode].counts and real[mode].counts["conv2d"] > 0


def test_the_counter_sees_host_syncs_and_fresh_tensors_after_the_first_batch() -> None:
    """The counter itself can fail: an .item() and a torch.tensor() after the first
    batch are reported, and the same before it are not."""
    counter = OpCount()
    with counter:
        torch.ones(2).sum().item()
        counter.batches_seen = 1
        torch.tensor([1, 2])
        torch.ones(3).nonzero()
    late = counter.syncs_after_first_batch()
    assert late.get("lift_fresh") == 1 and late.get("nonzero") == 1
    assert "_local_scalar_dense" not in late
    assert counter.counts["_local_scalar_dense"] == 1


def test_a_grid_compiles_its_indices_once_across_calls_and_parts(monkeypatch) -> None:
    """Compiling a grid's indices took 0.1 s for ResNet18's 2,809 positions — a third of a
    whole naive run on one H200 — and every call compiled again, the planned run twice
    (its timed first batch and the rest were separate geometries). Now a graph keeps its
    latest grids with their indices: a planned run compiles once, a repeat not at all,
    with the same values."""
    import torchvision

    import krypton
    from krypton.engine import run as engine_run

    compiled = []
    original = engine_run.compile_batches

    def counting(*args, **kwargs):
        compiled.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(engine_run, "compile_batches", counting)
    torch.manual_seed(0)
    explainer = krypton.OcclusionExplainer(torchvision.models.resnet18(num_classes=5).eval())
    image = torch.randn(3, 96, 96)
    options = dict(patch=16, stride=8, batch_size=16)
    planned = explainer.explain(image, **options)
    assert "measured in this call" in planned.extra["plan"]
    assert len(compiled) == 1, "the planned run compiled its grid more than once"
    again = explainer.explain(image, strategy="incremental", **options)
    assert len(compiled) == 1, "a repeat on the same grid compiled again"
    assert (abs(again.values - planned.values) <= 1e-5).all()
    explainer.forget_grids()
    explainer.explain(image, strategy="incremental", **options)
    assert len(compiled) == 2


def test_two_runs_on_one_model_share_the_kept_grids_safely() -> None:
    """Two runs on one model (two tabs) read and trim a graph's kept grids at once: a run
    that found its grid could see another run evict it before it marked it recent
    (KeyError). Here one run is held right after finding its grid while another keeps
    two new ones; it must still get its geometry."""
    import collections
    import threading

    import numpy as np
    import torchvision

    import krypton

    torch.manual_seed(0)
    explainer = krypton.OcclusionExplainer(torchvision.models.resnet18(num_classes=3).eval())
    graph = explainer.captured_graph(torch.randn(3, 64, 64))
    grids = [(np.array([0, 4 * k]), np.array([0, 8])) for k in (1, 2, 3)]
    graph.geometry(grids[0], (8, 8))
    inside, proceed = threading.Event(), threading.Event()

    class Held(collections.OrderedDict):
        armed = True

        def get(self, key, default=None):
            found = super().get(key, default)
            if found is not None and Held.armed:
                Held.armed = False
                inside.set()
                proceed.wait(5)
            return found

    graph._geometries = Held(graph._geometries)
    results, errors = [], []

    def run(*wanted) -> None:
        try:
            results.extend(graph.geometry(grid, (8, 8)) for grid in wanted)
        except Exception as exc:  # the failure this test looks for
            errors.append(exc)

    first = threading.Thread(target=run, args=(grids[0],))
    first.start()
    assert inside.wait(5)
    other = threading.Thread(target=run, args=(grids[1], grids[2]))
    other.start()
    other.join(1.0)  # without a lock it evicts the first grid now
    proceed.set()
    first.join(5)
    other.join(5)
    assert errors == [] and len(results) == 3
