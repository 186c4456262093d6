"""The rank-side half of ``fairscale check``: one checked step and its comparison with one process.

:func:`check_on_ranks` runs inside launched ranks (``parallelize(..., check=True)``);
:func:`fairscale.check.check` launches ranks itself and uses the same pieces. See
:mod:`fairscale.check` for what is compared and why dropout is turned off.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from fairscale import numerics
from fairscale.build import build_module
from passes.ops.random_ops import random_nodes
from fairscale.capture_cache import trace_dtype
from fairscale.runtime.batch_form import microbatch_example
from fairscale.runtime.startup import broadcast_from_zero
from planner.capture import LossModule
from planner.graph import META_MODULE, META_PARAM, ModelGraph
from planner.plan import Plan

__all__ = ["check_on_ranks", "CheckReport", "CheckFailed", "RandomOpsError", "quiet_copy", "random_ops",
           "backward_order", "reference_step"]

ORDER_NOTE = " (walking back from the loss, the order backward computes gradients)"


class CheckFailed(AssertionError):
    """The parallel run's loss or gradients differ from one process; ``report`` has the numbers."""

    def __init__(self, report: CheckReport) -> None:
        self.report = report
        super().__init__(report.describe())


class RandomOpsError(ValueError):
    """The model draws random numbers the check cannot turn off, so runs cannot be compared."""


@dataclass
class CheckReport:
    """The outcome of one checked step."""

    plan: Plan
    comparison: numerics.Comparison
    devices: int
    batch_rows: int
    dropout_off: list[str] = field(default_factory=list)
    """Module paths of the ``nn.Dropout*`` modules run with ``p = 0``."""

    @property
    def ok(self) -> bool:
        return self.comparison.ok

    def describe(self) -> str:
        m, sched = self.plan.mesh, self.plan.schedule
        head = (f"fairscale check: one step of the plan (pp={m.pp} dp={m.dp} tp={m.tp}"
                + (f" ep={m.ep}" if m.ep > 1 else "")
                + f", {sched.kind}, {sched.microbatches} microbatch(es), {self.plan.data_parallel.kind}) on "
                f"{self.devices} CPU ranks against one process"
                + (f" in {dtype}" if (dtype := self.plan.data_parallel.param_dtype) != "fp32" else "")
                + f", global batch of {self.batch_rows}")
        lines = [head]
        if self.dropout_off:
            shown = ", ".join(self.dropout_off[:6]) + (" ..." if len(self.dropout_off) > 6 else "")
            lines.append(f"dropout off in both runs ({len(self.dropout_off)} module(s): {shown})")
        lines.append(self.comparison.describe())
        return "\n".join(lines)


def quiet_copy(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """A deep copy of ``model`` whose ``nn.Dropout*`` modules have ``p = 0``, and their paths."""
    quiet = copy.deepcopy(model)
    names = []
    for name, m in quiet.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            m.p = 0.0
            names.append(name)
    return quiet, names


def random_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes of a captured graph that draw random numbers with effect (``passes.ops.random_ops``),
    each as ``module (op, p=...)``."""
    return [f"{node.meta.get(META_MODULE) or '<model top level>'} ({node.target}{detail})"
            for node, detail in random_nodes(gm)]


def backward_order(graph: ModelGraph) -> list[str]:
    """Parameter keys in the order backward produces their gradients: reverse first use in the
    captured forward (a tied weight by every name, at its first use)."""
    position = {node: i for i, node in enumerate(graph.gm.graph.nodes)}
    first: dict[str, int] = {}
    for node in graph.gm.graph.nodes:
        key = node.meta.get(META_PARAM) if node.op == "get_attr" else None
        if isinstance(key, str) and node.users:  # get_attr nodes may all sit at the top: use their users
            at = min(position[u] for u in node.users)
            first[key] = min(at, first.get(key, at))
    return sorted(first, key=lambda k: -first[k])


def reference_step(model: nn.Module, batch: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None, *,
                   dtype: torch.dtype | None = None) -> tuple[float, dict[str, torch.Tensor], torch.dtype]:
    """Loss, gradients (by parameter name) and the precision they were computed in, of one forward
    and backward in one process. ``dtype``: a mixed-precision plan's compute dtype
    (``capture_cache.trace_dtype``); the step then runs as such a plan computes, with the floating
    parameters (``model``'s own, so pass a copy) and the batch's floating tensors cast to it,
    buffers as they are, and the gradients returned in the parameters' dtype."""
    kept = {k: p.dtype for k, p in model.named_parameters()}
    if dtype is not None:
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
        batch = tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in batch)
    loss = LossModule(model, loss_fn)(*batch)
    loss.backward()
    grads = {k: p.grad.detach().to(kept[k]) for k, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, numerics.least_precise([loss.dtype, dtype])


def _check_batch(example_inputs: Sequence[Any], plan: Plan) -> tuple[Any, ...]:
    rows = next((t.shape[0] for t in example_inputs if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if rows is None:
        raise ValueError("the example batch has no tensor with a batch dimension")
    return microbatch_example(example_inputs, plan.schedule.global_batch or int(rows))


def _compare(plan: Plan, graph: ModelGraph, ref: tuple[float, dict[str, torch.Tensor], torch.dtype],
             loss: float, grads: dict[str, torch.Tensor], *, devices: int, rows: int,
             dropout_off: list[str]) -> CheckReport:
    ref_loss, ref_grads, loss_dtype = ref
    dtype = numerics.least_precise([t.dtype for t in ref_grads.values()] + [loss_dtype])
    result = numerics.compare([ref_loss], [loss], ref_grads, grads, order=backward_order(graph),
                              order_note=ORDER_NOTE, dtype=dtype)
    return CheckReport(plan=plan, comparison=result, devices=devices, batch_rows=rows, dropout_off=dropout_off)


def _refuse_random(graph: ModelGraph) -> None:
    found = random_ops(graph.gm)
    if found:
        raise RandomOpsError(
            f"the model draws random numbers that are not nn.Dropout modules, at {'; '.join(found[:5])}: ranks "
            "draw other numbers than one process, so the runs cannot be compared. Make them configurable and "
            "set them to 0 (or use nn.Dropout modules, which the check turns off) for the check")


def _rank_step(rank: int, world: int, quiet: nn.Module, batch: tuple[Any, ...], plan: Plan,
               loss_fn: Callable[..., torch.Tensor] | None) -> tuple[float, dict[str, np.ndarray]] | None:
    pm = build_module(quiet, plan, example_inputs=batch, loss_fn=loss_fn,
                      optimizer=functools.partial(torch.optim.SGD, lr=0.0))
    loss = pm.train_step(batch)
    grads = pm.full_grads()  # collective; rank 0 gets them
    return (loss, {k: v.numpy() for k, v in grads.items()}) if rank == 0 else None



def check_on_ranks(model: nn.Module, example_inputs: Sequence[Any], plan: Plan, *,
                   loss_fn: Callable[..., torch.Tensor] | None = None) -> CheckReport:
    """The same check inside launched ranks (``parallelize(..., check=True)``): every rank runs the
    step on a copy of ``model``, rank 0 runs the reference and compares, and every rank gets the
    report. Collective. Raises :class:`CheckFailed` on every rank if the runs differ."""
    batch = _check_batch(example_inputs, plan)
    quiet, dropout_off = quiet_copy(model)
    from fairscale.compile_check import checker_for

    graph = checker_for(quiet, batch, loss_fn=loss_fn).graph_for(plan)  # the capture a rank compiles
    if not isinstance(graph, ModelGraph):
        raise RuntimeError(graph.message())
    _refuse_random(graph)
    pm = build_module(quiet, plan, example_inputs=batch, loss_fn=loss_fn,
                      optimizer=functools.partial(torch.optim.SGD, lr=0.0))
    loss = pm.train_step(batch)
    grads = pm.full_grads()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        ref = reference_step(copy.deepcopy(quiet), batch, loss_fn, dtype=trace_dtype(plan))
        box[0] = _compare(plan, graph, ref, loss, grads, devices=dist.get_world_size(), rows=_rows(batch),
                          dropout_off=dropout_off)
    broadcast_from_zero(box, "the one-process reference step of the check")
    report: CheckReport = box[0]
    if not report.ok:
        raise CheckFailed(report)
    return report



def _rows(batch: Sequence[Any]) -> int:
    return next(int(t.shape[0]) for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0)
