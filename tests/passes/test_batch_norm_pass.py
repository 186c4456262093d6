"""The batch-norm pass and its ops in one process (float64): each form of batch norm is rewritten
into ``passes.ops.bn_ops`` and the rewritten graph computes what the model computes (losses,
gradients, running statistics, ``num_batches_tracked``), including under activation recompute,
where the native op would update the running statistics twice. Multi-rank exactness is in
``tests/runtime/test_batch_norm_dp.py``."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fairscale.testing.batch_norm_models import build_resnet, build_tabular
from passes import compile_rank
from passes.dp.batch_norm import META_BATCH_NORM, batch_norm_pass
from passes.layout import layout_of
from passes.ops import bn_ops
from passes.verify import verify_pass
from planner.capture import capture
from planner.plan import Mesh, Plan, PlanError, Schedule

STEPS = 3


@pytest.fixture(autouse=True)
def _float64():
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(prev)


@pytest.mark.parametrize("shape", [(6, 4), (6, 4, 5), (6, 4, 3, 3), (4, 4, 2, 2, 2)], ids=["1d", "1d-seq", "2d", "3d"])
@pytest.mark.parametrize("affine,stats", [(True, True), (False, True), (True, False)],
                         ids=["affine", "no-affine", "no-running-stats"])
def test_local_op_equals_native_batch_norm(shape, affine, stats):
    torch.manual_seed(0)
    c = shape[1]
    w, b = (torch.randn(c, requires_grad=True), torch.randn(c, requires_grad=True)) if affine else (None, None)
    init = (torch.randn(c), torch.rand(c) + 0.5)
    runs = {}
    for name in ("native", "ours"):
        rm, rv = (init[0].clone(), init[1].clone()) if stats else (None, None)
        torch.manual_seed(1)
        for _ in range(2):
            x = (torch.randn(shape) * 3 + 1).requires_grad_()
            y = F.batch_norm(x, rm, rv, w, b, True, 0.3, 1e-5) if name == "native" else \
                bn_ops.batch_norm_local(x, w, b, rm, rv, None, 0.3, 1e-5)
            g = torch.randn(shape)
            grads = torch.autograd.grad(y, [x] + ([w, b] if affine else []), g)
        runs[name] = (y.detach(), grads, rm, rv)
    (y0, g0, rm0, rv0), (y1, g1, rm1, rv1) = runs["native"], runs["ours"]
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-12)
    for a, e in zip(g1, g0):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-11)
    if stats:
        torch.testing.assert_close(rm1, rm0, rtol=0, atol=1e-13)
        torch.testing.assert_close(rv1, rv0, rtol=0, atol=1e-13)


@pytest.mark.parametrize("offset", [0.0, 100.0])
def test_float32_statistics_are_as_accurate_as_native(offset):
    """Two passes (mean, then Σ(x-μ)²), so an offset mean costs no more digits than natively."""
    torch.manual_seed(0)
    x = torch.randn(64, 4, 8, 8, dtype=torch.float32) + offset
    w, b = torch.randn(4, dtype=torch.float32), torch.randn(4, dtype=torch.float32)
    truth = F.batch_norm(x.double(), None, None, w.double(), b.double(), True, 0.1, 1e-5)
    native = F.batch_norm(x, None, None, w, b, True, 0.1, 1e-5)
    ours = bn_ops.batch_norm_local(x, w, b, None, None, None, 0.1, 1e-5)
    assert ours.dtype == torch.float32
    native_err = (native.double() - truth).abs().max().item()
    assert (ours.double() - truth).abs().max().item() <= 2 * native_err + 1e-6


def _case(build, **kwargs):
    case = build(**kwargs)
    case.model.double()
    make = case.make_batch
    case.make_batch = lambda step, n: tuple(t.double() if t.is_floating_point() else t for t in make(step, n))
    return case


def _code(gm: torch.fx.GraphModule) -> str:
    """The code of ``gm`` and of its recompute regions."""
    return "".join(m.code for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


def _check_against_model(gm: torch.fx.GraphModule, case, model: nn.Module, *, steps: int = STEPS,
                         unused: tuple[str, ...] = ()) -> None:
    """Forward and backward ``steps`` batches through ``gm`` and through a copy of the model:
    the same losses, gradients and state (parameters and buffers), by the user's keys. Keys ending
    in ``unused`` are buffers the graph never reads (eval mode's ``num_batches_tracked``)."""
    keys = layout_of(gm).keys
    held = {keys[a]: t for a, t in [*gm.named_parameters(), *gm.named_buffers()] if a in keys}
    params = {keys[a]: p for a, p in gm.named_parameters() if a in keys}
    for step in range(steps):
        batch = case.make_batch(step, 8)
        out = gm(*batch)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        ref = case.loss_fn(model(batch[0]), *batch[1:])
        ref.backward()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=0)
    for key, value in model.state_dict().items():
        if key.endswith(unused) and unused:
            continue
        assert key in held, f"{key} is not held by the rewritten graph"
        torch.testing.assert_close(held[key], value, rtol=0, atol=1e-12, msg=key)
    for key, p in model.named_parameters():
        torch.testing.assert_close(params[key].grad, p.grad, rtol=0, atol=1e-11, msg=key)


@pytest.mark.parametrize("family,recompute", [("resnet", {}), ("tabular", {}), ("tabular", {"layers.0": "full"}),
                                              ("tabular", {"layers.[0-1]": "selective"})],
                         ids=["resnet", "tabular", "tabular-recompute-full", "tabular-recompute-selective"])
def test_compiled_rank_graph_equals_the_model(family, recompute):
    """Under recompute the region runs forward again in backward; the native op would update the
    running statistics twice there (see the control below), the rewritten one once."""
    case = _case({"resnet": build_resnet, "tabular": build_tabular}[family])
    model = copy.deepcopy(case.model)
    graph = capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)
    _, modules = compile_rank(graph, Plan(recompute=recompute), stages=[0], dp_index=0, tp_index=0)
    gm = modules[0]
    assert _code(gm).count("batch_norm_sync(") == {"resnet": 6, "tabular": 2}[family]
    assert "aten.batch_norm" not in _code(gm)
    _check_against_model(gm, case, model)


def test_control_native_batch_norm_under_recompute_updates_twice(monkeypatch):
    """Without the pass, recompute's second forward updates the running statistics again."""
    import passes

    monkeypatch.setattr(passes, "batch_norm_pass", lambda gm, plan: gm)
    case = _case(build_tabular)
    model = copy.deepcopy(case.model)
    graph = capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)
    _, modules = compile_rank(graph, Plan(recompute={"layers.0": "full"}), stages=[0], dp_index=0, tp_index=0)
    with pytest.raises(AssertionError, match="layers.0.1.running_mean"):
        _check_against_model(modules[0], case, model)


@pytest.mark.parametrize("norm", [functools.partial(nn.BatchNorm1d, momentum=None), nn.SyncBatchNorm],
                         ids=["momentum-none", "sync-batch-norm"])
def test_modules_kept_whole_by_fx_are_inlined(norm):
    """torch.fx keeps these modules whole (``call_module``): the momentum=None one because export
    cannot trace its ``1/num_batches_tracked``, SyncBatchNorm in launched ranks. Inlined, their
    parameters get provenance (the verifier passes) and the cumulative average is kept."""
    case = _case(build_tabular, norm=norm)
    model = copy.deepcopy(case.model)
    graph = capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn, tracer="fx", annotate=False)
    assert sum(n.op == "call_module" for n in graph.gm.graph.nodes) == 2
    gm = batch_norm_pass(graph.gm, Plan())
    verify_pass(gm)
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    assert gm.code.count("batch_norm_sync(") == 2 and gm.code.count("aten.add_.Tensor(") == 2
    assert {"layers.0.1.weight", "layers.0.1.running_var", "layers.1.1.num_batches_tracked"} <= set(
        layout_of(gm).keys.values())
    _check_against_model(gm, case, model)
    if norm is not nn.SyncBatchNorm:
        assert model.layers[0][1].num_batches_tracked.item() == STEPS  # the cumulative average ran


def test_eval_mode_is_left_alone_and_fx_modules_are_inlined_as_eval():
    case = _case(build_resnet)
    case.model.eval()
    graph = capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)
    assert batch_norm_pass(graph.gm, Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=4))) is graph.gm
    tab = _case(build_tabular)
    tab.model.eval()
    model = copy.deepcopy(tab.model)
    fx = capture(tab.model, tab.make_batch(0, 8), loss_fn=tab.loss_fn, tracer="fx", annotate=False)
    gm = batch_norm_pass(fx.gm, Plan(schedule=Schedule(microbatches=4)))
    assert gm.code.count("torch.ops.aten.batch_norm.default(") == 2 and "batch_norm_sync" not in gm.code
    verify_pass(gm)
    _check_against_model(gm, tab, model, unused=("num_batches_tracked",))


def test_instance_norm_running_statistics():
    case = _case(build_resnet, norm=functools.partial(nn.InstanceNorm2d, affine=True, track_running_stats=True))
    model = copy.deepcopy(case.model)
    graph = capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)
    gm = batch_norm_pass(graph.gm, Plan())
    assert gm.code.count("instance_norm_sync(") == 6
    _check_against_model(gm, case, model, unused=("num_batches_tracked",))  # InstanceNorm never counts


def test_pass_refuses_microbatches_and_opt_in_rewrites_locally():
    case = _case(build_tabular)
    graph = capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)
    with pytest.raises(PlanError) as info:
        batch_norm_pass(graph.gm, Plan(schedule=Schedule(microbatches=2)))
    (problem,) = info.value.problems
    assert problem.startswith("schedule.microbatches: 2 microbatches per step would give each microbatch its own "
                              "batch statistics, but the model has training-mode BatchNorm: layers.0.1 (BatchNorm1d, "
                              "batch_norm_models.py:")
    gm = batch_norm_pass(graph.gm, Plan(schedule=Schedule(microbatches=2), batch_norm="local"))
    assert gm.code.count("batch_norm_local(") == 2 and "batch_norm_sync" not in gm.code
    info_ = gm.meta[META_BATCH_NORM]
    assert (info_.mode, [op.module for op in info_.ops]) == ("local", ["layers.0.1", "layers.1.1"])


def test_compiled_graphs_own_their_running_statistics():
    """Two programs compiled from one capture do not share (and so do not double-update) statistics."""
    case = _case(build_tabular)
    graph = capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)
    first, second = (batch_norm_pass(graph.gm, Plan()) for _ in range(2))
    first(*case.make_batch(0, 8))
    key = "model.layers.0.1.running_mean"
    assert not torch.equal(first.get_buffer(key), second.get_buffer(key))
    assert torch.equal(second.get_buffer(key), graph.gm.get_buffer(key))
    assert first.get_buffer("model.layers.0.1.num_batches_tracked").item() == 1
    assert graph.gm.get_buffer("model.layers.0.1.num_batches_tracked").item() == 0


def test_rank_graph_shows_the_synchronized_op():
    case = _case(build_tabular)
    graph = capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)
    gm = batch_norm_pass(graph.gm, Plan(mesh=Mesh(dp=4)))
    line = next(line for line in gm.code.splitlines() if "batch_norm_sync(" in line)
    assert "model_layers_0_1_running_mean, model_layers_0_1_running_var, None, 0.1, 1e-05, 'dp')" in line
