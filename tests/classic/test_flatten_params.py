"""FlattenParamsWrapper: original state_dict keys, param_list forms, tied weights, exact training
(single process and under DDP on 2 and 4 gloo ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fairscale.nn import FlattenParamsWrapper
from fairscale.testing.models import build
from fairscale.testing.reference import compare

from classic_harness import launch_ranks as _launch, reference as _reference, train_data_parallel as _train_data_parallel


def test_flat_param_holds_everything_and_keys_are_original():
    model = build("mlp").model
    ref = copy.deepcopy(model)
    fpw = FlattenParamsWrapper(model)
    assert [n for n, _ in fpw.named_parameters()] == ["flat_param_0"]
    assert fpw.flat_param.numel() == sum(p.numel() for p in ref.parameters())
    sd = fpw.state_dict()
    assert list(sd) == list(ref.state_dict())
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    x = torch.randn(3, 32)
    assert torch.equal(fpw(x), ref(x))


def test_load_state_dict_with_original_keys():
    fpw = FlattenParamsWrapper(build("mlp", seed=1).model)
    ref = build("mlp", seed=2).model
    fpw.load_state_dict(ref.state_dict())
    x = torch.randn(3, 32)
    assert torch.equal(fpw(x), ref(x))
    fpw2 = FlattenParamsWrapper(build("mlp", seed=3).model)
    fpw2.load_state_dict({"flat_param_0": fpw.flat_param.detach().clone()})
    assert torch.equal(fpw2(x), ref(x))


def test_param_list_forms():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))
    fpw = FlattenParamsWrapper(model, param_list=[model[0].weight, model[0].bias])
    names = [n for n, _ in fpw.named_parameters()]
    assert names == ["flat_param_0", "_fpw_module.1.weight", "_fpw_module.1.bias"]
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 5))
    fpw = FlattenParamsWrapper(model, param_list=[[model[0].weight], [model[1].weight, model[1].bias]])
    assert [n for n, _ in fpw.named_parameters()][:2] == ["flat_param_0", "flat_param_1"]
    assert fpw.flat_params[1].numel() == 25
    assert set(fpw.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias"}


def test_tied_weights_stored_once():
    model = build("gpt", layers=1).model
    ref = copy.deepcopy(model)
    fpw = FlattenParamsWrapper(model)
    assert fpw.flat_param.numel() == sum(p.numel() for p in ref.parameters())  # parameters() dedups ties
    assert set(fpw.state_dict()) == set(ref.state_dict())
    ids = torch.randint(0, 256, (2, 8))
    assert torch.allclose(fpw(ids), ref(ids))


def test_errors_name_the_fix():
    model = nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="cannot mix parameters that require grad with frozen ones"):
        FlattenParamsWrapper(model)
    with pytest.raises(ValueError, match="is not a parameter of the wrapped module"):
        FlattenParamsWrapper(nn.Linear(2, 2), param_list=[nn.Parameter(torch.zeros(3))])


def test_single_process_trains_exactly():
    compare(_reference("cnn"), _reference("cnn", FlattenParamsWrapper))


@pytest.mark.parametrize("world", [2, 4])
def test_trains_exactly_under_ddp(world):
    ref = _reference("cnn")
    fn = lambda rank, n: _train_data_parallel(  # noqa: E731
        lambda m: nn.parallel.DistributedDataParallel(FlattenParamsWrapper(m)), "cnn", rank, n,
        lambda m: m.module.state_dict())
    for got in _launch(fn, world):
        compare(ref, got)
