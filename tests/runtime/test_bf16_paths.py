"""bf16 plans on the paths around a training step: a live switch and a checkpoint between an fp32
and a bf16 plan (the fp32 masters carry over exactly), ``pm.evaluate``, ``parallelize(check=True)``
and pipeline cuts next to fp32 upcasts, each against eager bf16 with fp32 masters
(``test_bf16_trace.eager_bf16``'s recipe, here step by step in either dtype)."""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.compile_check import checker_for
from fairscale.testing.models import Case, build_llama, build_mlp
from planner.plan import Plan, Stage
from test_bf16_trace import BATCH, LR, STEPS, _plan, eager_bf16

BF16_EPS = 2.0 ** -7
SWITCH = 2  # steps under the first plan; as many again under the second


def eager_mixed(build, dtypes: list[torch.dtype]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``eager_bf16`` with a dtype per step: each step's forward and backward run on copies of the
    fp32 masters in that dtype (fp32: the masters themselves), Adam steps the masters. Returns the
    losses and the masters after the first ``SWITCH`` steps."""
    case: Case = build()
    master = list(case.model.parameters())
    work = copy.deepcopy(case.model)
    copies = list(work.parameters())
    opt = torch.optim.Adam(master, lr=LR)
    losses, at_switch = [], {}
    for step, dtype in enumerate(dtypes):
        if step == SWITCH:
            at_switch = {k: v.detach().clone() for k, v in case.model.named_parameters()}
        for c, m in zip(copies, master):
            c.data, c.grad = m.detach().to(dtype), None
        x, *rest = case.make_batch(step, BATCH)
        x = x.to(dtype) if x.is_floating_point() else x
        loss = case.loss_fn(work(x), *rest)
        loss.float().backward()
        for c, m in zip(copies, master):
            m.grad = None if c.grad is None else c.grad.float()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, at_switch


def _in(plan: Plan, dtype: str, kind: str = "ddp") -> Plan:
    return dataclasses.replace(plan, data_parallel=dataclasses.replace(plan.data_parallel, param_dtype=dtype,
                                                                       kind=kind))


def _pm(case: Case, plan: Plan, **kwargs):
    return fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                                 plan=plan, optimizer=functools.partial(torch.optim.Adam, lr=LR), **kwargs)


def _switch(rank: int, world: int, case: Case, first: Plan, second: Plan, path: str):
    pm = _pm(case, first)
    losses = [pm.train_step(case.make_batch(step, BATCH)) for step in range(SWITCH)]
    before = pm.state_dict()
    pm.save_checkpoint(path)
    pm = fairscale.switch_plan(pm, second)
    after = pm.state_dict()
    losses += [pm.train_step(case.make_batch(step, BATCH)) for step in range(SWITCH, 2 * SWITCH)]
    pm.close()
    return losses, before, after


def _resume(rank: int, world: int, case: Case, plan: Plan, path: str):
    pm = _pm(case, plan)
    pm.load_checkpoint(path)
    state = pm.state_dict()
    losses = [pm.train_step(case.make_batch(step, BATCH)) for step in range(SWITCH, 2 * SWITCH)]
    pm.close()
    return losses, state


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SWITCHES = {  # first plan (dtype, kind, pp, dp), second plan
    "fp32-dp2-to-bf16-pp2": (("fp32", "zero2", 1, 2), ("bf16", "ddp", 2, 1)),
    "bf16-dp2-to-fp32-pp2": (("bf16", "fsdp", 1, 2), ("fp32", "ddp", 2, 1)),
    "bf16-pp2-to-fp32-dp2": (("bf16", "ddp", 2, 1), ("fp32", "zero1", 1, 2)),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_a_switch_and_a_checkpoint_between_fp32_and_bf16_carry_the_masters(name, tmp_path):
    (d1, k1, pp1, dp1), (d2, k2, pp2, dp2) = SWITCHES[name]
    case = build_mlp()
    first = _in(_plan(case, pp1, dp1, 1), d1, k1)
    second = _in(_plan(case, pp2, dp2, 1), d2, k2)
    path = str(tmp_path / "ckpt")
    losses, before, after = fairscale.launch(_switch, devices=2, args=(case, first, second, path))[0]
    resumed, loaded = fairscale.launch(_resume, devices=2, args=(case, second, path))[0]
    ref, at_switch = eager_mixed(build_mlp, [DTYPES[d1]] * SWITCH + [DTYPES[d2]] * SWITCH)
    for key, value in before.items():  # the fp32 masters, unrounded, through the switch and the checkpoint
        assert value.dtype == torch.float32 and torch.equal(after[key], value) and torch.equal(loaded[key], value), key
    assert losses[SWITCH:] == resumed, (losses, resumed)  # the switch continues as a fresh run of the new plan
    # against eager: a mean of dp or microbatch losses, each rounded to bf16 apart (measured: one
    # bf16 ulp at the first step, 2**-6 at 2.3); fp32 steps after bf16 ones start from masters that
    # differ from eager's by that rounding of the gradients (measured 6e-5 and 2e-4 relative)
    assert all(abs(a - b) <= BF16_EPS * abs(b) for a, b in zip(losses, ref)), (losses, ref)
    for key, value in at_switch.items():
        assert torch.allclose(before[key], value, rtol=0, atol=2 * LR), key


def _eval(rank: int, world: int, case: Case, plan: Plan):
    pm = _pm(case, plan)
    for step in range(SWITCH):
        pm.train_step(case.make_batch(step, BATCH))
    got = pm.evaluate(case.make_batch(99, BATCH))
    state = pm.state_dict()
    pm.close()
    return got, state


def eager_eval_bf16(case: Case, state: dict[str, torch.Tensor]) -> float:
    """The eval-mode loss of ``state``'s masters cast to bf16 (buffers as they are), in one process."""
    model = copy.deepcopy(case.model)
    model.load_state_dict(state)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    model.eval()
    x, *rest = case.make_batch(99, BATCH)
    x = x.to(torch.bfloat16) if x.is_floating_point() else x
    with torch.no_grad():
        return float(case.loss_fn(model(x), *rest))


@pytest.mark.parametrize("build,mesh", [(build_mlp, (1, 1, 1)), (build_mlp, (1, 2, 1)), (build_llama, (2, 1, 1))],
                         ids=["mlp-one", "mlp-dp2", "llama-pp2"])
def test_evaluate_under_bf16_is_the_bf16_forward_of_the_masters(build, mesh):
    case = build()
    got, state = fairscale.launch(_eval, devices=mesh[0] * mesh[1], args=(case, _plan(case, *mesh)))[0]
    want = eager_eval_bf16(case, state)
    if mesh[1] == 1:  # the whole batch in one forward, as eager: to the bit
        assert got == want, (got, want)
    else:  # the mean of two half-batch bf16 losses, each rounded apart (and the mean's own rounding)
        assert abs(got - want) <= BF16_EPS * abs(want), (got, want)


def _checked(rank: int, world: int, case: Case, plan: Plan):
    pm = _pm(case, plan, check=True)
    losses = [pm.train_step(case.make_batch(step, BATCH)) for step in range(STEPS)]
    pm.close()
    return pm.check_report, losses


def _cut(case: Case, *stages: list[str]) -> Plan:
    """A bf16 plan of ``case`` cut into ``stages`` (layer names), one rank each."""
    plan = _plan(case, 1, 1, 1)
    plan = dataclasses.replace(plan, mesh=dataclasses.replace(plan.mesh, pp=len(stages)),
                               stages=[Stage(layers=", ".join(s)) for s in stages])
    checker_for(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn).check(plan)
    return plan


class WeightlessNorm(nn.Module):
    """Meta-style RMSNorm without a weight: computes in fp32, hands back the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)


class Upcast(nn.Module):
    """Hands an fp32 value to the next layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() * 2


class CastingHead(nn.Linear):
    """Casts its input to its weight's dtype, as Hugging Face heads do."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight.dtype))


class Chain(nn.Module):
    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 64), middle, CastingHead(64, 10)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _chain(middle: type[nn.Module]) -> Case:
    torch.manual_seed(0)
    return Case("chain", Chain(middle()), build_mlp().make_batch, F.cross_entropy)


LLAMA = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
CUTS = {  # where an RMSNorm's fp32 upcast sits next to the cut
    "mlp-dp2": (build_mlp, lambda c: _plan(c, 1, 2, 1)),
    "llama-one": (build_llama, lambda c: _plan(c, 1, 1, 1)),
    "llama-pp2-head-only": (build_llama, lambda c: _cut(c, LLAMA[:4], LLAMA[4:])),
    "llama-pp3-norm-alone": (build_llama, lambda c: _cut(c, LLAMA[:3], LLAMA[3:4], LLAMA[4:])),
    # a middle stage with fp32 pins and no parameter (was refused as "the fp32 capture records as
    # no-ops": its trace dtype was read from parameters only), and one whose fp32 output crosses the cut
    "weightless-norm-pp3": (functools.partial(_chain, WeightlessNorm),
                            lambda c: _cut(c, ["layers.0"], ["layers.1"], ["layers.2"])),
    "upcast-pp3": (functools.partial(_chain, Upcast), lambda c: _cut(c, ["layers.0"], ["layers.1"], ["layers.2"])),
}


@pytest.mark.parametrize("name", list(CUTS))
def test_check_under_bf16_compares_with_bf16_and_cuts_next_to_upcasts_train_as_eager(name):
    # was: a false alarm on every bf16 plan (compared with fp32 at fp32 tolerance: "BAD loss step 0:
    # 2.28125 vs 2.29707527" on one rank, which computes eager bf16 to the bit)
    build, make = CUTS[name]
    case = build()
    plan = make(case)
    report, got = fairscale.launch(_checked, devices=plan.mesh.size, args=(case, plan))[0]
    assert report.ok and " in bf16, global batch" in report.describe(), report.describe()
    # measured: gradients within 2.1e-3 (mlp dp2) and 4.4e-3 (llama pp2) of eager bf16, losses 1e-4
    assert max(d.error for d in report.comparison.grads) < 1e-2, report.describe()
    ref = eager_bf16(build)
    assert all(abs(a - b) <= BF16_EPS * abs(b) for a, b in zip(got, ref)), (got, ref)
