"""The verifier run before and after the pass pipeline.

It checks what every pass promises to keep true, and names the node when something is off:

* the graph lints (``gm.graph.lint()``) and every get_attr resolves;
* every parameter of the module has a provenance record (``passes.layout.ParamLayout``), so the
  runtime can rebuild the user's state_dict;
* every collective call names an axis that the runtime binds (a string such as ``"tp"``).

node.meta read: ``fs_param`` (capture). Writes nothing.
"""

from __future__ import annotations

import torch
import torch.fx

from passes.ops.calls import CALLS
from passes.layout import layout_of
from passes.dp.info import find_dp_info
from planner.modpath import fetch_attr

__all__ = ["verify_pass", "VerifyError", "COLLECTIVES"]

COLLECTIVES = {f: c.axis_arg for f, c in CALLS.items() if c.axis_arg is not None}
"""Collective calls the passes insert -> the position of their axis-name argument."""


class VerifyError(RuntimeError):
    """A rewritten graph broke an invariant; the message quotes the node."""


def verify_pass(gm: torch.fx.GraphModule, *, where: str = "") -> torch.fx.GraphModule:
    """Check ``gm``'s invariants; returns ``gm`` unchanged, or raises VerifyError listing every problem."""
    problems: list[str] = []
    try:
        gm.graph.lint()
    except Exception as exc:  # noqa: BLE001 - reported with the others
        problems.append(f"graph does not lint: {exc}")
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                fetch_attr(gm, str(node.target))
            except AttributeError:
                problems.append(f"{node.format_node()}: get_attr target {node.target!r} does not exist")
        elif node.op == "call_function" and node.target in COLLECTIVES:
            at = COLLECTIVES[node.target]
            axis = node.args[at] if len(node.args) > at else node.kwargs.get("axis")
            if not isinstance(axis, str):
                problems.append(f"{node.format_node()}: collective axis must be an axis name, got {axis!r}")
    recorded = _recorded_tensors(gm)
    for name, p in gm.named_parameters():  # deduplicated: a shared tensor needs one record
        if id(p) not in recorded:
            problems.append(f"parameter {name!r} has no provenance in gm.meta['fs_layout']")
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise VerifyError(f"graph verification failed{' ' + where if where else ''}:\n{lines}")
    return gm


def _recorded_tensors(gm: torch.fx.GraphModule) -> set[int]:
    """Identities of the tensors whose origin is recorded: the layout's attributes, plus the
    shards the data-parallel record owns (ZeRO fp32 master shards, FSDP flat parameters)."""
    layout = layout_of(gm)
    out: set[int] = set()
    for attr in [*layout.keys, *layout.flat]:
        try:
            out.add(id(fetch_attr(gm, attr)))
        except AttributeError:
            pass  # reported through the get_attr check when the graph uses it
    info = find_dp_info(gm)
    if info is not None:
        out.update(id(p) for p in info.sharded_params())
    return out
