"""A batch handed to a ParallelModule in another form than positional inputs is refused before anything
runs, saying how to pass it (``fairscale.runtime.batch_form``).

A Hugging Face collator's dict given to ``pm.train_step`` had run the rank graphs on its keys and
failed deep inside aten (``Unable to cast x to Tensor``); ``pm(**batch)`` failed with Python's bare
"unexpected keyword argument"; a bare tensor was iterated row by row as if each row were an input.
"""

from __future__ import annotations

import pytest

import fairscale
from fairscale.testing.models import build

from refusals import BATCH, DP2, refused


def _rank(rank: int, world: int) -> dict[str, object]:
    case = build("mlp")
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=DP2)
    x, y = case.make_batch(1, BATCH)
    named = {"inputs": x, "labels": y}
    return {"train_step(dict)": refused(lambda: pm.train_step(named)),
            "pm(**dict)": refused(lambda: pm(**named)),
            "evaluate(dict)": refused(lambda: pm.evaluate(named)),
            "train_step(tensor)": refused(lambda: pm.train_step(x)),
            "then a tuple": pm.train_step((x, y))}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_rank, devices=2, timeout_s=600)


def test_named_inputs_are_refused_saying_to_pass_a_tuple(runs) -> None:
    for out in runs:
        for call, key in (("pm.train_step", "train_step(dict)"), ("pm(*batch)", "pm(**dict)"),
                          ("pm.evaluate", "evaluate(dict)")):
            assert out[key] == (f"TypeError: {call} takes the global batch as the model's positional inputs, in the "
                                "order example_inputs gave them, not by name (inputs, labels): pass a tuple in the "
                                "order of the forward's parameters, e.g. (batch['inputs'], batch['labels'])"), out[key]


def test_a_bare_tensor_is_refused_and_a_tuple_trains(runs) -> None:
    for out in runs:
        assert out["train_step(tensor)"].startswith("TypeError: pm.train_step takes the global batch as a tuple of "
                                                    "the model's positional inputs, got a Tensor of shape (8, 32): "
                                                    "wrap a single input as (x,)"), out["train_step(tensor)"]
        assert isinstance(out["then a tuple"], float)
