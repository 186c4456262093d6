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
import operator
from dataclasses import dataclass, field
from typing import Collection

import torch
import torch.fx
from torch import nn

from passes.ops import dp_ops, ep_ops
from passes.dp.graph import (ParamUse, Placement, cast_io, common_dtype, drop_aliases, dtype_of, fill_shard,
                             find_params, fresh_layout, place_graph, placement, positions, real_copy, rebuild,
                             replace_param_uses)
from passes.ops.dp_ops import DDPBucket, FSDPUnit, no_sync
from passes.layout import INSIDE_DP, ParamLayout
from planner.plan import DP_KINDS, DataParallel, Plan
from planner.validate_fields import fp16_problem

__all__ = ["shard_data_parallel_pass", "no_sync", "DataParallelInfo", "META_DP"]

META_DP = "fs_dp"
"""gm.meta key holding the rank's :class:`DataParallelInfo`."""


@dataclass
class DataParallelInfo:
    """What the data-parallel pass did, for the optimizer, state dicts and reports."""

    kind: str
    """ddp, zero1, zero2 or fsdp."""
    axis: str
    dp_index: int
    dp_size: int
    config: DataParallel
    buckets: list[DDPBucket] = field(default_factory=list)
    """ddp/zero: gradient buckets in backward (reduction) order."""
    units: list[FSDPUnit] = field(default_factory=list)
    """fsdp: units in forward order."""
    aliases: dict[str, list[str]] = field(default_factory=dict)
    """Tied parameters: the key the rank holds -> the user's other keys for the same tensor."""
    replicated: dict[str, str] = field(default_factory=dict)
    """attr -> user key of parameters kept whole on every rank (all of them for ddp/zero; frozen
    ones for fsdp)."""
    placement: Placement = field(default_factory=lambda: Placement(torch.device("cpu"), torch.device("cpu")))
    """Where the graph computes and where the optimizer's tensors live (``passes.dp.graph.Placement``)."""

    def plain_params(self) -> list[nn.Parameter]:
        """Trainable parameters kept whole and all-reduced (every parameter for ddp; for the
        sharded kinds, those compiled with ``replicate=``); a plain optimizer steps them."""
        return [p for b in self.buckets if b.kind == "ddp" for p in b.params]

    def sharded_params(self) -> list[nn.Parameter]:
        """The tensors a sharded optimizer steps (zero: bucket shards; fsdp: unit flats)."""
        if self.kind == "fsdp":
            return [u.flat for u in self.units]
        if self.kind in ("zero1", "zero2"):
            return [b.shard for b in self.buckets if b.shard is not None]
        return []


def shard_data_parallel_pass(gm: torch.fx.GraphModule, plan: Plan | DataParallel, *, dp_index: int, dp_size: int,
                             axis: str = "dp", replicate: Collection[str] = (), ep_size: int = 1,
                             expert_axis: str = "ep_rep", device: torch.device | str | None = None,
                             ) -> torch.fx.GraphModule:
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
        from passes.dp.fsdp import rewrite_fsdp

        result = rewrite_fsdp(gm, cfg, dp_index=dp_index, dp_size=dp_size, axis=axis, param_dtype=param_dtype,
                              reduce_dtype=reduce_dtype, replicate=set(replicate), experts=experts, place=place)
    else:
        result = _rewrite_buckets(gm, cfg, dp_index=dp_index, dp_size=dp_size, axis=axis, param_dtype=param_dtype,
                                  reduce_dtype=reduce_dtype, replicate=set(replicate), experts=experts, place=place)
    result.meta[META_DP].placement = place
    place_graph(result, place.compute)
    return result


@dataclass(frozen=True)
class ExpertGroup:
    """Where expert-parallel weights average their gradients (see ``shard_data_parallel_pass``)."""

    axis: str
    """The comm axis of the ranks holding the same experts."""
    size: int
    """dp / ep."""
    index: int
    """This rank's position on that axis (dp_index // ep)."""
    ep: int
    """The expert-parallel degree; gradients are scaled by 1/ep before the average over ``size``."""


def split_experts(graph: torch.fx.Graph, params: list[ParamUse], layout: ParamLayout,
                  group: ExpertGroup) -> tuple[list[ParamUse], list[ParamUse]]:
    """(the expert-parallel weights, the others). Each use of an expert weight is wrapped in
    ``ep_ops.scale_grad(w, 1/ep)`` so the bucket's average over ``group.size`` gives the dp mean."""
    experts = [u for u in params if (s := layout.tp.get(u.key)) is not None and s.axis in INSIDE_DP]
    if experts and group.ep == 1:
        raise ValueError(f"{experts[0].key} is split over the ep axis but ep_size is 1; pass the plan's mesh.ep")
    for u in experts:
        for node in u.nodes:
            with graph.inserting_after(node):
                scaled = graph.call_function(ep_ops.scale_grad, (node, 1.0 / group.ep))
            scaled.meta = {k: v for k, v in node.meta.items() if k != "fs_param"}
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    return experts, [u for u in params if u not in experts]


FIRST_BUCKET_BYTES = 2**20
"""The first bucket (the last layers' gradients) holds at most 1 MiB, so its reduction starts early
in backward and overlaps the rest of it (PyTorch DDP's ``first_bucket_cap``)."""


def _buckets(params: list[ParamUse], bucket_bytes: float) -> list[list[ParamUse]]:
    """Group trainable parameters into buckets in reverse order of first use (the order their
    gradients become ready in backward): the first up to ``FIRST_BUCKET_BYTES``, the others up to
    ``bucket_bytes`` (PyTorch DDP's policy)."""
    out: list[list[ParamUse]] = []
    size = 0.0
    for use in reversed(params):
        nbytes = use.tensor.numel() * use.tensor.element_size()
        cap = min(bucket_bytes, FIRST_BUCKET_BYTES) if len(out) == 1 else bucket_bytes
        if not out or (size + nbytes > cap and out[-1]) or out[-1][0].tensor.dtype != use.tensor.dtype:
            out.append([])
            size = 0.0
        out[-1].append(use)
        size += nbytes
    return out


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
    trainable = [u for u in params if u.tensor.requires_grad]
    for use in params:
        if not use.tensor.requires_grad:
            objects[use.attr] = nn.Parameter(real_copy(use.tensor, place.compute), requires_grad=False)
            info.replicated[use.attr] = use.key
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
        cast_io(graph, param_dtype)
    result = rebuild(gm, graph, objects, layout)
    for attr in info.replicated:
        layout.keys.setdefault(attr, info.replicated[attr])
    result.meta[META_DP] = info
    return result


def insert_buckets(graph: torch.fx.Graph, info: DataParallelInfo, objects: dict[str, object],
                   trainable: list[ParamUse], *, kind: str, bucket_mb: float, param_dtype: torch.dtype | None,
                   reduce_dtype: torch.dtype | None, place: Placement, group: ExpertGroup | None = None) -> None:
    """Bucket ``trainable`` and insert one ``dp_bucket`` call per bucket (``kind`` ddp, zero1 or
    zero2), recording buckets and replicated parameters in ``info`` and tensors in ``objects``.
    With ``group`` the buckets reduce over its axis instead of the dp axis. Replicas live on
    ``place.compute``; zero master shards on ``place.store`` (the host when offloaded; ddp
    buckets, whose optimizer steps the replicas, are never offloaded)."""
    dp_index, dp_size, axis = info.dp_index, info.dp_size, info.axis
    if group is not None:
        dp_index, dp_size, axis = group.index, group.size, group.axis
    sharded = kind in ("zero1", "zero2")
    pos = positions(graph)
    for i, bucket_params in enumerate(_buckets(trainable, bucket_mb * 2**20), start=len(info.buckets)):
        shapes = [u.tensor.shape for u in bucket_params]
        numel = sum(s.numel() for s in shapes)
        padded = -(-numel // dp_size) * dp_size
        master = common_dtype([u.tensor for u in bucket_params], f"bucket {i}")
        full = torch.zeros(padded, dtype=master, device=place.compute)
        start = 0
        for u in bucket_params:  # one parameter at a time onto the device
            if not u.tensor.is_meta:  # meta: filled by materialize_sharded
                full[start:start + u.tensor.numel()] = u.tensor.detach().reshape(-1)
            start += u.tensor.numel()
        shard = None
        if sharded:
            s = padded // dp_size
            if place.store == place.compute:
                shard = full[dp_index * s:(dp_index + 1) * s].clone()
            else:  # offloaded: filled on the host straight from the parameters, no device round trip
                shard = place.store_zeros(s, master)
                if not any(u.tensor.is_meta for u in bucket_params):
                    fill_shard(shard, [u.tensor.detach() for u in bucket_params], dp_index * s)
        bucket = DDPBucket(kind=kind, index=i, keys=[u.key for u in bucket_params], shapes=list(shapes),
                           n=dp_size, rank=dp_index, axis=axis, param_dtype=param_dtype or master,
                           reduce_dtype=reduce_dtype or master, shard=shard)
        # replicated parameters: zero kinds keep them (in param_dtype) as views of one flat buffer
        # that the post-step all-gather writes into; ddp keeps independent fp32 copies
        if sharded:
            bucket.flat = full.to(bucket.param_dtype)
            start = 0
            for u in bucket_params:
                n = u.tensor.numel()
                view = bucket.flat[start:start + n].view(u.tensor.shape)
                objects[u.attr] = nn.Parameter(view, requires_grad=kind == "zero1")
                start += n
        else:
            for u in bucket_params:
                objects[u.attr] = nn.Parameter(real_copy(u.tensor, place.compute), requires_grad=True)
        for u in bucket_params:
            info.replicated[u.attr] = u.key
        bucket.params = [p for p in (objects[u.attr] for u in bucket_params) if isinstance(p, nn.Parameter)]
        handle_name = f"dp_bucket_{i}"
        objects[handle_name] = bucket
        info.buckets.append(bucket)
        first = min((user for u in bucket_params for n in u.nodes for user in n.users), key=lambda x: pos[x])
        for u in bucket_params:  # fx traces place get_attr next to its use; the bucket needs them all here
            first.prepend(u.nodes[0])
        with graph.inserting_before(first):
            h = graph.get_attr(handle_name)
            s_node = graph.get_attr(f"{handle_name}.shard") if sharded else None
            call = graph.call_function(dp_ops.dp_bucket, (h, s_node, *[u.nodes[0] for u in bucket_params]))
            outs = [graph.call_function(operator.getitem, (call, j)) for j in range(len(bucket_params))]
        for u, out in zip(bucket_params, outs):
            replace_param_uses(graph, u, out, keep={call})


def split_replicated(params: list[ParamUse], replicate: set[str]) -> tuple[list[ParamUse], list[ParamUse]]:
    """(parameters named in ``replicate`` by any of their keys, the others)."""
    unknown = set(replicate) - {k for u in params for k in (u.key, *u.aliases.values())}
    if unknown:
        raise ValueError(f"replicate names {sorted(unknown)[:5]}, which this graph does not train")
    chosen = [u for u in params if u.key in replicate or set(u.aliases.values()) & replicate]
    return chosen, [u for u in params if u not in chosen]
