"""The search's own default dtype (bf16 on GPUs) for a model that cannot run in it: a float32 buffer
added to the activations (the PyTorch tutorial's PositionalEncoding) meets bf16 weights in every
linear after it. Nobody asked for bf16, so the search plans fp32 and its notes say why; asked for
bf16, the search refuses with the reason (was: every candidate refused, NoCompilablePlan, on every
GPU cluster)."""

from __future__ import annotations

import functools

import pytest

import fairscale
from fairscale.testing.corpus import models
from fairscale.testing.models import build
from planner.search import NoCompilablePlan

CLUSTER, DEVICES, BATCH = "h100-sxm-80gb", 2, 8


@functools.lru_cache(maxsize=None)
def _positional():
    return models()["torch-transformer"].build(0)  # one model: its captures and verdicts are shared


def _search(case, **kw):  # one mesh (dp2): few candidates to compile-check
    return fairscale.search(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn, cluster=CLUSTER,
                            devices=DEVICES, constraints={"mesh": {"pp": 1, "tp": 1}}, **kw)


def test_the_default_dtype_falls_back_to_fp32_with_the_reason():
    plan = _search(_positional()).plan
    assert plan.data_parallel.param_dtype == "fp32"
    note = next(n for n in plan.predicted.notes if n.startswith("planned in fp32"))
    assert "h100" in note and "default bf16, which cannot run this model" in note, note
    assert "corpus_styles_nets.py:43" in note and "x = x + self.pe" in note and ".to(x.dtype)" in note, note


def test_an_asked_for_bf16_is_refused_not_changed():
    with pytest.raises(NoCompilablePlan, match='"bf16" cannot run this model'):
        _search(_positional(), dtype="bf16")


def test_a_model_that_runs_in_bf16_keeps_the_default():
    case = build("gpt")
    plan = _search(case).plan
    assert plan.data_parallel.param_dtype == "bf16"
    assert not any(n.startswith("planned in fp32") for n in plan.predicted.notes)
