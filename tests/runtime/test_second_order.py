"""Gradients a ParallelModule cannot give as one process does are refused, not returned wrong.

A gradient penalty on the batch (``x.requires_grad_(); g = torch.autograd.grad(pm(x, y), x,
create_graph=True)``, then ``(loss + g.pow(2).sum()).backward()``) trained under dp2 to weights
3e-3 away from one process's after 3 SGD steps: each rank's loss is its own slice's mean, so ``g``
held the rank's rows at twice one process's scale. A penalty on the parameters' gradients
(``torch.autograd.grad(loss, params, create_graph=True)``) lost its term altogether (the losses
were those of training without it): the data-parallel bucket's backward is not differentiable.
Both silently. A batch input that wants a gradient is refused where the batch is cut
(``fairscale.runtime.data_parallel.rank_slice``), and a create_graph backward through a
collective is refused by every group function (``passes.ops.groups.group_function``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from planner.plan import Mesh, Plan


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _refused(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "(not refused)"


def _rank(rank: int, world: int) -> dict[str, str]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    pm = fairscale.parallelize(model, example_inputs=_batch(), loss_fn=F.cross_entropy, plan=Plan(mesh=Mesh(dp=2)))
    x, y = _batch()
    out = {"input": _refused(lambda: pm(x.clone().requires_grad_(), y)),
           "train_step": _refused(lambda: pm.train_step((x.clone().requires_grad_(), y)))}
    loss = pm(x, y)
    out["create_graph"] = _refused(lambda: torch.autograd.grad(loss, list(pm.parameters()), create_graph=True))
    pm.optimizer.zero_grad()
    with torch.no_grad():
        pm(x.clone().requires_grad_(), y)  # no gradient wanted: runs
    pm(x, y).backward()  # a plain backward still runs
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, str]]:
    return fairscale.launch(_rank, devices=2)


def test_a_batch_input_wanting_a_gradient_is_refused_where_the_batch_is_cut(runs) -> None:
    for out in runs:
        for call in ("input", "train_step"):
            assert out[call].startswith("ValueError: batch input 0 requires a gradient, but this plan cuts the batch "
                                        "over 2 data-parallel ranks"), out[call]


def test_a_gradient_of_a_gradient_through_a_collective_is_refused(runs) -> None:
    for out in runs:
        assert out["create_graph"].startswith("RuntimeError: a gradient of a gradient (create_graph=True: "), out
        assert "reached _Bucket, a collective of a ParallelModule's rank graph" in out["create_graph"]
