"""The planner's one way in: :func:`plan_for` (a captured graph and a cluster in, a searched plan
out), used by ``fairscale.search`` / ``fairscale.plan`` / ``fairscale.parallelize``, the
``fairscale plan`` command and the planner benchmarks; and :func:`resolve_cluster`, the one
reading of what a user may say a cluster is.

Usage::

    from planner.capture import capture
    from planner.api import plan_for, progress_printer
    graph = capture(model, example_inputs, loss_fn=loss_fn)
    result = plan_for(graph, "a100-80gb", devices=12, global_batch=512, constraints={"tp": 4},
                      progress=progress_printer())
    result.plan          # planner.plan.Plan, predicted filled in
    print(result.table())

Tensor-parallel rules come in as data (``tp_rules``): the planner never imports the pass that
detects them; the face passes ``passes.tp.patterns.propose_tp_rules`` for every caller.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from planner.cluster import Cluster
from planner.cost import CostOptions
from planner.gc_budget import fewer_collections
from planner.graph import ModelGraph
from planner.plan import Plan
from planner.search import Compiles, SearchResult, search

__all__ = ["plan_for", "resolve_cluster", "progress_printer"]

ClusterSpec = Cluster | dict[str, Any] | str | int | None
"""What a user may say a cluster is: see :func:`resolve_cluster`."""


def resolve_cluster(cluster: ClusterSpec = None, *, devices: int | None = None) -> Cluster:
    """A Cluster from a Cluster, its dict, a preset name (``"a100-80gb"``, ``"a100-80gb:4"`` for 4
    nodes, ``"cpu"``), an int (that many CPU ranks), or None (the detected GPUs, else CPU ranks).

    ``devices`` is the total device count. With a preset it may leave the last node partial
    (``devices=12`` on 8-GPU nodes: a full node and 4 GPUs of another); with CPU ranks it is the
    rank count; with a given Cluster or detected GPUs it takes that many of them (no more).
    """
    if devices is not None and (isinstance(devices, bool) or devices < 1):
        raise ValueError(f"devices must be a positive number of devices, got {devices!r}")
    if isinstance(cluster, bool):
        raise TypeError("cluster must be a Cluster, a dict, a preset name, a number of CPU ranks or None")
    if cluster is None:
        detected = Cluster.detect()
        if detected.device == "cpu":
            return Cluster.cpu(devices or detected.devices)
        cluster = detected
    elif isinstance(cluster, int):
        if devices is not None and devices != cluster:
            raise ValueError(f"devices={devices}, but cluster={cluster} CPU ranks; give one of them, or make them agree")
        return Cluster.cpu(cluster)
    elif isinstance(cluster, dict):
        cluster = Cluster.from_dict(cluster)
    elif isinstance(cluster, str):
        name, _, nodes = cluster.partition(":")
        if name == "cpu":
            ranks = int(nodes) if nodes else (devices or 1)
            if devices is not None and devices != ranks:
                raise ValueError(f'devices={devices}, but cluster="{cluster}" has {ranks} CPU ranks')
            return Cluster.cpu(ranks)
        return Cluster.preset(name, nodes=int(nodes) if nodes else None, devices=devices)
    elif not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a Cluster, a dict, a preset name, a number of CPU ranks or None, "
                        f"got {type(cluster).__name__}")
    if devices is None or devices == cluster.devices:
        return cluster
    if cluster.device == "cpu" or cluster.name == "cpu":
        return Cluster.cpu(devices, memory_bytes=cluster.memory_bytes)
    if devices > cluster.devices:
        raise ValueError(f"devices={devices}, but the cluster has {cluster.devices} ({cluster.nodes} node(s) of "
                         f"{cluster.devices_per_node}); to plan for more, name a preset (cluster=\"{cluster.name}\", "
                         f"devices={devices}) or give a Cluster of that size")
    return cluster.with_devices(devices)


@fewer_collections()
def plan_for(graph: ModelGraph, cluster: ClusterSpec = None, *, devices: int | None = None,
             global_batch: int | None = None, constraints: dict[str, Any] | Plan | None = None,
             tp_rules: dict[str, str] | Callable[[int], dict[str, str]] | None = None, dtype: str | None = None,
             top_k: int = 3, progress: Callable[[int, int, float | None], None] | None = None,
             options: CostOptions | None = None, use_all_devices: bool = False,
             compiles: Compiles | None = None, check_runners_up: bool = True) -> SearchResult:
    """Search the best plan for a captured model on a cluster.

    Args:
        cluster, devices: what to plan for (:func:`resolve_cluster`).
        global_batch: samples per optimizer step (default: the captured batch size).
        constraints: fields to keep, in the plan's JSON shape (``planner.search.space``).
        tp_rules: tensor-parallel candidates, or a function of the tp degree returning them.
        dtype: compute dtype (``bf16``, ``fp16``, ``fp32``, ``auto``); default: mixed precision on
            GPUs, fp32 on CPU ranks (``planner.cluster.default_compute_dtype``).
        use_all_devices: every plan uses every device (a launched world needs that); otherwise a
            plan may leave devices idle when that is faster, and its notes say why.
        compiles: the plan-time compile check (``planner.search.Compiles``, the face's
            ``fairscale.compile_check.checker_for``); the search moves on from plans it refuses.
        check_runners_up: with ``compiles``, check the runners-up too, not only the winner.
    """
    return search(graph, resolve_cluster(cluster, devices=devices), global_batch=global_batch or graph.batch_size,
                  constraints=constraints, top_k=top_k, progress=progress, tp_rules=tp_rules, options=options,
                  dtype=dtype, use_all_devices=use_all_devices, compiles=compiles,
                  check_runners_up=check_runners_up)


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
