"""An optimizer with parameter groups, built over the model as training scripts build it (nanoGPT's
weight decay on matrices only, a learning rate per group, a scheduler with one factor per group),
trains exactly as in one process under every data-parallel kind, tensor and pipeline parallelism,
and resumes from a checkpoint under another plan."""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from fairscale.testing.models import build
from fairscale.testing.plans import even_plan
from fairscale.testing.reference import Trajectory, compare, train_reference, start_again
from planner.plan import Plan

BATCH, WORLD = 8, 4


def _case():
    case = build("gpt")  # tied embedding and head
    case.model.double()
    return case


@functools.lru_cache(maxsize=None)
def _shared():
    return _case()


def _optimizer(params) -> torch.optim.Optimizer:
    """nanoGPT's groups, with a learning rate of their own too (over ``model.parameters()``)."""
    params = list(params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5},
                              {"params": no_decay, "weight_decay": 0.0, "lr": 3e-2}], lr=1e-2, betas=(0.9, 0.95))


def _scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, [lambda s: 1.0 / (1 + s), lambda s: 0.5 ** s])


def _reference(steps: int, scheduler: bool = True) -> Trajectory:
    return train_reference(_case, steps=steps, global_batch=BATCH, optimizer=_optimizer,
                           scheduler=_scheduler if scheduler else None)


def _plan(pp: int, dp: int, tp: int, kind: str, virtual: int = 1) -> Plan:
    return even_plan(_shared(), BATCH, pp, dp, tp, kind, microbatches=max(1, BATCH // (2 * dp)), virtual=virtual,
                     schedule="interleaved" if virtual > 1 else "1f1b")


PLANS = {
    "dp4-ddp": (1, 4, 1, "ddp"),
    "dp4-zero1": (1, 4, 1, "zero1"),
    "dp4-zero2": (1, 4, 1, "zero2"),
    "dp4-fsdp": (1, 4, 1, "fsdp"),
    "pp2xdp2-fsdp": (2, 2, 1, "fsdp"),
    "dp2xtp2-zero1": (1, 2, 2, "zero1"),
    "pp2xdp2-interleaved-zero2": (2, 2, 1, "zero2", 2),  # two stage optimizers per rank, one set of groups
}


def _train(rank: int, world: int, plans: list[Plan], steps: int) -> list[tuple[Trajectory, list[list[float]]]]:
    case = _shared()
    out = []
    for plan in plans:
        start_again(case.model)  # each plan from the model's initial weights
        pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                                   plan=plan, optimizer=_optimizer(case.model.parameters()))
        sched = _scheduler(pm.optimizer)
        losses, lrs = [], []
        for step in range(steps):
            losses.append(pm.train_step(case.make_batch(step, BATCH)))
            sched.step()
            lrs.append([g["lr"] for g in pm.optimizer.param_groups])
        out.append((Trajectory(losses=losses, params=pm.state_dict()), lrs))
    return out


@pytest.fixture(scope="module")
def trained():
    plans = [_plan(*mesh) for mesh in PLANS.values()]
    runs = fairscale.launch(_train, devices=WORLD, args=(plans, 3))[0]
    return dict(zip(PLANS, runs))


@pytest.mark.parametrize("name", list(PLANS))
def test_groups_train_as_in_one_process(trained, name):
    reference = _reference(3)
    got, lrs = trained[name]
    compare(reference, got, rtol=1e-10, atol=1e-9)
    # the user's groups, in the user's order, however many stages a rank runs
    assert lrs[-1] == pytest.approx([1e-2 / 4, 3e-2 * 0.125])


def test_the_groups_differ_so_the_test_can_fail():
    """Decay on every tensor (one group) trains elsewhere: the groups above are not a no-op."""
    one_group = train_reference(_case, steps=3, global_batch=BATCH, optimizer=functools.partial(
        torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.5))
    reference = _reference(3)
    assert max((reference.params[k] - v).abs().max().item() for k, v in one_group.params.items()) > 1e-4


def _save_then_resume(rank: int, world: int, first: Plan, second: Plan, path: str) -> tuple[list[float], Trajectory]:
    case = _shared()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               plan=first, optimizer=_optimizer(case.model.parameters()))
    before = [pm.train_step(case.make_batch(step, BATCH)) for step in range(2)]
    pm.save_checkpoint(path)
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               plan=second, optimizer=_optimizer(case.model.parameters()))
    pm.load_checkpoint(path)
    after = [pm.train_step(case.make_batch(step, BATCH)) for step in range(2, 4)]
    return before, Trajectory(losses=before + after, params=pm.state_dict())


def test_resume_under_another_plan_keeps_each_groups_state(tmp_path):
    reference = _reference(4, scheduler=False)  # no scheduler: the checkpoint carries each group's options
    _, got = fairscale.launch(_save_then_resume, devices=WORLD,
                              args=(_plan(1, 4, 1, "fsdp"), _plan(2, 2, 1, "zero2"), str(tmp_path / "ckpt")))[0]
    compare(reference, got, rtol=1e-10, atol=1e-9)


def test_runs_and_segment_state_in_one_process():
    """The pieces of a shard become runs of one group (padding joins the run before it); a shard's
    state reads whole and writes back per segment, each with its own copy of Adam's step."""
    from fairscale.runtime.optim_groups import Segments, group_runs

    group = {"w": 0, "b": 1, "v": 0}.__getitem__
    flat = torch.zeros(12)
    assert group_runs(flat, [("w", 0, 4), ("b", 4, 6), ("v", 6, 9)], group) == [(0, 4, 0), (4, 6, 1), (6, 12, 0)]
    assert group_runs(flat, [("b", 0, 3), ("b", 3, 5)], group) == [(0, 12, 1)]
    assert group_runs(flat, [("w", 0, 0)], group) == []  # a shard of padding only
    p = torch.nn.Parameter(torch.randn(12))
    view = p.detach().view(-1)
    segments = [(view[0:4], 0, 4), (view[4:12], 4, 12)]
    opt = torch.optim.Adam([{"params": [segments[0][0]]}, {"params": [segments[1][0]], "lr": 0.0}], lr=0.1)
    state = Segments(opt, {p: segments})
    p.grad = torch.ones(12)
    state.refresh_grads()
    before = p.detach().clone()
    opt.step()
    assert not torch.equal(p[:4], before[:4]) and torch.equal(p[4:], before[4:])  # groups, in place
    whole = state[p]
    assert whole["exp_avg"].shape == (12,) and float(whole["step"]) == 1.0 and list(state) == [p]
    state[p] = {"exp_avg": torch.arange(12.0), "exp_avg_sq": torch.ones(12), "step": torch.tensor(5.0)}
    assert torch.equal(opt.state[segments[1][0]]["exp_avg"], torch.arange(4.0, 12.0))
    opt.state[segments[0][0]]["step"] += 1
    assert float(opt.state[segments[1][0]]["step"]) == 5.0  # not shared between segments


def _switch(rank: int, world: int, first: Plan, second: Plan) -> tuple[list[float], list[list[float]], Trajectory]:
    case = _shared()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               plan=first, optimizer=_optimizer(case.model.parameters()))
    sched = _scheduler(pm.optimizer)
    losses, lrs = [], []
    for step in range(3):
        if step == 2:
            pm = fairscale.switch_plan(pm, second)
        losses.append(pm.train_step(case.make_batch(step, BATCH)))
        sched.step()
        lrs.append([g["lr"] for g in pm.optimizer.param_groups])
    return losses, lrs, Trajectory(losses=losses, params=pm.state_dict())


def test_a_live_plan_switch_keeps_the_groups_and_their_scheduler():
    """zero2 (segments) to an interleaved pipeline (two stage optimizers per rank) mid-run: the
    scheduler the user attached keeps driving each group, and training matches one process."""
    reference = _reference(3)
    losses, lrs, got = fairscale.launch(_switch, devices=WORLD,
                                        args=(_plan(1, 4, 1, "zero2"), _plan(2, 2, 1, "zero2", 2)))[0]
    compare(reference, got, rtol=1e-10, atol=1e-9)
    assert lrs[-1] == pytest.approx([1e-2 / 4, 3e-2 * 0.125])
