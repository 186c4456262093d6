"""``requires_grad_`` changed on the model after ``fairscale.parallelize`` is refused before a step
(``fairscale.runtime.frozen``).

The plan fixes which parameters train when it compiles the model. A script that froze its
embedding afterwards (or unfroze a backbone after an epoch) kept training the rank's copy of it,
without a word; ``pm.train_step`` and ``pm(*batch)`` with autograd on now raise and name the
parameter. A validation forward under ``torch.no_grad()`` is unaffected (the flag changes no value).
"""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from fairscale.testing.models import build

from refusals import BATCH, DP2, refused


def _rank(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    case = build("gpt")
    model, batch = case.model, case.make_batch(0, BATCH)
    model.wpe.weight.requires_grad_(False)  # before parallelize: compiled frozen
    pm = fairscale.parallelize(model, example_inputs=batch, loss_fn=case.loss_fn, plan=DP2,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    pm.train_step(batch)
    model.wte.weight.requires_grad_(False)
    out["train_step after freezing"] = refused(lambda: pm.train_step(batch))
    out["pm() after freezing"] = refused(lambda: pm(*batch))
    with torch.no_grad():
        out["pm() under no_grad"] = refused(lambda: pm(*batch))
    model.wte.weight.requires_grad_(True)
    model.wpe.weight.requires_grad_(True)
    out["train_step after unfreezing"] = refused(lambda: pm.train_step(batch))
    model.wpe.weight.requires_grad_(False)
    out["flags as compiled"] = refused(lambda: pm.train_step(batch))
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_rank, devices=2, timeout_s=600)


def test_freezing_after_parallelize_is_refused_naming_the_parameter(runs) -> None:
    for out in runs:
        for call in ("pm.train_step", "pm(batch)"):
            text = out["train_step after freezing" if call == "pm.train_step" else "pm() after freezing"]
            assert text.startswith(f"FrozenChangeError: {call}: parameter(s) wte.weight frozen (requires_grad=False) "
                                   "after fairscale.parallelize compiled the model"), text
            assert "Set requires_grad before fairscale.parallelize" in text, text
        text = out["train_step after unfreezing"]
        assert text.startswith("FrozenChangeError: pm.train_step: parameter(s) wpe.weight unfrozen "
                               "(requires_grad=True) after fairscale.parallelize compiled the model"), text


def test_calls_that_do_not_train_or_match_the_compiled_flags_run(runs) -> None:
    for out in runs:
        assert out["pm() under no_grad"] == "(not refused)"
        assert out["flags as compiled"] == "(not refused)"
