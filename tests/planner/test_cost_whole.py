"""The layer norms and elementwise ops a tensor-parallel rank runs on whole activations."""

import dataclasses

import pytest
import torch

from fairscale.testing.models import build
from planner.capture import capture
from planner.cluster import Cluster
from planner.cost import LayerFacts, TPInfo, layer_costs, layer_facts
from planner.cost_whole import ELEMENTWISE, NORM, op_kind, whole_op_seconds

RULES = {"layers.*.attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.attn.o_proj": "rowwise",
         "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}


def test_op_kinds():
    aten = torch.ops.aten
    assert op_kind(aten.layer_norm.default) == NORM and op_kind(aten.native_layer_norm.default) == NORM
    assert op_kind(aten.add.Tensor) == ELEMENTWISE and op_kind(aten.gelu.default) == ELEMENTWISE
    assert op_kind(aten.linear.default) is None and op_kind(aten.view.default) is None
    assert op_kind(aten.scaled_dot_product_attention.default) is None


def test_whole_op_bytes_of_a_gpt_block_under_megatron_rules():
    case = build("gpt", dim=32, layers=2, heads=4, seq=8, vocab=64)
    graph = capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn)
    facts = {f.name: f for f in layer_facts(graph, RULES)}
    # per sample, one activation is 8 tokens × 32 × 4 bytes = 1 KiB: the block's two layer norms
    # and its two residual adds stay whole; gelu on the split MLP hidden is not counted.
    # layers.0 also holds the embeddings' sum (wte + wpe), a third whole add.
    assert facts["layers.1"].whole_ops == (2 * 1024.0, 2 * 1024.0)
    assert facts["layers.0"].whole_ops == (2 * 1024.0, 3 * 1024.0)
    # without rules nothing is split and nothing is counted (the charge is a tp term)
    assert all(f.whole_ops == (0.0, 0.0) for f in layer_facts(graph, {}))


def test_whole_op_seconds_charge_what_the_division_by_tp_took_off():
    costs = {NORM: 0.5e-9, ELEMENTWISE: 0.25e-9}
    # 2 MB of norms at 0.5 ns/B, 2 MB of adds at 0.25 ns/B, tp 4: 0.75 · (1 + 0.5) ms
    assert whole_op_seconds((2e6, 2e6), costs, 4) == pytest.approx(1.125e-3)
    assert whole_op_seconds((2e6, 2e6), costs, 1) == whole_op_seconds((2e6, 2e6), {}, 4) == 0.0


def test_layer_cost_adds_the_whole_ops_a_third_forward_two_thirds_backward():
    base = Cluster.cpu(8)
    cpu = dataclasses.replace(base, whole_op_s={NORM: 0.5e-9, ELEMENTWISE: 0.25e-9})
    f = LayerFacts(name="l", index=0, block=None, flops_fwd=4e6, flops_bwd=8e6, saved=0.0, input=0.0, output=0.0,
                   params=100, tp=TPInfo(sharded=True, param_count=100), whole_ops=(1e6, 1e6))
    (plain,) = layer_costs([f], base, tp=4, micro=2, compute_dtype="fp32")
    (whole,) = layer_costs([f], cpu, tp=4, micro=2, compute_dtype="fp32")
    # micro 2: 2 MB of each; 0.75 · (1 + 0.5) ms = 1.125 ms
    assert whole.whole_op_s == pytest.approx(1.125e-3) and plain.whole_op_s == 0.0
    assert whole.fwd - plain.fwd == pytest.approx(1.125e-3 / 3)
    assert whole.bwd - plain.bwd == pytest.approx(2 * 1.125e-3 / 3)
    # sequence parallelism splits the norms and adds too; no tp, nothing split
    assert layer_costs([f], cpu, tp=4, micro=2, compute_dtype="fp32", sequence_parallel=True)[0].whole_op_s == 0.0
    assert layer_costs([f], cpu, tp=1, micro=2, compute_dtype="fp32")[0] == \
        layer_costs([f], base, tp=1, micro=2, compute_dtype="fp32")[0]


def test_cluster_keeps_the_whole_op_costs_through_json_and_checks_them():
    c = dataclasses.replace(Cluster.cpu(4), whole_op_s={NORM: 1e-9, ELEMENTWISE: 2e-10})
    assert Cluster.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="whole_op_s maps norm / elementwise to seconds per byte >= 0"):
        dataclasses.replace(c, whole_op_s={"softmax": 1e-9})
