"""Cluster detection with faked drivers: the GPU table, NVLink from NVML, nodes from the launcher,
and unknown models named as unknown (no GPU is lent to CI; every answer a driver could give is faked)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from planner.cluster import Cluster, detect_cluster
from planner.detect import GpuInfo, node_shape, probe_nvml
from planner.gpus import GPU_MODELS, PCIE_GEN4, PCIE_GEN5, gpu_model

MiB = 2**20


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
    ("NVIDIA A100-SXM4-40GB", "a100-sxm-40gb"), ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"),
    ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"), ("NVIDIA L40S", "l40s"), ("NVIDIA B200", "b200"),
    ("NVIDIA GH200 480GB", None), ("NVIDIA H800", None), ("NVIDIA GeForce RTX 4090", None),
    ("Tesla V100-SXM2-32GB", None),
])
def test_device_names_pick_their_own_row_and_nothing_else(name, key):
    m = gpu_model(name)
    assert (m.key if m else None) == key


def test_every_row_is_found_by_its_own_example_name_and_has_every_dtype():
    for key, m in GPU_MODELS.items():
        assert gpu_model(m.example_name) is m, key
        assert set(m.peak_flops) == {"fp32", "tf32", "bf16", "fp16"}
        assert m.peak_flops["bf16"] > m.peak_flops["fp32"] > 0
    # a few datasheet figures, dense
    assert GPU_MODELS["h100-pcie"].peak_flops["bf16"] == 756e12
    assert GPU_MODELS["h100-nvl"].memory_bytes == 95830 * MiB
    assert GPU_MODELS["l40s"].nvlink_bandwidth == 0.0 and GPU_MODELS["l40s"].fabric == "pcie"
    assert GPU_MODELS["b200"].nvlink_bandwidth == 900e9


def _detect(name, *, links=18, memory=None, count=8, environ=None):
    info = GpuInfo(name=name, memory_bytes=memory, nvlink_links=links)
    return detect_cluster(gpus=lambda: count, probe=lambda: info, environ=environ or {})


def test_an_h100_sxm_node_with_nvlink_seen_by_nvml():
    c = _detect("NVIDIA H100 80GB HBM3", memory=81559 * MiB)
    assert (c.name, c.device, c.nodes, c.devices_per_node) == ("detected", "NVIDIA H100 80GB HBM3", 1, 8)
    assert c.flops("bf16") == 989.4e12 and c.flops("tf32") == 494.7e12
    assert c.intra_bandwidth == 450e9 and c.host_bandwidth == PCIE_GEN5
    assert c.memory_bytes == 81559 * MiB


def test_an_h100_pcie_is_not_taken_for_sxm():
    c = _detect("NVIDIA H100 PCIe", links=0)
    assert c.flops("bf16") == 756e12 and c.hbm_bandwidth == 2.0e12
    assert c.intra_bandwidth == PCIE_GEN5


def test_nvlink_bridges_count_only_when_they_join_the_whole_node():
    pair = _detect("NVIDIA H100 NVL", links=12, count=2)
    assert pair.intra_bandwidth == 300e9
    with pytest.warns(UserWarning, match="NVLink bridges join groups of 2 GPUs; a node of 8 is planned with PCIe"):
        eight = _detect("NVIDIA H100 NVL", links=12, count=8)
    assert eight.intra_bandwidth == PCIE_GEN5


def test_without_nvml_the_usual_fabric_is_assumed_and_said():
    with pytest.warns(UserWarning, match=r"NVLink 4 through NVSwitch assumed .* install nvidia-ml-py"):
        c = _detect("NVIDIA H200", links=None)
    assert c.intra_bandwidth == 450e9 and c.memory_bytes == 143771 * MiB  # the table's memory
    with pytest.warns(UserWarning, match="PCIe between GPUs assumed"):
        c = _detect("NVIDIA A100 80GB PCIe", links=None)
    assert c.intra_bandwidth == PCIE_GEN4


def test_an_sxm_gpu_without_active_nvlink_is_planned_on_pcie():
    with pytest.warns(UserWarning, match="NVML reports no active NVLink"):
        c = _detect("NVIDIA A100-SXM4-80GB", links=0)
    assert c.intra_bandwidth == PCIE_GEN4


def test_an_unknown_gpu_is_named_unknown_with_conservative_figures():
    with pytest.warns(UserWarning, match="unknown GPU model 'NVIDIA GeForce RTX 4090': planning with conservative"):
        c = _detect("NVIDIA GeForce RTX 4090", memory=24564 * MiB, links=0)
    assert c.device == "unknown: NVIDIA GeForce RTX 4090"
    assert c.memory_bytes == 24564 * MiB  # what the driver said
    for dtype in ("fp32", "tf32", "bf16", "fp16"):
        assert c.flops(dtype) == min(m.peak_flops[dtype] for m in GPU_MODELS.values())
    assert c.hbm_bandwidth == min(m.hbm_bandwidth for m in GPU_MODELS.values())
    assert c.intra_bandwidth == PCIE_GEN4  # never silently an A100 (NVLink, 2 TB/s)


def test_nodes_come_from_the_launcher():
    assert node_shape(8, {}) == (1, 8)
    assert node_shape(8, {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}) == (2, 8)
    assert node_shape(8, {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}) == (2, 4)
    assert node_shape(8, {"WORLD_SIZE": "4"}) == (1, 4)
    assert node_shape(8, {"WORLD_SIZE": "32"}) == (4, 8)
    with pytest.raises(ValueError, match="WORLD_SIZE=12 is not a whole number of nodes of LOCAL_WORLD_SIZE=8"):
        node_shape(8, {"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"})
    with pytest.warns(UserWarning, match="2 nodes: the bandwidth between nodes cannot be measured"):
        c = _detect("NVIDIA H100 80GB HBM3", environ={"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert (c.nodes, c.devices_per_node, c.devices) == (2, 8, 16)


def test_no_gpu_is_cpu_ranks_and_an_unnamed_gpu_is_an_error():
    c = detect_cluster(gpus=lambda: 0, probe=lambda: None, environ={"WORLD_SIZE": "4"})
    assert (c.name, c.devices) == ("cpu", 4)
    with pytest.raises(RuntimeError, match="neither NVML nor torch.cuda could name them; install nvidia-ml-py"):
        detect_cluster(gpus=lambda: 2, probe=lambda: None, environ={})


def test_nvml_probe_reads_name_memory_and_links_of_the_first_visible_gpu(monkeypatch):
    asked = []

    class Mem:
        total = 81559 * MiB

    fake = types.SimpleNamespace(
        NVML_FEATURE_ENABLED=1, NVML_NVLINK_MAX_LINKS=18,
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: asked.append(("index", i)) or i,
        nvmlDeviceGetHandleByUUID=lambda u: asked.append(("uuid", u)) or 0,
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMemoryInfo=lambda h: Mem(),
        nvmlDeviceGetNvLinkState=lambda h, link: 1 if link < 18 else 0)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    info = probe_nvml()
    assert info == GpuInfo(name="NVIDIA H100 80GB HBM3", memory_bytes=81559 * MiB, nvlink_links=18, source="nvml")
    assert asked == [("index", 3)]  # NVML numbers all GPUs; CUDA device 0 is the first visible one
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1234")
    probe_nvml()
    assert asked[-1] == ("uuid", "GPU-1234")


def test_nvml_probe_without_pynvml_or_a_driver_answers_none(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    assert probe_nvml() is None

    def no_driver() -> None:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=no_driver))
    assert probe_nvml() is None


def test_detection_creates_no_cuda_context():
    Cluster.detect()
    assert not torch.cuda.is_initialized()
