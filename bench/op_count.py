"""How many aten operators one occlusion run dispatches, naive against forced incremental.

Every operator an eager run dispatches is a kernel launch (or a host-to-device copy) on a
card and interpreter time on a CPU; the incremental plan should not pay more of them than
naive inference does. A ``TorchDispatchMode`` counts them around ``krypton.explain`` after
a warm-up run, and notes the host-sync operators and ``lift_fresh`` (``torch.tensor`` of
Python data) seen after the first batch, where a plan's indices should all be built.

    python -m bench.op_count [--nets resnet18,vgg16,inception3,r3d_18] [--memory vgg16]

``--memory``: each net's peak memory, naive against forced incremental at batch 128 (a
12 GB memory budget, so neither is capped), each run in a child process of its own: its
peak resident set above the same process's peak after loading the model.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import krypton

# Operators that wait for a card's queue, or turn Python data into a tensor.
HOST_SYNC = frozenset(
    {"_local_scalar_dense", "nonzero", "unique", "_unique2", "masked_select", "repeat_interleave"}
)
FRESH = frozenset({"lift_fresh", "lift_fresh_copy"})
CONVOLUTIONS = frozenset({"conv2d", "conv3d", "convolution", "_convolution"})


def _zeros_like_result(func, args, kwargs) -> torch.Tensor:
    """Zeros shaped and strided as ``func``'s result, from its meta kernel."""

    def meta(value):
        return value.to("meta") if isinstance(value, torch.Tensor) else value

    shaped = func(*[meta(a) for a in args], **{k: meta(v) for k, v in kwargs.items()})
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    result = torch.empty_strided(shaped.shape, shaped.stride(), dtype=shaped.dtype, device=device)
    return result.zero_()


@dataclass
class OpCount(TorchDispatchMode):
    """Counts aten operators by name; ``batches_seen`` is bumped by the progress hook, so
    ``late`` holds what was dispatched after the first batch."""

    counts: collections.Counter = field(default_factory=collections.Counter)
    late: collections.Counter = field(default_factory=collections.Counter)
    batches_seen: int = 0
    # Count convolutions without computing them: each returns zeros of the shape and
    # strides PyTorch's own meta kernel gives. The dispatched operators stay the same
    # (a run's operators never depend on the values: the label is given, the strategy
    # forced), and a count of VGG16's naive run takes seconds instead of a minute.
    skip_convolutions: bool = False

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        if self.batches_seen >= 1:
            self.late[name] += 1
        kwargs = kwargs or {}
        if self.skip_convolutions and name in CONVOLUTIONS:
            return _zeros_like_result(func, args, kwargs)
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def syncs_after_first_batch(self) -> dict[str, int]:
        """Host syncs and fresh tensors dispatched after the first batch had run."""
        return {name: n for name, n in self.late.items() if name in HOST_SYNC | FRESH}


def count_run(
    run: Callable[[Callable[[int, int], None]], object],
    skip_convolutions: bool = False,
    forget: Callable[[], None] | None = None,
) -> OpCount:
    """Count one call of ``run(progress)`` (after a warm-up call, counted by nobody, that
    skips the same arithmetic; then ``forget()``, so the count is a first call's on its
    grid, compiling its indices, not a repeat's)."""
    with OpCount(skip_convolutions=skip_convolutions):
        run(lambda done, total: None)
    if forget is not None:
        forget()
    counter = OpCount(skip_convolutions=skip_convolutions)

    def progress(done: int, total: int) -> None:
        counter.batches_seen += 1

    with counter:
        run(progress)
    return counter


@dataclass(frozen=True)
class Setting:
    """A bench net with its input and region (the issue's: 224², region 80-144, patch 16,
    stride 4, 169 positions; Inception3's the same at the middle of 299²; r3d_18's bench.gpu
    patch (4, 16, 16) and stride (4, 8, 8) over one corner of its 16×112×112 clip, 50
    positions)."""

    name: str
    build: Callable[[], torch.nn.Module]
    shape: tuple[int, ...]
    region: tuple[int, ...] | None
    patch: int | tuple[int, ...]
    stride: int | tuple[int, ...]


def _torchvision(name: str, **kwargs) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import torchvision

        torch.manual_seed(0)
        return getattr(torchvision.models, name)(weights=None, **kwargs).eval()

    return build


def _video(name: str) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import torchvision.models.video as video

        torch.manual_seed(0)
        return getattr(video, name)(weights=None).eval()

    return build


SETTINGS = {
    "resnet18": Setting(
        "resnet18", _torchvision("resnet18"), (3, 224, 224), (80, 80, 144, 144), 16, 4
    ),
    "vgg16": Setting("vgg16", _torchvision("vgg16"), (3, 224, 224), (80, 80, 144, 144), 16, 4),
    "inception3": Setting(
        "inception3",
        _torchvision("inception_v3", aux_logits=False, init_weights=False),
        (3, 299, 299),
        (110, 110, 174, 174),
        16,
        4,
    ),
    "r3d_18": Setting(
        "r3d_18", _video("r3d_18"), (3, 16, 112, 112), (0, 0, 0, 8, 48, 48), (4, 16, 16), (4, 8, 8)
    ),
}


# what each compared run is: (explain's mode, its strategy)
RUNS = {"naive": ("naive", "auto"), "incremental": ("exact", "incremental")}


def _built(setting: Setting) -> tuple[torch.nn.Module, torch.Tensor]:
    """The setting's model and its input (seeded)."""
    model = setting.build()
    torch.manual_seed(1)
    return model, torch.randn(setting.shape)


def _explain(
    setting: Setting,
    explainer: krypton.OcclusionExplainer,
    image: torch.Tensor,
    run: str,
    batch_size: int,
    progress=None,
):
    """One bench run (``run``: a key of RUNS) of the setting, explaining class 0."""
    mode, strategy = RUNS[run]
    return explainer.explain(
        image,
        patch=setting.patch,
        stride=setting.stride,
        mode=mode,
        strategy=strategy,
        region=setting.region,
        batch_size=batch_size,
        label=0,
        progress=progress,
    )


def measure(
    setting: Setting, batch_size: int = 16, skip_convolutions: bool = False
) -> dict[str, OpCount]:
    """Operator counts of naive and forced-incremental exact runs of one setting
    (``skip_convolutions``: see :class:`OpCount`)."""
    model, image = _built(setting)
    explainer = krypton.OcclusionExplainer(model)
    return {
        run: count_run(
            lambda progress, run=run: _explain(
                setting, explainer, image, run, batch_size, progress
            ),
            skip_convolutions,
            forget=explainer.forget_grids,
        )
        for run in RUNS
    }


def _resident_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _ResidentPeak:
    """The process's highest resident set while the block runs, sampled every 2 ms."""

    def __init__(self) -> None:
        self.peak = self.before = 0.0  # set on entering
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.002):
            self.peak = max(self.peak, _resident_mb())

    def __enter__(self) -> _ResidentPeak:
        self.peak = self.before = _resident_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _resident_mb())


def child_peak(name: str, run: str, batch_size: int) -> None:
    """(In a child process) print one run's peak resident MB above the process before it
    (glibc returning every large block at once: MALLOC_MMAP_THRESHOLD_ set by the parent)."""
    setting = SETTINGS[name]
    model, image = _built(setting)
    with _ResidentPeak() as resident:
        heatmap = _explain(setting, krypton.OcclusionExplainer(model), image, run, batch_size)
    batch = heatmap.extra.get("batch_size", batch_size)
    print(json.dumps({"peak_mb": resident.peak - resident.before, "batch": batch}))


def peak_memory(name: str, batch_size: int = 128) -> dict[str, dict]:
    """Peak MB above the loaded model of a naive and a forced-incremental run, each in a
    child process of its own (the bench's own memory does not count)."""
    found = {}
    for run in RUNS:
        out = subprocess.run(
            [sys.executable, "-m", "bench.op_count", "--child", name, run, str(batch_size)],
            capture_output=True,
            text=True,
            check=True,
            env={
                **os.environ,
                "KRYPTON_MEMORY_BUDGET_MB": "12000",  # batch 128 for both
                "MALLOC_MMAP_THRESHOLD_": "131072",  # large blocks back to the system at once
            },
        ).stdout
        found[run] = json.loads(out.strip().splitlines()[-1])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nets", default=",".join(SETTINGS))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--memory", default="", help="nets whose peak memory to measure")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, run, batch = args.child
        child_peak(name, run, int(batch))
        return
    print(
        f"{'net':<12}{'naive ops':>11}{'incremental ops':>17}{'ratio':>8}  "
        "host syncs / lift_fresh after batch 1; most frequent incremental ops"
    )
    for name in args.nets.split(","):
        counts = measure(SETTINGS[name], args.batch_size)
        naive, incremental = counts["naive"], counts["incremental"]
        top = ", ".join(f"{op} {n}" for op, n in incremental.counts.most_common(6))
        syncs = incremental.syncs_after_first_batch() or "none"
        print(
            f"{name:<12}{naive.total:>11,}{incremental.total:>17,}"
            f"{incremental.total / naive.total:>7.1f}x  {syncs}; {top}",
            flush=True,
        )
    for name in filter(None, args.memory.split(",")):
        peaks = peak_memory(name)
        naive, incremental = peaks["naive"], peaks["incremental"]
        print(
            f"{name} peak memory above the loaded model, batch {naive['batch']} naive / "
            f"{incremental['batch']} incremental: naive {naive['peak_mb']:,.0f} MB, incremental "
            f"{incremental['peak_mb']:,.0f} MB "
            f"({incremental['peak_mb'] / max(naive['peak_mb'], 1):.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
