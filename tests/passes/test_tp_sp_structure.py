"""Llama under tensor + sequence parallelism: every communication call of the rank graph, in order,
with its local shape, against Megatron-SP's set (Korthikanti et al. 2022, section 4.2.2); and the
ring bytes those calls move per step against the volume benchmarks/tensor_parallel reports.

Megatron-SP per layer: an all-gather in front of each column-parallel block (``gather_seq``:
reduce-scatter in backward) and a reduce-scatter after each row-parallel block
(``reduce_scatter_seq``: all-gather in backward); each norm weight in the sequence-sharded region
gets its gradient all-reduced (``copy_to_group``). At the ends: the replicated embedding's output
enters the residual as this rank's sequence chunk, and the replicated LM head reads the gathered
final hidden state.
"""

from __future__ import annotations

import functools

import pytest
import torch

from fairscale.testing.models import build
from passes.ops import comm, tp_ops
from passes.tp.shard_tensor_parallel import COLLECTIVES, collective_counts, shard_tensor_parallel_pass
from planner.capture import capture
from planner.plan import Mesh, Plan, TensorParallel

BLOCK_RULES = {"layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.self_attn.o_proj": "rowwise",
               "layers.*.mlp.[gate_proj,up_proj]": "colwise", "layers.*.mlp.down_proj": "rowwise"}
B, T, D, L, TP = 2, 16, 64, 3, 2
NAMES = {**COLLECTIVES, tp_ops.local_chunk: "local_chunk"}


@functools.lru_cache(maxsize=None)
def captured() -> torch.fx.GraphModule:
    case = build("llama", layers=L, dim=D, seq=T)
    return capture(case.model, case.make_batch(0, B), loss_fn=case.loss_fn).gm


@functools.lru_cache(maxsize=None)
def rank_graph(tp_index: int = 0) -> torch.fx.GraphModule:
    plan = Plan(mesh=Mesh(tp=TP), tensor_parallel=TensorParallel(rules=BLOCK_RULES, sequence_parallel=True))
    return shard_tensor_parallel_pass(captured(), plan, tp_index=tp_index, tp_size=TP)


def calls(gm: torch.fx.GraphModule) -> list[tuple[str, tuple[int, ...], str]]:
    """(kind, local output shape, module) of every tp communication call, in graph order."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in NAMES:
            module = n.meta.get("fs_module", "").removeprefix("model.")
            out.append((NAMES[n.target], tuple(n.meta["val"].shape), module))
    return out


def expected() -> list[tuple[str, tuple[int, ...], str]]:
    full, shard, norm = (B, T, D), (B, T // TP, D), (D,)
    seq: list[tuple[str, tuple[int, ...], str]] = [
        # layer 0: the replicated embedding output is copied once (gradient all-reduced), then split
        # into the residual locally, and layer 0's input norm runs on it on every rank (its weight's
        # gradient is then a partial sum, hence the copy) - passes.tp.fuse.hoist_copy_over_scatter
        ("copy_to_group", full, "layers.0.input_layernorm"),
        ("copy_to_group", norm, "layers.0.input_layernorm"),
    ]
    for i in range(L):
        if i:
            seq += [("copy_to_group", norm, f"layers.{i}.input_layernorm"),
                    ("gather_seq", full, f"layers.{i}.input_layernorm")]  # in front of q|k|v
        if i == 0:
            seq.append(("local_chunk", shard, "layers.0.input_layernorm"))  # the residual's first add
        seq += [("reduce_scatter_seq", shard, f"layers.{i}.self_attn.o_proj"),
                ("copy_to_group", norm, f"layers.{i}.post_attention_layernorm"),
                ("gather_seq", full, f"layers.{i}.post_attention_layernorm"),  # in front of gate|up
                ("reduce_scatter_seq", shard, f"layers.{i}.mlp.down_proj")]
    seq += [("copy_to_group", norm, "norm"),
            ("gather_from_group", full, "")]  # final hidden state for the replicated LM head
    return seq


@pytest.mark.parametrize("tp_index", [0, 1])
def test_every_collective_in_order(tp_index: int) -> None:
    gm = rank_graph(tp_index)
    assert calls(gm) == expected()
    assert collective_counts(gm) == {"copy_to_group": 2 * L + 2, "local_chunk": 1, "gather_seq": 2 * L - 1,
                                     "reduce_scatter_seq": 2 * L, "gather_from_group": 1}
    # no scatter_to_group (whose backward would all-gather the embedding gradient) and no all-reduce
    # in forward
    assert not any(n.target in (comm.scatter_to_group, comm.reduce_from_group) for n in gm.graph.nodes)


def test_hoisted_copies_wrap_the_embedding_and_the_norm_weight() -> None:
    gm = rank_graph()
    copies = [n for n in gm.graph.nodes if n.target is comm.copy_to_group]
    emb = copies[0].args[0]
    while emb.target is torch.ops.aten.to.dtype:  # capture may share the norm's float32 cast
        emb = emb.args[0]
    assert emb.target is torch.ops.aten.embedding.default
    assert tp_ops.local_chunk in {u.target for u in copies[0].users} and len(copies[0].users) > 1
    weights = [str(c.args[0].target) for c in copies[1:]]
    assert all(w.endswith("norm.weight") for w in weights) and len(weights) == 2 * L + 1
    # layer 0's input norm output goes into q|k|v without a copy of its own
    q = next(n for n in gm.graph.nodes if n.meta.get("fs_module", "").endswith("layers.0.self_attn.q_proj")
             and n.target is torch.ops.aten.linear.default)
    assert q.args[0].target is torch.ops.aten.mul.Tensor


# ring volume per step and rank of each call, in units of (n-1)/n bytes of the full tensor
# (Thakur et al. 2005): forward + backward
_UNITS = {"gather_seq": 2, "reduce_scatter_seq": 2, "gather_from_group": 1, "scatter_to_group": 1,
          "copy_to_group": 2, "reduce_from_group": 2, "local_chunk": 0}


def test_ring_bytes_equal_the_megatron_sp_volume() -> None:
    """The volume benchmarks/tensor_parallel/bench_tp.py prints as theory: L × 4 all-reduces of the
    activation (as all-gather + reduce-scatter pairs), one all-gather of the final hidden state and
    one all-reduce per norm weight (2L + 1); measured on gloo ranks in tests/runtime."""
    act, w = B * T * D * 4, D * 4
    factor = (TP - 1) / TP
    moved = 0.0
    for kind, shape, _ in calls(rank_graph()):
        full = list(shape)
        if kind in ("reduce_scatter_seq", "local_chunk"):
            full[1] *= TP
        moved += _UNITS[kind] * factor * torch.Size(full).numel() * 4
    theory = L * 4 * 2 * factor * act + factor * act + (2 * L + 1) * 2 * factor * w
    assert moved == theory


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_a_cast_of_a_partial_sum_shares_the_reduction_of_its_source(sp: bool) -> None:
    """Vocab-parallel embedding in a float64 Llama: RMSNorm reads ``hidden.to(float32)`` while the
    residual reads ``hidden``; the partial sum is reduced once (in its own dtype) and cast after,
    not reduced once per dtype."""
    case = build("llama", layers=2, dim=D, seq=T)
    case.model.to(torch.float64)
    gm = capture(case.model, case.make_batch(0, B), loss_fn=case.loss_fn).gm
    rules = {**BLOCK_RULES, "embed_tokens": "vocab_embedding"}
    plan = Plan(mesh=Mesh(tp=TP), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp))
    counts = collective_counts(shard_tensor_parallel_pass(gm, plan, tp_index=0, tp_size=TP))
    # one reduction of the embedding plus one per row-parallel block (2 per layer)
    assert counts["reduce_scatter_seq" if sp else "reduce_from_group"] == 1 + 2 * 2
