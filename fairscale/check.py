"""``fairscale check``: one step of a plan on CPU ranks against the unparallelized model.

What a user runs on their own model before a long job::

    report = fairscale.check(model, batch, devices=8, loss_fn=loss_fn)            # the searched plan
    report = fairscale.check(model, batch, devices=8, plan="plan.json")           # or a given one
    print(report.describe())      # per-loss and per-gradient errors, the first module that differs
    python -m fairscale check mypkg.models:build --devices 8 [--plan plan.json]   # the same

and, inside launched ranks, ``fairscale.parallelize(..., check=True)`` runs the same comparison
before returning the module (and raises :class:`CheckFailed` on every rank if it differs).

How. The plan is compiled for every rank first (:mod:`fairscale.compile_check`). Then a copy of
the model runs one ``train_step`` of the plan on ``devices`` CPU ranks (gloo) on one global batch,
and :meth:`ParallelModule.full_grads` gathers its gradients in the user's keys; another copy runs
forward and backward on the same batch in one process. :func:`fairscale.numerics.compare` holds
the loss and every gradient to float tolerance (the bound is derived there; the exactness tests
use the same code) and names the first module whose gradient differs, walking from the loss back
(the order backward computes gradients: a module whose backward is wrong is the first to differ,
and everything before it inherits the difference). The user's model is never modified.

Dropout draws other random numbers on a rank than in one process, so the copies run with every
``nn.Dropout*`` module's ``p`` set to 0 (listed in the report). Random ops that are not modules
(``F.dropout(x, p=0.1)`` in a forward, ``torch.rand``) cannot be turned off from outside and
make the check refuse to compare, naming them.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from fairscale import numerics
from fairscale.compile_check import checker_for
from fairscale.runtime.engine import ParallelModule, microbatch_example
from planner.capture import LossModule
from planner.cluster import Cluster
from planner.graph import META_PARAM, ModelGraph
from planner.plan import Plan

__all__ = ["check", "check_on_ranks", "CheckReport", "CheckFailed", "RandomOpsError", "quiet_copy",
           "backward_order"]

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
                f"{self.devices} CPU ranks against one process, global batch of {self.batch_rows}")
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


_SAMPLERS = ("rand", "bernoulli", "normal", "uniform", "multinomial", "exponential", "geometric", "cauchy",
             "poisson")
"""Name fragments of aten ops that draw random numbers (``aten.randn``, ``aten.bernoulli_.float``, ...)."""


def random_ops(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes of a captured graph that draw random numbers with effect: ops with a dropout
    probability argument (``p``, ``dropout_p``) above 0, and samplers (:data:`_SAMPLERS`), each
    as ``module (op)``."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
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
            detail = f", {prob}={value}"
        elif any(r in name.split(".")[-2 if "." in name else -1] for r in _SAMPLERS):
            detail = ""
        else:
            continue
        found.append(f"{node.meta.get('fs_module') or '<model top level>'} ({name}{detail})")
    return found


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


def reference_step(model: nn.Module, batch: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None,
                   ) -> tuple[float, dict[str, torch.Tensor], torch.dtype]:
    """Loss, gradients (by parameter name) and loss dtype of one forward and backward in one process."""
    loss = LossModule(model, loss_fn)(*batch)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads, loss.dtype


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
    pm = ParallelModule(quiet, plan, example_inputs=batch, loss_fn=loss_fn,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.0))
    loss = pm.train_step(batch)
    grads = pm.full_grads()  # collective; rank 0 gets them
    return (loss, {k: v.numpy() for k, v in grads.items()}) if rank == 0 else None


def check(model: nn.Module, example_inputs: Sequence[Any], *, devices: int, loss_fn: Callable[..., torch.Tensor]
          | None = None, plan: Plan | str | Path | None = None, cluster: Cluster | str | None = None,
          global_batch: int | None = None, constraints: dict[str, Any] | None = None) -> CheckReport:
    """Run one step of ``plan`` (default: the searched plan) on ``devices`` forked CPU ranks and
    compare its loss and gradients with one process. Call it from a plain process (not a rank).

    Args:
        example_inputs: one batch (a tuple), as for ``parallelize``; it is cut or tiled to the
            plan's global batch.
        plan: a Plan or plan file; it is validated, re-costed and compiled first.
        cluster: what to plan for when searching (default: ``devices`` CPU ranks); the check
            itself always runs on CPU ranks, as many as the plan's mesh.
        global_batch, constraints: as for ``fairscale.search``.

    Raises:
        PlanError: the plan is invalid or does not compile (``PlanCompileError``).
        RandomOpsError: the model draws random numbers the check cannot turn off.
    """
    from fairscale.api import captured, load_and_check, resolve_cluster, search
    from fairscale.runtime.launch import launch

    if dist.is_initialized():
        raise RuntimeError("fairscale.check launches its own CPU ranks: call it from a plain process, or use "
                           "fairscale.parallelize(..., check=True) inside launched ranks")
    cl = resolve_cluster(devices, cluster) if cluster is not None else Cluster.cpu(devices)
    if plan is None:
        chosen = search(model, example_inputs, cluster=cl, global_batch=global_batch, loss_fn=loss_fn,
                        constraints=constraints).plan
    else:
        chosen = load_and_check(plan, captured(model, example_inputs, loss_fn=loss_fn), cl,
                                global_batch=global_batch)
        checker_for(model, example_inputs, loss_fn=loss_fn).check(
            chosen, source=str(plan) if isinstance(plan, (str, Path)) else "plan")
    batch = _check_batch(example_inputs, chosen)
    quiet, dropout_off = quiet_copy(model)
    graph = checker_for(quiet, batch, loss_fn=loss_fn).graph_for(chosen)
    if not isinstance(graph, ModelGraph):
        raise RuntimeError(graph.message())
    _refuse_random(graph)
    ref = reference_step(copy.deepcopy(quiet), batch, loss_fn)
    results = launch(_rank_step, devices=chosen.mesh.size, args=(quiet, batch, chosen, loss_fn))
    loss, grads = results[0]
    return _compare(chosen, graph, ref, loss, {k: torch.from_numpy(v) for k, v in grads.items()},
                    devices=chosen.mesh.size, rows=_rows(batch), dropout_off=dropout_off)


def check_on_ranks(model: nn.Module, example_inputs: Sequence[Any], plan: Plan, *,
                   loss_fn: Callable[..., torch.Tensor] | None = None) -> CheckReport:
    """The same check inside launched ranks (``parallelize(..., check=True)``): every rank runs the
    step on a copy of ``model``, rank 0 runs the reference and compares, and every rank gets the
    report. Collective. Raises :class:`CheckFailed` on every rank if the runs differ."""
    batch = _check_batch(example_inputs, plan)
    quiet, dropout_off = quiet_copy(model)
    pm = ParallelModule(quiet, plan, example_inputs=batch, loss_fn=loss_fn,
                        optimizer=functools.partial(torch.optim.SGD, lr=0.0))
    _refuse_random(pm.graph)
    loss = pm.train_step(batch)
    grads = pm.full_grads()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        ref = reference_step(copy.deepcopy(quiet), batch, loss_fn)
        box[0] = _compare(plan, pm.graph, ref, loss, grads, devices=dist.get_world_size(), rows=_rows(batch),
                          dropout_off=dropout_off)
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    report: CheckReport = box[0]
    if not report.ok:
        raise CheckFailed(report)
    return report


def _rows(batch: Sequence[Any]) -> int:
    return next(int(t.shape[0]) for t in batch if isinstance(t, torch.Tensor) and t.dim() > 0)
