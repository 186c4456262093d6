"""What users hand the public API is checked at the call, with the argument named and the accepted
forms said (not an IndexError from the annotator)."""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from fairscale.testing.models import build


@pytest.fixture(scope="module")
def case():
    return build("gpt", layers=2, dim=32, heads=2, seq=8, vocab=64)


def test_a_bare_tensor_or_a_dict_batch(case) -> None:
    x, y = case.make_batch(0, 4)
    with pytest.raises(TypeError, match=r"example_inputs must be a tuple of the model's positional inputs, got a "
                                        r"Tensor of shape \(4, 8\); wrap a single input as \(x,\)"):
        fairscale.search(case.model, x, devices=2, loss_fn=case.loss_fn)
    with pytest.raises(TypeError, match=r"example_inputs is a dict \(x, y\); pass the model's inputs as a tuple"):
        fairscale.search(case.model, {"x": x, "y": y}, devices=2, loss_fn=case.loss_fn)
    with pytest.raises(TypeError, match="example_inputs must be a non-empty tuple"):
        fairscale.search(case.model, (), devices=2)
    with pytest.raises(ValueError, match="example_inputs holds no tensor with a batch dimension"):
        fairscale.search(case.model, (3, torch.tensor(1.0)), devices=2)


def test_a_model_without_parameters_or_not_a_module() -> None:
    with pytest.raises(ValueError, match=r"model \(ReLU\) has no parameters, so there is nothing to train"):
        fairscale.search(torch.nn.ReLU(), (torch.randn(2, 3),), devices=2)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        fairscale.search(lambda x: x, (torch.randn(2, 3),), devices=2)


def test_an_optimizer_instance_says_how_to_pass_it(case) -> None:
    opt = torch.optim.SGD(case.model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(TypeError, match=r"got a SGD instance: pass functools.partial\(torch.optim.sgd.SGD, lr=0.1, "
                                        r"momentum=0.9, weight_decay=0"):
        fairscale.parallelize(case.model, 2, example_inputs=case.make_batch(0, 4), loss_fn=case.loss_fn,
                              optimizer=opt)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer subclass or functools.partial"):
        fairscale.parallelize(case.model, 2, example_inputs=case.make_batch(0, 4), loss_fn=case.loss_fn,
                              optimizer="adam")
    # the accepted forms pass the check (and then need launched ranks)
    with pytest.raises(RuntimeError, match="parallelize runs on every rank"):
        fairscale.parallelize(case.model, 2, example_inputs=case.make_batch(0, 4), loss_fn=case.loss_fn,
                              optimizer=functools.partial(torch.optim.AdamW, lr=3e-4))


def test_devices_and_loss_fn(case) -> None:
    with pytest.raises(ValueError, match="devices must be a positive int"):
        fairscale.search(case.model, case.make_batch(0, 4), devices=0, loss_fn=case.loss_fn)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        fairscale.search(case.model, case.make_batch(0, 4), devices=2, loss_fn="cross_entropy")
