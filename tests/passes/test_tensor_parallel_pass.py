"""shard_tensor_parallel_pass in one process: the collectives each rank graph calls (by count, kind
and place), the local shapes it rewrites, what it records, and the errors it raises.

The numbers are checked on real gloo ranks in tests/runtime/test_tensor_parallel.py.
"""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from torch import nn

from fairscale.testing.models import build
from passes.ops import comm, tp_ops
from passes.layout import META_LAYOUT, TensorShard
from passes.tp.shard_tensor_parallel import TPShardError, collective_counts, shard_tensor_parallel_pass
from passes.tp.summary import tp_summary
from passes.tp.patterns import propose_tp_rules
from planner.capture import capture
from planner.graph import ModelGraph
from planner.plan import Mesh, Plan, TensorParallel

RULES = {
    "llama": {"layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.self_attn.o_proj": "rowwise",
              "layers.*.mlp.[gate_proj,up_proj]": "colwise", "layers.*.mlp.down_proj": "rowwise",
              "embed_tokens": "vocab_embedding", "lm_head": "vocab_loss"},
    "gpt2": {"h.*.attn.c_attn": "colwise", "h.*.attn.c_proj": "rowwise", "h.*.mlp.c_fc": "colwise",
             "h.*.mlp.c_proj": "rowwise", "wte": "vocab_embedding", "lm_head": "vocab_loss"},
    "bert": {"attention.self.[query,key,value]": "colwise", "attention.output.dense": "rowwise",
             "intermediate.dense": "colwise", "layer.*.output.dense": "rowwise",
             "word_embeddings": "vocab_embedding", "cls.predictions.decoder": "vocab_loss"},
    "mixtral": {"layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                "layers.*.mlp.experts": "expert", "embed_tokens": "vocab_embedding", "lm_head": "vocab_loss"},
}

# Per family, 2 layers, tp=2. Without SP (Megatron): one copy_to_group ("f") before each column-parallel
# block and the LM head, one all-reduce ("g") after each row-parallel block and the vocab embedding.
# With SP: the "g"s become reduce-scatters, the "f"s all-gathers fused with their backward
# reduce-scatter (gather_seq), and every replicated parameter of the sequence-sharded regions gets
# copy_to_group (its gradient is a sum over sequence shards).
EXPECTED = {
    ("llama", False): {"vocab_parallel_embedding": 1, "reduce_from_group": 5, "copy_to_group": 5,
                       "vocab_parallel_cross_entropy": 1},
    ("llama", True): {"vocab_parallel_embedding": 1, "reduce_scatter_seq": 5, "gather_seq": 5,
                      "copy_to_group": 5,  # RMSNorm weights: 2 per layer + final norm
                      "vocab_parallel_cross_entropy": 1},
    ("gpt2", False): {"vocab_parallel_embedding": 1, "reduce_from_group": 5, "copy_to_group": 5,
                      "vocab_parallel_cross_entropy": 1},
    ("gpt2", True): {"vocab_parallel_embedding": 1, "reduce_scatter_seq": 5, "gather_seq": 5,
                     "scatter_to_group": 1,  # position embeddings enter the sequence-sharded residual
                     "copy_to_group": 14,  # LayerNorm weight+bias: 2×2 per layer + ln_f 2; row biases 2 per layer
                     "vocab_parallel_cross_entropy": 1},
    ("bert", False): {"vocab_parallel_embedding": 1, "reduce_from_group": 5, "copy_to_group": 5,
                      "vocab_parallel_cross_entropy": 1},
    ("bert", True): {"vocab_parallel_embedding": 1, "reduce_scatter_seq": 5, "gather_seq": 4,
                     "scatter_to_group": 2,  # token-type and position embeddings
                     # the MLM head's replicated transform (64×64 weight) reads a [2, 16, 64] activation:
                     # gathering it (2048 floats) beats all-reducing the weight's gradient (4096)
                     "gather_from_group": 1,
                     "copy_to_group": 15,  # 5 LayerNorms ×2 in the SP region, row biases 4, decoder input 1
                     "vocab_parallel_cross_entropy": 1},
    ("mixtral", False): {"vocab_parallel_embedding": 1, "reduce_from_group": 5, "expert_grouped_mm": 4,
                         "copy_to_group": 7,  # attention 2, LM head 1, MoE input + routing weights 2 per layer
                         "vocab_parallel_cross_entropy": 1},
    ("mixtral", True): {"vocab_parallel_embedding": 1, "reduce_scatter_seq": 5, "expert_grouped_mm": 4,
                        "gather_seq": 3,  # attention 2 and LM head 1
                        "gather_from_group": 2,  # MoE input, also read by the (replicated) router
                        "copy_to_group": 9, "vocab_parallel_cross_entropy": 1},
}


@functools.lru_cache(maxsize=None)
def graph_of(family: str, **over: int) -> ModelGraph:
    case = build(family, **over)
    return capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn)


def plan(rules: dict[str, str], tp: int = 2, sp: bool = False) -> Plan:
    return Plan(mesh=Mesh(tp=tp), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp))


def shard(family: str, sp: bool = False, *, tp: int = 2, index: int = 0, rules: dict[str, str] | None = None,
          **over: int) -> torch.fx.GraphModule:
    return shard_tensor_parallel_pass(graph_of(family, **over).gm, plan(rules or RULES[family], tp, sp),
                                      tp_index=index, tp_size=tp)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "mixtral"])
def test_collective_counts(family: str, sp: bool) -> None:
    gm = shard(family, sp)
    gm.graph.lint()
    assert collective_counts(gm) == EXPECTED[(family, sp)]
    assert tp_summary(gm)["collectives"] == EXPECTED[(family, sp)]


def _consumers(node: torch.fx.Node) -> set[str]:
    """Modules of the matmuls a collective's output feeds (through views and casts)."""
    out, stack = set(), list(node.users)
    while stack:
        u = stack.pop()
        if u.target in (torch.ops.aten.linear.default, torch.ops.aten.addmm.default):
            out.add(u.meta["fs_module"].rsplit(".", 1)[-1])
        elif u.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.alias.default):
            stack.extend(u.users)
    return out


def _producer(node: torch.fx.Node) -> str:
    src = node.args[0]
    while src.target in (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.to.dtype,
                         torch.ops.aten.add.Tensor):
        src = src.args[0]  # through views, casts and a row-parallel bias
    if src.target is tp_ops.vocab_parallel_embedding:
        return "embed"
    return src.meta["fs_module"].rsplit(".", 1)[-1]


PLACES = {  # (family, sp) -> (modules fed by each block entry, in order; producers of the block exits)
    ("llama", False): ([{"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}] * 2 + [{"lm_head"}],
                       {"embed": 1, "o_proj": 2, "down_proj": 2}),
    ("gpt2", False): ([{"c_attn"}, {"c_fc"}] * 2 + [{"lm_head"}], {"embed": 1, "c_proj": 4}),
    ("bert", False): ([{"query", "key", "value"}, {"dense"}] * 2 + [{"decoder"}], {"embed": 1, "dense": 4}),
}
PLACES.update({
    ("llama", True): PLACES[("llama", False)],
    ("gpt2", True): PLACES[("gpt2", False)],
    # the MLM head reads a gathered activation (see EXPECTED), so its entry is a plain copy_to_group
    ("bert", True): (PLACES[("bert", False)][0][:-1], PLACES[("bert", False)][1]),
})


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_collectives_sit_between_the_right_blocks(family: str, sp: bool) -> None:
    gm = shard(family, sp)
    enter, leave = (comm.gather_seq, comm.reduce_scatter_seq) if sp else (comm.copy_to_group, comm.reduce_from_group)
    entries = [_consumers(n) for n in gm.graph.nodes if n.target is enter]
    exits = Counter(_producer(n) for n in gm.graph.nodes if n.target is leave)
    if not sp:  # parameters never need copy_to_group without sequence parallelism
        assert all(n.args[0].op != "get_attr" for n in gm.graph.nodes if n.target is comm.copy_to_group)
    assert entries == PLACES[(family, sp)][0]
    assert exits == PLACES[(family, sp)][1]
    if sp and family == "llama":  # norm weights: the only copies left
        copies = [n.args[0].target for n in gm.graph.nodes if n.target is comm.copy_to_group]
        assert all(str(t).endswith("norm.weight") for t in copies) and len(copies) == 5


def test_head_views_become_local() -> None:
    gm = shard("llama")  # 4 query heads, 2 KV heads, head_dim 16, batch 2, seq 16
    views = [n for n in gm.graph.nodes if n.target is torch.ops.aten.reshape.default  # views, as reshapes
             and n.meta.get("fs_module") == "model.layers.0.self_attn"]
    assert [list(v.args[1]) for v in views[:3]] == [[2, 16, 2, 16], [2, 16, 1, 16], [2, 16, 1, 16]]
    sdpa = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default)
    assert tuple(sdpa.meta["val"].shape) == (2, 2, 16, 16) and sdpa.meta["fs_tp"] == "S(1)"
    assert sdpa.meta["fs_tp_global_shape"] == (2, 4, 16, 16)


def test_gqa_kv_heads_must_divide_by_tp() -> None:
    with pytest.raises(TPShardError) as info:
        shard("llama", tp=4)  # 2 KV heads over 4 ranks
    msg = str(info.value)
    assert "view_1 = aten.view.default(" in msg and "call_function" not in msg
    assert "into 2 x 16; 2 does not divide by tp=4" in msg and "heads must divide by tp" in msg


def test_layout_records_slices_and_fused_parts() -> None:
    for index in range(2):
        gm = shard("gpt2", index=index)
        layout = gm.meta[META_LAYOUT]
        c_attn = layout.tp["transformer.h.0.attn.c_attn.weight"]
        assert c_attn == TensorShard(key="transformer.h.0.attn.c_attn.weight", global_shape=(64, 192), dim=1,
                                     index=index, count=2, parts=3)
        assert layout.tp["transformer.h.0.attn.c_proj.weight"].dim == 0  # Conv1D weight is [in, out]
        assert "transformer.h.0.attn.c_proj.bias" not in layout.tp
        assert layout.tp["lm_head.weight"].dim == 0
        full = graph_of("gpt2").gm.get_parameter("model.transformer.h.0.attn.c_attn.weight")
        local = gm.get_parameter("model.transformer.h.0.attn.c_attn.weight")
        q, k, v = full.detach().split(64, dim=1)
        expect = torch.cat([t.chunk(2, dim=1)[index] for t in (q, k, v)], dim=1)
        assert torch.equal(local, expect)
    # tied wte/lm_head: one local tensor under both names
    assert gm.get_parameter("model.transformer.wte.weight") is gm.get_parameter("model.lm_head.weight")


def test_meta_records_placements_and_reasons() -> None:
    gm = shard("llama", True)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in (comm.gather_seq, comm.reduce_scatter_seq):
            assert node.meta["fs_tp_comm"]
    linear = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default
                  and n.meta.get("fs_module") == "model.layers.0.self_attn.o_proj")
    assert linear.meta["fs_tp"] == "P" and linear.meta["fs_tp_style"] == "rowwise"
    assert tp_summary(graph_of("llama").gm) is None  # the input graph is left alone


def test_colwise_gather_gathers_the_logits() -> None:
    rules = {**RULES["llama"], "lm_head": "colwise_gather"}
    counts = collective_counts(shard("llama", rules=rules))
    assert counts["gather_from_group"] == 1 and "vocab_parallel_cross_entropy" not in counts


def test_rowwise_embedding_is_vocab_parallel_and_colwise_embedding_splits_features() -> None:
    rules = {**RULES["llama"], "embed_tokens": "colwise"}
    gm = shard("llama", rules=rules)
    assert gm.meta[META_LAYOUT].tp["model.embed_tokens.weight"].dim == 1
    # the residual stream is then feature-sharded: gathered wherever a norm or a matmul needs whole rows
    assert collective_counts(gm)["gather_from_group"] >= 1


class _Reg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.proj(x)).sum() + self.proj.weight.cumsum(0).sum()


class _RegLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.weight.cumsum(0).sum()


class _RegInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = _RegLinear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.proj(x)).sum()


def test_sharded_weight_in_an_op_without_rule_raises() -> None:
    # read by another module that no rule splits: one tensor, two layouts (pipeline copies would disagree)
    g = capture(_Reg(), (torch.randn(2, 8),))
    with pytest.raises(TPShardError, match=r"parameter model.proj.weight is split by rule 'proj' \(S\(0\), module "
                                           r"'proj'\) but is also read by module ''.*aten.cumsum.default.*"
                                           r"a tied weight needs one layout"):
        shard_tensor_parallel_pass(g.gm, plan({"proj": "colwise"}), tp_index=0, tp_size=2)
    # read inside the split module by an op without a rule: gathering the weight would undo the plan
    g = capture(_RegInside(), (torch.randn(2, 8),))
    with pytest.raises(TPShardError, match=r"uses the tensor-parallel-sharded parameter model.proj.weight \(S\(0\)\)"
                                           r".*no sharding rule for aten.cumsum.default"):
        shard_tensor_parallel_pass(g.gm, plan({"proj": "colwise"}), tp_index=0, tp_size=2)


def test_errors_name_the_rule_and_node() -> None:
    with pytest.raises(TPShardError, match="tied parameters need one placement"):
        shard("gpt2", rules={**RULES["gpt2"], "wte": "colwise"})
    with pytest.raises(TPShardError, match=r"rule 'layers.\*.self_attn' \(colwise\) matches module "
                                           r"'model.layers.0.self_attn', which has no linear"):
        shard("llama", rules={"layers.*.self_attn": "colwise"})
    with pytest.raises(TPShardError, match="unknown style 'columnwise'"):
        shard("llama", rules={"q_proj": "columnwise"})
    with pytest.raises(TPShardError, match=r"plan.mesh.tp is 2 but tp_size=4"):
        shard_tensor_parallel_pass(graph_of("llama").gm, plan(RULES["llama"]), tp_index=0, tp_size=4)
    with pytest.raises(TPShardError, match="does not divide by tp=3"):
        shard("gpt2", tp=3)


class _Cum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.proj(x)).cumsum(-1).sum()  # cumsum along the vocab needs the logits whole


def test_vocab_loss_refuses_to_gather_logits() -> None:
    g = capture(_Cum(), (torch.randn(2, 8),))
    with pytest.raises(TPShardError, match=r"vocab_loss on linear_1 = aten.linear.default.*would be gathered"):
        shard_tensor_parallel_pass(g.gm, plan({"out": "vocab_loss"}), tp_index=0, tp_size=2)


def test_tp1_is_the_identity_rewrite() -> None:
    g = graph_of("llama")
    gm = shard_tensor_parallel_pass(g.gm, plan(RULES["llama"], tp=1), tp_index=0, tp_size=1)
    assert collective_counts(gm) == {}
    batch = build("llama").make_batch(0, 2)
    torch.testing.assert_close(gm(*batch), g.gm(*batch), rtol=0, atol=0)


def test_detector_rules_shard_like_the_hand_written_ones() -> None:
    for family in ("llama", "gpt2", "bert", "mixtral"):
        rules = propose_tp_rules(graph_of(family).gm, tp=2).rules
        assert collective_counts(shard(family, rules=rules)) == EXPECTED[(family, False)]


class _DropMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.dropout(torch.relu(self.up(x)), 0.5, training=True)).sum()


def test_dropout_on_a_shard_gets_its_own_mask_per_rank() -> None:
    g = capture(_DropMLP(), (torch.randn(4, 8),))
    gm = shard_tensor_parallel_pass(g.gm, plan({"up": "colwise", "down": "rowwise"}), tp_index=1, tp_size=2)
    (drop,) = [n for n in gm.graph.nodes if n.target is tp_ops.sharded_dropout]
    assert drop.args[1:] == (0.5, True, 1) and drop.meta["fs_tp"] == "S(1)"
    x = torch.ones(64, 64)
    masks, after = [], []
    for index in range(2):
        torch.manual_seed(0)
        masks.append(tp_ops.sharded_dropout(x, 0.5, True, index))
        after.append(torch.rand(1))
    assert not torch.equal(masks[0], masks[1])  # independent shards
    assert torch.equal(after[0], after[1])  # the shared stream advanced alike on both ranks
    assert set(masks[0].unique().tolist()) == {0.0, 2.0}
