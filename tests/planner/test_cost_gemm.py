"""A tensor-parallel rank's narrower GEMMs at the rates calibration measured by weight shape."""

import dataclasses
import math

import pytest

from fairscale.testing.models import build
from planner.capture import capture
from planner.cluster import Cluster
from planner.cost import LayerFacts, TPInfo, layer_costs, layer_facts
from planner.cost_gemm import SPLIT_IN, SPLIT_NONE, SPLIT_OUT, gemm_rate, tp_gemm_factor

RATES = ((128, 512, 45e9, 0), (128, 128, 28e9, 0), (128, 16, 20e9, 0))
"""Weight elements 65536, 16384, 2048; rows not recorded (read by size alone)."""
BY_ROWS = ((128, 128, 28e9, 256), (128, 16, 12e9, 256), (128, 128, 30e9, 2048), (128, 16, 24e9, 2048))
"""Two shapes, each on 256 and 2048 rows: the narrow one slows on few rows."""


def test_gemm_rate_interpolates_on_the_log_of_the_weight_size_and_holds_the_ends():
    assert gemm_rate(RATES, 16384) == pytest.approx(28e9)
    # 8192 elements: log2 from 2048 is 2 of 3 octaves to 16384 -> 20 + 8·2/3
    assert gemm_rate(RATES, 8192) == pytest.approx(20e9 + 8e9 * 2 / 3)
    # 32768: half way (1 of 2 octaves) from 16384 to 65536 -> 28 + 17/2
    assert gemm_rate(RATES, 32768) == pytest.approx(36.5e9)
    assert gemm_rate(RATES, 512) == 20e9 and gemm_rate(RATES, 1 << 20) == 45e9
    # two measured shapes of one size (16×128 and 128×16) are averaged
    assert gemm_rate(((16, 128, 18e9, 0), (128, 16, 22e9, 0), (128, 128, 28e9, 0)), 2048) == pytest.approx(20e9)


def test_gemm_rate_interpolates_between_the_measured_rows_on_their_log():
    assert gemm_rate(BY_ROWS, 2048, 256) == 12e9 and gemm_rate(BY_ROWS, 2048, 2048) == 24e9
    # 512 rows: one of three octaves from 256 to 2048
    assert gemm_rate(BY_ROWS, 2048, 512) == pytest.approx(12e9 + 12e9 / 3)
    assert gemm_rate(BY_ROWS, 16384, 724) == pytest.approx(29e9, rel=1e-3)  # half way in log2
    # held outside the measured rows; rows not known: every shape by size (both row counts averaged)
    assert gemm_rate(BY_ROWS, 2048, 64) == 12e9 and gemm_rate(BY_ROWS, 2048, 1 << 14) == 24e9
    assert gemm_rate(BY_ROWS, 2048) == pytest.approx(18e9)
    # and the size between two shapes at each row count, then the rows
    at_256 = 12e9 + 16e9 * 2 / 3  # 8192 elements: 2 of 3 octaves from 2048 to 16384
    at_2048 = 24e9 + 6e9 * 2 / 3
    assert gemm_rate(BY_ROWS, 8192, 512) == pytest.approx(at_256 + (at_2048 - at_256) / 3)


def test_tp_factor_is_the_ratio_of_the_whole_shapes_time_to_the_split_shapes():
    col = (128, 128, 1e6, 2e6, SPLIT_OUT)
    # one colwise 128×128 linear at tp 8 runs as 128×16: 28/20 per FLOP
    assert tp_gemm_factor((col,), RATES, 8) == pytest.approx(1.4)
    # an MLP pair 128->512 colwise, 512->128 rowwise at tp 4: both 16384 elements, 45/28
    mlp = ((128, 512, 1e6, 2e6, SPLIT_OUT), (512, 128, 1e6, 2e6, SPLIT_IN))
    assert tp_gemm_factor(mlp, RATES, 4) == pytest.approx(45 / 28)
    # FLOP-weighted: the 128×128 (3 MFLOP, 1.4× at tp 8) and an unsplit 128×512 (9 MFLOP, 1×):
    # (3/20 + 9/45) / (3/28 + 9/45)
    both = (col, (128, 512, 3e6, 6e6, SPLIT_NONE))
    assert tp_gemm_factor(both, RATES, 8) == pytest.approx((3 / 20 + 9 / 45) / (3 / 28 + 9 / 45))
    # no tp, no measured rates (GPUs) or no GEMMs: the planning rate as it is
    assert tp_gemm_factor((col,), RATES, 1) == tp_gemm_factor((col,), (), 8) == tp_gemm_factor((), RATES, 8) == 1.0


def test_tp_factor_reads_the_rates_at_the_rows_the_samples_give():
    # 128×128 colwise at tp 8 (128×16), 64 rows per sample (forward 2·64·128·128 FLOPs per sample)
    col = (128, 128, 2 * 64 * 128 * 128, 4 * 64 * 128 * 128, SPLIT_OUT)
    assert tp_gemm_factor((col,), BY_ROWS, 8, 4.0) == pytest.approx(28 / 12)  # 256 rows
    assert tp_gemm_factor((col,), BY_ROWS, 8, 32.0) == pytest.approx(30 / 24)  # 2048 rows
    assert tp_gemm_factor((col,), BY_ROWS, 8) == pytest.approx(29 / 18)  # rows not known: by size


def _facts(gemms: tuple) -> LayerFacts:
    return LayerFacts(name="l", index=0, block=None, flops_fwd=4e6, flops_bwd=8e6, saved=0.0, input=0.0,
                      output=0.0, params=100, tp=TPInfo(sharded=True, param_count=100), gemms=gemms)


def test_layer_cost_charges_the_split_gemms_at_their_shapes_rate():
    base = Cluster.cpu(8)
    cpu = dataclasses.replace(base, gemm_flops=RATES)
    # 3 of the layer's 4 MFLOP forward (6 of 8 backward) are a colwise 128×128 linear
    f = _facts(((128, 128, 3e6, 6e6, SPLIT_OUT),))
    peak = base.peak_flops["fp32"] * base.efficiency.matmul
    (plain,) = layer_costs([f], base, tp=8, micro=2, compute_dtype="fp32")
    (narrow,) = layer_costs([f], cpu, tp=8, micro=2, compute_dtype="fp32")
    # micro 2 over tp 8: the GEMM part's 0.75 (fwd) and 1.5 (bwd) MFLOP take 0.4 longer
    assert narrow.gemm_shape_s == pytest.approx(0.4 * (0.75e6 + 1.5e6) / peak)
    assert narrow.fwd - plain.fwd == pytest.approx(0.4 * 0.75e6 / peak)
    assert narrow.bwd - plain.bwd == pytest.approx(0.4 * 1.5e6 / peak)
    assert plain.gemm_shape_s == 0.0  # no measured rates: today's formula
    # without tp the measured rates change nothing (the planning rate is the unsplit shapes')
    (whole,) = layer_costs([f], cpu, tp=1, micro=2, compute_dtype="fp32")
    assert whole == layer_costs([f], base, tp=1, micro=2, compute_dtype="fp32")[0]


def test_layer_facts_list_each_linear_with_what_the_rules_split():
    case = build("gpt", dim=32, layers=2, heads=4, seq=8, vocab=64)
    graph = capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn)
    rules = {"layers.*.attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.attn.o_proj": "rowwise",
             "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
    block = next(f for f in layer_facts(graph, rules) if f.name == "layers.0")
    # q, k, v, o: 32×32; up 32->128, down 128->32; per sample 8 tokens: 2·8·in·out forward, twice that backward
    assert [(g[0], g[1], g[4]) for g in block.gemms] == [(32, 32, SPLIT_OUT)] * 3 + [
        (32, 32, SPLIT_IN), (32, 128, SPLIT_OUT), (128, 32, SPLIT_IN)]
    assert [g[2] for g in block.gemms] == [2 * 8 * 32 * 32] * 4 + [2 * 8 * 32 * 128] * 2
    assert all(g[3] == 2 * g[2] for g in block.gemms)
    # the rest of the block's FLOPs (attention) are not GEMMs with a weight
    assert sum(g[2] for g in block.gemms) < block.flops_fwd
    plain = next(f for f in layer_facts(graph, {}) if f.name == "layers.0")
    assert {g[4] for g in plain.gemms} == {SPLIT_NONE} and math.isclose(
        sum(g[2] for g in plain.gemms), sum(g[2] for g in block.gemms))


def test_cluster_keeps_the_measured_gemm_rates_through_json_and_checks_them():
    c = dataclasses.replace(Cluster.cpu(4), gemm_flops=RATES)
    assert Cluster.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match=r"gemm_flops needs \(in >= 1, out >= 1, FLOP/s > 0, rows >= 0\)"):
        dataclasses.replace(c, gemm_flops=((128, 16, 0.0, 256),))
    # a file written before calibration version 11 lists (in, out, FLOP/s): rows not recorded
    old = {**c.to_dict(), "gemm_flops": [[128, 512, 45e9], [128, 16, 20e9]]}
    assert Cluster.from_dict(old).gemm_flops == ((128, 512, 45e9, 0), (128, 16, 20e9, 0))
