"""``model.eval()`` / ``model.train()`` after ``fairscale.parallelize`` (``fairscale.runtime.modes``).

The rank graphs run the mode the model was captured in. A validation forward written the PyTorch
way (``model.eval()``, ``pm(*batch)`` under ``torch.no_grad()``, ``model.train()``) had run in
training mode without a word: batch statistics instead of running ones, and the running statistics
updated by every validation batch. It now runs the eval-mode graphs and matches one process; a call
that cannot run the mode the model is in is refused, naming the module. ``pm.evaluate`` after
``model.eval()`` had also proved its eval rewrite against the eval capture itself, so a model that
branches on ``self.training`` was evaluated on its training branch.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from planner.plan import Mesh, Plan, Schedule
from refusals import refused
from test_evaluate import Jittery, _double, _resnet

BATCH, STEPS = 4, 2
PLAN = Plan(mesh=Mesh(dp=2), schedule=Schedule(kind="1f1b", microbatches=1))


def _rank(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    model, make, loss_fn = _resnet()
    batch = lambda step: _double(make(step, BATCH))  # noqa: E731
    pm = fairscale.parallelize(model, example_inputs=batch(0), loss_fn=loss_fn, plan=PLAN,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    vals = []
    for step in range(STEPS):
        pm.optimizer.zero_grad()
        pm(*batch(step)).backward()
        pm.optimizer.step()
        model.eval()
        with torch.no_grad():
            val = pm(*batch(100 + step)).detach().clone()
        torch.distributed.all_reduce(val)  # each rank's mean over its equal share of the rows
        vals.append(float(val) / world)
        if step == 0:
            out["train_step in eval mode"] = refused(lambda: pm.train_step(batch(7)))
            out["pm() with autograd in eval mode"] = refused(lambda: pm(*batch(7)))
        model.train()
    out["vals"], out["state"] = vals, pm.state_dict()

    torch.manual_seed(0)
    jittery = Jittery()
    pm = fairscale.parallelize(jittery, example_inputs=(torch.randn(4, 4), torch.randn(4, 1)), plan=PLAN)
    jittery.eval()  # as a script does before validating: the proof still compares against training mode
    out["evaluate after model.eval()"] = refused(lambda: pm.evaluate((torch.randn(4, 4), torch.randn(4, 1))))

    model, make, loss_fn = _resnet()
    model.eval()  # compiled in eval mode (as Hugging Face's from_pretrained returns a model)
    pm = fairscale.parallelize(model, example_inputs=batch(0), loss_fn=loss_fn, plan=PLAN)
    model.train()
    out["train_step compiled in eval mode"] = refused(lambda: pm.train_step(batch(0)))
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_rank, devices=2, timeout_s=600)


def test_validation_after_model_eval_is_one_process_eval_mode(runs) -> None:
    model, make, loss_fn = _resnet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want = []
    for step in range(STEPS):
        opt.zero_grad()
        batch = _double(make(step, BATCH))
        loss_fn(model(batch[0]), batch[1]).backward()
        opt.step()
        model.eval()
        with torch.no_grad():
            val = _double(make(100 + step, BATCH))
            want.append(float(loss_fn(model(val[0]), val[1])))
        model.train()
    got = runs[0]
    assert got["vals"] == pytest.approx(want, rel=1e-10, abs=0)
    for key, value in model.state_dict().items():  # running statistics untouched by validation
        assert torch.allclose(got["state"][key], value, rtol=1e-10, atol=1e-12), key


def test_training_in_another_mode_than_compiled_is_refused_naming_the_module(runs) -> None:
    for out in runs:
        text = out["train_step in eval mode"]
        assert text.startswith("ModeError: pm.train_step runs the mode its graphs were compiled in, and the model "
                               "(ResNetMini) is in eval mode, but was in training mode when fairscale.parallelize "
                               "compiled it, and "), text
        assert "model.train()" in text and "pm.evaluate(batch)" in text, text
        text = out["pm() with autograd in eval mode"]
        assert text.startswith("ModeError: pm(batch) runs the mode its graphs were compiled in"), text
        assert "under torch.no_grad()" in text, text
        text = out["train_step compiled in eval mode"]
        assert "the model (ResNetMini) is in training mode, but was in eval mode when fairscale.parallelize " \
               "compiled it" in text, text


def test_evaluate_after_model_eval_still_proves_against_the_training_graph(runs) -> None:
    for out in runs:
        text = out["evaluate after model.eval()"]
        assert text.startswith("EvalModeError: pm.evaluate cannot run Jittery in eval mode"), text
        assert "self.training" in text, text
