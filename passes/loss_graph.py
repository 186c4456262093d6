"""Walks over a loss's captured graph that ``passes.loss_weights``' counters share: what a node is
computed from, copies of those nodes, the numbers that scale a loss, the graph's batch rows, and
whether a count drawn in the forward changes with the draw.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx

from passes.ops.random_ops import is_sampler
from planner.graph import ancestors, past_value_keeping

__all__ = ["batch_ancestors", "copy_nodes", "zero_dim", "varies_with_draws", "NUMBER_SCALINGS",
           "past_numbers", "multiple_of_rows", "graph_rows"]

aten = torch.ops.aten


def batch_ancestors(node: torch.fx.Node) -> set[torch.fx.Node] | None:
    """``node`` and every node it is computed from, or None when any of them is not a batch input or
    an op (a parameter, a buffer) or draws random numbers (mixup's ``y[randperm]``)."""
    seen: set[torch.fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op not in ("placeholder", "call_function") or is_sampler(n):
            return None
        stack.extend(n.all_input_nodes)
    return seen


def copy_nodes(gm: torch.fx.GraphModule, keep: set[torch.fx.Node]
                ) -> tuple[torch.fx.Graph, dict[torch.fx.Node, torch.fx.Node], list[int]]:
    """A new graph holding ``gm``'s nodes in ``keep`` (in order), the map from them to their copies,
    and the batch positions of the placeholders kept."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inputs = []
    for node in gm.graph.nodes:
        if node in keep:
            env[node] = graph.node_copy(node, lambda x: env[x])
            if node.op == "placeholder":
                inputs.append(placeholders.index(node))
    return graph, env, inputs


def zero_dim(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 0


def varies_with_draws(node: torch.fx.Node, count: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``count(value of node)`` differs between a few seeds of the draws it is computed from,
    the batch inputs held fixed (made up from their shapes): a mask drawn with a number of positions
    drawn per row (MaskGIT's cosine schedule) does, a permutation of a fixed mask (ViTMAE's) does not.
    True where it cannot be computed so (refused: no piece's count known)."""
    gm = node.graph.owning_module
    if gm is None:
        return True
    keep = set(ancestors(node, into_bodies=True))
    runner = torch.fx.Interpreter(gm)
    gen = torch.Generator(device="cpu").manual_seed(0)  # lint: cpu -- made-up inputs, seeded, then moved
    inputs = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n in keep:
            val = n.meta.get("val")
            if not isinstance(val, torch.Tensor):
                return True
            shape, host = [int(d) for d in val.shape], torch.device("cpu")
            # lint: cpu -- made up on the host from a seeded generator, then put where the capture's values are
            made = torch.randn(shape, generator=gen, dtype=val.dtype, device=host) if val.is_floating_point() else \
                torch.ones(shape, dtype=val.dtype, device=host) if val.dtype is torch.bool else \
                torch.randint(1, 8, shape, generator=gen, dtype=val.dtype, device=host)  # (no label 0 or -100)
            inputs[n] = made.to(val.device)
    seen: set[float] = set()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for seed in range(4):
                torch.manual_seed(seed)
                runner.env = dict(inputs)
                for n in gm.graph.nodes:
                    if n in keep and n.op != "placeholder":
                        runner.env[n] = runner.run_node(n)
                seen.add(float(count(runner.env[node])))
    except Exception:  # noqa: BLE001 - not computable on made-up inputs: taken as varying
        return True
    return len(seen) > 1


NUMBER_SCALINGS = {aten.mul.Tensor: (0, 1), aten.mul.Scalar: (0,), aten.div.Tensor: (0,), aten.div.Scalar: (0,)}
"""Ops that scale a loss by a number, and which of their two arguments may be the loss."""


def past_numbers(value: torch.fx.Node, rows: int | None) -> torch.fx.Node:
    """The loss ``value`` is ``-``, or times or over numbers, of (``0.5 * mse_sum``, ``kl_sum / 7``);
    ``value`` itself if none: each piece's loss carries the same factor, so the pieces weigh as the
    loss's own. With ``rows``, a division by a multiple of the graph's rows ends the walk: the capture
    bakes ``x.size(0)`` in as a number, and such a sum is a mean over rows (``passes.loss_weights._divided_by_rows``)."""
    while value.op == "call_function":
        if value.target is aten.neg.default and isinstance(value.args[0], torch.fx.Node):
            value = past_value_keeping(value.args[0])
            continue
        if value.target not in NUMBER_SCALINGS or len(value.args) != 2 or value.kwargs:
            return value
        for i in NUMBER_SCALINGS[value.target]:
            loss, factor = value.args[i], value.args[1 - i]
            if isinstance(loss, torch.fx.Node) and isinstance(factor, (int, float)) and not isinstance(factor, bool):
                if value.target in (aten.div.Tensor, aten.div.Scalar) and multiple_of_rows(factor, rows):
                    return value
                value = past_value_keeping(loss)
                break
        else:
            return value
    return value


def multiple_of_rows(number: object, rows: int | None) -> bool:
    """Whether ``number`` is a positive multiple of the graph's ``rows``: ``x.size(0)``, or the tokens
    of ``logits.view(-1, V)`` (``rows x positions``), as the capture bakes them in."""
    return rows is not None and rows > 0 and isinstance(number, (int, float)) and not isinstance(number, bool) \
        and number > 0 and number % rows == 0


def graph_rows(gm: torch.fx.GraphModule) -> int | None:
    """The graph's batch rows: dim 0 of its first input with dims (what the runtime cuts)."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() > 0:
            return int(val.shape[0]) if isinstance(val.shape[0], int) else None
    return None
