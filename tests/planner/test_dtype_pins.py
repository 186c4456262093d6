"""Models whose code converts values to float32 are planned in fp32 by default and refused bf16:
a mixed-precision plan of their fp32 capture would not compute what they compute in bf16."""

from __future__ import annotations

import copy

import pytest
import torch

from fairscale.testing.models import build_gpt, build_llama
from passes.dp.graph import cast_io
from planner.api import plan_for
from planner.capture import capture
from planner.cluster import Cluster
from planner.dtype_pins import fp32_pins
from planner.plan import PlanError


def _graph(case):
    return capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)


@pytest.fixture(scope="module")
def llama():
    return _graph(build_llama())


@pytest.fixture(scope="module")
def gpt():
    return _graph(build_gpt())


def test_pins_name_the_source_line_of_each_upcast(llama, gpt):
    pins = fp32_pins(llama)
    assert any("modeling_llama.py" in p and "hidden_states.to(torch.float32)" in p for p in pins), pins
    assert fp32_pins(gpt) == []  # our GPT never converts: its bf16 plans stay


def test_gpu_search_defaults_to_fp32_with_a_note_and_refuses_bf16(llama, gpt):
    h100 = Cluster.preset("h100-sxm-80gb", devices=1)
    plan = plan_for(llama, h100).plan
    assert plan.data_parallel.param_dtype == "fp32"
    assert any(n.startswith("precision: fp32, not bf16: the model's code converts values to float32 (")
               for n in plan.predicted.notes), plan.predicted.notes
    with pytest.raises(PlanError, match=r'dtype: "bf16" would not compute what this model computes in bf16: its '
                                        r"code converts values to float32 \(.*modeling_llama.py:\d+"):
        plan_for(llama, h100, dtype="bf16")
    with pytest.raises(PlanError, match=r'data_parallel.param_dtype: "bf16" would not compute'):
        plan_for(llama, h100, constraints={"data_parallel": {"param_dtype": "bf16"}})
    assert plan_for(llama, h100, dtype="fp32").plan.data_parallel.param_dtype == "fp32"
    assert plan_for(gpt, h100).plan.data_parallel.param_dtype == "bf16"


def test_the_mixed_precision_pass_refuses_a_hand_written_bf16_plan(llama):
    gm = copy.deepcopy(llama.gm)
    with pytest.raises(ValueError, match=r'data_parallel.param_dtype: "bf16" would not compute .*modeling_llama'):
        cast_io(gm.graph, torch.bfloat16)


def test_capture_works_with_cudnn_tf32_turned_off():
    """torch.export reads the legacy torch.backends.cudnn.allow_tf32, which raises unless cuDNN's conv
    and RNN flags are both tf32: a user who turned TF32 off for convolutions could capture nothing
    (seen on an H200: every Hugging Face capture failed). The flags are theirs again after."""
    conv, rnn = torch.backends.cudnn.conv, torch.backends.cudnn.rnn
    saved = conv.fp32_precision, rnn.fp32_precision
    try:
        conv.fp32_precision = rnn.fp32_precision = "ieee"
        with pytest.raises(RuntimeError, match="allow_tf32"):
            torch.backends.cudnn.allow_tf32  # noqa: B018 - the torch behaviour the capture works around
        assert fp32_pins(_graph(build_llama()))  # captured by torch.export, not refused
        assert (conv.fp32_precision, rnn.fp32_precision) == ("ieee", "ieee")
    finally:
        conv.fp32_precision, rnn.fp32_precision = saved
