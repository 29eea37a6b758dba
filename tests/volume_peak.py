"""Peak memory of one 3-D explain() call, in a fresh process (tests/test_volumes.py runs
it): python tests/volume_peak.py exact|naive, with KRYPTON_MEMORY_BUDGET_MB set.

Prints the peak resident memory above the process's memory after one unoccluded
inference (so torch's libraries and the model's weights are not counted), the batch
size the budget allowed and the materialised views' size."""

import json
import resource
import sys

import torch

import krypton


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM). Not getrusage's ru_maxrss: that
    survives execve, so under a pytest worker it started at the worker's own 1 GB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    """Start the peak over from the current resident memory (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


mode = sys.argv[1]
torch.set_num_threads(1)
torch.manual_seed(0)
from monai.networks.nets import resnet10  # noqa: E402

model = resnet10(spatial_dims=3, n_input_channels=1, num_classes=2).eval()
volume = torch.rand(1, 48, 48, 48)
with torch.inference_mode():
    model(volume[None])  # the allocator's first inference, before the baseline
baseline = rss_bytes()
reset_peak()
forced = {"strategy": "incremental"} if mode == "exact" else {}
heatmap = krypton.explain(model, volume, patch=12, stride=12, mode=mode, batch_size=64, **forced)
peak = peak_rss_bytes()
result = {
    "extra_peak": peak - baseline,
    "batch_size": heatmap.extra["batch_size"],
    "views_mb": heatmap.extra["views_mb"],
    "positions": heatmap.positions_evaluated,
}
print(json.dumps(result))
