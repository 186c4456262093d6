"""The optimizer a script gave ``fairscale.parallelize`` is kept from use (``fairscale.runtime.user_optimizer``).

``pm.optimizer`` trains the ranks' slices and shards; the instance holds the model's own tensors,
which get no gradients once parallelized. A Hugging Face-style loop that went on with it
(``optimizer.step(); scheduler.step(); optimizer.zero_grad()``) trained nothing, every loss the
same, and a scheduler left on the instance while ``pm.optimizer`` stepped trained at the starting
learning rate, both without a word. Now the instance's ``step``/``zero_grad`` raise, and
``pm.optimizer.step()`` raises before stepping when the instance's options changed. A scheduler
built on the instance before ``parallelize`` is refused there (it had been refused only at the first
step after it moved the rate: a ``StepLR(step_size=100)`` at step 100). An optimizer built over the
model after ``parallelize`` (accelerate's order) raises at a step that would train nothing.
"""

from __future__ import annotations

import pytest
import torch

import fairscale
from fairscale.testing.models import build

from refusals import BATCH, DP2, refused


def _parallelized(warmup: bool):
    case = build("mlp")
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               plan=DP2, optimizer=opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4) if warmup else None
    return case, opt, sched, pm


def _rank(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    case = build("mlp")
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    for kind in (torch.optim.lr_scheduler.StepLR, torch.optim.lr_scheduler.ReduceLROnPlateau):
        sched = kind(opt, 100) if kind is torch.optim.lr_scheduler.StepLR else kind(opt)
        out[f"{kind.__name__} built before"] = refused(lambda: fairscale.parallelize(
            case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=DP2, optimizer=opt))
        del sched

    case, opt, sched, pm = _parallelized(warmup=True)  # a warmup scheduler built on the instance afterwards
    batch = case.make_batch(1, BATCH)
    pm(*batch).backward()
    out["opt.step()"] = refused(opt.step)
    out["opt.zero_grad()"] = refused(opt.zero_grad)
    out["scheduler on the instance"] = refused(pm.optimizer.step)  # it drives the instance, which trains nothing

    case, opt, _, pm = _parallelized(warmup=False)
    opt.param_groups[0]["weight_decay"] = 0.5  # set by hand on the wrong optimizer
    out["hand-set option"] = refused(lambda: pm.train_step(case.make_batch(1, BATCH)))

    case, opt, _, pm = _parallelized(warmup=False)  # the documented way trains on
    sched = torch.optim.lr_scheduler.LambdaLR(pm.optimizer, lambda s: 0.5 ** s)
    for step in range(2):
        pm.train_step(case.make_batch(step, BATCH))
        sched.step()
    out["lr after two scheduled steps"] = pm.optimizer.param_groups[0]["lr"]

    # accelerate's order: the model parallelized first, then an optimizer built over its tensors
    case = build("mlp")
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=DP2)
    late = torch.optim.AdamW(case.model.parameters(), lr=1e-2)
    pm(*case.make_batch(1, BATCH)).backward()
    out["optimizer built afterwards"] = refused(late.step)
    pm.gather_into(case.model)  # then one process trains the model itself: its tensors have gradients
    case.loss_fn(case.model(case.make_batch(1, BATCH)[0]), *case.make_batch(1, BATCH)[1:]).backward()
    late.step()

    # the same, on a model that ran a backward before the call (a sanity check of the loss)
    case = build("mlp")
    case.loss_fn(case.model(case.make_batch(0, BATCH)[0]), *case.make_batch(0, BATCH)[1:]).backward()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=DP2)
    late = torch.optim.SGD(case.model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in case.model.parameters()]
    pm(*case.make_batch(1, BATCH)).backward()
    out["optimizer built afterwards, old gradients"] = refused(late.step)
    out["model untouched"] = all(torch.equal(a, p) for a, p in zip(before, case.model.parameters()))
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_rank, devices=2, timeout_s=600)


def test_stepping_the_instance_given_to_parallelize_isrefused(runs) -> None:
    for out in runs:
        for call in ("step()", "zero_grad()"):
            text = out[f"opt.{call}"]
            assert text.startswith("UserOptimizerError: this AdamW was given to fairscale.parallelize, which trains "
                                   "the model's slices and shards with pm.optimizer; "), text
            assert f"so its {call} would do nothing: " in text and "pm.optimizer.step()" in text, text


def test_a_changed_option_on_the_instance_is_refused_before_pm_optimizer_steps(runs) -> None:
    for out in runs:
        text = out["scheduler on the instance"]
        assert text.startswith("UserOptimizerError: param_groups[0] of the AdamW given to fairscale.parallelize "
                               "gained 'initial_lr' = 0.01 (a learning-rate scheduler attached to it?): "), text
        assert "attach learning-rate schedulers to pm.optimizer" in text, text
        text = out["hand-set option"]
        assert "has 'weight_decay' = 0.5, where fairscale.parallelize read 0.01" in text, text


@pytest.mark.parametrize("kind", ["StepLR", "ReduceLROnPlateau"])
def test_a_scheduler_built_on_the_instance_before_parallelize_is_refused_there(runs, kind) -> None:
    for out in runs:
        text = out[f"{kind} built before"]
        assert text.startswith(f"UserOptimizerError: optimizer: a learning-rate scheduler ({kind}) was built on this "
                               "AdamW before fairscale.parallelize, "), text
        assert f"scheduler = {kind}(pm.optimizer, ...)" in text, text


def test_an_optimizer_built_over_the_model_afterwards_is_refused_where_it_would_train_nothing(runs) -> None:
    """It had stepped nothing (the model's tensors get no gradients), every loss the same."""
    for out in runs:
        text = out["optimizer built afterwards"]
        assert text.startswith("UserOptimizerError: this AdamW holds 8 parameter(s) of the MLPNet passed to "
                               "fairscale.parallelize (e.g. "), text
        assert "so its step() would train nothing: build the AdamW over the model before the call and pass it" in text


def test_gradients_from_before_the_call_do_not_let_a_later_optimizer_step(runs) -> None:
    """Its first step had applied the backward's gradients from before parallelize to the unused
    model, and the refusal came only at the second (after launch)."""
    for out in runs:
        text = out["optimizer built afterwards, old gradients"]
        assert text.startswith("UserOptimizerError: this SGD holds 8 parameter(s) of the MLPNet"), text
        assert out["model untouched"]


def test_schedulers_on_pm_optimizer_still_drive_training(runs) -> None:
    for out in runs:
        assert out["lr after two scheduled steps"] == pytest.approx(1e-2 * 0.25)
