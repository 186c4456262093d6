"""bf16 plans traced in bf16 (:mod:`planner.trace_dtype`) of models with floating inputs (the
trace records the batch already cast, the ranks are handed fp32 batches) and with tied weights,
against the eager bf16 reference of ``test_bf16_trace``; and ``in_dtype`` leaves the model as it
was when the trace raises."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import fairscale
from fairscale.testing.models import build_cnn, build_gpt, build_mlp
from planner.capture import capture
from planner.trace_dtype import in_dtype
from test_bf16_trace import BATCH, LR, STEPS, _plan, _train, eager_bf16

BF16_EPS = 2.0 ** -7  # a bf16 loss's own rounding: split over ranks, each part is rounded apart


@pytest.mark.parametrize("build,mesh", [(build_mlp, (1, 1, 1)), (build_mlp, (2, 1, 1)), (build_cnn, (1, 2, 1))],
                         ids=["mlp-one", "mlp-pp2", "cnn-dp2"])
def test_floating_inputs_are_cast_as_the_trace_saw_them(build, mesh):
    # the trace records the batch in bf16; the batch a rank is given is fp32 (was: "mat1 and mat2
    # must have the same dtype" at the first step), and the loss comes back in fp32
    case = build()
    ref = eager_bf16(build)
    got = fairscale.launch(_train, devices=mesh[0] * mesh[1], args=(case, _plan(case, *mesh)))[0]
    if mesh[1] == 1:
        assert got == ref  # one batch, one bf16 loss: to the bit
    else:  # the mean of two bf16 half-batch losses, in fp32
        assert got[0] == ref[0] and all(abs(a - b) <= BF16_EPS * abs(b) for a, b in zip(got, ref)), (got, ref)


def test_tied_weights_stay_one_parameter_and_train_as_eager():
    case = build_gpt()
    graph = capture(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn, annotate=False, dtype=torch.bfloat16)
    tied = case.model.wte.weight
    assert graph.gm.get_parameter("model.wte.weight") is tied
    assert sum(p is tied for p in graph.gm.parameters()) == 1 and tied.dtype == torch.float32
    ref = eager_bf16(build_gpt)
    got = fairscale.launch(_train, devices=1, args=(case, _plan(case, 1, 1, 1)))[0]
    assert got == ref, (got, ref)


class _Raises(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"traced with {self.a.weight.dtype}")


def test_in_dtype_gives_the_model_back_when_the_trace_raises():
    model = _Raises()
    before = dict(model.named_parameters(remove_duplicate=False))
    with pytest.raises(RuntimeError, match="traced with torch.bfloat16"):
        with in_dtype(model, torch.bfloat16, (torch.ones(2, 4),)) as (cast, _):
            assert cast[0].dtype == torch.bfloat16 and model.b.weight is model.a.weight
            model(*cast)
    assert dict(model.named_parameters(remove_duplicate=False)) == before
    assert model.b.weight is model.a.weight and model.a.weight.dtype == torch.float32


def _frozen_mlp():
    case = build_mlp()
    for p in case.model.layers[0].parameters():  # a frozen first layer (fine-tuning's usual shape)
        p.requires_grad_(False)
    return case


@pytest.mark.parametrize("kind,mesh", [("ddp", (1, 1, 1)), ("zero2", (1, 2, 1)), ("fsdp", (1, 2, 1)),
                                       ("ddp", (2, 1, 1))], ids=["ddp-one", "zero2-dp2", "fsdp-dp2", "ddp-pp2"])
def test_frozen_parameters_are_cast_per_use_and_stay_fp32(kind, mesh):
    # was: "mat1 and mat2 must have the same dtype, but got BFloat16 and Float" at the first step
    # (frozen parameters were kept in fp32 and never cast); they are read in bf16 and kept in fp32
    case = _frozen_mlp()
    frozen = {k: v.clone() for k, v in case.model.state_dict().items() if k.startswith("layers.0.")}
    ref = eager_bf16(_frozen_mlp)
    plan = _plan(case, *mesh)
    plan = dataclasses.replace(plan, data_parallel=dataclasses.replace(plan.data_parallel, kind=kind))
    got, state = fairscale.launch(_train_and_state, devices=mesh[0] * mesh[1], args=(case, plan))[0]
    if mesh == (1, 1, 1):
        assert got == ref, (got, ref)
    else:  # a mean of bf16 losses over ranks or microbatches: each part is rounded apart
        assert all(abs(a - b) <= BF16_EPS * abs(b) for a, b in zip(got, ref)), (got, ref)
    for key, value in frozen.items():
        assert state[key].dtype == torch.float32 and torch.equal(state[key], value), key


def _train_and_state(rank, world, case, plan):
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                               optimizer=functools.partial(torch.optim.Adam, lr=LR))
    out = [pm.train_step(case.make_batch(step, BATCH)) for step in range(STEPS)]
    state = pm.state_dict()
    pm.close()
    return out, state
