"""Dropout under tensor parallelism with ranks seeded apart (``fairscale.runtime.tp_random``).

nanoGPT's train.py seeds each rank with ``torch.manual_seed(1337 + rank)``. Under tp2 a Hugging Face
GPT-2 with its default dropout (0.1) then drew other masks on each tp rank for its replicated
dropouts: the replicated layer norms' gradients differed, and their copies drifted apart from the
first step (3e-4 after three), silently. Each step now starts from the tp group's rank 0 random
state: the copies stay equal in ``train_step`` and in the plain loop, and a model without random
ops pays no collective for it.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fairscale
from fairscale.testing.models import Case, _HF_COMMON, _tokens, build, lm_loss
from fairscale.testing.plans import even_plan

BATCH = 8


def _gpt2_dropout() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=128, n_positions=16, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0, **_HF_COMMON)
    torch.manual_seed(0)
    return Case("gpt2-dropout", GPT2LMHeadModel(cfg), _tokens(128, 16), lm_loss)


def _replicated(pm) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in pm.modules[0].named_parameters() if "ln" in n}


def _rank(rank: int, world: int) -> dict[str, object]:
    case = _gpt2_dropout()
    plan = even_plan(case, BATCH, pp=1, dp=1, tp=2)
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn, plan=plan,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    torch.manual_seed(1337 + rank)  # nanoGPT's seeding: each rank its own stream
    out: dict[str, object] = {"losses": [pm.train_step(case.make_batch(s, BATCH)) for s in range(3)]}
    out["after train_step"] = _replicated(pm)
    torch.manual_seed(7 + rank)
    for s in range(2):
        loss = pm(*case.make_batch(3 + s, BATCH))
        loss.backward()
        pm.optimizer.step()
        pm.optimizer.zero_grad()
    out["after the plain loop"] = _replicated(pm)
    plain = build("gpt2")
    quiet = fairscale.parallelize(plain.model, example_inputs=plain.make_batch(0, BATCH), loss_fn=plain.loss_fn,
                                  plan=even_plan(plain, BATCH, pp=1, dp=1, tp=2))
    quiet.comm_counter.reset()
    quiet.train_step(plain.make_batch(0, BATCH))
    out["broadcasts without dropout"] = quiet.comm_counter.summary()
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, object]]:
    return fairscale.launch(_rank, devices=2, timeout_s=600)


def test_tp_ranks_seeded_apart_keep_replicated_weights_equal(runs) -> None:
    a, b = runs
    assert a["losses"] == b["losses"]
    for when in ("after train_step", "after the plain loop"):
        assert a[when], when
        for k in a[when]:
            assert torch.equal(a[when][k], b[when][k]), (when, k)


def test_a_model_without_random_ops_shares_no_random_state(runs) -> None:
    for out in runs:
        assert "broadcast" not in out["broadcasts without dropout"], out["broadcasts without dropout"]


class _NoisyRouter(torch.nn.Module):
    """A router that jitters its logits with noise drawn inside ``torch.no_grad()`` (which export
    puts in a higher-order op's body)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        with torch.no_grad():
            noise = torch.rand_like(logits) * 1e-2
        return (logits + noise).softmax(-1).pow(2).mean()


def test_a_draw_inside_no_grad_is_found() -> None:
    """The tp random-state sync, the plan check and the loss check all ask passes.ops.random_ops:
    a draw in a no_grad block's body had been invisible to it (helper-49's reading)."""
    from fairscale.runtime.tp_random import draws_random
    from passes.ops.random_ops import random_nodes
    from planner.capture import capture

    gm = capture(_NoisyRouter(), (torch.randn(4, 8),), annotate=False).gm
    assert any(node.op == "call_function" and "wrap_with_set_grad_enabled" in str(node.target)
               for node in gm.graph.nodes), "the draw is no longer in a higher-order op's body: test another way"
    assert [str(node.target) for node, _ in random_nodes(gm)] == ["aten.rand_like.default"]
    assert draws_random([gm])
