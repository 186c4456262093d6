"""Batch statistics as a graph rewrite: every training-mode batch norm computes over the global batch.

Data parallelism gives each rank a slice of the batch, so a plain ``aten.batch_norm`` would
normalize with the slice's statistics: a different function from the user's model (losses differ
from one process's at step 0, and the running statistics drift apart on every rank). This pass
replaces each batch-statistic op that ``planner.batch_stats`` finds with a call of
:mod:`passes.ops.bn_ops`::

    before:  batch_norm = aten.batch_norm(conv2d, w, b, running_mean, running_var, True, 0.1, 1e-05, False)
    after:   batch_norm = batch_norm_sync(conv2d, w, b, running_mean, running_var, None, 0.1, 1e-05, 'dp')

``plan.batch_norm`` chooses the semantics:

* ``"sync"`` (default, exact): statistics over the dp group's global batch (SyncBatchNorm), running
  statistics updated once per step, identically on every rank, as ``nn.BatchNorm*d`` on the whole
  batch. Microbatches cannot be exact (each microbatch's forward would need every other's
  statistics), so a plan with ``schedule.microbatches`` > 1 is refused here as in validation.
* ``"local"`` (opt-in): each rank and microbatch uses its own statistics and updates the running
  statistics once per microbatch, as torch DDP without SyncBatchNorm does.

Both modes make running-statistic updates safe under activation recompute (the re-run forward does
not update them twice). torch.fx captures keep norm modules whole (``call_module``: ``nn.SyncBatchNorm``
in launched ranks, ``momentum=None``); the pass inlines them into get_attr nodes and the same ops,
so their parameters become visible to the data-parallel pass and to state dicts. Eval-mode norms
are elementwise and stay as they are (inlined as ``aten.batch_norm``/``aten.instance_norm`` when
they were modules).

The pass runs on the whole captured graph before the stages are cut (``passes.compile_rank``),
and tensor parallelism leaves the op replicated (its rule table has no entry, so the fallback
gathers a sharded input: batch statistics are never taken over a shard). Tensor-parallel ranks
share a batch, so only the dp axis is synchronized.

gm.meta written: ``fs_batch_norm`` (:class:`BatchNormInfo`); ``fs_layout`` gains the keys of
inlined modules' tensors.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.fx
from torch import nn

from passes.dp.graph import rebuild
from passes.graph_utils import clone_graph_module
from passes.layout import ParamLayout, layout_of
from passes.ops import bn_ops
from planner.batch_stats import (BatchStatCall, BatchStatOp, batch_stat_call, find_batch_stat_ops,
                                 microbatch_problem, unsupported_problem)
from planner.graph import META_MODULE, META_PARAM
from planner.modpath import fetch_attr
from planner.plan import BATCH_NORM_MODES, Plan, PlanError

__all__ = ["batch_norm_pass", "BatchNormInfo", "META_BATCH_NORM", "batch_norm_info", "has_batch_norm"]

META_BATCH_NORM = "fs_batch_norm"
"""gm.meta key holding :class:`BatchNormInfo`."""

_NORM_MODULES = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


@dataclass
class BatchNormInfo:
    """What the pass did, for the runtime's checks and reports."""

    mode: str
    """``sync`` or ``local``."""
    axis: str
    """The comm axis statistics are synchronized over (``sync``)."""
    ops: list[BatchStatOp] = field(default_factory=list)
    """The batch-statistic ops rewritten, in graph order."""


def batch_norm_pass(gm: torch.fx.GraphModule, plan: Plan, *, axis: str = "dp") -> torch.fx.GraphModule:
    """Rewrite every training-mode batch-statistic op of ``gm`` per ``plan.batch_norm``.

    Returns ``gm`` itself when it holds no batch-statistic op and no norm module, else a rewritten
    copy sharing ``gm``'s tensors. Raises :class:`PlanError` (the same problems validation
    reports) for ``"sync"`` with ``schedule.microbatches`` > 1, or with a batch-norm kernel the pass
    cannot rewrite while dp or microbatches split the batch.
    """
    mode = plan.batch_norm
    if mode not in BATCH_NORM_MODES:
        raise PlanError([f'batch_norm: unknown mode "{mode}"; (allowed: {", ".join(BATCH_NORM_MODES)})'])
    ops = find_batch_stat_ops(gm)
    if not ops and not _norm_leaves(gm):
        return gm
    split = plan.mesh.dp > 1 or plan.schedule.microbatches > 1
    if mode == "sync":
        problems = []
        if split and any(not op.supported for op in ops):
            problems.append(unsupported_problem(ops))
        if plan.schedule.microbatches > 1 and ops:
            problems.append(microbatch_problem(ops, plan.schedule.microbatches))
        if problems:
            raise PlanError(problems)
    out = clone_graph_module(gm)
    src = layout_of(gm)
    layout = ParamLayout(keys=dict(src.keys), tp=dict(src.tp), flat=dict(src.flat))
    for node in list(out.graph.nodes):
        call = batch_stat_call(node, out) if node.op in ("call_function", "call_module") else None
        if call is not None:
            _rewrite(out, node, call, layout, axis=axis if mode == "sync" else None)
        elif node.op == "call_module" and isinstance(out.get_submodule(str(node.target)), _NORM_MODULES):
            _inline_elementwise(out, node, layout)
    # the rank graph owns the statistics it updates, as the data-parallel pass owns its parameters:
    # compiling one capture twice must not make two programs share running statistics
    owned: dict[str, object] = {t: _tensor(out, t).clone() for t in _updated_buffers(out)}
    result = rebuild(out, out.graph, owned, layout)
    result.meta[META_BATCH_NORM] = BatchNormInfo(mode=mode, axis=axis, ops=[op for op in ops if op.supported])
    return result


def has_batch_norm(gm: torch.fx.GraphModule) -> bool:
    """Whether :func:`batch_norm_pass` rewrites ``gm`` (a batch-statistic op or a norm module);
    when not, the pass reads nothing of the plan but ``plan.batch_norm`` and returns ``gm``."""
    return bool(find_batch_stat_ops(gm)) or bool(_norm_leaves(gm))


def _norm_leaves(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_module"
            and isinstance(gm.get_submodule(str(n.target)), _NORM_MODULES)]


def batch_norm_info(gm: torch.nn.Module) -> BatchNormInfo | None:
    """The :class:`BatchNormInfo` :func:`batch_norm_pass` left on ``gm``; None when it did not run."""
    meta = getattr(gm, "meta", None)
    return meta.get(META_BATCH_NORM) if isinstance(meta, dict) else None


def _tensor(gm: torch.fx.GraphModule, target: str) -> torch.Tensor:
    value = fetch_attr(gm, target)
    assert isinstance(value, torch.Tensor), f"{target} is not a tensor"
    return value


_STAT_OPS = (bn_ops.batch_norm_sync, bn_ops.batch_norm_local, bn_ops.instance_norm_sync, bn_ops.instance_norm_local)


def _updated_buffers(gm: torch.fx.GraphModule) -> set[str]:
    """get_attr targets of the buffers the graph updates: the running statistics the batch-statistic
    ops receive, and tensors an in-place aten op writes (``num_batches_tracked.add_(1)``)."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _STAT_OPS:
            written = list(node.args[3:5])
        elif isinstance(node.target, torch._ops.OpOverload) and node.target._schema.arguments and \
                (info := node.target._schema.arguments[0].alias_info) is not None and info.is_write:
            written = [node.args[0]]
        else:
            continue
        out.update(str(a.target) for a in written if isinstance(a, torch.fx.Node) and a.op == "get_attr"
                   and isinstance(fetch_attr(gm, str(a.target)), torch.Tensor)
                   and not isinstance(fetch_attr(gm, str(a.target)), nn.Parameter))
    return out


def _rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node, call: BatchStatCall, layout: ParamLayout, *,
             axis: str | None) -> None:
    graph = gm.graph
    with graph.inserting_before(node):
        if call.module is not None:
            tensors = [_attr(gm, node, name, layout) for name in
                       (call.weight, call.bias, call.running_mean, call.running_var)]
            counter = None
            if call.num_batches_tracked is not None:  # the module's forward counts its training calls
                counter = graph.call_function(torch.ops.aten.add_.Tensor,
                                              (_attr(gm, node, call.num_batches_tracked, layout), 1))
                counter.meta = {k: v for k, v in node.meta.items() if k != "val"}
        else:
            tensors = [call.weight, call.bias, call.running_mean, call.running_var]
            counter = None
        counter = counter if call.momentum is None else None  # only the cumulative average reads it
        if call.kind == "batch_norm":
            args = (call.input, *tensors, counter, call.momentum, call.eps)
            new = graph.call_function(bn_ops.batch_norm_sync if axis else bn_ops.batch_norm_local,
                                      args + ((axis,) if axis else ()))
        else:
            args = (call.input, *tensors, call.momentum or 0.0, call.eps)
            new = graph.call_function(bn_ops.instance_norm_sync if axis else bn_ops.instance_norm_local,
                                      args + ((axis,) if axis else ()))
    new.meta = copy.copy(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


def _inline_elementwise(gm: torch.fx.GraphModule, node: torch.fx.Node, layout: ParamLayout) -> None:
    """An eval-mode (or per-sample) norm module called by torch.fx: the aten op its forward runs,
    on get_attr nodes, so its parameters are seen like every other parameter."""
    module = gm.get_submodule(str(node.target))
    names = ("weight", "bias", "running_mean", "running_var")
    eps, momentum = float(module.eps), float(module.momentum or 0.0)  # type: ignore[arg-type]
    with gm.graph.inserting_before(node):
        if isinstance(module, nn.modules.batchnorm._BatchNorm):  # eval with running statistics
            w, b, rm, rv = (_attr(gm, node, n, layout) if getattr(module, n, None) is not None else None
                            for n in names)
            new = gm.graph.call_function(torch.ops.aten.batch_norm.default,
                                         (node.args[0], w, b, rm, rv, False, 0.0, eps, False))
        else:
            track = module.track_running_stats
            w, b, rm, rv = (_attr(gm, node, n, layout) if getattr(module, n, None) is not None
                            and (track or n in ("weight", "bias")) else None for n in names)
            new = gm.graph.call_function(torch.ops.aten.instance_norm.default,
                                         (node.args[0], w, b, rm, rv, module.training or not track, momentum,
                                          eps, False))
    new.meta = copy.copy(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)


def _attr(gm: torch.fx.GraphModule, node: torch.fx.Node, name: str | None, layout: ParamLayout) -> torch.fx.Node | None:
    """A get_attr node for the tensor ``name`` of the module ``node`` calls, with its user key."""
    if name is None:
        return None
    target = f"{node.target}.{name}"
    module = str(node.meta.get(META_MODULE, ""))
    key = f"{module}.{name}" if module else name
    got = gm.graph.get_attr(target)
    got.meta[META_PARAM] = key
    got.meta[META_MODULE] = module
    layout.keys[target] = key
    return got
