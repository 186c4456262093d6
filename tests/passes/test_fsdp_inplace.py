"""FSDP's reshard point hands on values the model may then update in place.

torchvision's ``BasicBlock`` ends with ``out += identity``; when a unit boundary falls there, the
tensor updated in place is an output of ``fsdp_reshard``. Those outputs are aliases made by
``detach()`` (sharing the version counter), not views: autograd forbids in-place updates of the
views a multi-output Function returns, which made this ordinary model crash in its first forward.
"""

from __future__ import annotations

import copy

import torch

from fairscale.testing.batch_norm_models import build_resnet
from passes.dp.shard_data_parallel import shard_data_parallel_pass
from passes.layout import layout_of
from planner.capture import capture
from planner.plan import DataParallel


def test_in_place_residual_after_a_reshard_point_trains_like_the_model():
    case = build_resnet()
    case.model.double().eval()  # eval: batch norm is elementwise here; this test is about FSDP alone
    model = copy.deepcopy(case.model)
    batch = tuple(t.double() if t.is_floating_point() else t for t in case.make_batch(0, 4))
    graph = capture(case.model, batch, loss_fn=case.loss_fn)
    gm = shard_data_parallel_pass(graph.gm, DataParallel(kind="fsdp", units="layer1, layer2"), dp_index=0,
                                  dp_size=1)
    assert "fsdp_reshard" in gm.code and "add_.Tensor(getitem" in gm.code  # the in-place add reads a reshard output
    out = gm(*batch)
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()
    ref = case.loss_fn(model(batch[0]), *batch[1:])
    ref.backward()
    assert loss.item() == ref.item()
    flat = {attr: spec for attr, spec in layout_of(gm).flat.items()}
    grads = {}
    for attr, spec in flat.items():
        grads.update(spec.split(gm.get_parameter(attr).grad))
    for key, p in model.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, rtol=0, atol=1e-12, msg=key)
