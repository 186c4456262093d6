"""Models whose code converts values to float32: their fp32 capture cannot say what they compute in
bf16, so ranks trace them in bf16 (``planner.trace_dtype``; trained against eager bf16 in
tests/runtime/test_bf16_trace.py), and the mixed-precision pass refuses an fp32 trace of them."""

from __future__ import annotations

import copy

import pytest
import torch

from fairscale.testing.models import build_gpt, build_llama
from passes.dp.graph import DtypeError, cast_io
from planner.api import plan_for
from planner.capture import capture
from planner.cluster import Cluster
from planner.dtype_pins import PINS_REMEDY, fp32_pins
from planner.trace_dtype import traced_dtype


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


def test_gpu_search_plans_them_in_bf16(llama, gpt):
    h100 = Cluster.preset("h100-sxm-80gb", devices=1)
    assert plan_for(llama, h100).plan.data_parallel.param_dtype == "bf16"
    assert plan_for(gpt, h100).plan.data_parallel.param_dtype == "bf16"
    assert plan_for(llama, h100, dtype="fp32").plan.data_parallel.param_dtype == "fp32"


def test_the_mixed_precision_pass_takes_a_bf16_trace_and_refuses_an_fp32_one(llama):
    gm = copy.deepcopy(llama.gm)
    assert traced_dtype(gm) == torch.float32
    with pytest.raises(DtypeError, match=r'data_parallel.param_dtype: "bf16" would not compute .*modeling_llama') as info:
        cast_io(copy.deepcopy(gm.graph), torch.bfloat16, gm)
    assert info.value.hint == PINS_REMEDY and str(info.value).endswith(PINS_REMEDY)  # what the compile check says
    case = build_llama()
    graph = capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn, annotate=False, dtype=torch.bfloat16)
    assert traced_dtype(graph.gm) == torch.bfloat16
    # the upcasts are real casts now, and the graph shares the model's own fp32 parameters
    assert sum(n.target is torch.ops.aten.to.dtype and n.args[1] is torch.float32 for n in graph.gm.graph.nodes) == 6
    own = {id(p) for p in case.model.parameters()}
    assert all(id(p) in own and p.dtype == torch.float32 for p in graph.gm.parameters())
    assert all(p.dtype == torch.float32 for p in case.model.parameters())  # the model is left as it was
    cast_io(copy.deepcopy(graph.gm.graph), torch.bfloat16, graph.gm)  # accepted


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
