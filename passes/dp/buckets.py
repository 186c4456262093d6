"""DDP and ZeRO-1/2 gradient buckets: grouping parameters in backward order and inserting one
``dp_bucket`` call per bucket (used by the data-parallel pass for every kind, and by the FSDP
rewrite for the parameters it keeps whole: tied copies, expert-parallel weights)."""

from __future__ import annotations

import operator

import torch
import torch.fx
from torch import nn

from passes.dp.graph import ParamUse, common_dtype, fill_shard, positions, real_copy, replace_param_uses
from passes.dp.info import DataParallelInfo, ExpertGroup, Placement
from passes.layout import INSIDE_DP, ParamLayout
from passes.ops import dp_ops, ep_ops
from passes.ops.dp_ops import DDPBucket
from planner.graph import META_PARAM

__all__ = ["insert_buckets", "split_experts", "split_replicated", "FIRST_BUCKET_BYTES"]


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
            scaled.meta = {k: v for k, v in node.meta.items() if k != META_PARAM}
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
