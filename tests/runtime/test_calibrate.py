"""CPU calibration: the alpha-beta fit by hand, and a tiny real run that yields a usable Cluster."""

import json

import pytest

from fairscale.runtime.calibrate import (CALIBRATION_VERSION, Calibration, block_flops_rate, block_model_counts,
                                         calibrate_cpu, fit_alpha_beta, fit_link, load_calibration, op_model_counts,
                                         per_op_overhead, save_calibration)
from fairscale.runtime.calibrate_fit import FLAT_BANDWIDTH, fit_ranges, spread
from fairscale.calibrate_host import host_meshes, measure_runtime_host
from planner.cluster import Cluster


def test_fit_alpha_beta_recovers_exact_points():
    # t = 1e-4 + n / 1e9: (1, 0) -> 1e-4 s; (1, 1e6) -> 1.1e-3 s; (1, 4e6) -> 4.1e-3 s
    alpha, beta, err = fit_alpha_beta([(1, 0, 1e-4), (1, 1e6, 1.1e-3), (1, 4e6, 4.1e-3)])
    assert alpha == pytest.approx(1e-4) and beta == pytest.approx(1e9) and err < 1e-9
    # all-reduce shape over 4 ranks: 2·3·alpha + 1.5·n/beta with alpha 10 us, beta 2 GB/s
    pts = [(6, 1.5 * n, 6e-5 + 1.5 * n / 2e9) for n in (4096, 65536, 2**20)]
    alpha, beta, _ = fit_alpha_beta(pts)
    assert alpha == pytest.approx(1e-5) and beta == pytest.approx(2e9)
    # a negative latency is clamped to 0 and beta refitted alone: with r_i = n_i/t_i = 1e9 and
    # 9.0909e8, 1/beta = Σr/Σr² = 1.90909e9 / 1.82645e18, beta = 9.5671e8 B/s
    alpha, beta, _ = fit_alpha_beta([(1, 1e6, 1e-3), (1, 2e6, 2.2e-3)])
    assert alpha == 0.0 and beta == pytest.approx(9.5671e8, rel=1e-4)



def test_fit_link_takes_beta_from_the_largest_messages_and_alpha_from_the_smallest():
    # 1e-4 s latency; 1 MB at 1.2 ms (in cache, faster per byte), 4 MB at 4.2 ms and 16 MB at 16.2 ms:
    # beta = 12e6 B / 12 ms = 1e9 B/s from the two largest, alpha = 1e-4 s from the smallest
    pts = [(1, 0, 1e-4), (1, 1e6, 0.8e-3), (1, 4e6, 4.1e-3), (1, 16e6, 16.1e-3)]
    alpha, beta, err = fit_link(pts)
    assert alpha == pytest.approx(1e-4) and beta == pytest.approx(1e9)
    assert err == pytest.approx((1.1e-3 - 0.8e-3) / 0.8e-3)  # worst at the mid-sized message
    # the relative-error fit is pulled to the small messages: it makes 16 MB cheaper than measured
    a2, b2, _ = fit_alpha_beta(pts)
    assert a2 + 16e6 / b2 < 16.1e-3 * 0.98
    # when the largest do not grow in time there is no bandwidth regime to read: the single fit
    assert fit_link([(1, 0, 1e-4), (1, 1e6, 1.1e-3), (1, 4e6, 1.0e-3)]) == \
        fit_alpha_beta([(1, 0, 1e-4), (1, 1e6, 1.1e-3), (1, 4e6, 1.0e-3)])


def test_fit_ranges_draws_a_line_per_range_between_measured_sizes():
    # (x_lat, x_bytes, t, size): the 8-rank reduce-scatter's (7, 7/8 of the size) form
    pts = [(7, 3.5e3, 20e-3, 4e3), (7, 3.5e6, 32e-3, 4e6), (7, 14e6, 100e-3, 16e6)]
    rows = fit_ranges(pts)
    assert [end for end, _, _ in rows] == [4e6, 16e6]
    for (end, bw, lat), (xl0, xb0, t0, _), (xl1, xb1, t1, _) in zip(rows, pts, pts[1:]):
        assert lat >= 0 and xl0 * lat + xb0 / bw == pytest.approx(t0) and xl1 * lat + xb1 / bw == pytest.approx(t1)
    # a range whose time grows faster than its bytes: no line of latency >= 0 meets both points;
    # it is charged from the origin through its smaller point (302 ms at 16 MB was measured once)
    end, bw, lat = fit_ranges(pts[:2] + [(7, 14e6, 302e-3, 16e6)])[1]
    assert (end, lat) == (16e6, 0.0) and 3.5e6 / bw == pytest.approx(32e-3)
    # a time that does not grow (small messages, within noise): latency only
    end, bw, lat = fit_ranges([(7, 3.5e3, 21e-3, 4e3), (7, 56e3, 20e-3, 64e3)])[0]
    assert bw == FLAT_BANDWIDTH and 7 * lat == pytest.approx(21e-3, rel=1e-6)


def test_calibrate_two_ranks_gives_a_cluster(tmp_path):
    cal = calibrate_cpu(2, repeat=1, runtime_host=measure_runtime_host)
    c = cal.cluster
    assert c.devices == 2 and c.efficiency.matmul == 1.0 and c.shared_cores >= 1
    assert c.peak_flops["fp32"] > 1e8 and c.hbm_bandwidth > 1e8
    assert c.intra_bandwidth > 0 and c.intra_latency >= 0
    assert c.op_overhead_s > 0 and c.optimizer_tensor_s >= 0 and cal.optimizer_tensor_s == c.optimizer_tensor_s
    assert c.recompute_op_s >= 0 and cal.recompute_op_s == c.recompute_op_s
    assert set(cal.fits) == {"all_reduce", "all_gather", "reduce_scatter", "p2p", "combined"}
    assert set(c.collective_links) == {"all_gather", "reduce_scatter", "p2p"}  # ZeRO's, FSDP's, pipelines' own
    assert c.collective_links["p2p"] == (cal.fits["p2p"]["bandwidth"], cal.fits["p2p"]["latency_s"])
    assert c.collective_links["reduce_scatter"] == (cal.fits["reduce_scatter"]["bandwidth"],
                                                    cal.fits["reduce_scatter"]["latency_s"])
    # ... and per size range, between each two measured sizes, which plans use (version 9)
    sizes = {op: sorted(cal.collectives[op]) for op in c.collective_links}
    assert set(c.collective_ranges) == set(c.collective_links)
    assert all([row[0] for row in c.collective_ranges[op]] == sizes[op][1:] for op in sizes)
    assert "reduce_scatter by size" in cal.table()
    # the host cost per small call, by group size (2 ranks: one group of 2)
    assert set(c.collective_call_s) == {"all_reduce", "all_gather"} and c.collective_call_s == cal.collective_call_s
    assert all(set(calls) == {2} and calls[2] > 0 for calls in c.collective_call_s.values())
    # the planning rate is the transformer block's; the runtime's host terms were measured on real steps
    assert cal.block_flops == c.peak_flops["fp32"] > 1e8 and list(cal.matmul_flops) == ["1024x256x1024"]
    assert c.step_host_s + c.microbatch_host_s > 0 and c.dp_tensor_host_s >= 0 and c.tp_op_host_s >= 0
    assert (cal.step_host_s, cal.microbatch_host_s, cal.dp_tensor_host_s) == \
        (c.step_host_s, c.microbatch_host_s, c.dp_tensor_host_s)
    assert cal.tp_op_host_s == c.tp_op_host_s and "tensor-parallel op" in cal.table()
    assert cal.runtime_measured and "ms per microbatch" in cal.table() and "transformer block" in cal.table()
    # without the probe (calibrate_cpu(..., runtime_host=None)) the table says so, not a silent 0
    assert "not measured" in Calibration.from_dict({**cal.to_dict(), "runtime_measured": False}).table()
    assert set(cal.machine["calibration_s"]) == {"rates", "runtime_host"}  # what first use spends where
    assert 0 < cal.machine["shape_rates_s"] < cal.machine["calibration_s"]["rates"]  # the GEMMs by shape, whole ops
    # the linear's rate by weight shape, the block model's widths whole and split (in, out): the
    # cost model's narrow-GEMM term reads them from the cluster, and the table prints each
    widths = [(128, 512), (128, 128), (128, 64), (128, 32), (128, 16)]
    assert [(i, o, n) for i, o, _, n in c.gemm_flops] == [(*w, 256) for w in widths] + [(*w, 2048) for w in widths]
    assert all(rate > 1e8 for _, _, rate, _ in c.gemm_flops) and "linear   128x16" in cal.table()
    assert "2048 rows" in cal.table()
    # a layer norm's and an add's cost per byte beyond the per-op cost (the ops tp ranks run whole)
    assert set(c.whole_op_s) == {"norm", "elementwise"} and all(v >= 0 for v in c.whole_op_s.values())
    assert "whole norm" in cal.table()
    # the block rate is the median of its samples spread over the calibration, and the table shows their spread
    assert len(cal.block_flops_samples) == 10 and all(r > 1e8 for r in cal.block_flops_samples)
    assert cal.block_flops == spread(cal.block_flops_samples)[0]
    assert "median of 10 samples, middle half" in cal.table()
    # the probe's steps in wall time over their CPU work: cores idle only when ranks share them
    assert cal.core_idle == c.core_idle >= 0 and "cores idle" in cal.table()
    assert c.core_idle == 0.0 or c.shared_cores < 2, "two ranks with a core each: their waits are costed as waits"
    assert cal.to_dict()["version"] == CALIBRATION_VERSION == 11
    assert Calibration.from_dict(cal.to_dict()) == cal
    path = tmp_path / "cpu.json"
    save_calibration(cal, path)
    assert load_calibration(path) == c
    assert Calibration.from_dict(json.loads(path.read_text())).ranks == 2
    path.write_text(json.dumps(c.to_dict()))
    assert load_calibration(path) == Cluster.from_dict(c.to_dict())
    with pytest.raises(ValueError, match="at least 2 ranks"):
        calibrate_cpu(1)


def test_runtime_host_plans_fill_the_calibration_world():
    # every plan uses all the ranks the calibration forks, so the probe runs with every rank busy
    assert host_meshes(8) == [(2, 4, 1, 2), (2, 4, 1, 4), (1, 8, 1, 1), (1, 4, 2, 1)]
    assert all(pp * dp * tp == 6 for pp, dp, tp, _ in host_meshes(6))
    assert host_meshes(2) == [(2, 1, 1, 2), (2, 1, 1, 4), (1, 2, 1, 1), (1, 1, 2, 1)]
    assert measure_runtime_host(3) is None  # no two-stage or tp-2 plan: not measured (the table says so)


def test_op_overhead_divides_a_transformers_time_by_the_ops_the_planner_counts():
    # synthetic: 3.7 ms for 49 ops (one forward, two backward each) and 1 MFLOP at 10 GFLOP/s
    assert per_op_overhead(3.7e-3, ops=49, flops=1e6, flops_per_s=1e10) == pytest.approx(3.6e-3 / 147)
    assert per_op_overhead(1e-5, ops=49, flops=1e6, flops_per_s=1e10) == 0.0  # all arithmetic: none left
    ops, flops, blocks = op_model_counts()  # the tiny GPT it is timed on: the planner's own count of its capture
    assert ops > 20 and flops > 0 and 0 < blocks < ops  # its blocks are what the recompute timing checkpoints


def test_block_flops_rate_takes_the_cost_models_other_terms_out():
    # 80 ms, 3 GFLOP, 100 ops at 20 us (3 per op: forward, 2x backward), 40 MB at 4 GB/s:
    # 3e9 / (80 - 6 - 10) ms
    assert block_flops_rate(80e-3, flops=3e9, ops=100, op_overhead_s=20e-6, traffic_bytes=40e6,
                            bandwidth=4e9) == pytest.approx(3e9 / 64e-3)
    # other terms that over-fill the time leave a tenth of it to the FLOPs (never a negative rate)
    assert block_flops_rate(10e-3, flops=1e9, ops=1000, op_overhead_s=20e-6, traffic_bytes=0.0,
                            bandwidth=4e9) == pytest.approx(1e9 / 1e-3)
    ops, flops, traffic = block_model_counts()  # the planner's own counts of the block model's capture
    assert ops > 20 and flops > 1e8 and traffic > 0


def test_spread_is_the_median_and_interpolated_quartiles():
    assert spread([9.0, 12.0, 10.0, 8.0, 11.0]) == (10.0, 9.0, 11.0)
    # four samples: the median halfway between the middle two; quartiles at 0.75 and 2.25 of the sorted positions
    assert spread([4.0, 1.0, 3.0, 2.0]) == pytest.approx((2.5, 1.75, 3.25))
    assert spread([7.0]) == (7.0, 7.0, 7.0)
    with pytest.raises(ValueError, match="at least one sample"):
        spread([])


def test_table_prints_the_block_rates_spread_and_old_files_without_samples_load():
    cluster = Cluster.cpu(2, memory_bytes=2**30)
    base = Calibration(cluster=cluster, ranks=2, matmul_flops={}, memory_bandwidth=1e9, block_flops=10e9,
                       collectives={}, fits={})
    assert "(the planning rate)" in base.table()  # no samples (a version-7 file): the rate alone
    data = base.to_dict()
    del data["block_flops_samples"]
    assert Calibration.from_dict(data).block_flops_samples == []
    sampled = Calibration.from_dict({**data, "block_flops_samples": [9e9, 12e9, 10e9, 8e9, 11e9]})
    assert ("10.00 GFLOP/s per rank (the planning rate; median of 5 samples, middle half 9.00-11.00, "
            "all 8.00-12.00)") in sampled.table()
