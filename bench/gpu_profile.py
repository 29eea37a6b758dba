"""Where exact mode's time goes on a GPU (run on a CUDA host; it says so and stops without
one): for each network, whole-image runs at patch 16, stride 4 in fp32 (TF32 off), timed
with ``torch.cuda.synchronize`` around each — naive, exact as planned, exact forced
incremental — with peak GPU memory and max |exact - naive|; then ``torch.profiler`` over
one forced-incremental and one naive run of a 64-pixel region, its operators sorted by
GPU time and by CPU time (kernel launches), written to ``--out``.

    python -m bench.gpu_profile --out DIR [--nets vgg16,resnet18]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torchvision

import krypton

PATCH, STRIDE = 16, 4


def timed(call) -> tuple[float, object, int]:
    """(seconds, result, peak bytes) of ``call`` with the GPU synchronised around it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    result = call()
    torch.cuda.synchronize()
    return time.perf_counter() - started, result, torch.cuda.max_memory_allocated()


def build(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name in ("r3d_18", "mc3_18"):
        model = getattr(torchvision.models.video, name)(weights=None)
        image = torch.randn(3, 16, 112, 112)
    else:
        model = torchvision.models.get_model(name, weights=None)
        side = 299 if name == "inception_v3" else 224
        image = torch.randn(3, side, side)
    return model.eval().cuda(), image.cuda()


def explain(model, image, **options):
    if image.dim() == 4:  # a clip: (C, T, H, W), a cube per axis
        options.update(patch=(4, PATCH, PATCH), stride=(4, 8, 8))
    else:
        options.update(patch=PATCH, stride=STRIDE)
    return krypton.explain(model, image, **options)


def matrix(name: str) -> str:
    model, image = build(name)
    explain(model, image, mode="naive")  # warm-up: cuDNN's algorithm search, first calls
    explain(model, image, mode="exact", strategy="incremental")
    naive_s, naive, naive_peak = timed(lambda: explain(model, image, mode="naive"))
    auto_s, auto, _ = timed(lambda: explain(model, image, mode="exact"))
    incremental_s, incremental, incremental_peak = timed(
        lambda: explain(model, image, mode="exact", strategy="incremental")
    )
    difference = float((incremental.values - naive.values).__abs__().max())
    positions = naive.values.size
    plan = str(auto.extra.get("plan", "")).split(":")[0]  # what exact mode ran
    return (
        f"| {name} | {positions} | {naive_s:.2f} s | {naive_s / auto_s:.2f}x ({plan}) | "
        f"{naive_s / incremental_s:.2f}x | {naive_peak / 2**20:,.0f} / "
        f"{incremental_peak / 2**20:,.0f} MB | {difference:.1e} |"
    )


def profile(name: str, out: Path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    model, image = build(name)
    region = (0, 0, 64, 64) if image.dim() == 3 else None
    for mode, strategy in (("exact", "incremental"), ("naive", "auto")):
        explain(model, image, mode=mode, strategy=strategy, region=region)  # warm
        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            explain(model, image, mode=mode, strategy=strategy, region=region)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        text = (
            f"# {name} {mode} ({strategy}), region {region}\n\n## by GPU time\n"
            + averages.table(sort_by="cuda_time_total", row_limit=30)
            + "\n\n## by CPU time\n"
            + averages.table(sort_by="cpu_time_total", row_limit=30)
        )
        (out / f"profile-{name}-{mode}.txt").write_text(text)
        kernels = sum(e.count for e in averages if e.device_type.name == "CUDA")
        print(f"{name} {mode}: {kernels} GPU kernel launches for the region", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--nets", default="vgg16,resnet18,inception_v3,resnet50,r3d_18,mc3_18")
    parser.add_argument("--profile", default="vgg16,resnet18")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: bench.gpu_profile needs one")
        raise SystemExit(0)
    torch.backends.cudnn.allow_tf32 = False  # fp32 both ways: exact is compared with naive
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = True
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}, fp32 (TF32 off)")
    print("| net | positions | naive | exact as planned | forced incremental | peak naive / "
          "incremental | max abs diff |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for name in args.nets.split(","):
        print(matrix(name), flush=True)
    for name in args.profile.split(","):
        profile(name, args.out)


if __name__ == "__main__":
    main()
