"""``torch.optim.swa_utils.AveragedModel.update_parameters(model)`` of a model behind its ranks raises
``StaleModelError``: it reads the model's tensors without a forward or a state_dict, so an EMA or
SWA of a parallelized model (``ema = AveragedModel(model)``, ``ema.update_parameters(model)`` after
each ``pm.train_step``, on 2 ranks under dp2) averaged the initial weights at every step, silently
(``fairscale.runtime.model_guard``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from fairscale.runtime.model_guard import StaleModelError, guard_model, mark_current, mark_stale


def test_an_average_of_a_model_behind_its_ranks_is_refused_and_of_a_current_one_taken() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    other = nn.Linear(3, 3)
    AveragedModel(other).update_parameters(other)  # a model fairscale never saw
    guard_model(model)
    ema.update_parameters(model)  # current: taken
    mark_stale(model, "an optimizer step of its ParallelModule")
    with pytest.raises(StaleModelError, match=r"^AveragedModel.update_parameters \(an average of its weights\) of "
                                              r"the model given to fairscale.parallelize, whose weights are behind"):
        ema.update_parameters(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # pm.gather_into(model) brings the trained weights
    mark_current(model)
    ema.update_parameters(model)
    assert not torch.equal(ema.module[0].weight, model[0].weight)  # averaged, not copied: it ran
