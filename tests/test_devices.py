"""Where and at what precision runs compute: the device setting (library, CLI, batch,
worker, app), the precision a run holds (TF32 off for fp32, autocast for bf16/fp16, the
caller's flags restored), the device clock every timing goes through, and the memory
budget on a card. The card itself is exercised by the cuda-marked tests at the end (and
``make bench-gpu``); everything else runs here on the CPU."""

import threading
import time

import numpy as np
import pytest
import torch
import torchvision

import krypton
from krypton import devices
from krypton._fingerprint import CARD_SHARE, memory_budget_bytes
from krypton.engine.clock import DeviceClock

ROOT_RETINA = "assets/samples/retina.jpg"
torch.manual_seed(0)
MODEL = torchvision.models.resnet18(num_classes=5).eval()
IMAGE = torch.randn(3, 64, 64)
HAS_CUDA = torch.cuda.is_available()


# -- the device setting -----------------------------------------------------------------------
def test_auto_is_the_card_when_there_is_one_else_the_cpu(monkeypatch):
    monkeypatch.delenv("KRYPTON_DEVICE", raising=False)
    assert devices.resolve_device().type == ("cuda" if HAS_CUDA else "cpu")
    assert devices.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setenv("KRYPTON_DEVICE", "cpu")
    assert devices.resolve_device() == torch.device("cpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a host without a card")
def test_a_card_that_is_not_there_is_refused_with_a_message(monkeypatch):
    with pytest.raises(ValueError, match="PyTorch sees no CUDA device"):
        devices.resolve_device("cuda")
    with pytest.raises(ValueError, match="auto, cpu, cuda or cuda:N"):
        devices.resolve_device("tpu")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a host without a card")
def test_cli_and_app_refuse_a_missing_card_at_once(cli_here, monkeypatch):
    result = cli_here("explain", ROOT_RETINA, "--device", "cuda", "--out", "x.png")
    assert result.returncode != 0 and "PyTorch sees no CUDA device" in result.stderr
    from webapp.settings import ServerSettings, SettingsError

    monkeypatch.setenv("KRYPTON_DEVICE", "cuda")
    with pytest.raises(SettingsError, match="KRYPTON_DEVICE"):
        ServerSettings.from_environment()


def test_cli_says_the_device_and_precision_that_ran(cli_here, tmp_path):
    out = tmp_path / "h.png"
    result = cli_here(
        "explain", ROOT_RETINA, "--device", "cpu", "--precision", "bf16", "--stride", "16",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "(on cpu, bf16)" in result.stdout


def test_the_app_loads_models_on_its_device(monkeypatch, tmp_path):
    from webapp.services import Services
    from webapp.settings import ServerSettings

    monkeypatch.setenv("KRYPTON_DEVICE", "cpu")
    services = Services(settings=ServerSettings.from_environment(), cache_dir=tmp_path)
    loaded = services._load("fundus-demo")
    assert next(loaded.module.parameters()).device.type == "cpu"


# -- precision ---------------------------------------------------------------------------------
def test_fp32_switches_tf32_off_inside_and_restores_the_callers_flags():
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    before = (cudnn.allow_tf32, matmul.allow_tf32)
    try:
        cudnn.allow_tf32, matmul.allow_tf32 = True, True
        with devices.run_precision(torch.device("cpu"), "fp32"):
            assert (cudnn.allow_tf32, matmul.allow_tf32) == (False, False)
        assert (cudnn.allow_tf32, matmul.allow_tf32) == (True, True)
        cudnn.allow_tf32, matmul.allow_tf32 = False, False
        with devices.run_precision(torch.device("cpu"), "tf32"):
            assert (cudnn.allow_tf32, matmul.allow_tf32) == (True, True)
        assert (cudnn.allow_tf32, matmul.allow_tf32) == (False, False)
        with pytest.raises(RuntimeError), devices.run_precision(torch.device("cpu"), "fp32"):
            raise RuntimeError("a failing run")
        assert (cudnn.allow_tf32, matmul.allow_tf32) == (False, False)
    finally:
        cudnn.allow_tf32, matmul.allow_tf32 = before


def test_a_run_that_needs_other_flags_waits_for_the_card():
    """Two runs at once must not change the flags under each other: a tf32 run waits
    until the fp32 run in progress is done."""
    inside, release = threading.Event(), threading.Event()
    seen = []

    def fp32_run():
        with devices.run_precision(torch.device("cpu"), "fp32"):
            inside.set()
            release.wait(5)
            seen.append(("fp32 ends", torch.backends.cudnn.allow_tf32))

    def tf32_run():
        with devices.run_precision(torch.device("cpu"), "tf32"):
            seen.append(("tf32 starts", torch.backends.cudnn.allow_tf32))

    first = threading.Thread(target=fp32_run)
    first.start()
    inside.wait(5)
    second = threading.Thread(target=tf32_run)
    second.start()
    time.sleep(0.2)
    assert seen == []  # still waiting
    release.set()
    first.join(5)
    second.join(5)
    assert seen == [("fp32 ends", False), ("tf32 starts", True)]


def test_unknown_precisions_are_refused():
    with pytest.raises(ValueError, match="precision must be one of"):
        krypton.explain(MODEL, IMAGE, precision="fp8")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_exact_equals_naive_at_each_precision(precision):
    """Naive and exact both run at the asked precision; exact stays within the tolerance
    documented for it (``devices.EXACT_TOLERANCE``, measured on both CPUs and cards)."""
    options = dict(patch=16, stride=8, precision=precision)
    naive = krypton.explain(MODEL, IMAGE, mode="naive", **options)
    exact = krypton.explain(MODEL, IMAGE, mode="exact", strategy="incremental", **options)
    difference = float(np.abs(exact.values - naive.values).max())
    assert difference <= devices.EXACT_TOLERANCE[precision], difference
    for heatmap in (naive, exact):
        assert heatmap.extra["precision"] == precision and heatmap.extra["device"] == "cpu"
        assert heatmap.extra["plan"].endswith(f"(on cpu, {precision})")
    if precision != "fp32":  # a lower precision is a different computation
        reference = krypton.explain(MODEL, IMAGE, mode="naive", patch=16, stride=8)
        assert float(np.abs(naive.values - reference.values).max()) > 0


# -- the clock ---------------------------------------------------------------------------------
def test_every_planner_timing_waits_for_the_device_and_a_card_warms_up_first():
    """On a card a timing must wait for the queued kernels (the planner once read
    launch times as work); the first run of each kind there is an untimed warm-up. Here a
    CPU clock stands in for a card's, with its synchronise counted."""
    waits = []
    explainer = krypton.OcclusionExplainer(torchvision.models.resnet18(num_classes=5).eval())
    explainer.clock = DeviceClock(
        torch.device("cpu"), synchronize=lambda: waits.append(1), warm_up=True
    )
    image = torch.randn(3, 96, 96)
    heatmap = explainer.explain(image, patch=16, stride=8, batch_size=16)
    assert "measured in this call" in heatmap.extra["plan"]
    assert len(waits) >= 6  # the run, the first batch, the naive probe: each start and end
    warmed = explainer.clock._warm
    assert {kind[0] for kind in warmed} >= {"incremental", "naive"}
    assert DeviceClock(torch.device("cpu")).warm_up is False


def test_the_clock_waits_for_queued_work_before_reading():
    order = []
    clock = DeviceClock(torch.device("cpu"), synchronize=lambda: order.append("sync"))
    began = clock.now()
    order.append("read")
    assert clock.now() >= began and order == ["sync", "read", "sync"]
    assert clock.cold("x") is False  # no warm-up on the CPU


class QueueEvent:
    """A card's timing event, for a CPU test: records into one log what the run marks
    and waits for."""

    log: list = []

    def __init__(self):
        self.number = sum(1 for entry in QueueEvent.log if entry[0] == "mark")

    def record(self):
        self.time = time.perf_counter()
        QueueEvent.log.append(("mark", self.number))

    def synchronize(self):
        QueueEvent.log.append(("wait", self.number))

    def elapsed_time(self, end):
        return (end.time - self.time) * 1e3


CORNERS = [(x, y) for y in range(0, 49, 8) for x in range(0, 49, 8)]


def queued_run(batches: int, **options):
    """An explain() call on an explainer whose clock queues work as a card's does."""
    QueueEvent.log = []
    waits = []
    explainer = krypton.OcclusionExplainer(MODEL)
    explainer.clock = DeviceClock(
        torch.device("cpu"), synchronize=lambda: waits.append(1), event=QueueEvent
    )
    assert explainer.clock.queued
    heatmap = explainer.explain(
        IMAGE, patch=16, stride=8, positions=CORNERS[: 4 * batches], batch_size=4,
        progress=lambda done, total: QueueEvent.log.append(("progress", done)), **options,
    )  # fmt: skip
    return heatmap, len(waits), list(QueueEvent.log)


@pytest.mark.parametrize("strategy", ["incremental", "naive"])
def test_a_cards_batches_are_queued_one_ahead_and_settled_in_order(strategy):
    """On a card the host launched a batch, then waited for it (a synchronise and a
    read-back per batch), so the card idled while the host prepared the next: a card's
    run now queues batch k+1 before it waits for batch k's end mark, never drains the
    whole queue per batch, and reports progress only for batches that have finished.
    The values are those of a run that waits for every batch."""
    few, few_waits, _ = queued_run(2, strategy=strategy)
    many, many_waits, log = queued_run(6, strategy=strategy)
    assert few_waits == many_waits  # no full synchronise per batch
    reference = krypton.OcclusionExplainer(MODEL).explain(
        IMAGE, patch=16, stride=8, positions=CORNERS[:24], batch_size=4, strategy=strategy
    )
    assert np.array_equal(many.values, reference.values, equal_nan=True)
    marks = [entry[1] for entry in log if entry[0] == "mark"]
    ends = marks[1:]  # the run's start, then each batch's end (where the next begins)
    assert len(ends) == 6
    for k, end in enumerate(ends):
        waited = log.index(("wait", end))
        later = [m for m in ends if m > end]
        if later:  # batch k+1 was queued before the host waited for batch k
            assert log.index(("mark", later[0])) < waited
        assert log.index(("progress", 4 * (k + 1))) > waited  # reported once finished


def test_on_a_card_the_planner_times_incremental_as_a_run_goes_pipelined():
    """A lone batch, launched then waited for, reads slower than a pipelined run goes:
    on a card the first timing runs two batches queued one ahead and takes the second's
    pace, and naive's probe is a whole batch. Every position is computed once by the
    chosen strategy and reported once."""
    QueueEvent.log = []
    explainer = krypton.OcclusionExplainer(MODEL)
    explainer.clock = DeviceClock(torch.device("cpu"), synchronize=lambda: None, event=QueueEvent)
    reported = []
    image = torch.randn(3, 96, 96)
    options = dict(patch=16, stride=16, batch_size=4)
    heatmap = explainer.explain(image, progress=lambda done, _: reported.append(done), **options)
    plan = heatmap.extra["plan"]
    assert "measured in this call" in plan, plan
    reference = krypton.OcclusionExplainer(MODEL).explain(image, **options)
    difference = np.nanmax(np.abs(heatmap.values - reference.values))
    assert difference <= devices.EXACT_TOLERANCE["fp32"]
    assert reported == sorted(reported) and reported[-1] == heatmap.values.size == 36


# -- memory on a card --------------------------------------------------------------------------
def test_a_cards_budget_is_a_share_of_its_free_memory(monkeypatch):
    monkeypatch.delenv("KRYPTON_MEMORY_BUDGET_MB", raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**30, 80 * 2**30))
    assert memory_budget_bytes(torch.device("cuda")) == int(8 * 2**30 * CARD_SHARE)
    assert memory_budget_bytes(torch.device("cpu")) == 2048 * 2**20
    monkeypatch.setenv("KRYPTON_MEMORY_BUDGET_MB", "100")
    assert memory_budget_bytes(torch.device("cuda")) == 100 * 2**20


# -- on a card (skipped without one; make bench-gpu measures the matrix) ----------------------
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_the_card_exact_equals_naive_at_its_precision(precision):
    model = torchvision.models.resnet18(num_classes=5).eval().cuda()
    image = torch.randn(3, 112, 112, device="cuda")
    options = dict(patch=16, stride=8, precision=precision)
    naive = krypton.explain(model, image, mode="naive", **options)
    exact = krypton.explain(model, image, mode="exact", strategy="incremental", **options)
    assert float(np.abs(exact.values - naive.values).max()) <= devices.EXACT_TOLERANCE[precision]
    assert exact.extra["device"].startswith("cuda")


@pytest.mark.cuda
@needs_cuda
def test_on_the_card_the_planner_times_with_the_card_synchronised():
    model = torchvision.models.vgg11(num_classes=5).eval().cuda()
    explainer = krypton.OcclusionExplainer(model)
    heatmap = explainer.explain(torch.randn(3, 112, 112, device="cuda"), patch=16, stride=4)
    assert explainer.clock.warm_up and explainer.clock._warm
    assert "(on cuda:" in heatmap.extra["plan"]


@pytest.mark.cuda
@needs_cuda
def test_cli_explain_and_batch_run_on_the_card(cli_here, tmp_path):
    result = cli_here(
        "explain", ROOT_RETINA, "--device", "cuda", "--stride", "16", "--out",
        str(tmp_path / "h.png"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "(on cuda:" in result.stdout
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(open(ROOT_RETINA, "rb").read())
    result = cli_here(
        "batch", str(folder), "--out", str(tmp_path / "out"), "--device", "cuda",
        "--stride", "16",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "(on cuda:" in (tmp_path / "out" / "summary.csv").read_text()


@pytest.mark.cuda
@needs_cuda
def test_the_app_runs_on_the_card(monkeypatch, tmp_path):
    from webapp.services import Services
    from webapp.settings import ServerSettings

    monkeypatch.setenv("KRYPTON_DEVICE", "cuda")
    services = Services(settings=ServerSettings.from_environment(), cache_dir=tmp_path)
    loaded = services._load("fundus-demo")
    assert next(loaded.module.parameters()).device.type == "cuda"
