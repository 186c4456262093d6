"""Which nodes of a graph draw random numbers with effect: the home of that test for the plan check
(``fairscale.check_step.random_ops``, on a capture) and the runtime (a rank graph whose tensor-parallel
ranks must draw alike, ``fairscale.runtime.tp_random``)."""

from __future__ import annotations

import torch
import torch.fx

from passes.ops import tp_ops

__all__ = ["SAMPLERS", "random_nodes", "is_sampler"]

SAMPLERS = ("rand", "bernoulli", "normal", "uniform", "multinomial", "exponential", "geometric", "cauchy",
            "poisson")
"""Name fragments of aten ops that draw random numbers (``aten.randn``, ``aten.bernoulli_.float``, ...)."""


def random_nodes(gm: torch.fx.GraphModule) -> list[tuple[torch.fx.Node, str]]:
    """(node, detail) for every node that draws random numbers with effect: ops with a dropout
    probability argument (``p``, ``dropout_p``) above 0 (detail ``", p=0.1"``), the tensor-parallel
    ``tp_ops.sharded_dropout`` likewise, and samplers (:data:`SAMPLERS`, detail ``""``), also in
    the bodies of higher-order ops (a router's noise drawn inside ``with torch.no_grad():``)."""
    found: list[tuple[torch.fx.Node, str]] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        inner = _bodies(node, gm)
        if inner:
            found.extend(hit for body in inner for hit in random_nodes(body))
            continue
        if node.target is tp_ops.sharded_dropout:
            p = node.kwargs.get("p", node.args[1] if len(node.args) > 1 else None)
            if p != 0:
                found.append((node, f", p={p}"))
            continue
        name = str(node.target)
        schema = getattr(node.target, "_schema", None)
        args = list(schema.arguments) if schema is not None else []
        names = [a.name for a in args]
        prob = "dropout_p" if "dropout_p" in names else "p" if "p" in names and "dropout" in name.lower() else None
        if prob is not None:
            i = names.index(prob)
            value = node.kwargs.get(prob, node.args[i] if i < len(node.args) else args[i].default_value)
            if isinstance(value, (int, float)) and value == 0:
                continue
            found.append((node, f", {prob}={value}"))
        elif is_sampler(node):
            found.append((node, ""))
    return found


def _bodies(node: torch.fx.Node, gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """The graphs a higher-order op runs, as ``planner.graph.bodies`` finds them (this run-time
    leaf imports nothing of the planner)."""
    found = []
    for arg in node.args:
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            body: object = gm
            for part in str(arg.target).split("."):
                body = getattr(body, part, None)
            if isinstance(body, torch.fx.GraphModule):
                found.append(body)
    return found


def is_sampler(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls an op that samples (:data:`SAMPLERS`: ``randn``, ``randperm``, ...)."""
    name = str(node.target)
    return node.op == "call_function" and any(r in name.split(".")[-2 if "." in name else -1] for r in SAMPLERS)
