"""Saved activations under tensor parallelism and recompute, from the captured graph's saved
tensors (issue 16, item 3).

A GPT block under Megatron's rules (q, k, v and the MLP's first linear column-parallel, the output
projections row-parallel) keeps these tensors for backward, counted by hand from the shapes
(fp32, ``B`` sequences of ``S`` tokens, width ``D``, ``H`` heads, MLP width ``4D``):

    whole on every tp rank: the block's input and the residual sum after attention (the two layer
    norms' inputs), the two layer norms' outputs (the q/k/v and MLP inputs): 4·B·S·D values, and
    each norm's per-token mean and 1/std: 4·B·S
    split over tp: q, k, v and the attention output (4·B·S·D), its log-sum-exp (B·H·S), the MLP's
    hidden activation before and after GELU (2·B·S·4D)

so on one rank a block keeps ``whole + split / tp`` bytes; Korthikanti et al.'s constant (5 × the
block's input whole, ``ATTENTION_REPLICATED_INPUTS``) counts dropout masks this model does not have.
"""

from __future__ import annotations

import pytest

from fairscale.testing.models import build
from planner.capture import capture
from planner.cluster import Cluster
from planner.cost import ATTENTION_REPLICATED_INPUTS, layer_costs, layer_facts
from planner.cost_gpt import gpt_graph
from planner.cost_memory import saved_input_bytes, tp_whole_saved_bytes
from planner.plan import Plan
from planner.search import cost_plan

B, S, D, H = 2, 16, 32, 4
MEGATRON = {"layers.*.attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.attn.o_proj": "rowwise",
            "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
WHOLE = (4 * B * S * D + 4 * B * S) * 4
SPLIT = (4 * B * S * D + B * H * S + 2 * B * S * 4 * D) * 4


@pytest.fixture(scope="module")
def graph():
    case = build("gpt", dim=D, layers=2, heads=H, seq=S, vocab=64)
    return capture(case.model, case.make_batch(0, B), loss_fn=case.loss_fn)


def test_a_gpt_block_keeps_its_input_norms_and_residual_whole_and_the_rest_split(graph):
    whole = tp_whole_saved_bytes(graph, {f"layers.{i}.{m}": style for i in (0, 1) for m, style in
                                         [("attn.q_proj", "colwise"), ("attn.k_proj", "colwise"),
                                          ("attn.v_proj", "colwise"), ("attn.o_proj", "rowwise"),
                                          ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise")]})
    saved = {layer.name: layer.saved_bytes for layer in graph.layers}
    for block in ("layers.0", "layers.1"):
        assert saved[block] == WHOLE + SPLIT
        assert whole[block] == WHOLE
    # layers without split modules keep everything whole
    assert whole["ln_f"] == saved["ln_f"] and whole["lm_head"] == saved["lm_head"]


@pytest.mark.parametrize("tp", [2, 4])
def test_layer_costs_keep_the_whole_tensors_and_split_the_rest(graph, tp):
    facts = {f.name: f for f in layer_facts(graph, MEGATRON)}
    block = facts["layers.1"]
    assert block.saved_whole * B == WHOLE
    (cost,) = layer_costs([block], Cluster.preset("a100-80gb"), tp=tp, micro=B, compute_dtype="fp32")
    assert cost.act == pytest.approx(WHOLE + SPLIT / tp)
    # Korthikanti's 5 inputs would keep (1 - 4/D) of an input more whole than this block does
    constant = ATTENTION_REPLICATED_INPUTS * B * S * D * 4
    assert cost.act < constant + (WHOLE + SPLIT - constant) / tp


def test_the_vocab_parallel_head_splits_its_log_softmax(graph):
    facts = {f.name: f for f in layer_facts(graph, {**MEGATRON, "lm_head": "vocab_loss"})}
    head = facts["lm_head"]
    # the head keeps ln_f's output and the targets whole; cross-entropy's log-softmax (B·S·64) is
    # split with the logits (and so is its 4-byte scalar)
    assert head.saved_whole * B == (B * S * D) * 4 + B * S * 8
    assert (head.saved - head.saved_whole) * B == B * S * 64 * 4 + 4


def test_graphs_without_saved_tensor_facts_keep_the_constant():
    graph = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=128, batch=2)
    facts = layer_facts(graph, {"layers.*.attn.qkv": "colwise"})
    assert all(f.saved_whole is None for f in facts)


def test_each_block_saves_its_own_input(graph):
    # the first layer norm saves the block's input: what full recompute keeps is saved again, once
    got = saved_input_bytes(graph)
    assert got["layers.1"] == B * S * D * 4
    # the head saves ln_f's output; the targets it saves are a reshape made inside the head (its own)
    assert got["ln_f"] == B * S * D * 4 and got["lm_head"] == B * S * D * 4


def test_full_recompute_peaks_at_the_last_block_after_the_head_freed_its_activations(graph):
    """One microbatch of the captured batch: after the forward every block keeps its input and the
    head layers keep all they saved; the backward frees ln_f's and lm_head's activations first,
    then the last block's recompute brings back its whole saved bytes (its input among them)."""
    by = {layer.name: layer for layer in graph.layers}
    plan = Plan(recompute={"layers.*": "full"})
    got = cost_plan(plan, graph, Cluster.preset("a100-80gb"), global_batch=B, validate=False).memory_parts[0]
    before_last = by["wte"].saved_bytes + by["wpe"].saved_bytes + by["layers.0"].input_bytes
    assert got["activations"] == pytest.approx(before_last + WHOLE + SPLIT)
    after_forward = before_last + by["layers.1"].input_bytes + by["ln_f"].saved_bytes + by["lm_head"].saved_bytes
    assert after_forward < got["activations"]


def test_selective_recompute_under_tp_keeps_row_parallel_outputs_whole(graph):
    # cached: q, k, v, the attention output (+ its log-sum-exp) and the MLP's up projection, split;
    # the two row-parallel outputs (attention's o_proj, the MLP's down_proj) are partial sums of full size
    facts = {f.name: f for f in layer_facts(graph, MEGATRON)}
    block = facts["layers.1"]
    whole = 2 * B * S * D * 4
    split = (4 * B * S * D + B * H * S + B * S * 4 * D) * 4
    assert block.selective * B == whole + split
    assert block.selective_whole * B == whole
    (cost,) = layer_costs([block], Cluster.preset("a100-80gb"), tp=2, micro=B, compute_dtype="fp32")
    assert cost.act_selective == pytest.approx(B * S * D * 4 + whole + split / 2)
