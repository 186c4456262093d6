"""Cluster presets, serialization, CPU fallback."""

import dataclasses
import json
import os

import pytest

from planner.cluster import PRESETS, Cluster, Efficiency


def test_a100_80gb_preset_numbers_are_the_datasheet_figures():
    c = Cluster.preset("a100-80gb", nodes=4)
    assert c.devices == 32
    assert c.devices_per_node == 8
    assert c.flops("bf16") == 312e12
    assert c.flops("fp32") == 19.5e12
    assert c.hbm_bandwidth == 2039e9
    assert c.memory_bytes == 81920 * 2**20
    assert c.intra_bandwidth == 300e9  # NVLink 3: 600 GB/s total = 300 GB/s per direction
    assert c.inter_bandwidth == 25e9  # one 200 Gb/s HDR NIC per GPU


def test_every_required_preset_exists_with_sane_numbers():
    for name in ("a100-40gb", "a100-80gb", "h100-sxm-80gb", "h200"):
        c = Cluster.preset(name, nodes=2)
        assert c.devices == 16
        assert c.flops("bf16") > c.flops("fp32") > 0
    assert Cluster.preset("h100-sxm-80gb").flops("bf16") == 989.4e12
    assert Cluster.preset("h200").hbm_bandwidth == 4800e9
    assert Cluster.preset("a100-40gb").hbm_bandwidth == 1555e9
    assert Cluster.preset("H100").name == "h100-sxm-80gb"  # alias, case-insensitive


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown cluster preset 'v100'; known presets: a100-40gb, a100-80gb"):
        Cluster.preset("v100")
    with pytest.raises(ValueError, match="nodes must be >= 1, got 0"):
        Cluster.preset("a100-80gb", nodes=0)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trips_through_json(name):
    c = Cluster.preset(name, nodes=3)
    back = Cluster.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c


def test_from_dict_accepts_a_preset_reference_and_rejects_unknown_keys():
    assert Cluster.from_dict({"preset": "h200", "nodes": 2}) == Cluster.preset("h200", nodes=2)
    data = Cluster.preset("h200").to_dict()
    data["colour"] = "green"
    with pytest.raises(ValueError, match=r"unknown keys \['colour'\]"):
        Cluster.from_dict(data)


def test_link_is_the_slowest_one_the_group_crosses():
    c = Cluster.preset("a100-80gb", nodes=2)
    assert c.link(8) == (300e9, 5e-6)
    assert c.link(9) == (25e9, 10e-6)


def test_cpu_cluster_and_detect_fallback():
    c = Cluster.cpu(4, memory_bytes=2**30)
    assert (c.devices, c.nodes, c.memory_bytes, c.device) == (4, 1, 2**30, "cpu")
    d = Cluster.detect()  # this machine has no GPU
    assert d.name == "cpu" and d.devices == max(1, os.cpu_count() or 1)
    assert Cluster.from_dict(d.to_dict()) == d


def test_invalid_cluster_says_what_is_wrong():
    with pytest.raises(ValueError, match="memory_bytes must be > 0"):
        Cluster(name="x", device="x", nodes=1, devices_per_node=1, memory_bytes=0,
                peak_flops={"fp32": 1.0, "bf16": 1.0, "fp16": 1.0}, hbm_bandwidth=1.0, intra_bandwidth=1.0,
                intra_latency=0.0, inter_bandwidth=1.0, inter_latency=0.0)
    assert Efficiency().to_dict()["matmul"] > 0


@pytest.mark.parametrize("devices, nodes, last", [(6, 1, 6), (7, 1, 7), (12, 2, 4), (16, 2, 0), (1, 1, 1)])
def test_a_preset_with_any_device_count_has_a_partial_last_node(devices, nodes, last):
    c = Cluster.preset("a100-80gb", devices=devices)
    assert (c.devices, c.nodes, c.last_node_devices) == (devices, nodes, last % 8)
    assert Cluster.from_dict(c.to_dict()) == c
    assert Cluster.from_dict({"preset": "a100-80gb", "devices": devices}) == c
    from planner.validate import device_count

    assert device_count(c.to_dict()) == devices  # what validate reads from a plan's cluster record


def test_nodes_and_devices_must_agree():
    assert Cluster.preset("h100", nodes=2, devices=12).devices == 12
    with pytest.raises(ValueError, match=r"12 devices of h100-sxm-80gb \(8 per node\) take 2 node\(s\), not 3"):
        Cluster.preset("h100", nodes=3, devices=12)
    with pytest.raises(ValueError, match="last_node_devices must be in 0..7"):
        dataclasses.replace(Cluster.preset("h100"), last_node_devices=8)
