"""The GPU calibration's record, cache and use, run small on the CPU (the GPU run is
benchmarks/gpu/run_all.sh; its figures are in benchmarks/gpu/README.md)."""

from __future__ import annotations

import json

import pytest
import torch

from fairscale.runtime import calibrate_gpu as cg
from planner.cluster import Cluster


@pytest.fixture(scope="module")
def measured():
    torch.set_num_threads(1)
    return cg.measure("cpu", widths=(64, 128), tokens=128, elements=2**14)


def test_measure_reports_every_dtype_and_round_trips(measured):
    assert set(measured.gemm_flops) == {"bf16", "fp16", "tf32", "fp32"}
    assert set(measured.gemm_flops["bf16"]) == {64, 128} and set(measured.gemm_flops["fp32"]) == {128}
    assert all(r > 0 for rates in measured.gemm_flops.values() for r in rates.values())
    assert measured.memory_bandwidth > 0 and measured.launch_s > 0
    assert cg.GpuCalibration.from_dict(json.loads(json.dumps(measured.to_dict()))) == measured


def test_apply_plans_with_the_measured_rates_at_efficiency_one(measured):
    h100 = Cluster.preset("h100-sxm-80gb", devices=8)
    got = measured.apply(h100)
    assert got.name == "detected-calibrated" and got.devices == 8 and got.memory_bytes == h100.memory_bytes
    # no rate at the planning width here: the widest measured one
    assert got.peak_flops == {d: rates[max(rates)] for d, rates in measured.gemm_flops.items()}
    assert got.hbm_bandwidth == measured.memory_bandwidth
    assert (got.efficiency.matmul, got.efficiency.memory, got.efficiency.network) == (1.0, 1.0,
                                                                                       h100.efficiency.network)
    table = measured.table(h100)
    assert "bf16 GEMM TFLOP/s (of datasheet peak): h=64:" in table
    assert "collectives between GPUs are not measured" in table


def test_gpu_cluster_reads_the_cache_and_never_measures_when_told(measured, tmp_path, monkeypatch):
    monkeypatch.setenv("FAIRSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cg, "calibrate_gpu_and_cache", lambda *a, **k: pytest.fail("measured"))
    h100 = Cluster.preset("h100-sxm-80gb", devices=1)
    monkeypatch.setenv("FAIRSCALE_NO_CALIBRATE", "1")
    assert cg.gpu_cluster(h100) == h100  # nothing cached, not measured: the datasheet figures
    path = cg.gpu_cache_path(h100.device)
    assert path.parent == tmp_path / "calibration" and path.name.startswith("gpu-")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(measured.to_dict()))
    assert cg.gpu_cluster(h100) == measured.apply(h100)
    path.write_text(json.dumps({**measured.to_dict(), "version": cg.GPU_CALIBRATION_VERSION + 1}))
    assert cg.gpu_cluster(h100) == h100  # another version's record is measured again, not misread
