"""Incremental CNN inference over a torch.fx graph (paper §3, Algorithm 1; thesis §7.2).

The package follows the engine's seams:

* :mod:`.classify` — what each op does to the spatial dimensions (:class:`NodeKind`, the
  rule table a newcomer extends);
* :mod:`.ops` — geometry of convolution / pooling / padding ops;
* :mod:`.plan` — patch propagation over all positions, MAC costs, the incremental-or-naive
  planner;
* :mod:`.views` — materialisation of the unoccluded image's views (an fx.Interpreter);
* :mod:`.run` — batched execution of a slice of positions;
* :mod:`.kernels` — the vectorised gather/scatter primitives;
* :mod:`.graph` — :class:`IncrementalGraph`, which ties them together.
"""

from .classify import NodeKind, Step
from .graph import IncrementalGraph, UnsupportedModelError
from .kernels import Patched, scatter_full
from .plan import ExecutionPlan, PatchGeometry
from .views import MaterializedViews

__all__ = [
    "ExecutionPlan",
    "IncrementalGraph",
    "MaterializedViews",
    "NodeKind",
    "PatchGeometry",
    "Patched",
    "Step",
    "UnsupportedModelError",
    "scatter_full",
]
