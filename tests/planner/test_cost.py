"""Cost formulas, each against a number worked out by hand."""

import dataclasses
import json
import math

import pytest

from planner.cluster import Cluster
from planner.cost import CostOptions, LayerFacts, TPInfo, compute_time, layer_costs
from planner.cost_comm import (all_gather_time, all_gather_volume, all_reduce_time, all_reduce_volume,
                               all_to_all_time, p2p_time, reduce_scatter_time)
from planner.cost_gpt import gpt_graph, megatron_flops
from planner.cost_memory import model_state_bytes, unshard_buffer_bytes
from planner.schedule_cost import bubble_fraction, in_flight, pipeline_time


# --- collectives ---------------------------------------------------------------------------------

def test_ring_all_reduce():
    # 1 GB over 8 ranks at 100 GB/s, 10 us: 2·7·10us + 2·7/8·1e9/1e11 s = 0.00014 + 0.0175
    assert all_reduce_time(1e9, 8, bandwidth=1e11, latency=1e-5) == pytest.approx(0.01764)
    assert all_reduce_volume(1000, 4) == pytest.approx(1500)  # 2·3/4·1000
    assert all_reduce_time(1e9, 1, bandwidth=1e11, latency=1e-5) == 0.0


def test_all_gather_reduce_scatter_all_to_all_p2p():
    # 1 GB over 4 ranks at 10 GB/s, no latency: 3/4 · 0.1 s
    assert all_gather_time(1e9, 4, bandwidth=1e10, latency=0.0) == pytest.approx(0.075)
    assert reduce_scatter_time(1e9, 4, bandwidth=1e10, latency=0.0) == pytest.approx(0.075)
    assert all_to_all_time(1e9, 4, bandwidth=1e10, latency=1e-3) == pytest.approx(0.078)  # + 3 · 1 ms
    assert all_gather_volume(1000, 4) == pytest.approx(750)
    assert p2p_time(1e6, bandwidth=1e9, latency=1e-5) == pytest.approx(0.00101)


# --- compute -------------------------------------------------------------------------------------

def test_roofline_adds_compute_bound_and_memory_bound_parts():
    # 1e12 FLOPs at 312e12·0.5 = 6.4103 ms, plus 1e9 bytes at 2e12·0.5 = 1 ms
    t = compute_time(1e12, 1e9, peak_flops=312e12, hbm_bandwidth=2e12, matmul_efficiency=0.5, memory_efficiency=0.5)
    assert t == pytest.approx(0.0074103, rel=1e-4)


def _layer(**kw):
    base = dict(name="layers.0", index=0, block="layers.*", flops_fwd=2e12, flops_bwd=4e12, saved=1e9, input=1e8,
                output=1e8, params=1000, attention=True)
    base.update(kw)
    return LayerFacts(**base)


def test_layer_cost_without_tp():
    c = Cluster.preset("a100-80gb")
    (lc,) = layer_costs([_layer()], c, tp=1, micro=1, compute_dtype="bf16")
    # bf16 halves the fp32-captured activations: 5e8 bytes saved, 5e7 kept under recompute
    assert lc.act == pytest.approx(5e8)
    assert lc.act_recompute == pytest.approx(5e7)
    assert lc.fwd == pytest.approx(2e12 / (312e12 * 0.70) + 5e8 / (2039e9 * 0.7))  # 9.508 ms
    assert lc.fwd == pytest.approx(0.0095078, rel=1e-4)
    assert lc.bwd == pytest.approx(4e12 / (312e12 * 0.70) + 1e9 / (2039e9 * 0.7))
    assert lc.tp_s == 0.0 and lc.params == 1000


def test_unfused_attention_matmuls_add_their_score_traffic_to_their_flops():
    c = Cluster.preset("a100-80gb")
    # 1e11 of the 2e12 forward FLOPs are the two batched matmuls, which move 4e8 fp32 bytes (2e8 in
    # bf16) of Q, K, V, output and scores: forward = 2e12 FLOPs at 312e12·0.70 + (5e8 + 2e8) bytes
    # at 2039e9·0.7; backward twice the matmuls' FLOPs and bytes
    f = _layer(bmm_flops=1e11, bmm_bytes=4e8)
    (lc,) = layer_costs([f], c, tp=1, micro=1, compute_dtype="bf16")
    assert lc.fwd == pytest.approx(2e12 / (312e12 * 0.70) + 7e8 / (2039e9 * 0.7))  # 9.648 ms
    assert lc.fwd == pytest.approx(0.0096479, rel=1e-4)
    assert lc.bwd == pytest.approx(4e12 / (312e12 * 0.70) + 1.4e9 / (2039e9 * 0.7))
    # heads split over tp: the matmuls' FLOPs and bytes divide by tp like the rest of the layer's
    tp4 = layer_costs([_layer(bmm_flops=1e11, bmm_bytes=4e8, tp=TPInfo(sharded=True, heads=8, kv_heads=8))], c,
                      tp=4, micro=1, compute_dtype="bf16")[0]
    plain = layer_costs([_layer(tp=TPInfo(sharded=True, heads=8, kv_heads=8))], c, tp=4, micro=1,
                        compute_dtype="bf16")[0]
    assert tp4.fwd - plain.fwd == pytest.approx(2e8 / 4 / (2039e9 * 0.7))


def test_layer_cost_with_tp_splits_flops_params_and_activations():
    c = Cluster.preset("a100-80gb")
    f = _layer(tp=TPInfo(sharded=True, param_count=800, allreduce_fwd=2, allreduce_bwd=2, heads=8, kv_heads=8))
    (lc,) = layer_costs([f], c, tp=4, micro=2, compute_dtype="bf16")
    # micro 2, bf16: saved 1e9, input 1e8; replicated = 5 × input = 5e8 (Korthikanti Eq. 2)
    assert lc.act == pytest.approx(5e8 + (1e9 - 5e8) / 4)
    assert lc.params == pytest.approx(200 + 800 / 4)
    # each all-reduce: 1e8 bytes in a 4-GPU NVLink ring at 300e9·0.8: 2·3·5us + 2·3/4·1e8/2.4e11
    ar = 6 * 5e-6 + 1.5 * 1e8 / 2.4e11
    assert lc.tp_s == pytest.approx(4 * ar)
    assert lc.tp_bytes == pytest.approx(4 * 1.5e8)
    assert lc.fwd == pytest.approx(4e12 / 4 / (312e12 * 0.70) + 6.25e8 / (2039e9 * 0.7) + 2 * ar)
    sp = layer_costs([f], c, tp=4, micro=2, compute_dtype="bf16", sequence_parallel=True)[0]
    assert sp.act == pytest.approx(1e9 / 4) and sp.act_recompute == pytest.approx(1e8 / 4)
    overlapped = layer_costs([f], c, tp=4, micro=2, compute_dtype="bf16", options=CostOptions(overlap_tp=True))[0]
    assert overlapped.tp_s == 0.0


# --- memory --------------------------------------------------------------------------------------

def test_model_states_follow_zero_accounting():
    # mixed precision Adam: 2 + 2 + 12 bytes per parameter (ZeRO §3.1)
    assert model_state_bytes(1e9, dp_kind="ddp", dp=8, param_dtype="bf16") == pytest.approx(16e9)
    assert model_state_bytes(1e9, dp_kind="ddp", dp=8, param_dtype="fp32") == pytest.approx(16e9)  # 4 + 4 + 8
    assert model_state_bytes(1e9, dp_kind="zero1", dp=4, param_dtype="bf16") == pytest.approx(7e9)  # 2+2+12/4
    assert model_state_bytes(1e9, dp_kind="zero2", dp=4, param_dtype="bf16") == pytest.approx(5.5e9)  # 2+14/4
    assert model_state_bytes(1e9, dp_kind="fsdp", dp=4, param_dtype="bf16") == pytest.approx(4e9)  # 16/4
    assert model_state_bytes(1e9, dp_kind="ddp", dp=1, optimizer="sgd") == pytest.approx(12e9)  # 4 + 4 + 4
    with pytest.raises(ValueError, match="unknown data-parallel kind 'zero3'; use ddp, zero1, zero2 or fsdp"):
        model_state_bytes(1.0, dp_kind="zero3", dp=2)


def test_fsdp_unshard_buffers():
    # units of 10, 20, 30 elements (forward order) in bf16; the peak is in the backward of the middle
    # unit: it and the first (prefetched) gathered, beside the last unit's gradient in its reduce-scatter
    assert unshard_buffer_bytes([10, 20, 30], param_dtype="bf16", reshard_after_forward=True,
                                prefetch=True) == 120  # (20 + 10 + 30 grads) · 2
    assert unshard_buffer_bytes([10, 20, 30], param_dtype="bf16", reshard_after_forward=True,
                                prefetch=False) == 100  # (20 + 30 grads) · 2
    # the last unit's backward with nothing in flight: it and the first, prefetched, then its gradient
    assert unshard_buffer_bytes([10, 20, 30], param_dtype="bf16", reshard_after_forward=True, prefetch=True,
                                reduce_in_flight=False) == 100  # (30 + 20) · 2, or (20 + 30 grads) · 2
    # kept gathered: all three after forward, then two beside the last unit's gradient
    assert unshard_buffer_bytes([10, 20, 30], param_dtype="bf16", reshard_after_forward=False,
                                prefetch=True) == 120  # 60 · 2, or (10 + 20 + 30 grads) · 2
    # the root stays gathered through every unit's backward; its own gradient comes last, alone
    assert unshard_buffer_bytes([10], param_dtype="bf16", reshard_after_forward=True, prefetch=True,
                                grad_dtype="fp32", root=15) == 15 * 2 + 10 * 4  # the unit's gradient made
    assert unshard_buffer_bytes([10], param_dtype="bf16", reshard_after_forward=True, prefetch=True,
                                grad_dtype="fp32", root=100) == 100 * 4


# --- pipeline ------------------------------------------------------------------------------------

def test_pipeline_time_and_bubble():
    assert pipeline_time("1f1b", [1.0, 2.0, 1.0], 4) == pytest.approx(10.0)  # 3·2 + (1+2+1)
    assert pipeline_time("gpipe", [1.0] * 4, 12) == pytest.approx(15.0)  # (12 + 3)·1
    assert pipeline_time("interleaved", [1.0, 1.0], 4, v=2) == pytest.approx(4.5)  # 4·1 + 1/2
    assert bubble_fraction("1f1b", 4, 12) == pytest.approx(0.2)  # 3 / 15
    assert bubble_fraction("interleaved", 4, 12, v=3) == pytest.approx(1 / 13)  # 1 / (12 + 1)
    with pytest.raises(ValueError, match='2 model chunks per pipeline rank need kind "interleaved", but schedule.kind is "1f1b"'):
        pipeline_time("1f1b", [1.0], 1, v=2)


def test_microbatches_in_flight():
    assert in_flight("gpipe", 4, 8, 0) == 8
    assert in_flight("1f1b", 4, 8, 0) == 4
    assert in_flight("1f1b", 4, 8, 3) == 1
    assert in_flight("1f1b", 4, 2, 0) == 2
    assert in_flight("interleaved", 4, 8, 0, v=2) == pytest.approx(5.5)  # min(16, 2·3 + 1·4 + 1) / 2


# --- the analytic GPT fixture -------------------------------------------------------------------

def test_megatron_flop_formula_and_gpt_fixture_agree():
    # 1T row of Narayanan et al. 2021: 128 layers, hidden 25600, 160 heads
    g = gpt_graph(layers=128, hidden=25600, heads=160, seq=2048, vocab=51200, batch=1)
    assert g.num_parameters / 1e9 == pytest.approx(1008.0, rel=5e-3)
    blocks = sum(l.flops_fwd for l in g.layers if l.block)
    head = g.layers[-1].flops_fwd
    # full recompute = 4 forwards of the blocks; the head runs forward + backward = 3 forwards
    assert 4 * blocks + 3 * head == pytest.approx(megatron_flops(batch=1, seq=2048, layers=128, hidden=25600,
                                                                 vocab=51200))
    assert megatron_flops(batch=1, seq=2048, layers=1, hidden=6, vocab=0) == pytest.approx(
        96 * 2048 * 36 * (1 + 2048 / 36))


# --- step-time assembly --------------------------------------------------------------------------

def _toy_context(params=0, output=0.0, options=None):
    from planner.cluster import Efficiency
    from planner.search.config import Context

    c = Cluster(name="toy", device="toy", nodes=1, devices_per_node=8, memory_bytes=2**40,
                peak_flops={"fp32": 1e12, "bf16": 1e12, "fp16": 1e12}, hbm_bandwidth=1e30, intra_bandwidth=1e9,
                intra_latency=0.0, inter_bandwidth=1e9, inter_latency=0.0,
                efficiency=Efficiency(matmul=1.0, memory=1.0, network=1.0))
    facts = [LayerFacts(name=f"layers.{i}", index=i, block="layers.*", flops_fwd=1e12, flops_bwd=2e12, saved=0.0,
                        input=0.0, output=output, params=params) for i in range(2)]
    return Context(facts, c, global_batch=2, options=options or CostOptions.megatron2021(), captured_dtype="fp32")


def test_step_time_is_assembled_from_the_schedule_and_the_gradient_sync():
    from planner.search.config import Config
    from planner.search.evaluate import evaluate

    ctx = _toy_context()
    # each layer: 1 s forward + 2 s backward per sample; 2 stages, 2 microbatches of 1 sample:
    # (m-1)·max + Σ = 1·3 + 6 = 9 s
    b = evaluate(ctx, Config(pp=2, dp=1, tp=1, microbatches=2, cuts=(0, 1, 2)))
    assert b.step_time_s == pytest.approx(9.0)
    assert b.bubble == pytest.approx(1 / 3)  # (9 - 2·3) / 9
    assert b.tflops_per_device == pytest.approx(2 * 6e12 / 9.0 / 2 / 1e12)
    # recomputing layer 0 adds its forward: rank 0 takes 4 s: 1·4 + 7 = 11 s
    assert evaluate(ctx, Config(pp=2, dp=1, tp=1, microbatches=2, cuts=(0, 1, 2),
                                recompute=frozenset({0}))).step_time_s == pytest.approx(11.0)
    # one stage, gradient accumulation over 2 microbatches: 2 · 6 = 12 s
    assert evaluate(ctx, Config(pp=1, dp=1, tp=1, microbatches=2, cuts=(0, 2))).step_time_s == pytest.approx(12.0)


def test_ddp_gradient_all_reduce_after_the_flush():
    from planner.search.config import Config
    from planner.search.evaluate import evaluate

    ctx = _toy_context(params=10**8)
    # dp=2, 1 microbatch of 1 sample: 6 s of compute; then all-reduce of 2e8 fp32 parameters (8e8 bytes)
    # at 1 GB/s over 2 ranks: 2·1/2·8e8/1e9 = 0.8 s (one bucket), then Adam: 2 · 16 B · 2e8 at 1e30 B/s ≈ 0
    b = evaluate(ctx, Config(pp=1, dp=2, tp=1, microbatches=1, cuts=(0, 2), bucket_mb=2.0**20))
    assert b.step_time_s == pytest.approx(6.8)
    assert b.dp_comm_s == pytest.approx(0.8)
    assert b.comm_bytes == pytest.approx(8e8)
    assert b.memory_bytes == [pytest.approx(16 * 2e8)]  # fp32 Adam: 4 + 4 + 8 bytes per parameter
    # overlapped with the backward (4 s) only the last bucket stays exposed: one bucket = everything
    over = _toy_context(params=10**8, options=CostOptions())
    b2 = evaluate(over, Config(pp=1, dp=2, tp=1, microbatches=1, cuts=(0, 2), bucket_mb=100.0))
    # 8e8 bytes in buckets of at most 100 MiB: 8 equal buckets of 1e8; the last one's all-reduce: 2·1/2·1e8/1e9 s
    assert b2.step_time_s == pytest.approx(6.0 + 1e8 / 1e9)


def test_pipeline_sends_cost_latency_plus_bytes_over_bandwidth():
    from planner.search.config import Config
    from planner.search.evaluate import evaluate

    ctx = _toy_context(output=1e8)
    # each stage sends 1e8 bytes per microbatch at 1 GB/s (0.1 s) forward or backward: ranks take 3.1 s
    b = evaluate(ctx, Config(pp=2, dp=1, tp=1, microbatches=2, cuts=(0, 1, 2)))
    assert b.step_time_s == pytest.approx(1 * 3.1 + 6.2)
    assert b.p2p_s == pytest.approx(2 * 0.1)


def test_pipeline_sends_use_the_measured_p2p_link_inside_a_node():
    from planner.search.config import Config, Context
    from planner.search.evaluate import evaluate

    ctx = _toy_context(output=1e8)
    # calibration measured a pipeline send (a batch of the send and its paired receive): 2 ms + bytes at 0.5 GB/s
    c = dataclasses.replace(ctx.cluster, collective_links={"p2p": (5e8, 2e-3)})
    own = Context(ctx.facts, c, global_batch=2, options=ctx.options, captured_dtype="fp32")
    b = evaluate(own, Config(pp=2, dp=1, tp=1, microbatches=2, cuts=(0, 1, 2)))
    assert b.p2p_s == pytest.approx(2 * (2e-3 + 0.2))  # two microbatches, one send each way per rank
    assert b.step_time_s == pytest.approx(1 * (3 + 0.202) + 2 * (3 + 0.202))
    # between nodes a send rides the inter-node link, whatever was measured inside one
    apart = dataclasses.replace(c, devices_per_node=1, nodes=2)
    far = Context(ctx.facts, apart, global_batch=2, options=ctx.options, captured_dtype="fp32")
    assert evaluate(far, Config(pp=2, dp=1, tp=1, microbatches=2, cuts=(0, 1, 2))).p2p_s == pytest.approx(2 * 0.1)
    assert Cluster.from_dict(c.to_dict()) == c


def test_tp_collectives_per_layer_follow_the_rules():
    from planner.cost import layer_facts

    g = gpt_graph(layers=2, hidden=64, heads=4, seq=32, vocab=256)
    rules = {"layers.*.attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.attn.o_proj": "rowwise",
             "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise", "wte": "vocab_embedding",
             "lm_head": "vocab_loss"}
    facts = {f.name: f.tp for f in layer_facts(g, rules)}
    # a block: o_proj and down_proj all-reduce forward; attn (q,k,v share it) and mlp inputs backward
    assert (facts["layers.0"].allreduce_fwd, facts["layers.0"].allreduce_bwd) == (2, 2)
    assert facts["layers.0"].param_count == 12 * 64 * 64 + 9 * 64  # split weights and their split biases
    assert (facts["wte"].allreduce_fwd, facts["lm_head"].allreduce_bwd) == (1, 1)
    assert not facts["ln_f"].sharded
    experts = {f.name: f.tp for f in layer_facts(g, {"layers.*.mlp.up_proj": "expert"})}
    assert (experts["layers.1"].allreduce_fwd, experts["layers.1"].allreduce_bwd) == (1, 1)


def test_hierarchical_collectives_cross_nodes_once_per_node():
    from planner.cost_comm import (comm_group, group_all_gather_time, group_all_reduce_time,
                                   group_all_reduce_volume, group_all_to_all_time)

    c = Cluster.preset("a100-80gb", nodes=2)  # intra 300 GB/s, inter 25 GB/s per GPU; network efficiency 0.8
    g = comm_group(c, 16)
    assert (g.per_node, g.nodes) == (8, 2)
    intra, inter = 300e9 * 0.8, 25e9 * 0.8
    # reduce-scatter + all-gather inside the node, all-reduce of 1/8 of the bytes between the 2 nodes
    want = (2 * 7 * 5e-6 + 2 * 7 / 8 * 1e9 / intra) + (2 * 1 * 10e-6 + 2 * 1 / 2 * (1e9 / 8) / inter)
    assert group_all_reduce_time(g, 1e9) == pytest.approx(want)
    flat = all_reduce_time(1e9, 16, bandwidth=inter, latency=10e-6)
    assert group_all_reduce_time(g, 1e9) < flat / 5  # 15 inter-node hops of the whole buffer in a flat ring
    assert group_all_reduce_volume(g, 1e9) == pytest.approx(2 * 7 / 8 * 1e9 + 2 * 1 / 2 * 1e9 / 8)
    # a dp group across tp=8: one rank per node, every hop between nodes: the flat ring
    across = comm_group(c, 2, stride=8)
    assert (across.per_node, across.nodes) == (1, 2)
    assert group_all_reduce_time(across, 1e9) == pytest.approx(all_reduce_time(1e9, 2, bandwidth=inter,
                                                                               latency=10e-6))
    # stride 2: four members per node
    assert comm_group(c, 8, stride=2).per_node == 4
    inside = comm_group(c, 8)
    assert group_all_gather_time(inside, 1e9) == pytest.approx(all_gather_time(1e9, 8, bandwidth=intra,
                                                                              latency=5e-6))
    # all-to-all over 16: 7 shares over NVLink, 8 over the NIC
    assert group_all_to_all_time(g, 16e6) == pytest.approx(7 * (5e-6 + 1e6 / intra) + 8 * (10e-6 + 1e6 / inter))



def test_all_gather_and_reduce_scatter_use_their_own_measured_links():
    from planner.cost_comm import comm_group, group_all_gather_time, group_all_reduce_time, group_reduce_scatter_time

    c = Cluster.cpu(8)
    bw, lat, eff = c.intra_bandwidth, c.intra_latency, c.efficiency.network
    links = dataclasses.replace(c, collective_links={"all_gather": (bw / 2, 2 * lat), "reduce_scatter": (bw / 5, lat)})
    plain, own = comm_group(c, 8), comm_group(links, 8)
    # without measured links both ride the intra link, as on GPUs
    assert group_reduce_scatter_time(plain, 1e8) == group_all_gather_time(plain, 1e8) == \
        pytest.approx(all_gather_time(1e8, 8, bandwidth=bw * eff, latency=lat))
    # with them: 7 hops and 7/8 of the bytes at each collective's own rate (× the network efficiency,
    # as every link); the all-reduce keeps the link
    assert group_all_gather_time(own, 1e8) == pytest.approx(7 * 2 * lat + 7 / 8 * 1e8 / (bw / 2 * eff))
    assert group_reduce_scatter_time(own, 1e8) == pytest.approx(7 * lat + 7 / 8 * 1e8 / (bw / 5 * eff))
    assert group_all_reduce_time(own, 1e8) == group_all_reduce_time(plain, 1e8)
    assert Cluster.from_dict(links.to_dict()) == links  # JSON round trip (tuples come back from lists)
    with pytest.raises(ValueError, match="collective_links maps all_gather / reduce_scatter / p2p"):
        dataclasses.replace(c, collective_links={"all_reduce": (bw, lat)})
    with pytest.raises(ValueError, match="bandwidth > 0"):
        dataclasses.replace(c, collective_links={"all_gather": (0.0, lat)})


def test_measured_size_ranges_price_each_message_on_its_own_range():
    from planner.cluster import link_at
    from planner.cost_comm import comm_group, group_all_gather_time, group_reduce_scatter_time

    c = Cluster.cpu(8)
    bw, lat, eff = c.intra_bandwidth, c.intra_latency, c.efficiency.network
    rows = ((64e3, bw, 2 * lat), (4e6, bw / 2, lat), (16e6, bw / 8, 0.0))
    ranged = dataclasses.replace(c, collective_links={"reduce_scatter": (bw / 5, lat)},
                                 collective_ranges={"reduce_scatter": rows})
    # the first row reaching the size; the last beyond them all
    assert [link_at(rows, n) for n in (1e3, 64e3, 1e6, 16e6, 1e9)] == \
        [rows[0][1:], rows[0][1:], rows[1][1:], rows[2][1:], rows[2][1:]]
    g = comm_group(ranged, 8)
    for n, (b, a) in ((1e3, rows[0][1:]), (1e6, rows[1][1:]), (64e6, rows[2][1:])):
        assert group_reduce_scatter_time(g, n) == pytest.approx(7 * a + 7 / 8 * n / (b * eff))
    # the ranges replace the op's one-line link; an op without ranges keeps its link (here: none)
    assert ranged.link_rows("reduce_scatter") == tuple((e, b * eff, a) for e, b, a in rows)
    assert group_all_gather_time(g, 1e6) == group_all_gather_time(comm_group(c, 8), 1e6)
    assert ranged.link_rows("all_gather") == ((math.inf, bw * eff, lat),)
    assert Cluster.from_dict(json.loads(json.dumps(ranged.to_dict()))) == ranged
    for bad in ({"all_reduce": rows}, {"p2p": ()}, {"p2p": rows[::-1]}, {"p2p": ((1e3, 0.0, lat),)}):
        with pytest.raises(ValueError, match=r"collective_ranges\[.*must be an op of"):
            dataclasses.replace(c, collective_ranges=bad)


def test_a_pipeline_send_takes_the_p2p_range_of_its_size():
    from planner.search.config import Config, Context
    from planner.search.evaluate import evaluate

    ctx = _toy_context(output=1e8)  # one 100 MB send each way per microbatch
    fast = ((1e5, 1e10, 1e-4), (1e9, 5e8, 2e-3))  # 100 MB falls in the second range
    slow = ((1e9, 1e10, 1e-4), (2e9, 5e8, 2e-3))  # ... in the first
    for rows, one_send in ((fast, 2e-3 + 1e8 / 5e8), (slow, 1e-4 + 1e8 / 1e10)):
        c = dataclasses.replace(ctx.cluster, collective_links={"p2p": (1.0, 1.0)}, collective_ranges={"p2p": rows})
        own = Context(ctx.facts, c, global_batch=2, options=ctx.options, captured_dtype="fp32")
        b = evaluate(own, Config(pp=2, dp=1, tp=1, microbatches=2, cuts=(0, 1, 2)))
        assert b.p2p_s == pytest.approx(2 * one_send)  # the ranges, not the one-line link


def test_a_head_split_on_the_vocabulary_is_costed_with_its_loss_or_its_gather():
    from planner.cost import layer_facts

    s, h, v = 256, 512, 32000
    g = gpt_graph(layers=2, hidden=h, heads=8, seq=s, vocab=v)
    c = Cluster.preset("a100-80gb")
    block = {"layers.*.attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.attn.o_proj": "rowwise"}

    def head(style):
        facts = layer_facts(g, {**block, "lm_head": style} if style else block)
        f = facts[-1]
        return f, layer_costs(facts, c, tp=8, micro=1, compute_dtype="bf16")[-1]
    rep_f, rep = head(None)
    loss_f, loss = head("vocab_loss")
    gath_f, gath = head("colwise_gather")
    assert loss_f.tp.loss_tokens == s and loss_f.tp.gather_bytes == 0
    assert gath_f.tp.gather_bytes == s * v * 4 and gath_f.tp.loss_tokens == 0  # fp32 logits per sample
    # the fused loss: three all-reduces of one fp32 per token forward, and the input gradient's backward
    intra = (300e9 * 0.8, 5e-6)
    want = 3 * all_reduce_time(s * 4, 8, bandwidth=intra[0], latency=intra[1])
    assert loss.tp_bytes == pytest.approx(3 * all_reduce_volume(s * 4, 8) + all_reduce_volume(s * h * 2, 8))
    assert loss.tp_s - gath.tp_s == pytest.approx(want - all_gather_time(s * v * 2, 8, bandwidth=intra[0],
                                                                         latency=intra[1]))
    # splitting the head divides its compute by 8 (what is left besides the collectives)
    assert loss.fwd - want < rep.fwd / 4
    assert gath.fwd - loss.fwd == pytest.approx(all_gather_time(s * v * 2, 8, bandwidth=intra[0], latency=intra[1])
                                                - want, rel=1e-6)
