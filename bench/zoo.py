"""The benchmarks' models by name: "tv:NAME" (torchvision) or "timm:NAME", random
weights (seed 0), in eval mode."""

from __future__ import annotations

import torch


def build(name: str) -> torch.nn.Module:
    source, arch = name.split(":")
    torch.manual_seed(0)
    if source == "tv":
        import torchvision

        kwargs = (
            {"aux_logits": False, "init_weights": True}
            if arch in ("inception_v3", "googlenet")
            else {}
        )
        return getattr(torchvision.models, arch)(weights=None, **kwargs).eval()
    import timm

    return timm.create_model(arch, pretrained=False).eval()
