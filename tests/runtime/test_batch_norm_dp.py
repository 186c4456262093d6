"""Batch norm on real gloo ranks (float64): exact under data parallelism, refused across
microbatches, and per-microbatch only when the plan opts in.

A ResNet in torchvision's style (BatchNorm2d, in-place ReLU and residual add) and a tabular MLP
(BatchNorm1d) train 3 Adam steps under dp2 and dp4 with DDP, ZeRO-2 and FSDP
(``DataParallelRunner``), matching one process on the whole batch in losses, gradient norms (Adam
is blind to a gradient's scale, the norm is not), parameters, and on EVERY rank running_mean,
running_var and num_batches_tracked. The engine (``fairscale.parallelize``) runs the same under a
plan, a tp2 × dp2 plan whose column-parallel linear feeds a BatchNorm1d, refuses microbatches
before any step, and with ``"batch_norm": "local"`` trains exactly as per-rank, per-microbatch
statistics do (an emulation in one process). One launch per world size runs every case.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import pytest
import torch

import fairscale
from fairscale.data_parallel import DataParallelRunner
from fairscale.runtime.data_parallel import local_slice
from fairscale.testing.batch_norm_models import BATCH_NORM_FAMILIES
from fairscale.testing.models import Case
from fairscale.testing.reference import Trajectory, train_reference
from planner.capture import LossModule, capture
from planner.plan import DataParallel, Mesh, Plan, PlanError, Schedule, TensorParallel

STEPS, BATCH, LR, CLIP = 3, 8, 1e-2, 1e9  # CLIP: never clips; makes every run report its gradient norm
KINDS = {"ddp": {}, "zero2": {}, "fsdp": {"reshard_after_forward": True}}
UNITS = {"resnet": "layer1, layer2", "tabular": "layers.*"}
TP_RULES = {"layers.0.0": "colwise", "layers.1.0": "rowwise"}  # tabular: BatchNorm1d on a column shard


def _case(family: str, *, eval_mode: bool = False) -> Case:
    case = BATCH_NORM_FAMILIES[family]()
    case.model.double()
    if eval_mode:  # frozen statistics (fine-tuning): batch norm is elementwise
        case.model.eval()
    make = case.make_batch
    case.make_batch = lambda step, n: tuple(t.double() if t.is_floating_point() else t for t in make(step, n))
    return case


def _numpy(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def _engine(family: str, plan: Plan) -> dict[str, Any]:
    case = _case(family)
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                               optimizer=functools.partial(torch.optim.Adam, lr=LR))
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(pm.train_step(case.make_batch(step, BATCH), clip_norm=CLIP))
        norms.append(pm.last_grad_norm)
    return dict(losses=losses, norms=norms, state=_numpy(pm.state_dict()), report=pm.report())


def _plain_loop(family: str, plan: Plan) -> dict[str, Any]:
    """The ordinary PyTorch loop: ``loss.backward()`` runs outside the module, so the sync batch
    norm's backward all-reduce must find the forward's dp group (it raised "ran outside the module")."""
    case = _case(family)
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                               optimizer=functools.partial(torch.optim.Adam, lr=LR))
    losses, norms = [], []
    for step in range(STEPS):
        pm.optimizer.zero_grad()
        loss = pm(*case.make_batch(step, BATCH))
        loss.backward()
        norms.append(float(pm.clip_grad_norm_(CLIP)))
        pm.optimizer.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)  # each dp rank's mean over its equal share of the rows
        losses.append(float(total) / torch.distributed.get_world_size())
    return dict(losses=losses, norms=norms, state=_numpy(pm.state_dict()))


def _refusal(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except (PlanError, ValueError) as exc:
        return str(exc)
    return "(not refused)"


def _rank(rank: int, world: int, graphs: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if world == 2:  # first: the runner below binds a process-wide "dp" group, which would hide a lost mesh
        out["engine-plain-loop"] = _plain_loop("resnet", Plan(mesh=Mesh(dp=2)))
    for family, graph in graphs.items():
        case = _case(family)
        for kind, options in KINDS.items():
            cfg = DataParallel(kind=kind, units=UNITS[family] if kind == "fsdp" else "", bucket_mb=0.01, **options)
            runner = DataParallelRunner.build(graph, cfg, torch.optim.Adam, lr=LR)
            losses, norms = [], []
            for step in range(STEPS):
                losses.append(runner.train_step(case.make_batch(step, BATCH), clip_norm=CLIP))
                norms.append(runner.last_grad_norm)
            out[f"{family}-{kind}"] = dict(losses=losses, norms=norms,
                                           state=_numpy(runner.full_state_dict(rank0_only=False)))
        runner = DataParallelRunner.build(graph, DataParallel(), torch.optim.Adam, lr=LR)
        out[f"{family}-runner-microbatches"] = _refusal(
            lambda: runner.train_step(case.make_batch(0, BATCH), microbatches=2))
    if world == 2:
        eval_case = _case("resnet", eval_mode=True)
        eval_graph = capture(eval_case.model, eval_case.make_batch(0, BATCH // world), loss_fn=eval_case.loss_fn,
                             annotate=False)
        for kind in ("ddp", "fsdp"):
            cfg = DataParallel(kind=kind, units=UNITS["resnet"] if kind == "fsdp" else "")
            runner = DataParallelRunner.build(eval_graph, cfg, torch.optim.Adam, lr=LR)
            losses = [runner.train_step(eval_case.make_batch(step, BATCH)) for step in range(STEPS)]
            out[f"eval-{kind}"] = dict(losses=losses, state=_numpy(runner.full_state_dict(rank0_only=False)))
        out["engine-sync"] = _engine("resnet", Plan(mesh=Mesh(dp=2)))
        out["engine-local"] = _engine("resnet", Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=2),
                                                     batch_norm="local"))
        out["engine-refused"] = _refusal(
            lambda: _engine("resnet", Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=2))))
    if world == 4:
        out["engine-tp2-dp2"] = _engine("tabular", Plan(mesh=Mesh(dp=2, tp=2),
                                                        tensor_parallel=TensorParallel(rules=TP_RULES)))
    return out


def _local_reference(family: str, *, dp: int, microbatches: int) -> dict[str, Any]:
    """What "local" means, in one process: each dp rank keeps its own running statistics and
    normalizes each of its microbatches with that microbatch's statistics; the gradient is the
    mean over all dp × microbatches slices (what DDP's average of accumulated gradients gives)."""
    case = _case(family)
    model = LossModule(case.model, case.loss_fn)
    opt = torch.optim.Adam(case.model.parameters(), lr=LR)
    buffers = [{k: v.clone() for k, v in case.model.named_buffers()} for _ in range(dp)]
    losses = []
    for step in range(STEPS):
        batch = case.make_batch(step, BATCH)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for r in range(dp):
            for k, v in case.model.named_buffers():
                v.copy_(buffers[r][k])
            mine = local_slice(batch, r, dp)
            for m in range(microbatches):
                loss = model(*local_slice(mine, m, microbatches))
                (loss / (dp * microbatches)).backward()
                total += loss.item() / (dp * microbatches)
            buffers[r] = {k: v.clone() for k, v in case.model.named_buffers()}
        opt.step()
        losses.append(total)
    params = {k: v.detach().clone() for k, v in case.model.state_dict().items()}
    return dict(losses=losses, ranks=[{**params, **b} for b in buffers])


@functools.lru_cache(maxsize=None)
def _runs(world: int):
    graphs = {}
    for family in BATCH_NORM_FAMILIES:
        case = _case(family)
        graphs[family] = capture(case.model, case.make_batch(0, BATCH // world), loss_fn=case.loss_fn, annotate=False)
    results = fairscale.launch(_rank, devices=world, args=(graphs,), timeout_s=900)
    refs = {f: train_reference(functools.partial(_case, f), steps=STEPS, global_batch=BATCH, lr=LR, clip_norm=CLIP)
            for f in BATCH_NORM_FAMILIES}
    return refs, results


def _assert_state(got: dict[str, np.ndarray], want: dict[str, torch.Tensor], where: str) -> None:
    assert set(got) == set(want), f"{where}: keys {sorted(set(got) ^ set(want))[:5]} differ"
    for key, value in want.items():
        err = float(np.abs(got[key].astype(np.float64) - value.numpy().astype(np.float64)).max())
        assert err <= 1e-9, f"{where}: {key} differs by {err:.3e}"
        if key.endswith("num_batches_tracked"):
            assert int(got[key]) == int(value) == STEPS, f"{where}: {key} = {int(got[key])}"


def _assert_run(run: dict[str, Any], ref: Trajectory, where: str, *, loss_rel: float = 1e-10) -> None:
    assert run["losses"] == pytest.approx(ref.losses, rel=loss_rel, abs=0), where
    assert run["norms"] == pytest.approx(ref.grad_norms, rel=1e-10, abs=0), where
    _assert_state(run["state"], ref.params, where)


WORLDS = [2, 4]
CASES = [(w, f, k) for w in WORLDS for f in BATCH_NORM_FAMILIES for k in KINDS]


@pytest.mark.parametrize("world,family,kind", CASES, ids=[f"dp{w}-{f}-{k}" for w, f, k in CASES])
def test_data_parallel_matches_one_process_on_every_rank(world, family, kind):
    refs, results = _runs(world)
    for rank, result in enumerate(results):
        # the runner reports its loss in float32 (loss.float().item()); the rest is compared in float64
        _assert_run(result[f"{family}-{kind}"], refs[family], f"rank {rank} of dp{world} {family} {kind}",
                    loss_rel=1e-7)


@pytest.mark.parametrize("world", WORLDS)
def test_runner_refuses_microbatches(world):
    _, results = _runs(world)
    message = results[0]["tabular-runner-microbatches"]
    assert message.startswith("train_step(microbatches=...): 2 microbatches per step would give each microbatch "
                              "its own batch statistics, but the model has training-mode BatchNorm: layers.0.1 "
                              "(BatchNorm1d")
    assert message.endswith('or opt in to per-microbatch statistics with a Plan with batch_norm="local" given to '
                            "DataParallelRunner.build (each dp rank and microbatch normalizes with its own statistics "
                            "and updates the running statistics once per microbatch, as torch DDP without "
                            "SyncBatchNorm does)")


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_eval_mode_batch_norm_just_works(kind):
    """Eval-mode batch norm uses its running statistics: elementwise, nothing to synchronize."""
    ref = train_reference(functools.partial(_case, "resnet", eval_mode=True), steps=STEPS, global_batch=BATCH, lr=LR)
    _, results = _runs(2)
    for rank, result in enumerate(results):
        got = result[f"eval-{kind}"]
        assert got["losses"] == pytest.approx(ref.losses, rel=1e-7, abs=0)
        # the graph never reads num_batches_tracked in eval mode, so the rank graph does not hold it
        held = {k: v for k, v in ref.params.items() if not k.endswith("num_batches_tracked")}
        _assert_state({k: v for k, v in got["state"].items()}, held, f"rank {rank} eval {kind}")


def test_engine_plan_matches_one_process_and_reports_sync():
    refs, results = _runs(2)
    _assert_run(results[0]["engine-sync"], refs["resnet"], "engine dp2")
    assert "batch norm: sync: statistics over the dp group's global batch" in results[0]["engine-sync"]["report"]


def test_engine_plain_loop_backward_outside_the_module_is_exact():
    refs, results = _runs(2)
    _assert_run(results[0]["engine-plain-loop"], refs["resnet"], "plain loop dp2")


def test_engine_tensor_parallel_batch_norm_on_a_column_shard_is_exact():
    """The TP rules have no batch-norm entry: the fallback gathers the column shard, so the
    statistics are over every channel whole (an all-gather where a channel-sharded norm needs none)."""
    refs, results = _runs(4)
    _assert_run(results[0]["engine-tp2-dp2"], refs["tabular"], "engine tp2 x dp2")


def test_engine_refuses_microbatches_before_any_step():
    _, results = _runs(2)
    for result in results:
        assert result["engine-refused"].startswith(
            "plan has 1 problem:\n  - schedule.microbatches: 2 microbatches per step would give each microbatch its "
            "own batch statistics, but the model has training-mode BatchNorm: bn1 (BatchNorm2d, ")


def test_engine_local_opt_in_trains_per_rank_per_microbatch_and_is_reported():
    _, results = _runs(2)
    want = _local_reference("resnet", dp=2, microbatches=2)
    got = results[0]["engine-local"]
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-10, abs=0)
    _assert_state_local(got["state"], want["ranks"][0])
    assert "batch norm: local (opted in)" in got["report"]
    # it is a different function from one process's: the losses show it
    ref = train_reference(functools.partial(_case, "resnet"), steps=STEPS, global_batch=BATCH, lr=LR)
    assert abs(got["losses"][0] - ref.losses[0]) > 1e-3


def _assert_state_local(got: dict[str, np.ndarray], want: dict[str, torch.Tensor]) -> None:
    for key, value in want.items():
        err = float(np.abs(got[key].astype(np.float64) - value.numpy().astype(np.float64)).max())
        assert err <= 1e-9, f"{key} differs by {err:.3e}"
        if key.endswith("num_batches_tracked"):  # once per microbatch
            assert int(got[key]) == 2 * STEPS
