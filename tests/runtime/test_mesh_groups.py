"""Two ParallelModules in one process keep their own process groups (issue 17).

Axis names in rank graphs (``'dp'``, ``'tp'``) mean the groups of the mesh of the module that runs
them (``passes.ops.groups``). Here a model under dp4 and a model under dp2 × tp2 live on the same
4 ranks and train interleaved, in the plain loop (``loss.backward()`` outside the module) and with
``train_step``: each trains bit for bit as it does alone. Before the tables were owned by meshes,
building the second module re-bound ``'dp'`` process-wide, and the first then averaged its
gradients over 2 ranks instead of 4 without a word.
"""

from __future__ import annotations

import functools
import gc

import pytest
import torch

import fairscale
from fairscale.api import captured
from fairscale.testing.models import build
from passes.ops import comm
from passes.tp.patterns import propose_tp_rules
from planner.plan import Mesh, Plan, Schedule, TensorParallel

BATCH, STEPS = 8, 3


def _case():
    case = build("gpt")
    case.model.double()
    make = case.make_batch
    case.make_batch = lambda step, n: tuple(t.double() if t.is_floating_point() else t for t in make(step, n))
    return case


def _recomputed(plan: Plan) -> Plan:
    return Plan(mesh=plan.mesh, schedule=plan.schedule, tensor_parallel=plan.tensor_parallel,
                recompute={"layers.*": "full"})


def _plans() -> dict[str, Plan]:
    case = _case()
    graph = captured(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn)
    schedule = Schedule(kind="1f1b", microbatches=1, global_batch=BATCH)
    rules = propose_tp_rules(graph.gm, tp=2).rules
    return {"dp4": Plan(mesh=Mesh(dp=4), schedule=schedule),
            "dp2xtp2": Plan(mesh=Mesh(dp=2, tp=2), schedule=schedule, tensor_parallel=TensorParallel(rules=rules))}


def _module(plan: Plan) -> fairscale.ParallelModule:
    case = _case()
    return fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                                 plan=plan, optimizer=functools.partial(torch.optim.Adam, lr=1e-3))


def _step(pm: fairscale.ParallelModule, step: int) -> float:
    batch = _case().make_batch(step, BATCH)
    if step % 2:
        return pm.train_step(batch)
    loss = pm(*batch)  # the plain loop: backward and the optimizer outside the module's methods
    loss.backward()
    pm.optimizer.step()
    pm.optimizer.zero_grad()
    return float(loss)


def _ranks(rank: int, world: int, plans: dict[str, Plan]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, plan in plans.items():  # each alone
        pm = _module(plan)
        out[f"{name} alone"] = ([_step(pm, s) for s in range(STEPS)], pm.state_dict())
        del pm
        gc.collect()
    # recompute re-runs a layer's forward, tp all-reduces included, inside the plain loop's
    # loss.backward(): outside the module, over the groups of the forward (it had raised)
    pm = _module(_recomputed(plans["dp2xtp2"]))
    out["dp2xtp2 recompute alone"] = ([_step(pm, s) for s in range(STEPS)], pm.state_dict())
    del pm
    gc.collect()
    pms = {name: _module(plan) for name, plan in plans.items()}  # both, the second built last
    for name in pms:
        pms[name].comm_counter.reset()
    comm.COUNTER.reset()
    losses: dict[str, list[float]] = {name: [] for name in pms}
    for s in range(STEPS):
        for name, pm in pms.items():
            losses[name].append(_step(pm, s))
    for name, pm in pms.items():
        out[f"{name} together"] = (losses[name], pm.state_dict())
        out[f"{name} counted"] = sorted(pm.comm_counter.snapshot())
    out["process counted"] = sorted(comm.COUNTER.snapshot())
    try:
        comm.all_reduce_(torch.ones(1), "dp")
        out["outside"] = "ran"
    except RuntimeError as exc:
        out["outside"] = str(exc)
    with pms["dp4"].mesh.groups.active():
        out["dp4 group size"] = comm.group_size("dp")
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_ranks, devices=4, args=(_plans(),), timeout_s=600)


@pytest.mark.parametrize("name", ["dp4", "dp2xtp2"])
def test_each_module_trains_as_it_does_alone(runs, name) -> None:
    for rank, out in enumerate(runs):
        alone, together = out[f"{name} alone"], out[f"{name} together"]
        assert together[0] == alone[0], f"rank {rank}: {name}'s losses changed beside the other module"
        for key, value in alone[1].items():
            assert torch.equal(together[1][key], value), f"{name}: {key} differs"


def test_recompute_in_the_plain_loop_runs_over_the_forwards_groups(runs) -> None:
    for rank, out in enumerate(runs):
        plain, recomputed = out["dp2xtp2 alone"], out["dp2xtp2 recompute alone"]
        assert recomputed[0] == pytest.approx(plain[0], rel=1e-12, abs=0), f"rank {rank}"
        for key, value in plain[1].items():
            assert torch.allclose(recomputed[1][key], value, rtol=1e-10, atol=1e-12), f"{key} differs"


def test_each_module_counts_its_own_collectives(runs) -> None:
    out = runs[0]
    assert out["dp4 counted"] and all(k.endswith(":dp") for k in out["dp4 counted"]), out["dp4 counted"]
    assert any(k.endswith(":tp") for k in out["dp2xtp2 counted"]), out["dp2xtp2 counted"]
    assert set(out["dp4 counted"]) | set(out["dp2xtp2 counted"]) == set(out["process counted"])


def test_a_collective_outside_every_module_is_refused_not_run_on_some_group(runs) -> None:
    for out in runs:
        assert out["outside"].startswith("a collective over axis 'dp' ran outside the module whose mesh owns "
                                         "that group (the pp1×dp"), out["outside"]
        assert "with pm.mesh.groups.active()" in out["outside"]
        assert out["dp4 group size"] == 4
