"""``pm.evaluate(batch)``: validation loss in eval mode under every kind of plan, equal to one
process's ``model.eval()`` loss on the weights (and running statistics) trained so far.

Before there was no way to evaluate: ``pm(batch)`` raised for pipelined plans, ran the training
graph (dropout on, batch norm updating its statistics) for the others, and returned the rank's own
piece of the loss.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import fairscale
from fairscale.api import captured
from fairscale.eval_mode import EvalModeError
from fairscale.testing.corpus_styles_gpt import NanoConfig, NanoGPT, tokens
from fairscale.testing.corpus_styles_nets import ResNetMini
from passes.tp.patterns import propose_tp_rules
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel
from test_token_mean import BATCH as N, _batch, _case  # a TinyLM with uneven -100 labels

BATCH, STEPS = 4, 2
GPT_BATCH = tokens(96, 16)


def _images(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _gpt() -> tuple[nn.Module, object, object]:
    torch.manual_seed(0)
    return NanoGPT(NanoConfig(dropout=0.1)).double(), GPT_BATCH, None


def _resnet() -> tuple[nn.Module, object, object]:
    torch.manual_seed(0)
    return ResNetMini().double(), _images, nn.functional.cross_entropy


def _double(batch: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.double() if t.is_floating_point() else t for t in batch)


def _plan(kind: str) -> Plan:
    model, make, loss_fn = _gpt()
    graph = captured(model, make(0, BATCH), loss_fn=loss_fn)
    names = [layer.name for layer in graph.layers]
    if kind == "pp2xtp2-sp":
        half = len(names) // 2
        return Plan(mesh=Mesh(pp=2, tp=2), schedule=Schedule(kind="1f1b", microbatches=2, global_batch=BATCH),
                    stages=[Stage(layers=", ".join(names[:half])), Stage(layers=", ".join(names[half:]))],
                    tensor_parallel=TensorParallel(rules=propose_tp_rules(graph.gm, tp=2).rules,
                                                   sequence_parallel=True))
    return Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=1, global_batch=BATCH),
                data_parallel=DataParallel(kind=kind, units="transformer.h.*" if kind == "fsdp" else ""))


def _rank(rank: int, world: int, build, plan: Plan) -> tuple[float, float, dict[str, torch.Tensor]]:
    model, make, loss_fn = build()
    batch = lambda step: _double(make(step, BATCH))  # noqa: E731
    pm = fairscale.parallelize(model, example_inputs=batch(0), loss_fn=loss_fn, plan=plan,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    for step in range(STEPS):
        pm.train_step(batch(step))
    first = pm.evaluate(batch(99))
    state = pm.state_dict()
    again = pm.evaluate(batch(99))  # evaluation changed nothing (running statistics, RNG use)
    return first, again, {k: v.clone() for k, v in state.items()}


CASES = {
    "gpt-pp2xtp2-sp": (_gpt, lambda: _plan("pp2xtp2-sp")),  # dropout in shards, pipeline forward only
    "gpt-dp2-fsdp": (_gpt, lambda: _plan("fsdp")),  # gathered units, evaluated without a backward
    "resnet-dp2-sync-bn": (_resnet, lambda: Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=1))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_evaluate_is_one_process_eval_mode_on_the_trained_state(name: str) -> None:
    build, plan = CASES[name]
    chosen = plan()
    first, again, state = fairscale.launch(_rank, devices=chosen.mesh.size, args=(build, chosen))[0]
    model, make, loss_fn = build()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        batch = _double(make(99, BATCH))
        out = model(*batch) if loss_fn is None else loss_fn(model(batch[0]), *batch[1:])
        want = float(out[1] if isinstance(out, tuple) else out)
    assert first == again, (first, again)
    assert abs(first - want) <= 1e-10 * abs(want), (first, want)


def _token_mean_rank(rank: int, world: int) -> tuple[float, str]:
    case = _case()
    plan = Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=2))
    pm = fairscale.parallelize(case.model, example_inputs=_batch(0, N), plan=plan)
    case.model.eval()  # a Lightning-style validation_step: eval mode, no_grad, the module called
    with torch.no_grad(), pytest.raises(RuntimeError) as refused:
        pm(*_batch(5, N))
    case.model.train()
    return pm.evaluate(_batch(5, N)), str(refused.value)


def test_a_token_mean_is_weighted_by_each_pieces_labels() -> None:
    """-100 labels spread unevenly over dp slices and microbatches: the pieces are weighted by
    their share of the labels, as in train_step (passes.loss_weights)."""
    got, refused = fairscale.launch(_token_mean_rank, devices=2)[0]
    # pm(*batch) of a plan with microbatches said only 'use pm.train_step(batch)', which trains on
    # the validation batch; it names pm.evaluate for a loss without training
    assert "pm.evaluate(batch) for a loss without training" in refused, refused
    with torch.no_grad():
        want = float(_case().model(*_batch(5, N)))
    assert abs(got - want) <= 1e-6 * abs(want), (got, want)


class Jittery(nn.Module):
    """A router-style branch on the module's mode: noise only while training."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.training:
            h = h * (1 + 0.01 * torch.rand_like(h))
        return ((self.b(h) - y) ** 2).mean()


def _jittery(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = Jittery()  # pm.evaluate captures it again in eval mode: the script keeps it
    pm = fairscale.parallelize(model, example_inputs=(torch.randn(4, 4), torch.randn(4, 1)))
    pm.evaluate((torch.randn(4, 4), torch.randn(4, 1)))


def test_a_model_that_branches_on_self_training_is_refused_with_the_line() -> None:
    with pytest.raises(Exception) as info:
        fairscale.launch(_jittery, devices=1)
    text = str(info.value)
    assert EvalModeError.__name__ in text and "cannot run Jittery in eval mode" in text, text
    assert "test_evaluate.py" in text and "self.training" in text, text
