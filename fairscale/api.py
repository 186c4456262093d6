"""The public entry points: ``fairscale.search``, ``fairscale.plan`` and ``fairscale.parallelize``.

Typical use, on a laptop with CPU ranks::

    import fairscale

    result = fairscale.search(model, batch, devices=8)      # capture + plan, in this process
    print(result.table())                                    # the winner, the runners-up, and why

    def train(rank, world):
        pm = fairscale.parallelize(model, example_inputs=batch, plan=result.plan)
        for step in range(100):
            loss = pm.train_step(next_batch(step))           # same global batch on every rank

    fairscale.launch(train, devices=8)

Under ``torchrun`` call ``parallelize`` in the script directly: ``devices`` defaults to the launched
world size. Captures and searches are cached in this process, so ranks forked after the parent
planned reuse its work instead of capturing eight times.
"""

from __future__ import annotations

import json
import os
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fairscale.arguments import check_all, check_allocated
from fairscale.build import build_module, memory_by_stage, rank_memory
from fairscale.calibrate_host import measure_runtime_host
from fairscale.capture_cache import model_key
from fairscale.closed_loop import ClosedLoop, steps_requested
from fairscale.compile_check import CompileChecker, checker_for
from fairscale.runtime.calibrate_gpu import gpu_cluster
from fairscale.runtime.calibration_cache import cpu_cluster
from fairscale.runtime.device import resolve_device, use_device
from fairscale.runtime.engine import OptimizerSpec, ParallelModule
from fairscale.runtime.launch import init_distributed, under_torchrun
from fairscale.runtime.model_guard import fairscale_uses_models
from fairscale.runtime.model_owners import check_owned, started_behind
from fairscale.runtime.reshard import reshard
from fairscale.runtime.startup import broadcast_from_zero, on_zero
from passes.tp.patterns import propose_tp_rules
from passes.dp.graph import dtype_of
from planner.capture import CaptureError, capture
from planner.cluster import Cluster, default_compute_dtype
from planner.graph import ModelGraph
from planner.api import plan_for
from planner.api import resolve_cluster as _resolve_cluster
from planner.plan import DTYPES as PLAN_DTYPES
from planner.plan import KEEP_BATCH_WHOLE, Plan, PlanError, whole_batch
from planner.search import Compiles, NoCompilablePlan, SearchResult, cost_plan
from planner.search.core import DTYPE_NAMES, compute_dtype
from planner.search.space import parse_constraints
from planner.validate import validate_plan
from planner.validate_fields import fp16_problem

__all__ = ["search", "plan", "parallelize", "switch_plan", "captured", "known_dtype", "planning_dtype", "resolve_cluster",
           "search_graph", "tp_rules_of"]

_CAPTURES: dict[tuple[Any, ...], ModelGraph] = {}
_SEARCHES: dict[tuple[Any, ...], SearchResult] = {}


def captured(model: nn.Module, example_inputs: Sequence[Any], *,
             loss_fn: Callable[..., torch.Tensor] | None = None, dtype: str = "fp32") -> ModelGraph:
    """``planner.capture.capture`` with an in-process cache keyed by the model, shapes and loss,
    and the model's state (``fairscale.capture_cache.model_state``: its structure and settings).
    The captured graph shares the model's parameters (no copy, and never stale weights); an entry
    lives as long as its model, so the cache neither keeps a dropped model's weights alive nor
    gives a new model at a freed one's address the old capture.

    ``dtype`` is the compute dtype of the plans the capture costs: for ``bf16``/``fp16`` the model
    is traced and annotated as those plans' ranks run it (``capture(dtype=...)``), so the fp32
    tensors of its upcasts (an RMSNorm's statistics, a loss's fp32 logits) are counted at 4 bytes
    and the rest at 2, where halving an fp32 capture's bytes counted them all at 2 (HF Llama's
    saved activations 1.6× the halved figure at 256 tokens, its logits dominating). A model that
    cannot be traced in that dtype gets its fp32 capture (the compile check then says why)."""
    key = (*model_key(model, example_inputs, loss_fn), dtype)  # a changed model is captured anew
    if key not in _CAPTURES:
        low = dtype_of(dtype, "param_dtype")
        try:
            graph = capture(model, tuple(example_inputs), loss_fn=loss_fn, dtype=low)
        except CaptureError:
            if low is None:
                raise
            graph = captured(model, example_inputs, loss_fn=loss_fn)
        _CAPTURES[key] = graph
        weakref.finalize(model, _CAPTURES.pop, key, None)
    return _CAPTURES[key]


def known_dtype(name: str) -> str:
    """A plan's compute dtype ``name`` as :func:`captured` takes it: ``fp32`` for a name that is not
    a plan dtype (a hand-edited file's; validation reports it)."""
    return name if name in PLAN_DTYPES else "fp32"


def planning_dtype(cluster: Cluster, constraints: dict[str, Any] | Plan | None, dtype: str | None) -> str:
    """The compute dtype a search for ``cluster`` plans in (``planner.search.core.compute_dtype``:
    the constraints' ``data_parallel.param_dtype``, else ``dtype``, else the cluster's default),
    which the capture it costs from is traced in (:func:`captured`). fp16 asked for is refused here,
    before the capture: the compile check had refused it mesh by mesh after the whole search."""
    fixed = parse_constraints(constraints)
    asked = (("dtype", DTYPE_NAMES.get(dtype or "", dtype)), ("data_parallel.param_dtype", fixed.param_dtype),
             ("data_parallel.reduce_dtype", fixed.reduce_dtype))
    if refused := [p for path, value in asked if (p := fp16_problem(path, value or ""))]:
        raise PlanError(refused, source="constraints" if refused[-1].startswith("data_") else "dtype")
    return compute_dtype(fixed.param_dtype, dtype, cluster)


def resolve_cluster(devices: int | None = None, cluster: Cluster | str | None = None, *,
                    device: torch.device | None = None) -> Cluster:
    """The cluster to plan for (``planner.api.resolve_cluster``: a Cluster or a preset name, else
    the detected GPUs, where no CUDA context is created), with ``devices`` defaulting to the
    launched world size. Without GPUs, or when ``device`` (the ranks' device) is a CPU device,
    ``devices`` CPU ranks (default ``WORLD_SIZE``), even on a machine with GPUs."""
    if devices is None and dist.is_initialized():
        devices = dist.get_world_size()
    if cluster is None and ((device is not None and device.type == "cpu") or torch.cuda.device_count() == 0):
        return cpu_cluster(devices or int(os.environ.get("WORLD_SIZE", "1")),  # measured once, cached
                           runtime_host=measure_runtime_host)
    if cluster is None:  # the detected GPUs, with what calibration measured they achieve (once, cached)
        return _resolve_cluster(gpu_cluster(_resolve_cluster(None)), devices=devices)
    return _resolve_cluster(cluster, devices=devices)


def tp_rules_of(graph: ModelGraph) -> Callable[[int], dict[str, str]]:
    """The tensor-parallel candidates every way in passes to the planner: the graph-based detector
    next to the TP pass (``passes.tp.patterns.propose_tp_rules``), which keeps only the rules the
    pass accepts at each degree."""
    return lambda tp: propose_tp_rules(graph.gm, tp=tp).rules


def search_graph(graph: ModelGraph, cluster: Cluster, *, global_batch: int | None = None,
                 constraints: dict[str, Any] | Plan | None = None, dtype: str | None = None, top_k: int = 3,
                 progress: Callable[[int, int, float | None], None] | None = None,
                 use_all_devices: bool = False, compiles: Compiles | None = None,
                 check_runners_up: bool = True) -> SearchResult:
    """Search a captured graph through ``planner.api.plan_for`` with the face's tensor-parallel
    rules (:func:`tp_rules_of`) and, given ``compiles`` (``fairscale.compile_check.checker_for``),
    the plan-time compile check; what :func:`search`, :func:`parallelize` and ``fairscale plan``
    all call, cached in this process."""
    gb = global_batch or graph.batch_size
    ckey = json.dumps(constraints.to_dict() if isinstance(constraints, Plan) else constraints, sort_keys=True)
    key = (graph.fingerprint, id(graph), json.dumps(cluster.to_dict(), sort_keys=True), gb, ckey, dtype, top_k,
           use_all_devices, compiles is not None, check_runners_up)
    if key not in _SEARCHES:
        def plain(dtype: str | None, constraints: dict[str, Any] | Plan | None = constraints) -> SearchResult:
            return plan_for(graph, cluster, global_batch=gb, constraints=constraints, tp_rules=tp_rules_of(graph),
                            dtype=dtype, top_k=top_k, progress=progress, use_all_devices=use_all_devices,
                            compiles=compiles, check_runners_up=check_runners_up)

        def run(dtype: str | None) -> SearchResult:
            found: SearchResult | None = None
            try:
                found = plain(dtype)
            except NoCompilablePlan as refused:
                error = refused
            if isinstance(compiles, CompileChecker) and compiles.rows_coupled:
                refused = found.refused if found is not None else error.refused
                found = _with_whole_batch(found, lambda c: plain(dtype, c), constraints, compiles.rows_coupled)
                if found is not None and found.refused is not refused:
                    found.refused[:0] = [c for c in refused if c not in found.refused]
            if found is None:
                raise error
            return found
        try:
            _SEARCHES[key] = run(dtype)
        except NoCompilablePlan:
            blocker = _default_dtype_blocker(cluster, constraints, dtype, compiles)
            if blocker is None:
                raise
            if graph.extra.get("trace_dtype") is not None:  # fp32 plans are costed from the fp32 capture
                graph = captured(compiles.model, compiles.example_inputs, loss_fn=compiles.loss_fn)
            _SEARCHES[key] = found = run("fp32")
            for c in (found.best, *found.runners_up):
                c.plan.predicted.notes.append(blocker)
    return _SEARCHES[key]


def _with_whole_batch(found: SearchResult | None, again: Callable[[dict[str, Any]], SearchResult],
                      constraints: dict[str, Any] | Plan | None, why: str) -> SearchResult | None:
    """The faster of ``found`` and the search again with the batch kept whole (``KEEP_BATCH_WHOLE``),
    after the loss check refused plans that cut it (``why``): the search gives a refused
    mesh up whole, so a pipeline or tensor-parallel mesh that runs with one microbatch was lost."""
    fixed = parse_constraints(constraints)
    if fixed.dp not in (None, 1) or fixed.microbatches not in (None, 1):
        return found  # the user fixed a cut
    try:
        other = again(whole_batch(constraints))
    except PlanError:  # nothing fits or compiles with the batch whole
        return found
    if found is not None and found.best.plan.predicted.step_time_s <= other.best.plan.predicted.step_time_s:
        return found
    for c in (other.best, *other.runners_up):
        c.plan.predicted.notes.append(f"searched with the batch whole ({KEEP_BATCH_WHOLE}): {why}")
    return other


def _default_dtype_blocker(cluster: Cluster, constraints: dict[str, Any] | Plan | None, dtype: str | None,
                           compiles: Compiles | None) -> str | None:
    """Why the search's own default dtype (bf16 on GPUs; nobody asked for it) cannot run this model,
    so that it plans in fp32 instead, or None (the dtype was asked for, or is not the reason)."""
    default = default_compute_dtype(cluster)
    if dtype not in (None, "auto") or parse_constraints(constraints).param_dtype or default == "fp32" \
            or not isinstance(compiles, CompileChecker):
        return None
    problem = compiles.dtype_problem(default)
    if problem is None:
        return None
    return f"planned in fp32, not {cluster.name}'s default {default}, which cannot run this model: {problem}"


@fairscale_uses_models
def search(model: nn.Module, example_inputs: Sequence[Any], *, devices: int | None = None,
           cluster: Cluster | str | None = None, global_batch: int | None = None,
           loss_fn: Callable[..., torch.Tensor] | None = None, constraints: dict[str, Any] | Plan | None = None,
           dtype: str | None = None, top_k: int = 3,
           progress: Callable[[int, int, float | None], None] | None = None,
           check_runners_up: bool = True) -> SearchResult:
    """Capture ``model`` and search plans for the cluster; returns the best plan and runners-up.

    Every plan returned compiles: the search runs the plan-time compilation check
    (:mod:`fairscale.compile_check`) on its winner and runners-up and moves on from any plan the
    passes refuse; ``result.refused`` (and ``result.table()``) say which and why.

    Args:
        example_inputs: one batch (a tuple), as ``planner.capture`` takes it.
        devices: number of devices (default: the launched world size, or the detected GPUs); with
            a preset, a count that is not a multiple of its node size leaves the last node partial.
        cluster: a ``planner.cluster.Cluster`` or a preset name such as ``"a100-80gb"``.
        global_batch: samples per optimizer step (default: the example batch's size).
        constraints: fields to fix, in the plan's JSON shape, e.g. ``{"mesh": {"tp": 2}}``.
        dtype: compute dtype, ``bf16``, ``fp16``, ``fp32`` or ``auto`` (default): mixed precision
            (bf16, fp16 where bf16 is unsupported) on GPUs, fp32 on CPU ranks.
        check_runners_up: compile-check the runners-up too (default); False checks only the
            winner (the runners-up are costed, marked unchecked): what :func:`plan` does.

    A plan may leave devices idle when that is faster (a batch that does not split over them);
    ``result.plan.predicted.notes`` says how many and why.
    """
    example_inputs, _ = check_all(model, example_inputs, loss_fn=loss_fn, devices=devices)
    cl = resolve_cluster(devices, cluster)
    graph = captured(model, example_inputs, loss_fn=loss_fn, dtype=planning_dtype(cl, constraints, dtype))
    return search_graph(graph, cl, global_batch=global_batch, constraints=constraints,
                        dtype=dtype, top_k=top_k, progress=progress,
                        compiles=checker_for(model, example_inputs, loss_fn=loss_fn, graph=graph),
                        check_runners_up=check_runners_up)


def plan(model: nn.Module, example_inputs: Sequence[Any], **kwargs: Any) -> Plan:
    """The best plan for ``model``; arguments as :func:`search`. Only the winner is compile-checked
    (``check_runners_up=False``): the runners-up are not returned."""
    kwargs.setdefault("check_runners_up", False)
    return search(model, example_inputs, **kwargs).plan


@fairscale_uses_models
def parallelize(model: nn.Module, devices: int | None = None, *, example_inputs: Sequence[Any],
                loss_fn: Callable[..., torch.Tensor] | None = None, plan: Plan | str | Path | None = None,
                cluster: Cluster | str | None = None, optimizer: OptimizerSpec | None = None,
                global_batch: int | None = None, constraints: dict[str, Any] | None = None,
                dtype: str | None = None, device: str | torch.device | None = None, tf32: bool = True,
                check: bool = False, calibrate: bool | int | None = None) -> ParallelModule:
    """Capture, plan (or load and check ``plan``), rewrite and return this rank's trainable module.

    Call it on every rank (inside ``fairscale.launch`` or torchrun) with the same model and batch.

    Args:
        model: the model, initialized (every rank must hold the same weights, e.g. the same seed
            or a model inherited through fork).
        devices: number of ranks; default the launched world size.
        example_inputs: one global batch (a tuple; a dict by name for a model returning its loss);
            fixes shapes and the default global batch.
        loss_fn: ``loss_fn(model(batch[0]), *batch[1:])``; without it ``model(*batch)`` returns
            the loss (or an object with ``.loss``).
        plan: a Plan, or the path of a plan file, to use instead of searching. It is validated
            against the model, re-costed (a plan predicted not to fit in memory warns) and
            compiled for every rank before any rank builds its module (``PlanCompileError``,
            the same on every rank, if the passes refuse it).
        cluster: what to plan for (default: detected GPUs, else CPU ranks).
        optimizer: an optimizer class or ``functools.partial`` of one (default Adam, lr 1e-3), or
            an optimizer built over ``model``'s parameters, with parameter groups if it has them
            (weight decay for some parameters only): each rank's ``pm.optimizer`` gets the same
            groups and options over its shards (:mod:`fairscale.runtime.optim_groups`); the
            instance itself is not stepped.
        global_batch: samples per step (default: the example batch's size).
        constraints: fields the search must keep (an error with ``plan``).
        dtype: compute dtype for the search (see :func:`search`; ignored when ``plan`` is given).
        device: where this rank computes. Default: ``cuda:LOCAL_RANK`` when the process group is
            NCCL (the default whenever CUDA is present), else ``cpu``. It is made the current CUDA
            device before anything touches CUDA. ``"cpu"`` with NCCL, or a CUDA device without
            one, is an error. The model stays where it is: each rank's slices and shards are built
            on the device one parameter at a time, and batches are moved there without blocking.
        tf32: on a CUDA device, run fp32 matmuls in TF32 (unless the user already chose a
            precision; ``fairscale.runtime.device.enable_tf32``). ``False`` keeps IEEE fp32.
        check: first run one step of the plan on a copy of the model and compare its loss and
            gradients with one process (``fairscale check``, :mod:`fairscale.check`); raises
            ``fairscale.CheckFailed`` on every rank if they differ, else the report is
            ``pm.check_report``. Costs one extra compile and step.
        calibrate: close the loop (:mod:`fairscale.closed_loop`): after one warm-up step, time the
            next ``calibrate`` steps (``True``: 5) by term, print predicted against measured, refit
            the cost model to the measurement, search again, and if another plan is predicted at
            least 10% faster, switch ``pm`` to it live (``fairscale.switch_plan``); the report is
            ``pm.closed_loop_report``. Default: ``FAIRSCALE_CALIBRATE`` (``fairscale run --calibrate``), else off.

    Returns:
        :class:`fairscale.runtime.engine.ParallelModule`: ``pm.train_step(batch)``, ``pm(batch)``
        for pp = 1, ``pm.plan``, ``pm.report()``, ``pm.memory_report()``, ``pm.state_dict()``.
        The rank holds its own share of the weights once (``fairscale.build``): neither the module
        nor this process's caches keep a reference to the capture or the user's model.
    """
    example_inputs, optimizer = check_all(model, example_inputs, loss_fn=loss_fn, optimizer=optimizer, devices=devices,
                                          plan=plan, constraints=constraints)
    check_allocated(model)
    behind = check_owned(model)  # no trainable weight another module trains; behind a module built from it?
    if not dist.is_initialized() and under_torchrun():  # torchrun initializes nothing; fairscale.train does too
        init_distributed(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), init_method="env://")
    if not dist.is_initialized():
        raise RuntimeError("parallelize runs on every rank: call it inside fairscale.launch(fn, devices=N), "
                           "`python -m fairscale run --devices N script.py`, or torchrun; to inspect a plan "
                           "without ranks, use fairscale.search or `python -m fairscale plan`")
    devices = devices or dist.get_world_size()
    if devices != dist.get_world_size():
        raise ValueError(f"devices={devices}, but {dist.get_world_size()} ranks were launched")
    rank_device = resolve_device(device)
    use_device(rank_device)  # before anything below can create a CUDA context on another GPU
    cl = _same_on_every_rank(resolve_cluster(devices, cluster, device=rank_device))
    if plan is None:  # every launched rank takes part: no plan that leaves devices idle
        def plan_on_zero() -> tuple[Plan, list[dict[str, float]]]:
            graph = captured(model, example_inputs, loss_fn=loss_fn, dtype=planning_dtype(cl, constraints, dtype))
            found = search_graph(graph, cl, global_batch=global_batch, constraints=constraints, dtype=dtype,
                                 use_all_devices=True, compiles=checker_for(model, example_inputs, loss_fn=loss_fn,
                                                                            graph=graph),
                                 check_runners_up=False).plan
            # the search costs any dtype (fp16 plans compare with published fp16 runs); running one needs
            # loss scaling, which plan files are refused for in validation and searched plans here
            refused = [p for name in ("param_dtype", "reduce_dtype")
                       if (p := fp16_problem(f"data_parallel.{name}", getattr(found.data_parallel, name)))]
            if refused:
                raise PlanError(refused, source="constraints")
            costed = captured(model, example_inputs, loss_fn=loss_fn, dtype=found.data_parallel.param_dtype)
            return found, memory_by_stage(found, costed, cl, optimizer=optimizer)

        chosen, by_stage = on_zero(plan_on_zero, "planning (rank 0 captures the model and searches)")
        predicted = rank_memory(chosen, by_stage)
    else:
        chosen, predicted = _checked_on_zero(plan, model, example_inputs, loss_fn, cl, global_batch, optimizer)
        check_compiles_on_ranks(model, example_inputs, chosen, loss_fn=loss_fn,
                                source=str(plan) if isinstance(plan, (str, Path)) else "plan")
    report = None
    if check:
        from fairscale.check_step import check_on_ranks

        report = check_on_ranks(model, example_inputs, chosen, loss_fn=loss_fn)
    in_dtype = chosen.data_parallel.param_dtype
    pm = build_module(model, chosen, example_inputs=example_inputs, loss_fn=loss_fn, optimizer=optimizer,
                      device=rank_device, tf32=tf32, predicted=predicted)
    pm.check_report = report
    started_behind(pm, model, behind)  # its calls refuse the old weights, but for pm.load_checkpoint
    steps = steps_requested(calibrate, dict(os.environ))
    if steps:  # the loop re-plans on rank 0 only (ClosedLoop.finish): the capture is made there, when needed
        gb, keep_dtype = pm.global_batch, dtype or in_dtype  # switching keeps the numerics

        def graph_of() -> ModelGraph:
            return captured(model, example_inputs, loss_fn=loss_fn, dtype=in_dtype)

        def replan(refit: Cluster) -> Plan:
            return search_graph(graph_of(), refit, global_batch=gb, constraints=constraints, dtype=keep_dtype,
                                use_all_devices=True, compiles=checker_for(model, example_inputs, loss_fn=loss_fn),
                                check_runners_up=False).plan

        ClosedLoop(steps, graph_of=graph_of, cluster=cl, replan=replan,
                   switch=lambda old, new, refit: switch_plan(old, new, cluster=refit)).attach(pm)
    return pm


@fairscale_uses_models
def switch_plan(pm: ParallelModule, plan: Plan | str | Path, *, cluster: Cluster | str | None = None,
                ) -> ParallelModule:
    """``pm``'s whole training state resharded in memory to ``plan`` on the same ranks; returns the
    new module, and ``pm`` is retired (its calls raise). Collective: every rank calls it alike.

        pm = fairscale.switch_plan(pm, "dp4.json")      # training continues exactly where it was

    Parameters, buffers and the optimizer's state (moments and step counts; a tied weight's under
    every name of the tie) move through the any-plan checkpoint's mapping, without a disk
    (:mod:`fairscale.runtime.reshard`). The plan is checked as ``parallelize(plan=...)`` checks one
    (validated, re-costed, compiled on rank 0 first) before any state moves, and must keep the
    global batch. The new module's ``optimizer`` is ``pm.optimizer``, the same object, now holding
    the new plan's stage optimizers, whose hyperparameters (``lr`` and a scheduler's ``initial_lr``
    included) carry over: a learning-rate scheduler attached to it keeps driving it.

    Args:
        pm: a module built by ``fairscale.parallelize``; the user's model it was built from must
            still be alive (its structure is compiled again; its weights are not read).
        plan: a Plan or the path of a plan file.
        cluster: what the plan is costed for (default: as ``parallelize``).
    """
    if pm.retired:
        raise RuntimeError(pm.retired)
    program = pm.rank_program
    model = program.model()
    if model is None:
        raise RuntimeError("switch_plan compiles the new plan from the user's model, which is gone: keep a "
                           "reference to the model passed to fairscale.parallelize while training")
    batch, loss_fn = program.example_inputs, program.loss_fn
    cl = _same_on_every_rank(resolve_cluster(dist.get_world_size(), cluster, device=pm.device))
    chosen, predicted = _checked_on_zero(plan, model, batch, loss_fn, cl, pm.global_batch, pm.optimizer_spec)
    if chosen.schedule.global_batch != pm.global_batch:
        raise ValueError(f"the new plan's global batch is {chosen.schedule.global_batch}, but this run trains on "
                         f"{pm.global_batch} samples per step; a live switch keeps the global batch (set "
                         f"schedule.global_batch to {pm.global_batch}, or leave it out)")
    check_compiles_on_ranks(model, batch, chosen, loss_fn=loss_fn,
                            source=str(plan) if isinstance(plan, (str, Path)) else "plan")
    optimizer = pm.optimizer  # the object a user's scheduler holds; reshard retires pm
    new = reshard(pm, lambda: build_module(model, chosen, example_inputs=batch, loss_fn=loss_fn,
                                           optimizer=pm.optimizer_spec, device=pm.device,
                                           tf32=pm.tf32_requested, predicted=predicted))
    optimizer.adopt(new.optimizer)
    new.optimizer = optimizer
    return new


def check_compiles_on_ranks(model: nn.Module, example_inputs: Sequence[Any], plan: Plan, *,
                            loss_fn: Callable[..., torch.Tensor] | None = None, source: str = "plan") -> None:
    """The plan-time compilation check, run once (on global rank 0, or found in the cache of a
    parent that already checked) with its verdict sent to every rank, so that all ranks refuse
    the plan alike (``PlanCompileError``) before any of them builds its module. Collective."""
    from fairscale.compile_check import PlanCompileError

    checker = checker_for(model, example_inputs, loss_fn=loss_fn)
    verdict = [checker.refusal(plan) if dist.get_rank() == 0 else None]
    broadcast_from_zero(verdict, "the plan-time compile check")
    if verdict[0] is not None:
        raise PlanCompileError(verdict[0], source=source)


def _checked_on_zero(plan: Plan | str | Path, model: nn.Module, example_inputs: Sequence[Any],
                     loss_fn: Callable[..., torch.Tensor] | None, cluster: Cluster, global_batch: int | None,
                     optimizer: OptimizerSpec | None) -> tuple[Plan, dict[str, float]]:
    """``plan`` loaded, validated and re-costed (:func:`load_and_check`) with its predicted memory
    (``fairscale.build.memory_by_stage``), worked out on global rank 0 and sent to every rank
    (``fairscale.runtime.startup.on_zero``): both cost from the annotated capture, which every
    rank would otherwise trace and annotate again (8 ranks on 2 cores: about 1 s of CPU each for
    a small model). Collective."""
    def graph_of(dtype: str) -> ModelGraph:
        return captured(model, example_inputs, loss_fn=loss_fn, dtype=dtype)

    def check() -> tuple[Plan, list[dict[str, float]]]:
        chosen = load_and_check(plan, graph_of, cluster, global_batch=global_batch)
        return chosen, memory_by_stage(chosen, graph_of(chosen.data_parallel.param_dtype), cluster,
                                       optimizer=optimizer)

    chosen, by_stage = on_zero(check, "checking the plan (rank 0 validates and costs it)")
    return chosen, rank_memory(chosen, by_stage)


def _same_on_every_rank(cluster: Cluster) -> Cluster:
    """Global rank 0's cluster on every rank: a calibration cached while the ranks started must not
    give them different figures, and so different plans."""
    if dist.get_world_size() == 1:
        return cluster
    box = [cluster.to_dict() if dist.get_rank() == 0 else None]
    broadcast_from_zero(box, "resolving the cluster (a first calibration measures the machine)")
    return Cluster.from_dict(box[0])


def load_and_check(plan: Plan | str | Path, graph: ModelGraph | Callable[[str], ModelGraph], cluster: Cluster, *,
                   global_batch: int | None = None) -> Plan:
    """Load ``plan`` if it is a path, validate it against ``graph`` and ``cluster`` (raising
    PlanError with every problem), and re-cost it; warn if it is predicted not to fit in memory.
    ``graph`` may be a function of the plan's compute dtype (:func:`captured`'s ``dtype``)."""
    if isinstance(plan, (str, Path)):
        loaded, schema = Plan.read(plan)
        source = str(plan)
    else:
        loaded, schema, source = plan, [], "plan"
    if callable(graph):
        graph = graph(known_dtype(loaded.data_parallel.param_dtype))
    validate_plan(loaded, graph, cluster, devices=cluster.devices, source=source, schema_problems=schema)
    gb = global_batch or loaded.schedule.global_batch or graph.batch_size
    if not loaded.schedule.global_batch:
        loaded.schedule.global_batch = gb
    cost = cost_plan(loaded, graph, cluster, global_batch=gb, validate=False)
    loaded.predicted = cost.predicted
    if not cost.fits:
        worst = max(range(len(cost.memory_bytes)), key=lambda r: cost.memory_bytes[r])
        warnings.warn(f"plan predicted not to fit: pipeline rank {worst} needs "
                      f"{cost.memory_bytes[worst] / 2**30:.2f} GiB of {cost.memory_cap / 2**30:.2f} GiB usable",
                      stacklevel=3)
    return loaded
