"""A 0-dim tensor in the batch is given whole to every microbatch, as to every dp rank.

A script that passes a scalar tensor with the batch (a temperature, or Hugging Face's
``num_items_in_batch``, which ``LlamaForCausalLM(input_ids, labels, num_items_in_batch)`` divides
its summed loss by) crashed after launch under every plan, even one microbatch: the pipeline's
splitter read ``x.shape[0]`` of it ("IndexError: tuple index out of range" on every rank; HF
LlamaForCausalLM and BertForMaskedLM with their default configs under the searched plan and pp2 x
tp2, BertForMaskedLM under dp4 x 2 microbatches). The dp slice, the loss check and the capture's
microbatch example already repeat a 0-dim tensor in every piece; the splitter now does too.

A summed loss divided by such a count, Hugging Face's ``num_items_in_batch``, was refused for
every plan that cuts the batch ("adds a sum over the batch to other terms"): the division hid the
sum. Each piece's ``sum_i / count`` adds up to the batch's ``sum / count`` (every piece gets the
count whole), so ``passes.loss_weights`` reads it as the sum it scales, and such plans train as
one process does (beside other terms it is still refused: tests/test_loss_check.py).
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


class CountedLlama(nn.Module):
    """Hugging Face's LlamaForCausalLM (default config, sizes shrunk) as a script calls it with the
    count of the global batch's labels: ``loss = cross_entropy(..., reduction="sum") / num_items_in_batch``."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ)
        self.lm = transformers.LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels, num_items_in_batch=num_items).loss


def _counted_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    keep = torch.rand((n, SEQ), generator=g) < torch.linspace(0.2, 0.9, n)[:, None]  # rows count differently
    labels = torch.where(keep, ids, torch.full_like(ids, -100))
    return ids, labels, (labels[:, 1:] != -100).sum()  # the shifted labels the loss counts, as HF's Trainer counts


def _counted_case() -> Case:
    torch.manual_seed(0)
    return Case("counted-llama", CountedLlama(), _counted_batch, None)


def _counted_rank(rank: int, world: int, plan: Plan) -> RankResult:
    return train_on_rank(_counted_case(), plan, steps=STEPS, global_batch=BATCH,
                         optimizer=functools.partial(torch.optim.SGD, lr=0.5))


def test_a_sum_divided_by_the_global_count_trains_as_one_process() -> None:
    plan = fairscale.plan(_counted_case().model, _counted_batch(0, BATCH), devices=2,
                          constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}, "schedule": {"microbatches": 2}})
    assert (plan.mesh.dp, plan.schedule.microbatches) == (2, 2)
    ref = train_reference(_counted_case, steps=STEPS, global_batch=BATCH,
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.5))
    compare_grads(ref, rank_trajectory(fairscale.launch(_counted_rank, devices=2, args=(plan,))[0]))
