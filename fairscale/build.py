"""The face's compile step: capture → ``passes.compile_rank`` → a :class:`RankProgram` for the runtime.

``fairscale.parallelize`` plans (or checks a given plan) and then calls :func:`compile_program`,
which on this rank

1. chooses the device (``fairscale.runtime.device``: ``cuda:LOCAL_RANK`` under NCCL, else CPU) and
   makes it current before anything touches CUDA;
2. captures the model at the shape one microbatch has on one rank (global batch / (dp ×
   microbatches)), because exported graphs are shape-specialized: ``fairscale.capture_cache``'s
   capture, which the plan-time compile check made already where it ran in this process or in
   the parent this rank was forked from (the key sees any change to the model's structure or
   settings, so it is never stale);
3. checks that every rank holds the same initial weights (one checksum all-reduce);
4. runs the pass pipeline for this rank's stages (``passes.compile_rank``), which builds the rank's
   slices and shards directly on the device, one parameter at a time, and keeps no reference to
   the capture's tensors: the rank holds one copy of its share of the weights (the capture holds
   the user's model's own tensors, no copy, and is dropped with the model);
5. renders the plan's report and the planner's memory prediction for this rank into the program.

:func:`build_module` wraps the result in a :class:`fairscale.runtime.engine.ParallelModule`: what
``parallelize`` returns, without searching, validating or checking the plan.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fairscale.capture_cache import rank_capture, trace_dtype
from fairscale.eval_mode import eval_modules
from fairscale.report.text import render_report
from fairscale.runtime.device import resolve_device, use_device
from fairscale.runtime.batch_form import KeywordBatch, microbatch_example
from fairscale.runtime.engine import OptimizerSpec, ParallelModule
from fairscale.runtime.init import check_replicas
from fairscale.runtime.mesh import RankMesh
from fairscale.runtime.model_guard import fairscale_uses_models
from fairscale.runtime.frozen import trainable_of
from fairscale.runtime.modes import forward_set, modes_of
from fairscale.runtime.optim_groups import OptimizerGroups
from fairscale.runtime.user_optimizer import disown, watch
from fairscale.runtime.program import MEMORY_PARTS, RankProgram
from fairscale.runtime.startup import rendezvous
from passes import compile_rank
from passes.loss_weights import token_counter
from planner.cluster import Cluster
from planner.cost import CostOptions
from planner.graph import ModelGraph
from planner.mode_setters import MODES_SET
from planner.plan import Plan, PlanError
from planner.schedule import build_schedule
from planner.search import cost_plan

__all__ = ["compile_program", "build_module", "memory_by_stage", "rank_memory"]


@fairscale_uses_models
def compile_program(model: nn.Module, plan: Plan, *, example_inputs: Sequence[Any],
                    loss_fn: Callable[..., torch.Tensor] | None = None, device: str | torch.device | None = None,
                    predicted: dict[str, float] | None = None) -> RankProgram:
    """This rank's compiled part of ``plan`` (see the module docstring). Collective (the replica
    check). ``predicted``: the planner's memory per category for this rank, to carry along."""
    if not dist.is_initialized():
        raise RuntimeError("a ParallelModule runs on launched ranks: call fairscale.parallelize inside "
                           "fairscale.launch(fn, devices=N), `python -m fairscale run`, or torchrun")
    rank_device = resolve_device(device)
    use_device(rank_device)
    m = plan.mesh
    world = dist.get_world_size()
    if m.size != world:
        raise ValueError(f"mesh pp({m.pp}) × dp({m.dp}) × tp({m.tp}) = {m.size}, but the world has {world} ranks")
    gb = plan.schedule.global_batch or batch_rows(example_inputs)
    micro = plan.schedule.microbatches
    if gb % (m.dp * micro):
        raise ValueError(f"global batch {gb} does not split into dp({m.dp}) × microbatches({micro}) "
                         f"= {m.dp * micro} equal microbatches")
    rows = gb // (m.dp * micro)
    modes = modes_of(model)  # what the capture bakes into the rank graphs
    graph = rank_capture(model, microbatch_example(example_inputs, rows), loss_fn=loss_fn, dtype=trace_dtype(plan))
    modes = forward_set(model, modes, graph.extra.get(MODES_SET, ()))  # but modules the forward sets itself
    rendezvous("capturing the model")  # the collectives below wait for the slowest capture
    if not any(p.is_meta for p in graph.gm.parameters()):
        check_replicas(graph.gm, device=rank_device)  # under torchrun each rank built its own model
    schedule = build_schedule(plan.schedule.kind, pp=m.pp, microbatches=micro,
                              virtual_stages=plan.schedule.virtual_stages)
    coords = RankMesh(m.pp, m.dp, m.tp, dist.get_rank()).coords()
    stages, modules = compile_rank(graph, plan, stages=schedule.rank_stages(coords[0]), dp_index=coords[1],
                                   tp_index=coords[2], device=rank_device)
    rendezvous("compiling its part of the plan")  # before the module's first collectives
    return RankProgram(plan=plan, stages=stages, schedule=schedule, modules=modules, coords=coords,
                       device=rank_device, global_batch=gb, microbatch_rows=rows,
                       tied=[list(g) for g in graph.tied], report=render_report(plan, graph),
                       token_counter=token_counter(graph.gm),
                       model=weakref.ref(model), modes=modes, eval_modules=eval_modules,
                       trainable=trainable_of(model),
                       predicted_memory=dict(predicted or {}),
                       loss_fn=loss_fn, example_inputs=example_inputs if isinstance(example_inputs, KeywordBatch)
                       else tuple(example_inputs))


@fairscale_uses_models
def build_module(model: nn.Module, plan: Plan, *, example_inputs: Sequence[Any],
                 loss_fn: Callable[..., torch.Tensor] | None = None, optimizer: OptimizerSpec | None = None,
                 device: str | torch.device | None = None, tf32: bool = True,
                 predicted: dict[str, float] | None = None) -> ParallelModule:
    """:func:`compile_program` run by a :class:`ParallelModule`: ``plan`` as given, no search,
    validation or compile check (``fairscale.parallelize`` does those first)."""
    program = compile_program(model, plan, example_inputs=example_inputs, loss_fn=loss_fn, device=device,
                              predicted=predicted)
    pm = ParallelModule(program, optimizer=optimizer, tf32=tf32)
    instance = optimizer.source() if isinstance(optimizer, OptimizerGroups) and optimizer.source else None
    if instance is not None:  # the user's own instance no longer trains anything: keep it from use
        disown(instance)
        watch(pm.optimizer, optimizer.source, optimizer.options)  # type: ignore[union-attr, arg-type]
    return pm


def memory_by_stage(plan: Plan, graph: ModelGraph, cluster: Cluster, *, optimizer: OptimizerSpec | None = None,
                    ) -> list[dict[str, float]]:
    """Per pipeline rank, the bytes the cost model predicts it holds at its peak, per category
    (``MEMORY_PARTS``), for the runtime fairscale runs (``CostOptions.for_runtime``) and the
    optimizer given (Adam's two states, SGD's momentum; an optimizer the model does not know leaves
    ``optimizer`` out). ``graph`` is the annotated capture the plan was costed on. Empty (with a
    warning) when the cost model cannot cost the plan."""
    kind, states = _optimizer_kind(optimizer)
    options = dataclasses.replace(CostOptions.for_runtime(cluster), optimizer=kind)
    try:
        cost = cost_plan(plan, graph, cluster, global_batch=plan.schedule.global_batch or graph.batch_size,
                         options=options, validate=False)
    except (PlanError, ValueError) as exc:  # the plan was validated already: a prediction must not stop a run
        warnings.warn(f"pm.memory_report() will have no prediction: the cost model cannot cost this plan ({exc})",
                      stacklevel=3)
        return []
    out = []
    for stage in cost.memory_parts:
        parts = {k: float(stage[k]) for k in MEMORY_PARTS}
        if states is None:
            del parts["optimizer"]
        elif states == 0:
            parts["optimizer"] = 0.0
        out.append(parts)
    return out


def rank_memory(plan: Plan, by_stage: list[dict[str, float]]) -> dict[str, float]:
    """This rank's entry of :func:`memory_by_stage` (its pipeline rank's), or {} without one."""
    if not by_stage:
        return {}
    return by_stage[RankMesh(plan.mesh.pp, plan.mesh.dp, plan.mesh.tp, dist.get_rank()).coords()[0]]


def _optimizer_kind(spec: OptimizerSpec | None) -> tuple[str, int | None]:
    """(cost-model optimizer, per-element state tensors: None when the cost model does not know it)."""
    if isinstance(spec, OptimizerGroups):
        momentum = any(o.get("momentum", 0) for o in spec.options)
        cls, kwargs = spec.cls, {"momentum": momentum}
    else:
        cls, kwargs = (spec.func, spec.keywords) if isinstance(spec, functools.partial) else (spec, {})
    if cls is None or (isinstance(cls, type) and issubclass(cls, (torch.optim.Adam, torch.optim.AdamW))):
        return "adam", 2
    if isinstance(cls, type) and issubclass(cls, torch.optim.SGD):
        return "sgd", 1 if kwargs.get("momentum", 0) else 0
    return "adam", None


def batch_rows(batch: Sequence[Any]) -> int:
    """Rows (dim 0) of the batch's first tensor with a batch dimension."""
    for t in batch:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise ValueError("the example batch has no tensor with a batch dimension")
