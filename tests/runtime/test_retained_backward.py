"""Backward twice through one retained graph (``loss.backward(retain_graph=True)``, then again), in
the plain loop, accumulates the gradients twice as in one process under every data-parallel kind.

FSDP crashed on the second backward (``setStorage: ... out of bounds for storage of size 0``): the
first one freed the units nothing re-gathers in backward (the root, units not resharded after
forward), and the graph's saved views read the freed buffer. An optimizer step between the two
backwards fails as PyTorch's own does (a tensor saved for backward changed in place)."""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

import fairscale
from fairscale.testing.models import build
from fairscale.testing.plans import even_plan
from planner.capture import LossModule
from fairscale.testing.reference import start_again

BATCH = 8


@functools.lru_cache(maxsize=None)
def _shared():
    case = build("gpt", layers=2, dim=32, heads=2, seq=8, vocab=64)
    case.model.double()
    return case


def _plans() -> dict[str, object]:
    case = _shared()
    fsdp = even_plan(case, BATCH, 1, 2, 1, "fsdp")
    kept = dataclasses.replace(fsdp, data_parallel=dataclasses.replace(fsdp.data_parallel, reshard_after_forward=False))
    return {"ddp": even_plan(case, BATCH, 1, 2, 1, "ddp"), "zero2": even_plan(case, BATCH, 1, 2, 1, "zero2"),
            "fsdp": fsdp, "fsdp-kept": kept}


def _twice(rank: int, world: int, plans: dict) -> dict:
    case = _shared()
    out = {}
    for name, plan in plans.items():
        start_again(case.model)  # each plan from the model's initial weights
        pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                                   plan=plan, optimizer=functools.partial(torch.optim.SGD, lr=0.1))
        loss = pm(*case.make_batch(0, BATCH))
        loss.backward(retain_graph=True)
        loss.backward()
        out[name] = pm.full_grads()
        if name == "fsdp-kept":  # a step between the two backwards: PyTorch's error, not new values
            pm.optimizer.zero_grad()
            loss = pm(*case.make_batch(0, BATCH))
            loss.backward(retain_graph=True)
            pm.optimizer.step()
            try:
                loss.backward()
                out["stepped"] = "no error"
            except RuntimeError as exc:
                out["stepped"] = str(exc)
    return out


def test_a_second_backward_through_a_retained_graph_accumulates_as_in_one_process():
    got = fairscale.launch(_twice, devices=2, args=(_plans(),))[0]
    model = _shared().model
    reference = LossModule(model, _shared().loss_fn)
    loss = reference(*_shared().make_batch(0, BATCH))
    loss.backward(retain_graph=True)
    loss.backward()
    want = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for name in ("ddp", "zero2", "fsdp", "fsdp-kept"):
        for key, g in want.items():
            assert torch.allclose(got[name][key], g, rtol=1e-10, atol=1e-12), (name, key)
    assert re.search(r"modified (by an )?inplace", got["stepped"]), got["stepped"]
