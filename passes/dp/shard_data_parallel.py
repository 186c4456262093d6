"""Data parallelism as a graph rewrite: DDP, ZeRO-1, ZeRO-2 and FSDP (ZeRO-3) on the ``dp`` axis.

Usage::

    from passes.dp.shard_data_parallel import shard_data_parallel_pass, no_sync
    rank_gm = shard_data_parallel_pass(graph.gm, plan, dp_index=r, dp_size=n)
    loss = rank_gm(*my_slice_of_the_batch); loss.backward()
    print(rank_gm.code)      # dp_bucket(...) / fsdp_unshard(...) / fsdp_reshard(...) calls are visible

The input GraphModule is left intact: the result owns fresh copies of the parameters (replicated
kinds) or only this rank's flat shards (fsdp), so one captured graph can be compiled many times.
Inputs may be any GraphModule: capture's (batch in, loss out), a pipeline stage (arbitrary
placeholders, tuple output), or one the tensor-parallel pass already rewrote (its local slices are
what gets bucketed or flattened; ``layout.tp`` is carried over).

What each kind inserts (``n`` = dp size; volumes per rank per step, ``M`` = parameter bytes)::

    kind   forward                 backward                          optimizer step        volume
    ddp    dp_bucket: identity     all-reduce bucket, / n            local                 2(n-1)/n·M
    zero1  dp_bucket: identity     all-reduce bucket, / n            1/n shard, all-gather 3(n-1)/n·M
    zero2  dp_bucket: identity     reduce-scatter bucket, / n        1/n shard, all-gather 2(n-1)/n·M
    fsdp   fsdp_unshard: gather    reduce-scatter unit, / n          1/n shard (no comm)   3(n-1)/n·M
           fsdp_reshard: free      gather again (reshard units)                            (2 without reshard)

zero1 follows FairScale's OSS (full averaged gradients on every rank, optimizer state sharded);
zero2 keeps only 1/n of the gradients (ShardedDDP / DeepSpeed stage 2). Buckets and units are
padded to a multiple of ``n`` elements so every rank's shard has the same size.

``node.meta`` read: ``fs_param`` (get_attr: user key), ``val`` (placeholders and compute nodes:
dtype/shape, for casts and liveness). ``gm.meta`` read and written: ``fs_layout``
(:class:`passes.layout.ParamLayout`); written: ``fs_dp`` (:class:`DataParallelInfo`).
"""

from __future__ import annotations

import copy
from typing import Collection

import torch
import torch.fx

from passes.dp.buckets import insert_buckets, split_experts, split_replicated
from passes.dp.fsdp import rewrite_fsdp
from passes.dp.graph import cast_io, drop_aliases, dtype_of, find_params, fresh_layout, keep_frozen, place_graph, \
    placement, rebuild
from passes.dp.info import META_DP, DataParallelInfo, ExpertGroup, Placement, dp_info
from passes.ops.dp_ops import no_sync
from planner.plan import DP_KINDS, DataParallel, Plan
from planner.validate_fields import fp16_problem

__all__ = ["shard_data_parallel_pass", "no_sync", "DataParallelInfo", "META_DP"]  # the record: passes.dp.info

def shard_data_parallel_pass(gm: torch.fx.GraphModule, plan: Plan | DataParallel, *, dp_index: int, dp_size: int,
                             axis: str = "dp", replicate: Collection[str] = (), ep_size: int = 1,
                             expert_axis: str = "ep_rep", device: torch.device | str | None = None,
                             model_keys: Collection[str] | None = None) -> torch.fx.GraphModule:
    """Rewrite ``gm`` for rank ``dp_index`` of ``dp_size`` data-parallel ranks per ``plan.data_parallel``.

    Args:
        gm: a captured or already-rewritten GraphModule (left unchanged).
        plan: the Plan, or just its ``DataParallel`` section.
        dp_index, dp_size: this rank's position on the dp axis and the axis size.
        axis: the comm axis name collectives use (bound with ``passes.ops.comm.set_group``).
        replicate: user keys (any name of a tied tensor) to keep whole and all-reduce DDP-style
            whatever the kind, so ``p.grad`` is the full averaged gradient after backward: e.g.
            weights tied across pipeline stages, whose copies' gradients the pipeline then sums.
            The optimizer steps them unsharded.
        ep_size: the expert-parallel degree (``plan.mesh.ep``). The expert weights that
            :mod:`passes.ep.shard_experts` split (``layout.tp`` shards on axis ``"ep"``) are already
            this rank's own: whatever the kind, they stay as they are and their gradients, which come
            back summed over the ep group's tokens, are scaled by 1/ep and all-reduced DDP-style over
            ``expert_axis``, the dp/ep ranks holding the same experts (rank ``dp_index // ep``).
        device: where the rank graph runs (default: where ``gm``'s parameters are). Every tensor
            the pass makes is created there (shards directly, one parameter copied at a time, so
            the whole model never lands on the device), the graph's buffers move there, and
            device arguments baked into the capture's nodes are rewritten to it. With
            ``data_parallel.offload`` the tensors the optimizer steps (ZeRO master shards, FSDP
            flat shards) and so its state stay in host memory, pinned when ``device`` is CUDA.
        model_keys: fsdp: the parameter keys of the whole model when ``gm`` is one pipeline stage of
            it. ``data_parallel.units`` must select a module somewhere in the model, not in every
            stage: a stage it selects nothing in is all root unit. Default: ``gm``'s own keys.
    """
    cfg = plan.data_parallel if isinstance(plan, Plan) else plan
    if cfg.kind not in DP_KINDS:
        raise ValueError(f"data_parallel.kind = {cfg.kind!r}; choose one of {list(DP_KINDS)}")
    if isinstance(plan, Plan) and plan.mesh.dp != dp_size:
        raise ValueError(f"plan.mesh.dp = {plan.mesh.dp} but dp_size = {dp_size}: compile each rank with the "
                         "plan's dp degree")
    if not 0 <= dp_index < dp_size:
        raise ValueError(f"dp_index {dp_index} is outside [0, dp_size={dp_size})")
    if cfg.offload and cfg.kind == "ddp":
        raise ValueError("data_parallel.offload needs kind zero1, zero2 or fsdp (ddp keeps every state "
                         "replicated on the device); change kind or set offload=false")
    param_dtype = dtype_of(cfg.param_dtype, "param_dtype")
    reduce_dtype = dtype_of(cfg.reduce_dtype, "reduce_dtype")
    for name in ("param_dtype", "reduce_dtype"):  # refused in plan validation too; this path may skip it
        problem = fp16_problem(f"data_parallel.{name}", getattr(cfg, name))
        if problem:
            raise ValueError(problem)
    if ep_size < 1 or dp_size % ep_size:
        raise ValueError(f"ep_size = {ep_size} must divide dp_size = {dp_size}")
    experts = ExpertGroup(axis=expert_axis, size=dp_size // ep_size, index=dp_index // ep_size, ep=ep_size)
    place = placement(device, offload=cfg.offload, tensors=list(gm.parameters()))
    if cfg.kind == "fsdp":
        result = rewrite_fsdp(gm, cfg, dp_index=dp_index, dp_size=dp_size, axis=axis, param_dtype=param_dtype,
                              reduce_dtype=reduce_dtype, replicate=set(replicate), experts=experts, place=place,
                              model_keys=model_keys)
    else:
        result = _rewrite_buckets(gm, cfg, dp_index=dp_index, dp_size=dp_size, axis=axis, param_dtype=param_dtype,
                                  reduce_dtype=reduce_dtype, replicate=set(replicate), experts=experts, place=place)
    dp_info(result).placement = place
    place_graph(result, place.compute)
    return result


def _rewrite_buckets(gm: torch.fx.GraphModule, cfg: DataParallel, *, dp_index: int, dp_size: int, axis: str,
                     param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                     replicate: set[str], experts: ExpertGroup, place: Placement) -> torch.fx.GraphModule:
    if cfg.bucket_mb <= 0:
        raise ValueError(f"data_parallel.bucket_mb = {cfg.bucket_mb}; it must be > 0")
    layout = fresh_layout(gm)
    graph = copy.deepcopy(gm.graph)
    params = find_params(gm, graph, layout)
    info = DataParallelInfo(kind=cfg.kind, axis=axis, dp_index=dp_index, dp_size=dp_size, config=cfg,
                            aliases=drop_aliases(params, layout))
    objects: dict[str, object] = {}
    trainable = keep_frozen(graph, params, info, objects, param_dtype=param_dtype, place=place)
    own, trainable = split_experts(graph, trainable, layout, experts)
    if own:
        insert_buckets(graph, info, objects, own, kind="ddp", bucket_mb=cfg.bucket_mb, param_dtype=param_dtype,
                       reduce_dtype=reduce_dtype, group=experts, place=place)
    plain, rest = split_replicated(trainable, replicate)
    if plain and cfg.kind != "ddp":
        insert_buckets(graph, info, objects, plain, kind="ddp", bucket_mb=cfg.bucket_mb, param_dtype=param_dtype,
                       reduce_dtype=reduce_dtype, place=place)
    else:
        rest = trainable
    insert_buckets(graph, info, objects, rest, kind=cfg.kind, bucket_mb=cfg.bucket_mb, param_dtype=param_dtype,
                   reduce_dtype=reduce_dtype, place=place)
    if param_dtype is not None:
        cast_io(graph, param_dtype, gm)
    result = rebuild(gm, graph, objects, layout)
    for attr in info.replicated:
        layout.keys.setdefault(attr, info.replicated[attr])
    result.meta[META_DP] = info
    return result


