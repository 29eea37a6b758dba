"""What planning (plan.py) and execution (run.py) read of a captured model, as a
protocol: the classified steps in execution order and the facts kept per node. The
captured graph (graph.IncrementalGraph) provides it; plan and run depend on this
description only, so neither imports the graph that calls them."""

from __future__ import annotations

from typing import Protocol

import torch.fx as fx

from .classify import Step

__all__ = ["Program"]


class Program(Protocol):
    """A captured model as the planner and the executor see it."""

    steps: list[Step]  # classified ops in execution order
    shapes: dict[fx.Node, tuple[int, ...]]  # each node's output shape (batch of one)
    last_use: dict[fx.Node, int]  # index of the last step reading each node's value

    def first_global(self) -> tuple[str | None, float]:
        """(name of the first image-dependent global op, share of MACs before it)."""
        ...

    def dims_of(self, node: fx.Node) -> tuple[int, ...]:
        """Where the spatial axes are in ``node``'s tensor."""
        ...
