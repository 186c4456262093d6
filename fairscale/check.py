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
and everything before it inherits the difference). The user's model is never modified. The
rank-side pieces live in :mod:`fairscale.check_step` (``parallelize`` imports them; this module
imports ``parallelize``'s module to search and load plans).

A mixed-precision plan (``data_parallel.param_dtype`` bf16 or fp16) is compared with one process
computing as it does: the copy's parameters and the batch's floating tensors cast to that dtype,
buffers as they are (``reference_step(dtype=)``), at that dtype's tolerance (the loss and every
gradient within 2⁻⁵ relative for bf16: a coarse check, which still sees a missing or doubled
reduction, a gradient off by a whole factor). Against an fp32 reference every such plan would be
a false alarm.

Dropout draws other random numbers on a rank than in one process, so the copies run with every
``nn.Dropout*`` module's ``p`` set to 0 (listed in the report). Random ops that are not modules
(``F.dropout(x, p=0.1)`` in a forward, ``torch.rand``) cannot be turned off from outside and
make the check refuse to compare, naming them.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fairscale.check_step import (CheckFailed, CheckReport, RandomOpsError, _check_batch, _compare, _rank_step,
                                  _refuse_random, _rows, backward_order, check_on_ranks, quiet_copy, random_ops,
                                  reference_step)
from fairscale.capture_cache import trace_dtype
from fairscale.runtime.model_guard import fairscale_uses_models
from fairscale.compile_check import checker_for
from planner.cluster import Cluster
from planner.graph import ModelGraph
from planner.plan import Plan

__all__ = ["check", "check_on_ranks", "CheckReport", "CheckFailed", "RandomOpsError", "quiet_copy", "random_ops",
           "backward_order", "reference_step"]

@fairscale_uses_models
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
        chosen = load_and_check(plan, lambda dt: captured(model, example_inputs, loss_fn=loss_fn, dtype=dt), cl,
                                global_batch=global_batch)
        checker_for(model, example_inputs, loss_fn=loss_fn).check(
            chosen, source=str(plan) if isinstance(plan, (str, Path)) else "plan")
    batch = _check_batch(example_inputs, chosen)
    quiet, dropout_off = quiet_copy(model)
    graph = checker_for(quiet, batch, loss_fn=loss_fn).graph_for(chosen)
    if not isinstance(graph, ModelGraph):
        raise RuntimeError(graph.message())
    _refuse_random(graph)
    ref = reference_step(copy.deepcopy(quiet), batch, loss_fn, dtype=trace_dtype(chosen))
    results = launch(_rank_step, devices=chosen.mesh.size, args=(quiet, batch, chosen, loss_fn))
    loss, grads = results[0]
    return _compare(chosen, graph, ref, loss, {k: torch.from_numpy(v) for k, v in grads.items()},
                    devices=chosen.mesh.size, rows=_rows(batch), dropout_off=dropout_off)
