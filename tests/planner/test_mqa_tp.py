"""Multi-query attention under tensor parallelism (HF GPTBigCode: one kv head).

``tp=2`` cannot split one kv head. Rules that split it are refused naming the attention's module,
op and source line, with the other way out: keep the attention whole and split only the MLP, which
trains exactly (checked here on 2 ranks). The search does that itself: it had refused every tp > 1
for such a model, so multi-query models got no tensor parallelism.
"""

from __future__ import annotations

import pytest
import torch

import fairscale
from planner.plan import PlanError


def _bigcode() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    from fairscale.testing.corpus_hf import Labels

    torch.manual_seed(0)
    config = transformers.GPTBigCodeConfig(vocab_size=64, n_positions=8, n_embd=32, n_layer=2, n_head=4,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    assert config.multi_query
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    return Labels(transformers.GPTBigCodeForCausalLM(config)), (ids, ids)


def test_rules_splitting_one_kv_head_are_refused_naming_the_attention_and_the_way_out() -> None:
    model, batch = _bigcode()
    rules = {"inner.transformer.h.*.attn.c_attn": "colwise", "inner.transformer.h.*.attn.c_proj": "rowwise"}
    with pytest.raises(PlanError) as info:
        fairscale.plan(model, batch, devices=2,
                       constraints={"mesh": {"pp": 1, "dp": 1, "tp": 2}, "tensor_parallel": {"rules": rules}})
    text = str(info.value)
    assert "(heads 4 % 2 = 0, kv_heads 1 % 2 = 1) at module inner.transformer.h.0.attn.c_attn (Linear), " \
           "op aten.linear.default, source modeling_gpt_bigcode.py:" in text, text
    assert "keep the attention whole: tensor_parallel.rules for the other modules only (the MLP)" in text, text


def test_the_search_keeps_one_kv_head_whole_and_splits_the_rest() -> None:
    """The detector proposes the attention's c_attn / c_proj too; at a tp that does not divide the
    kv heads the search drops them (the whole degree had been refused: MQA models got no tensor
    parallelism) and keeps the MLP and vocabulary split."""
    model, batch = _bigcode()
    plan = fairscale.plan(model, batch, devices=2, constraints={"mesh": {"pp": 1, "dp": 1, "tp": 2}})
    assert plan.mesh.tp == 2
    assert plan.tensor_parallel.rules == {"inner.transformer.h.*.mlp.c_fc": "colwise",
                                          "inner.transformer.h.*.mlp.c_proj": "rowwise",
                                          "inner.lm_head": "vocab_loss", "inner.transformer.wte": "vocab_embedding"}


def test_the_mlp_split_with_the_attention_whole_trains_exactly() -> None:
    model, batch = _bigcode()
    rules = {"inner.transformer.h.*.mlp.c_fc": "colwise", "inner.transformer.h.*.mlp.c_proj": "rowwise"}
    report = fairscale.check(model, batch, devices=2,
                             constraints={"mesh": {"pp": 1, "dp": 1, "tp": 2}, "tensor_parallel": {"rules": rules}})
    assert report.plan.mesh.tp == 2 and report.ok, report
    searched = fairscale.check(model, batch, devices=2, constraints={"mesh": {"pp": 1, "dp": 1, "tp": 2}})
    assert searched.plan.tensor_parallel.rules.keys() >= rules.keys() and searched.ok, searched
