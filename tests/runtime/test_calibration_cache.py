"""The machine's calibration, measured on first use and cached (fairscale.runtime.calibration_cache):
the first CPU plan measures, later ones read the cache, launched ranks never measure, and
FAIRSCALE_NO_CALIBRATE keeps the defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

import fairscale
import fairscale.runtime.calibration_cache as cc
from fairscale import cli
from fairscale.api import resolve_cluster
from fairscale.testing.models import build
from planner.cluster import Cluster


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FAIRSCALE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FAIRSCALE_NO_CALIBRATE", raising=False)
    return tmp_path


def test_first_use_measures_and_caches_then_reads(cache: Path, capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = resolve_cluster(2)  # no GPUs here: 2 CPU ranks of this machine
    err = capsys.readouterr().err
    assert "calibrating this machine for 2 CPU ranks" in err and "calibrated in" in err
    assert cluster.name == "cpu-calibrated" and cluster.peak_flops["fp32"] > 0
    path = cc.cache_path(2)
    assert path.parent.parent == cache and path.is_file()
    assert cluster.peak_flops["fp32"] != Cluster.cpu(2).peak_flops["fp32"]  # measured, not the defaults

    def no_measuring(*a: object, **k: object) -> None:
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(cc, "calibrate_cpu", no_measuring)
    again = resolve_cluster(2)
    assert again.to_dict() == cluster.to_dict() and capsys.readouterr().err == ""
    # the plan says which figures it rests on
    model_case = build("mlp")
    plan = fairscale.plan(model_case.model, model_case.make_batch(0, 8), loss_fn=model_case.loss_fn, devices=2)
    from fairscale.report.text import render_report

    assert "rates measured on this machine" in render_report(plan, None)


def test_no_calibrate_keeps_the_defaults_and_ranks_only_read(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIRSCALE_NO_CALIBRATE", "1")
    assert resolve_cluster(2).to_dict() == Cluster.cpu(2).to_dict()
    assert not cc.cache_path(2).exists()
    monkeypatch.delenv("FAIRSCALE_NO_CALIBRATE")
    monkeypatch.setattr(cc.dist, "is_initialized", lambda: True)  # as inside parallelize's ranks
    assert cc.cpu_cluster(2).name == "cpu" and not cc.cache_path(2).exists()


def test_the_calibrate_command_remeasures(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["calibrate", "--devices", "2"]) == 0
    assert "calibrated in" in capsys.readouterr().out and cc.cache_path(2).is_file()
    assert cli.main(["calibrate", "--devices", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err


def test_a_cache_of_another_calibration_version_is_measured_again(cache: Path) -> None:
    import json

    from fairscale.runtime.calibrate import CALIBRATION_VERSION, Calibration

    cal = Calibration(cluster=Cluster.cpu(2), ranks=2, matmul_flops={"8x8x8": 1e9}, memory_bandwidth=1e9,
                      step_host_s=1e-3, microbatch_host_s=2e-3, dp_tensor_host_s=3e-6, block_flops=1e9,
                      collectives={}, fits={})
    path = cc.cache_path(2)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(cal.to_dict()))
    assert cc._read(path) == Cluster.cpu(2)
    # a file of version 3 measured no runtime host terms: read as absent (measured again), not as zeros
    path.write_text(json.dumps({**cal.to_dict(), "version": CALIBRATION_VERSION - 1}))
    assert cc._read(path) is None
