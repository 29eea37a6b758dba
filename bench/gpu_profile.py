"""Where exact mode's time goes on a GPU (run on a CUDA host; it says so and stops without
one): ``torch.profiler`` over one forced-incremental and one naive run of a 64-pixel
region per network (bench.gpu's nets and settings, fp32), its operators sorted by GPU
time and by CPU time (kernel launches), written to ``--out``. The timing matrix is
``make bench-gpu`` (bench/gpu.py).

    python -m bench.gpu_profile --out DIR [--profile vgg16,resnet18]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.gpu import build, run  # the matrix's nets and settings


def profile(name: str, out: Path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    built = build(name)
    if built is None:
        print(f"{name}: not installed here")
        return
    model, image = built
    region = (0, 0, 64, 64) if image.dim() == 3 else None
    for mode, strategy in (("exact", "incremental"), ("naive", "auto")):
        run(model, image, "fp32", mode=mode, strategy=strategy, region=region)  # warm
        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(model, image, "fp32", mode=mode, strategy=strategy, region=region)
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
    parser.add_argument("--profile", default="vgg16,resnet18")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: bench.gpu_profile needs one")
        raise SystemExit(0)
    torch.backends.cudnn.benchmark = True
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}, fp32 (TF32 off)")
    for name in args.profile.split(","):
        profile(name, args.out)


if __name__ == "__main__":
    main()
