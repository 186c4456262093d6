"""Planning leaves the model as it was, even when its eval-mode forward changes it.

HF ``RwkvForCausalLM`` (default config) rescales weights for inference: its forward in eval mode
divides some weights in place and sets ``layers_are_rescaled``, and the next forward in training
mode multiplies them back in place. The loss check (``fairscale.loss_check``) ran the user's model
in eval mode and restored only the training flags, so after planning the flag stayed set: the
ranks' capture recorded the in-place multiply of a parameter, and every plan crashed after
launch ("Output 41 of _Bucket is a view and its base ... has been modified inplace"); with 6 or
more layers the user's weights would have been left divided. The check runs on a copy now.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.testing.reference import compare_grads, Trajectory

BATCH, STEPS, LR = 8, 3, 0.1


class Rescaling(nn.Module):
    """RWKV's habit: weights halved in place for inference, doubled back for training."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.out = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.rescaled = False

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.training == self.rescaled:
            with torch.no_grad():
                self.out.weight.mul_(2.0) if self.training else self.out.weight.div_(2.0)
            self.rescaled = not self.training
        return F.cross_entropy(self.out(self.embed(ids)).flatten(0, 1), labels.flatten())


class UnprovenRescaling(Rescaling):
    """The same, with an op the row proof has no rule for (an FFT over features), so that planning
    also captures it in eval mode and runs the eager check on it (in training mode: its eval mode
    takes another path, the division)."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.training == self.rescaled:
            with torch.no_grad():
                self.out.weight.mul_(2.0) if self.training else self.out.weight.div_(2.0)
            self.rescaled = not self.training
        h = torch.fft.rfft(self.embed(ids), n=14).abs()
        return F.cross_entropy(self.out(h[..., :8]).flatten(0, 1), labels.flatten())


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 16, (BATCH, 4), generator=g), torch.randint(0, 16, (BATCH, 4), generator=g)


def _model() -> Rescaling:
    torch.manual_seed(0)
    return Rescaling()


@pytest.mark.parametrize("cls", [Rescaling, UnprovenRescaling])
def test_planning_leaves_an_eval_rescaling_model_as_it_was(cls: type) -> None:
    torch.manual_seed(0)
    model = cls()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fairscale.plan(model, _batch(0), devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    assert model.rescaled is False and model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _train(rank: int, world: int) -> Trajectory:
    pm = fairscale.parallelize(_model(), example_inputs=_batch(0), devices=world,
                               optimizer=functools.partial(torch.optim.SGD, lr=LR))
    out = Trajectory()
    for step in range(STEPS):
        out.losses.append(pm.train_step(_batch(step)))
        if step == 0:
            out.grads = pm.full_grads()
    return out


def test_it_trains_exactly_on_two_ranks() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    reference = Trajectory()
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*_batch(step))
        loss.backward()
        if step == 0:
            reference.loss_dtype = loss.dtype
            reference.grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        reference.losses.append(loss.item())
    compare_grads(reference, fairscale.launch(_train, devices=2)[0])
