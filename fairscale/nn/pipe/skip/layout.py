"""Which skip tensors cross partitions: routes from the stashing partition to the popping one."""

from __future__ import annotations

from typing import Any, Iterable

from torch import nn

from fairscale.nn.pipe.skip.skippable import Skippable

__all__ = ["SkipLayout", "inspect_skip_layout"]


class SkipLayout:
    """``skip_routes``: ``(namespace, name) -> (stashing partition, popping partition)``."""

    def __init__(self, num_partitions: int, skip_routes: dict[tuple[Any, str], tuple[int, int]]) -> None:
        self.by_ns_name = skip_routes
        self.by_partition: list[list[tuple[int, Any, str]]] = [[] for _ in range(num_partitions)]
        for (ns, name), (prev_j, next_j) in skip_routes.items():
            self.by_partition[next_j].append((prev_j, ns, name))
        for routes in self.by_partition:
            routes.sort(key=lambda route: route[0])

    def copy_policy(self, next_j: int) -> Iterable[tuple[int, Any, str]]:
        """``(source partition, namespace, name)`` of the skips partition ``next_j`` pops from an
        earlier partition, by source partition."""
        for prev_j, ns, name in self.by_partition[next_j]:
            if prev_j != next_j:
                yield prev_j, ns, name

    def requires_copy(self, ns: Any, name: str) -> bool:
        """Whether the skip crosses a partition boundary (and so travels through a portal)."""
        prev_j, next_j = self.by_ns_name.get((ns, name), (-1, -1))
        return prev_j != next_j


def inspect_skip_layout(partitions: list[nn.Sequential]) -> SkipLayout:
    """The routes of the skippable layers that are direct children of ``partitions``."""
    routes: dict[tuple[Any, str], tuple[int, int]] = {}
    stashed_at: dict[tuple[Any, str], int] = {}
    for j, partition in enumerate(partitions):
        for layer in partition.children():
            if not isinstance(layer, Skippable):
                continue
            for key in layer.stashable():
                stashed_at[key] = j
            for key in layer.poppable():
                routes[key] = (stashed_at.pop(key), j)
    return SkipLayout(len(partitions), routes)
