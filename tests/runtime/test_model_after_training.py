"""The model given to ``fairscale.parallelize`` after its ranks trained (``fairscale.runtime.model_guard``).

A script that trained with ``pm`` and then saved or ran its own ``model`` (``model.save_pretrained``,
``torch.save(model.state_dict())``, ``model.generate``, a validation ``model(x)``) got the initial
weights, silently. Now those calls raise ``StaleModelError`` saying to call ``pm.gather_into(model)``
(every rank), after which the model holds exactly the weights ``pm.state_dict()`` gathers, on every
rank, under dp (ZeRO-2) and pp alike; a full ``model.load_state_dict`` makes it current too.
"""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch

import fairscale
from fairscale.testing.models import build
from fairscale.testing.plans import even_plan

from refusals import BATCH, refused

STEPS = 3


def _rank(rank: int, world: int, plan_kind: str) -> dict[str, object]:
    out: dict[str, object] = {}
    case = build("gpt")
    model = case.model
    plan = even_plan(case, BATCH, pp=2, dp=1, tp=1, microbatches=2) if plan_kind == "pp2" else \
        even_plan(case, BATCH, pp=1, dp=2, tp=1, kind="zero2")
    pm = fairscale.parallelize(model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    before = {k: v.clone() for k, v in model.state_dict().items()}  # before any step: the model is current
    for step in range(STEPS):
        pm.train_step(case.make_batch(step, BATCH))
    batch = case.make_batch(9, BATCH)
    out["state_dict"] = refused(model.state_dict)
    out["forward"] = refused(lambda: model(batch[0]))
    out["submodule state_dict"] = refused(model.wte.state_dict)
    buf = io.BytesIO()
    out["torch.save(model)"] = refused(lambda: torch.save(model, buf))  # pickles the model with its hooks
    out["deepcopy forward"] = refused(lambda: copy.deepcopy(model)(batch[0]))  # a copy is not guarded
    full = pm.state_dict()
    pm.gather_into(model)
    mine = {k: v.clone() for k, v in model.state_dict().items()}
    out["changed"] = any(not torch.equal(before[k], mine[k]) for k in mine)
    out["state"] = mine
    if rank == 0:
        out["equal to pm.state_dict()"] = all(torch.equal(full[k], mine[k]) for k in full)
    out["forward after"] = refused(lambda: model(batch[0]))
    out["torch.save(model) after"] = refused(lambda: torch.save(model, io.BytesIO()))
    pm.train_step(case.make_batch(STEPS, BATCH))
    out["stale again"] = refused(model.state_dict)
    full = pm.state_dict()
    if rank == 0:
        model.load_state_dict(full)
        out["after load_state_dict"] = refused(model.state_dict)
    return out


def _reference() -> dict[str, torch.Tensor]:
    case = build("gpt")
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1)
    for step in range(STEPS):
        batch = case.make_batch(step, BATCH)
        opt.zero_grad()
        case.loss_fn(case.model(batch[0]), *batch[1:]).backward()
        opt.step()
    return case.model.state_dict()


@pytest.fixture(scope="module", params=["zero2", "pp2"])
def runs(request) -> list[dict[str, object]]:
    return fairscale.launch(functools.partial(_rank, plan_kind=request.param), devices=2, timeout_s=600)


def test_the_model_refuses_use_until_the_trained_weights_are_gathered_into_it(runs) -> None:
    for out in runs:
        for call in ("state_dict", "forward", "submodule state_dict", "torch.save(model)"):
            text = out[call]
            assert text.startswith("StaleModelError: "), (call, text)
            assert "behind its ranks' since an optimizer step of its ParallelModule" in text, text
            assert "pm.gather_into(model) on every rank" in text, text
        assert "the parallelized model's submodule wte" in out["submodule state_dict"]
        assert "torch.save (pickling) of the model given to fairscale.parallelize" in out["torch.save(model)"]
        assert out["torch.save(model) after"] == "(not refused)"
        assert out["deepcopy forward"] == "(not refused)"
        assert out["forward after"] == "(not refused)"
        assert out["stale again"].startswith("StaleModelError: ")
    assert runs[0]["after load_state_dict"] == "(not refused)"


def test_gather_into_gives_every_rank_the_trained_weights(runs) -> None:
    assert runs[0]["equal to pm.state_dict()"] is True
    ref = _reference()
    for out in runs:
        assert out["changed"] is True
        state = out["state"]
        assert set(state) == set(ref)
        for k in ref:
            torch.testing.assert_close(state[k], ref[k], rtol=1e-5, atol=1e-6)


def _train_rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    case = build("gpt")
    fairscale.train(case.model, lambda step: case.make_batch(step, BATCH), steps=STEPS, loss_fn=case.loss_fn,
                    optimizer=functools.partial(torch.optim.SGD, lr=0.1), constraints={"mesh": {"dp": 2}},
                    checkpoint_dir=None)
    return {k: v.clone() for k, v in case.model.state_dict().items()}


def test_fairscale_train_leaves_the_trained_weights_in_the_model() -> None:
    """fairscale.train keeps its module to itself: the model it was given is gathered into at the end
    (it had kept its initial weights, and now would refuse its state_dict() with no pm to gather from)."""
    ref = _reference()
    for state in fairscale.launch(_train_rank, devices=2, timeout_s=600):
        for k in ref:
            torch.testing.assert_close(state[k], ref[k], rtol=1e-5, atol=1e-6)
