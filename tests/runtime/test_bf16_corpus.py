"""bf16 plans of corpus models (``benchmarks/corpus/bf16_sweep.py`` sweeps them all): a model whose
own float32 values meet bf16 values in an op that takes one dtype (a matmul, a norm, ...:
``planner.dtype_pins.MIXED_OPS``) is refused before launch (was: the plan compiled, since
torch.export's fake kernels do not check operand dtypes, and every rank crashed at its first step
with "mat1 and mat2 must have the same dtype"); one that runs trains as eager bf16 with fp32
masters (``test_bf16_trace.eager_bf16``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fairscale
from fairscale.compile_check import checker_for
from fairscale.testing.corpus import models
from planner.dtype_pins import mixed_ops
from planner.plan import DataParallel, Mesh, Plan, PlanError, Schedule
from planner.trace_dtype import in_dtype
from test_bf16_trace import BATCH, _plan, _train, eager_bf16


def _build(name: str):
    return lambda: models()[name].build(0)


@pytest.mark.parametrize("name,where,source", [
    ("torch-transformer", "transformer.encoder.layers.0.self_attn (MultiheadAttention) at corpus_styles_nets.py:64",
     "aten.add.Tensor in module positional_encoding (PositionalEncoding) at corpus_styles_nets.py:43 "
     "`x = x + self.pe[: x.size(0)]`"),
    ("t5-relpos", "blocks.0.attn.q (Linear) at corpus_styles_seq.py:287",
     "aten.to.dtype in module blocks.0.ln1 (T5RMSNorm) at corpus_styles_seq.py:301 "
     "`variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)`"),
], ids=["fp32-position-buffer", "fp32-norm-upcast"])
def test_fp32_values_meeting_bf16_matmuls_are_refused_before_launch(name, where, source):
    case = _build(name)()
    with pytest.raises(PlanError) as info:
        _plan(case, 1, 1, 1)
    text = str(info.value)
    assert 'data_parallel.param_dtype: "bf16" cannot run this model' in text, text
    # the first matmul that mixes, and where its float32 operand became float32
    assert f"op aten.linear.default in module {where}" in text, text
    assert f": float32 x bfloat16 (the float32 value from {source})" in text, text
    assert "meets a bf16 value in an op whose kernel takes one dtype" in text, text
    assert "cast that value to the activations' dtype in the model (e.g. `.to(x.dtype)`), or plan with \"fp32\"" in text
    assert "choose another data_parallel.kind" not in text  # the dp pass's generic advice would not help


def test_the_refusal_is_of_bf16_only():
    case = _build("t5-relpos")()
    batch = case.make_batch(0, BATCH)
    fp32 = Plan(mesh=Mesh(pp=1, dp=1, tp=1), schedule=Schedule(kind="gpipe", microbatches=1, global_batch=BATCH),
                data_parallel=DataParallel(kind="ddp", param_dtype="fp32"))
    assert checker_for(case.model, batch, loss_fn=case.loss_fn).refusal(fp32) is None


@pytest.mark.parametrize("name,mesh", [("meta-llama", (1, 2, 1)), ("encoder-seqfirst", (1, 1, 1))],
                         ids=["meta-llama-dp2", "encoder-seqfirst-one"])
def test_corpus_models_train_in_bf16_as_eager(name, mesh):
    case = _build(name)()
    ref = eager_bf16(_build(name))
    got = fairscale.launch(_train, devices=mesh[0] * mesh[1] * mesh[2], args=(case, _plan(case, *mesh)))[0]
    # Meta's `x.float()` norms cast back (`.type_as(x)`) and nn.MultiheadAttention's fused path has
    # no fp32 operand: neither is refused, and both are exact: one rank to the bit, dp2 within two
    # bf16 epsilons (each half-batch loss is rounded apart from the full batch's, and later steps
    # start from weights that differ by that rounding)
    if mesh == (1, 1, 1):
        assert got == ref, (got, ref)
    else:
        assert got != ref and all(abs(a - b) <= 2.0 ** -6 * abs(b) for a, b in zip(got, ref)), (got, ref)


class _MaskedAttention(torch.nn.Module):
    """bf16 attention beside an fp32 additive mask buffer, which SDPA takes in eager PyTorch."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.register_buffer("mask", torch.triu(torch.full((4, 4), float("-inf")), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask).sum()


def test_an_fp32_attention_mask_beside_bf16_queries_is_not_mixed():
    model = _MaskedAttention()
    with in_dtype(model, torch.bfloat16, (torch.randn(2, 4, 8),)) as (batch, _):
        assert model(*batch).dtype == torch.bfloat16  # eager runs it
        gm = torch.export.export(model, batch).module()
    assert not mixed_ops(gm)

