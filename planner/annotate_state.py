"""The tables one run of :func:`planner.annotate.annotate_graph` keeps: per node, per storage, and
the cached results of isolated forward runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["AnnotateStats"]


@dataclass
class AnnotateStats:
    """Counters for reports: how much work the cache saved."""

    nodes: int = 0
    """Nodes interpreted."""
    runs: int = 0
    """Isolated forward runs (cache misses)."""
    backward_runs: int = 0
    """Isolated backward runs (cache misses)."""


@dataclass
class _OpFacts:
    """Cached result of one isolated forward run."""

    flops: int
    saved: list[tuple[str, int, int]]
    """(``in``/``out``/``tmp``, flat index, storage bytes) of each saved tensor."""
    outs: Any
    """Output pytree with tensors replaced by (shape, stride, offset, dtype, requires_grad, alias)."""


@dataclass
class _Record:
    """Autograd state of a node's isolated forward, kept for its isolated backward."""

    leaves: list[torch.Tensor | None]
    outs: list[Any]


@dataclass
class _State:
    """Per-run tables, keyed by node name (or storage key for ``counted``/``params``/``alias``)."""

    env: dict[str, Any] = field(default_factory=dict)
    prov: dict[str, list[tuple[str, int] | None]] = field(default_factory=dict)
    keys: dict[str, Any] = field(default_factory=dict)
    records: dict[str, _Record] = field(default_factory=dict)
    facts: dict[str, _OpFacts] = field(default_factory=dict)
    counted: set[int] = field(default_factory=set)
    params: set[int] = field(default_factory=set)
    alias: dict[int, int] = field(default_factory=dict)
    inputs: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """Shapes and dtypes of each node's tensor inputs: a replica's must equal its template's."""
