"""The tensor-parallel pattern detector: what it proposes per family, and what it leaves out and why."""

from __future__ import annotations

import torch
from torch import nn

from passes.tp.patterns import propose_tp_rules
from planner.capture import capture
from test_tensor_parallel_pass import graph_of  # captures shared with the pass tests (same batch shape)


def test_llama_attention_swiglu_vocab() -> None:
    proposal = propose_tp_rules(graph_of("llama").gm, tp=2)
    assert proposal.rules == {
        "model.layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
        "model.layers.*.mlp.[gate_proj,up_proj]": "colwise",
        "model.layers.*.mlp.down_proj": "rowwise",
        "lm_head": "vocab_loss",
        "model.embed_tokens": "vocab_embedding",
    }
    assert proposal.attention == [{"heads": 4, "kv_heads": 2, "head_dim": 16}] * 2
    assert proposal.notes == []


def test_gqa_attention_left_replicated_when_kv_heads_do_not_divide() -> None:
    proposal = propose_tp_rules(graph_of("llama").gm, tp=4)
    assert proposal.rules == {"model.layers.*.mlp.[gate_proj,up_proj]": "colwise",
                              "model.layers.*.mlp.down_proj": "rowwise",
                              "lm_head": "vocab_loss", "model.embed_tokens": "vocab_embedding"}
    dropped = sorted(n.split(":")[0] for n in proposal.notes)
    assert dropped == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("k_proj", "o_proj", "q_proj",
                                                                                       "v_proj")]
    assert all("2 does not divide by tp=4" in n for n in proposal.notes)


def test_gpt2_fused_qkv_and_tied_vocab() -> None:
    rules = propose_tp_rules(graph_of("gpt2").gm, tp=4).rules
    assert rules == {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
                     "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise",
                     "lm_head": "vocab_loss", "transformer.wte": "vocab_embedding"}


def test_bert_and_mixtral() -> None:
    bert = propose_tp_rules(graph_of("bert").gm, tp=2).rules
    assert bert == {"bert.encoder.layer.*.attention.self.[query,key,value]": "colwise",
                    "bert.encoder.layer.*.attention.output.dense": "rowwise",
                    "bert.encoder.layer.*.intermediate.dense": "colwise",
                    "bert.encoder.layer.*.output.dense": "rowwise",
                    "cls.predictions.decoder": "vocab_loss",
                    "bert.embeddings.word_embeddings": "vocab_embedding"}  # position/type tables stay whole
    mixtral = propose_tp_rules(graph_of("mixtral").gm, tp=2).rules
    assert mixtral["model.layers.*.mlp.experts"] == "expert"
    assert "model.layers.*.mlp.gate" not in mixtral  # the router stays replicated


class Chain(nn.Module):
    """Four linears in a row: Megatron pairs them (0 col, 1 row), (2 col, 3 row)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.fc:
            x = torch.relu(layer(x))
        return x.sum()


def test_linear_chain_pairs_without_overlap() -> None:
    g = capture(Chain(), (torch.randn(2, 8),))
    assert propose_tp_rules(g.gm, tp=2).modules == {"fc.0": "colwise", "fc.1": "rowwise", "fc.2": "colwise",
                                                    "fc.3": "rowwise"}


def test_indivisible_sizes_are_noted_not_proposed() -> None:
    g = capture(Chain(), (torch.randn(2, 8),))
    proposal = propose_tp_rules(g.gm, tp=3)
    assert proposal.rules == {}
    assert any("does not divide by tp=3" in n for n in proposal.notes)


def test_a_proposal_accepted_at_a_degree_is_not_rewritten_again_at_its_divisors(monkeypatch) -> None:
    """The search asks for the largest degree first: a proposal the pass took whole at tp=4 is
    taken at tp=2 without a second rewrite; one it cut down at tp=4 (GQA's 2 KV heads) is checked
    again at tp=2, where it is kept whole."""
    import passes.tp.shard_tensor_parallel as stp
    from fairscale.testing.models import build

    calls: list[int] = []
    real = stp.check_tensor_parallel

    def counting(gm, plan, *, tp_size, **kw):
        calls.append(tp_size)
        return real(gm, plan, tp_size=tp_size, **kw)

    def fresh(family: str) -> torch.fx.GraphModule:  # a capture of its own: what was checked is kept per graph
        case = build(family)
        return capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn).gm

    monkeypatch.setattr(stp, "check_tensor_parallel", counting)
    gpt2 = fresh("gpt2")
    at4, at2 = propose_tp_rules(gpt2, tp=4), propose_tp_rules(gpt2, tp=2)
    assert calls == [4] and at4.rules == at2.rules and at2.notes == [] and at2.rules
    calls.clear()
    llama = fresh("llama")
    cut, whole = propose_tp_rules(llama, tp=4), propose_tp_rules(llama, tp=2)
    assert calls[0] == 4 and calls[-1] == 2  # cut down at 4, so checked again at 2
    assert len(whole.rules) > len(cut.rules) and whole.notes == []
