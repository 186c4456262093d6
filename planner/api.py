"""The planner's entry point for ``fairscale.plan`` and the ``fairscale plan`` CLI.

Usage::

    from planner.capture import capture
    from planner.api import plan_model, progress_printer
    graph = capture(model, example_inputs, loss_fn=loss_fn)
    result = plan_model(graph, cluster="a100-80gb:4", global_batch=512, constraints={"tp": 8},
                        progress=progress_printer())
    result.plan          # planner.plan.Plan, predicted filled in
    print(result.table())
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from planner.cluster import Cluster
from planner.cost import CostOptions
from planner.graph import ModelGraph
from planner.plan import Plan
from planner.search import SearchResult, search

__all__ = ["plan_model", "resolve_cluster", "progress_printer"]


def resolve_cluster(cluster: Cluster | dict[str, Any] | str | int | None) -> Cluster:
    """A Cluster from what a user may pass: a Cluster, its dict, ``"preset"`` or ``"preset:nodes"``,
    an int (that many CPU ranks), or None (:meth:`Cluster.detect`)."""
    if cluster is None:
        return Cluster.detect()
    if isinstance(cluster, Cluster):
        return cluster
    if isinstance(cluster, bool):
        raise TypeError("cluster must be a Cluster, a dict, a preset name, a number of CPU ranks or None")
    if isinstance(cluster, int):
        return Cluster.cpu(cluster)
    if isinstance(cluster, dict):
        return Cluster.from_dict(cluster)
    if isinstance(cluster, str):
        name, _, nodes = cluster.partition(":")
        if name == "cpu":
            return Cluster.cpu(int(nodes) if nodes else 1)
        return Cluster.preset(name, nodes=int(nodes) if nodes else 1)
    raise TypeError(f"cluster must be a Cluster, a dict, a preset name, a number of CPU ranks or None, "
                    f"got {type(cluster).__name__}")


def plan_model(graph: ModelGraph, *, cluster: Cluster | dict[str, Any] | str | int | None = None,
               global_batch: int | None = None, constraints: dict[str, Any] | Plan | None = None,
               tp_rules: dict[str, str] | Callable[[int], dict[str, str]] | None = None, top_k: int = 3,
               progress: Callable[[int, int, float | None], None] | None = None,
               options: CostOptions | None = None) -> SearchResult:
    """Search a plan for a captured model. ``global_batch`` defaults to the captured batch size;
    see :func:`planner.search.search` for the rest."""
    return search(graph, resolve_cluster(cluster), global_batch=global_batch or graph.batch_size,
                  constraints=constraints, top_k=top_k, progress=progress, tp_rules=tp_rules, options=options)


def progress_printer(stream: TextIO | None = None, *, every_s: float = 0.5) -> Callable[[int, int, float | None], None]:
    """A progress callback that rewrites one status line at most every ``every_s`` seconds."""
    out = stream if stream is not None else sys.stderr
    last = [0.0]

    def report(done: int, total: int, best: float | None) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < every_s:
            return
        last[0] = now
        best_txt = f", best {best:.4g} s/step" if best is not None else ""
        end = "\n" if done >= total else ""
        out.write(f"\rplanning: {done}/{total} configurations{best_txt}{end}")
        out.flush()
    return report
