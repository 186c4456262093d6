"""Split a sequence of layer costs into contiguous blocks minimizing the largest block.

Exact dynamic program (the linear-partition problem, Skiena, "The Algorithm Design Manual",
section 8.5): ``best[k][i]`` = smallest possible maximum block cost when the first ``i`` layers
form ``k`` blocks; O(k · n²) for n layers, instant for any real layer count.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["solve", "balance_cost"]


def solve(costs: Sequence[float], partitions: int) -> list[list[float]]:
    """``costs`` cut into ``partitions`` contiguous, non-empty blocks (the values, as FairScale's
    ``blockpartition.solve``): ``solve([1, 2, 3, 4, 5, 6], 2) == [[1, 2, 3, 4], [5, 6]]``."""
    n = len(costs)
    if partitions < 1:
        raise ValueError(f"partitions must be a positive integer, got {partitions}")
    if n < partitions:
        raise ValueError(f"cannot split {n} layers into {partitions} non-empty partitions")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = 0.0
    for k in range(1, partitions + 1):
        for i in range(k, n - (partitions - k) + 1):
            for j in range(k - 1, i):  # last block is layers j..i-1
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    blocks, i = [], n
    for k in range(partitions, 0, -1):
        j = cut[k][i]
        blocks.append(list(costs[j:i]))
        i = j
    return blocks[::-1]


def balance_cost(costs: Sequence[float], partitions: int) -> list[int]:
    """The ``balance`` argument of :class:`Pipe` (layers per partition) for these per-layer costs."""
    return [len(b) for b in solve(costs, partitions)]
