"""Device selection, the fork launcher's CUDA guard, build-time replica checks, and where state lands.

No GPU is lent to CI: CUDA answers (device counts, backends, an initialized context) are faked,
and placement is checked on the ``meta`` device, which no CPU tensor can pass for.
"""

from __future__ import annotations


import pytest
import torch

import fairscale
from fairscale.runtime import device as dev
from fairscale.runtime.init import ReplicaMismatchError
from fairscale.testing.models import build
from passes import compile_rank
from passes.dp.shard_data_parallel import META_DP, shard_data_parallel_pass
from planner.capture import capture
from planner.plan import DataParallel, Mesh, Plan, PlanError
from planner.validate import validate_plan


@pytest.fixture
def machine(monkeypatch):
    """Fake the process group's backend and the visible GPU count."""
    def set_(*, backend: str | None, gpus: int, local_rank: int | None = None) -> None:
        monkeypatch.setattr(dev, "_backend", lambda: backend)
        monkeypatch.setattr(dev, "cuda_count", lambda: gpus)
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    return set_


def test_the_default_follows_the_process_group_and_local_rank(machine):
    machine(backend=None, gpus=0)
    assert dev.resolve_device(None) == torch.device("cpu")
    machine(backend="gloo", gpus=8)
    assert dev.resolve_device(None) == torch.device("cpu")  # gloo ranks compute on the CPU
    machine(backend="nccl", gpus=8, local_rank=3)
    assert dev.resolve_device(None) == torch.device("cuda", 3)  # LOCAL_RANK, not the global rank
    machine(backend=None, gpus=2, local_rank=1)
    assert dev.resolve_device(None) == torch.device("cuda", 1)
    assert dev.resolve_device("cuda") == torch.device("cuda", 1)
    machine(backend="nccl", gpus=8, local_rank=3)
    assert dev.resolve_device("cuda:5") == torch.device("cuda", 5)  # an explicit index is kept


def test_impossible_devices_are_errors_that_name_the_argument(machine, monkeypatch):
    machine(backend="nccl", gpus=8)
    with pytest.raises(ValueError, match=r"device='cpu' but the process group uses NCCL, which only moves CUDA"):
        dev.resolve_device("cpu")
    machine(backend="gloo", gpus=0)
    with pytest.raises(ValueError, match=r"device='cuda:0' but no CUDA device is visible"):
        dev.resolve_device("cuda:0")
    machine(backend="gloo", gpus=4)
    with pytest.raises(ValueError, match=r"device='cuda' with the gloo backend: gloo has no CUDA reduce-scatter"):
        dev.resolve_device("cuda")
    with pytest.raises(ValueError, match=r"device='mps': the runtime runs on 'cpu' or 'cuda\[:N\]'"):
        dev.resolve_device("mps")
    with pytest.raises(ValueError, match=r"device='gpu0' is not a device"):
        dev.resolve_device("gpu0")
    machine(backend="nccl", gpus=4, local_rank=5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(ValueError, match=r"LOCAL_RANK asks for cuda:5, but this node has 4 visible CUDA device\(s\) "
                                         r"\(CUDA_VISIBLE_DEVICES=0,1,2,3\); launch at most 4 ranks per node"):
        dev.resolve_device(None)
    machine(backend="nccl", gpus=0)
    with pytest.raises(ValueError, match="uses NCCL but no CUDA device is visible"):
        dev.resolve_device(None)


def test_the_launcher_sets_the_nccl_device_from_local_rank(machine):
    machine(backend=None, gpus=8, local_rank=1)
    assert dev.resolve_device_for_backend("nccl") == torch.device("cuda", 1)  # e.g. global rank 9 of 2 × 8
    assert dev.resolve_device_for_backend("gloo") == torch.device("cpu")


def test_tf32_is_left_alone_on_cpu():
    before = torch.backends.cuda.matmul.fp32_precision
    assert dev.enable_tf32(torch.device("cpu")) is False
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_fork_is_refused_once_cuda_is_initialized(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match=r"CUDA was initialized in this process before fairscale.launch forked its "
                                           r"ranks.*torchrun --nproc_per_node N"):
        fairscale.launch(lambda rank, world: None, devices=2)


def test_fork_is_refused_when_cuda_was_only_asked_for_its_devices(monkeypatch):
    """torch.cuda.is_available() (or a library calling it in a model's forward) poisons fork without
    is_initialized() saying so: a probe child reads torch's own flag, before any rank starts."""
    from fairscale.runtime.launch import _fork_poisoned

    assert _fork_poisoned() is False  # this test process never touched CUDA
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)  # what a poisoned parent's child sees
    assert _fork_poisoned() is True
    with pytest.raises(RuntimeError, match=r"CUDA was initialized in this process before fairscale.launch forked.*"
                                           r"nor a model run whose library asks them"):
        fairscale.launch(lambda rank, world: None, devices=2, backend="nccl")
    assert fairscale.launch(lambda rank, world: rank, devices=2, backend="gloo") == [0, 1]  # CPU ranks need no CUDA


def _unseeded(rank: int, world: int) -> str:
    case = build("mlp", seed=rank)  # a torchrun script that forgot to seed: every rank differs
    try:
        fairscale.parallelize(case.model, example_inputs=case.make_batch(0, 4), loss_fn=case.loss_fn,
                              plan=Plan(mesh=Mesh(dp=2), data_parallel=DataParallel(kind="zero2")))
    except ReplicaMismatchError as exc:
        return str(exc)
    return "built"


def test_ranks_with_different_initial_weights_are_stopped_at_build_time():
    got = fairscale.launch(_unseeded, devices=2)
    for text in got:
        assert "ranks start from different weights" in text and "torch.manual_seed(0)" in text


def test_fp16_is_refused_before_anything_runs():
    case = build("mlp")
    graph = capture(case.model, case.make_batch(0, 4), loss_fn=case.loss_fn)
    plan = Plan(data_parallel=DataParallel(kind="ddp", param_dtype="fp16"))
    with pytest.raises(PlanError, match=r'data_parallel.param_dtype: "fp16" needs dynamic loss scaling'):
        validate_plan(plan, graph)
    with pytest.raises(ValueError, match=r'data_parallel.reduce_dtype: "fp16" needs dynamic loss scaling'):
        shard_data_parallel_pass(graph.gm, DataParallel(kind="zero2", reduce_dtype="fp16"), dp_index=0, dp_size=1)


@pytest.mark.parametrize("kind", ["zero1", "zero2", "fsdp"])
def test_offload_keeps_the_optimizer_side_on_the_host_and_the_rest_on_the_device(kind):
    case = build("gpt")
    graph = capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, annotate=False)
    units = "layers.*" if kind == "fsdp" else ""
    _, modules = compile_rank(graph, Plan(data_parallel=DataParallel(kind=kind, units=units, offload=True)),
                              stages=[0], dp_index=0, tp_index=0, device="meta")
    info = modules[0].meta[META_DP]
    assert (info.placement.compute, info.placement.store) == (torch.device("meta"), torch.device("cpu"))
    host = info.sharded_params()
    assert host and all(p.device.type == "cpu" for p in host)  # master shards, hence the optimizer's state
    for b in info.buckets:
        assert b.flat is None or b.flat.is_meta  # replicas the graph computes with
    for u in info.units:
        assert u.compute_device == torch.device("meta") and u.full.is_meta
    on_device = {id(p) for p in host}
    assert all(p.is_meta for p in modules[0].parameters() if id(p) not in on_device)


def test_optimizer_state_lands_on_its_parameters_device_after_loading():
    from fairscale.runtime.optim import DataParallelOptimizer
    from fairscale.runtime.state import load_optimizer_state_dict

    case = build("mlp")
    graph = capture(case.model, case.make_batch(0, 4), loss_fn=case.loss_fn)
    gm = compile_rank(graph, Plan(data_parallel=DataParallel(kind="zero2")), stages=[0], dp_index=0, tp_index=0,
                      device="meta")[1][0]
    opt = DataParallelOptimizer(gm, torch.optim.Adam, lr=1e-3)
    full = {}
    for b in gm.meta[META_DP].buckets:
        for key, shape in zip(b.keys, b.shapes):
            full[f"optim.{key}.exp_avg"] = torch.ones(shape)
            full[f"optim.{key}.step"] = torch.tensor(3.0)
    load_optimizer_state_dict(gm, opt, full)
    states = [st for st in opt.state.values()]
    assert states and all(st["exp_avg"].is_meta for st in states)  # on the shard's device, as torch.optim would
    assert all(st["step"].device.type == "cpu" for st in states)  # Adam keeps step on the host (not capturable)


def test_fp16_asked_of_the_search_is_refused_before_the_capture(monkeypatch):
    """fairscale.search / plan / ``fairscale plan --dtype fp16`` had captured and searched, then the
    compile check refused every mesh one by one, saying to change the FSDP units."""
    import fairscale.api as api

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before the dtype was refused")

    monkeypatch.setattr(api, "captured", no_capture)
    case = build("mlp")
    batch = case.make_batch(0, 4)
    with pytest.raises(PlanError, match=r'dtype: "fp16" needs dynamic loss scaling') as info:
        fairscale.search(case.model, batch, loss_fn=case.loss_fn, cluster="h100-sxm-80gb", devices=8, dtype="float16")
    assert "FSDP units" not in str(info.value) and 'use "bf16"' in str(info.value)
    with pytest.raises(PlanError, match=r'data_parallel.reduce_dtype: "fp16" needs dynamic loss scaling'):
        fairscale.plan(case.model, batch, loss_fn=case.loss_fn, cluster="h100-sxm-80gb", devices=8,
                       constraints={"data_parallel": {"reduce_dtype": "fp16"}})
