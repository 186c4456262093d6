"""auto_wrap_bn and get_fsdp_instances (FairScale 0.4.13's fairscale.nn.data_parallel helpers)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import auto_wrap_bn, get_fsdp_instances


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2))


def test_auto_wrap_bn_wraps_each_batch_norm_in_full_precision_and_trains_the_same():
    plain, wrapped = _net(), FSDP(auto_wrap_bn(_net()))
    bns = [m for m in get_fsdp_instances(wrapped) if m is not wrapped]
    assert len(bns) == 2 and all(isinstance(b.module.module, nn.BatchNorm2d) for b in bns)
    assert all(not b.flatten_parameters and not b.mixed_precision and not b.reshard_after_forward for b in bns)
    assert get_fsdp_instances(wrapped, skip_empty=True) == get_fsdp_instances(wrapped)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_w = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(step))
        for model, opt in ((plain, opt_p), (wrapped, opt_w)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    got = wrapped.state_dict()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-6, msg=k)


def test_auto_wrap_bn_tags_only_and_refuses_collisions():
    net = _net()
    tagged = auto_wrap_bn(copy.deepcopy(net), wrap_it=False)
    assert not get_fsdp_instances(tagged) and tagged[1].wrapper_config["flatten_parameters"] is False
    with pytest.raises(AssertionError, match="already has a wrapper_config"):
        auto_wrap_bn(tagged, wrap_it=False)
