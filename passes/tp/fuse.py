"""Collective fusions on a tensor-parallel rank graph, run by ``shard_tensor_parallel_pass`` after
the rewrite (``passes.tp.rewrite`` inserts one conversion per value and consumer; these merge the
ones whose backward halves meet).

* :func:`fuse_gather_copy`: ``gather_from_group -> copy_to_group`` becomes ``gather_seq``
  (Korthikanti et al. 2022, section 4.2.2).
* :func:`hoist_copy_over_scatter`: a replicated value that both enters the sequence-sharded
  residual stream and feeds a replicated region (a norm) in front of a column-parallel block pays
  an all-gather and an all-reduce in backward; one all-reduce does (worked picture in its docstring).

node.meta read: ``fs_tp`` (placements written by the rewrite), ``val`` (sizes for the byte
comparison). node.meta written: ``fs_tp``, ``fs_tp_comm`` on the nodes they insert or retarget.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx import Node

from passes.ops import comm, tp_ops
from passes.tp.rewrite import META_TP, META_TP_COMM, args_of
from planner.graph import META_LAYER, META_MODULE
from passes.tp.rules import VIEWS

__all__ = ["fuse_gather_copy", "hoist_copy_over_scatter"]

aten = torch.ops.aten
_PASSTHROUGH = VIEWS | {aten.to.dtype, aten.to.dtype_layout, aten.alias.default, aten._to_copy.default}
_TP_CALLS = {comm.copy_to_group, comm.reduce_from_group, comm.gather_from_group, comm.scatter_to_group,
             comm.gather_seq, comm.reduce_scatter_seq, tp_ops.local_chunk, tp_ops.vocab_parallel_embedding,
             tp_ops.vocab_parallel_cross_entropy, tp_ops.expert_grouped_mm, tp_ops.sharded_dropout}


def fuse_gather_copy(graph: torch.fx.Graph) -> None:
    """``gather_from_group -> (views) -> copy_to_group`` with no other users is ``gather_seq``:
    all-gather forward, and in backward split∘all-reduce = one reduce-scatter (Korthikanti et al.
    2022, section 4.2.2). Views are linear, so the all-reduce commutes with them."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not comm.gather_from_group:
            continue
        cur = node
        while len(cur.users) == 1:
            (user,) = cur.users
            if user.target in _PASSTHROUGH and user.args[0] is cur:
                cur = user
                continue
            break
        if len(cur.users) != 1:
            continue
        (copy_node,) = cur.users
        if copy_node.target is not comm.copy_to_group:
            continue
        node.target = comm.gather_seq
        node.meta[META_TP_COMM] = node.meta.get(META_TP_COMM, "") + " (fused with copy_to_group)"
        copy_node.replace_all_uses_with(cur)
        graph.erase_node(copy_node)


def hoist_copy_over_scatter(graph: torch.fx.Graph, owner: torch.nn.Module) -> int:
    """Move ``copy_to_group`` from the outputs of a replicated region to its inputs where that
    lets a ``scatter_to_group`` of the same input drop its backward all-gather. Returns how many
    values were rewritten.

    The case: under sequence parallelism a replicated ``v`` (a replicated embedding's output, a
    pipeline stage input) is split into the sequence-sharded residual and also normed on every
    rank in front of the first column-parallel block::

        before:   v ─┬─ scatter_to_group ─ add  S(1)
                     └─ norm(v, w) ─ copy_to_group ─ q|k|v
                  backward: all-gather |v| + all-reduce |v|
        after:    v ─ copy_to_group ─┬─ local_chunk ─ add  S(1)
                                     └─ norm(·, copy_to_group(w)) ─ q|k|v
                  backward: all-reduce |v| + all-reduce |w|

    Why it is exact: every rank runs the region on the same replicated inputs, so its backward is
    the same linear map on every rank and commutes with the sum over ranks. The region may
    therefore propagate the unreduced (partial-sum) gradients of the column-parallel block, the
    residual's shard gradient enters as a partial sum too (``local_chunk`` pads it with zeros, no
    communication), and one all-reduce at ``v`` sums both; the region's parameters, whose
    gradients are now partial sums, get ``copy_to_group`` like the norm weights of the
    sequence-sharded regions. Megatron-LM pays the all-gather: its embedding output enters the
    sequence-parallel region through ``scatter_to_sequence_parallel_region``, whose backward
    all-gathers. Ring bytes per rank, in units of (n-1)/n·bytes (Thakur et al.
    2005), go from |v| + 2|v| to 2|v| + 2|w|.

    The rewrite applies only when the region is closed: every node in it is a replicated
    computation, every way out of it is a ``copy_to_group``, and its other inputs are parameters
    or values that carry no floating-point data.
    """
    done = 0
    seen: set[Node] = set()
    for node in list(graph.nodes):
        if node.target is not comm.scatter_to_group:
            continue
        v = node.args[0]
        if not isinstance(v, Node) or v in seen:
            continue
        seen.add(v)
        scatters = [u for u in v.users if u.target is comm.scatter_to_group]
        found = _copy_region(v, scatters, owner)
        if found is None:
            continue
        region, copies, params = found
        old = len(scatters) * _nbytes(v) + 2 * sum(_nbytes(c.args[0]) for c in copies)
        new = 2 * _nbytes(v) + 2 * sum(_attr(owner, str(w.target)).nbytes for w in params)
        if new >= old:
            continue
        _rewrite(graph, v, scatters, region, copies, params)
        done += 1
    return done


def _copy_region(v: Node, scatters: list[Node],
                 owner: torch.nn.Module) -> tuple[list[Node], list[Node], list[Node]] | None:
    """(region nodes, boundary copies, parameters read inside) of ``v``'s non-scatter users, or
    None when the region is not closed (see ``hoist_copy_over_scatter``)."""
    region: dict[Node, None] = {}
    copies: dict[Node, None] = {}
    stack = [u for u in v.users if u not in scatters]
    while stack:
        n = stack.pop()
        if n in region or n in copies:
            continue
        if n.target is comm.copy_to_group:
            copies[n] = None
            continue
        if n.op != "call_function" or n.target in _TP_CALLS or not _replicated(n) or _inplace(n):
            return None
        region[n] = None
        stack.extend(n.users)
    if not copies:
        return None
    params: dict[Node, None] = {}
    for n in region:
        for a in n.all_input_nodes:
            if a is v or a in region:
                continue
            if a.op == "get_attr":
                if a.meta.get(META_TP, "R") != "R":
                    return None
                value = _attr(owner, str(a.target))
                if isinstance(value, torch.Tensor) and value.requires_grad:
                    params[a] = None
            elif _floating(a):
                return None  # an activation from outside could carry a gradient the region would leave unreduced
    return list(region), list(copies), list(params)


def _rewrite(graph: torch.fx.Graph, v: Node, scatters: list[Node], region: list[Node], copies: list[Node],
             params: list[Node]) -> None:
    with graph.inserting_after(v):
        c = graph.call_function(comm.copy_to_group, (v, scatters[0].args[1]))
    c.meta.update({k: v.meta[k] for k in ("val", META_MODULE, META_LAYER) if k in v.meta})
    c.meta[META_TP] = "R"
    c.meta[META_TP_COMM] = "replicated input of a replicated region and of a sequence shard (hoisted copy)"
    inside = set(region) | set(copies) | set(scatters)
    v.replace_all_uses_with(c, delete_user_cb=lambda u: u in inside)
    for s in scatters:
        s.target = tp_ops.local_chunk
        s.meta[META_TP_COMM] = "sequence shard of a copied value (gradient enters as a partial sum)"
    for b in copies:
        b.replace_all_uses_with(args_of(b)[0])
        graph.erase_node(b)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for w in params:
        users = sorted((u for u in w.users if u in inside), key=order.__getitem__)
        with graph.inserting_before(users[0]):
            cw = graph.call_function(comm.copy_to_group, (w, scatters[0].args[1]))
        cw.meta.update({k: users[0].meta[k] for k in (META_MODULE, META_LAYER) if k in users[0].meta})
        if "val" in w.meta:
            cw.meta["val"] = w.meta["val"]
        cw.meta[META_TP] = "R"
        cw.meta[META_TP_COMM] = "parameter of a region whose gradient is a partial sum (hoisted copy)"
        w.replace_all_uses_with(cw, delete_user_cb=lambda u: u in inside)


def _replicated(n: Node) -> bool:
    place: Any = n.meta.get(META_TP)
    return place == "R" or (not n.users and not isinstance(n.meta.get("val"), torch.Tensor))


def _inplace(n: Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _floating(n: Node) -> bool:
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        return any(isinstance(x, torch.Tensor) and x.is_floating_point() for x in val)
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _nbytes(n: Any) -> int:
    val = n.meta.get("val") if isinstance(n, Node) else None
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _attr(owner: torch.nn.Module, target: str) -> Any:
    obj: Any = owner
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
