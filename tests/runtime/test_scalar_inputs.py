"""A 0-dim tensor in the batch is given whole to every microbatch, as to every dp rank.

A script that passes a scalar tensor with the batch (a temperature, or Hugging Face's
``num_items_in_batch``, which ``LlamaForCausalLM(input_ids, labels, num_items_in_batch)`` divides
its summed loss by) crashed after launch under every plan, even one microbatch: the pipeline's
splitter read ``x.shape[0]`` of it ("IndexError: tuple index out of range" on every rank; HF
LlamaForCausalLM and BertForMaskedLM with their default configs under the searched plan and pp2 x
tp2, BertForMaskedLM under dp4 x 2 microbatches). The dp slice, the loss check and the capture's
microbatch example already repeat a 0-dim tensor in every piece; the splitter now does too. A
summed loss divided by such a count is still refused for plans that cut the batch (a sum beside
other terms).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.testing.models import Case
from fairscale.testing.reference import RankResult, compare_grads, rank_trajectory, train_on_rank, train_reference
from planner.plan import Mesh, Plan, Schedule, Stage

VOCAB, SEQ, BATCH, STEPS = 32, 8, 8, 3


class Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return F.cross_entropy(self.head(x).flatten(0, 1) / temperature, labels.flatten())


def _batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.tensor(0.5 + step)


def _case() -> Case:
    torch.manual_seed(0)
    return Case("tempered", Tempered(), _batch, None)


def _rank(rank: int, world: int, plan: Plan) -> RankResult:
    return train_on_rank(_case(), plan, steps=STEPS, global_batch=BATCH, optimizer=functools.partial(torch.optim.SGD, lr=0.5))


def test_a_scalar_input_reaches_every_microbatch_whole() -> None:
    plan = Plan(mesh=Mesh(pp=2, dp=2), schedule=Schedule(kind="1f1b", microbatches=2),
                stages=[Stage(layers="embed, layers.0"), Stage(layers="layers.1, head")])
    ref = train_reference(_case, steps=STEPS, global_batch=BATCH,
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    compare_grads(ref, rank_trajectory(fairscale.launch(_rank, devices=4, args=(plan,))[0]))
