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
from torch import nn

import fairscale
from fairscale.compile_check import checker_for
from fairscale.testing.corpus import models
from fairscale.testing.models import Case
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


class _Fp32ResidualLM(nn.Module):
    """Megatron-LM's ``fp32_residual_connection`` style: the embedding output is upcast and the
    residual stream stays float32; each block casts it to the weights' dtype and normalizes
    (``cast_back``), or, the mistake, normalizes the float32 stream and casts the result: a bf16
    LayerNorm weight then meets the float32 stream, which eager bf16 refuses ("mixed dtype (CPU):
    expect parameter to have scalar type of Float"), while every matmul sees bf16."""

    def __init__(self, cast_back: bool, vocab: int = 32, dim: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.cast_back = cast_back
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(dim), "fc": nn.Linear(dim, dim)})
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).float()  # the residual stream, in fp32
        dtype = self.emb.weight.dtype
        for block in self.blocks:
            x = block["ln"](h.to(dtype)) if self.cast_back else block["ln"](h).to(dtype)
            h = h + F.gelu(block["fc"](x))
        return self.head(self.ln_f(h.to(self.emb.weight.dtype)))


def _residual_lm(cast_back: bool) -> Case:
    torch.manual_seed(0)

    def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randint(0, 32, (size, 6), generator=g), torch.randint(0, 32, (size, 6), generator=g)

    return Case("fp32-residual", _Fp32ResidualLM(cast_back), batch,
                lambda logits, y: F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))


def test_an_fp32_value_reaching_a_bf16_layer_norm_is_refused_before_launch():
    """Was: the plan compiled (the check looked at matmuls only, and every matmul here is bf16) and
    every rank crashed at its first step in the LayerNorm."""
    with pytest.raises(PlanError) as info:
        _plan(_residual_lm(cast_back=False), 1, 1, 1)
    text = str(info.value)
    assert 'data_parallel.param_dtype: "bf16" cannot run this model' in text, text
    assert "op aten.layer_norm.default in module blocks.0.ln (LayerNorm) at test_bf16_corpus.py:" in text, text
    assert "(2 ops in all)" in text and "aten.linear" not in text, text  # the two blocks' norms, nothing else
    assert ": float32 x bfloat16 (the float32 value from aten.to.dtype in module (top) (_Fp32ResidualLM) at " \
           "test_bf16_corpus.py:" in text and "`h = self.emb(ids).float()" in text, text
    assert "at module blocks.0.ln, op aten.layer_norm.default; source " in text, text  # the compile check's pointer
    assert "meets a bf16 value in an op whose kernel takes one dtype" in text, text


def test_the_same_model_cast_back_trains_in_bf16_as_eager():
    ref = eager_bf16(lambda: _residual_lm(cast_back=True))
    case = _residual_lm(cast_back=True)
    got = fairscale.launch(_train, devices=1, args=(case, _plan(case, 1, 1, 1)))[0]
    assert got == ref, (got, ref)


class _FrozenNormNet(nn.Module):
    """mmdetection's ``norm_eval``: a backbone whose BatchNorm layers stay in eval mode while the
    rest trains (``train()`` puts them back), so their float32 running statistics are read beside
    bf16 weights, which eager bf16 refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)
        self.train()

    def train(self, mode: bool = True) -> "_FrozenNormNet":
        super().train(mode)
        self.bn.eval()  # norm_eval=True
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_a_frozen_batch_norm_beside_bf16_weights_is_refused_before_launch():
    """Was: compiled (an eval-mode batch norm is no batch statistic, so the batch-norm pass leaves
    it to aten), and the ranks crashed at their first step: "expected scalar type BFloat16 but found
    Float". A training-mode one is replaced by the pass's own kernel and trains (vgg-bn, resnet)."""
    torch.manual_seed(0)
    case = Case("frozen-bn", _FrozenNormNet(), lambda step, size: (
        torch.randn(size, 3, 4, 4, generator=torch.Generator().manual_seed(step)), torch.zeros(size, dtype=torch.long)),
                F.cross_entropy)
    with pytest.raises(PlanError) as info:
        _plan(case, 1, 1, 1)
    text = str(info.value)
    assert "op aten.batch_norm.default in module bn (BatchNorm2d) at test_bf16_corpus.py:" in text, text
    assert ": bfloat16 x float32" in text, text
