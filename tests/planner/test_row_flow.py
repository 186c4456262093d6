"""The proof that the loss is computed row by row (``planner.row_flow``), against the eager check.

Every model here is captured on 2 and 4 rows of its batch, as ``fairscale.loss_check`` does. Each
proven model is also checked eagerly (``fairscale.loss_check.row_problem``: the loss and gradient
of 4 rows against those of 2 + 2): a proof the eager check contradicts would be a silent wrong
result. Each model that couples its rows, in every way the eager check knows of and a few more,
must stay unproven: the eager check then judges it (and ``tests/test_loss_check.py`` that it
refuses it). The op models cover each rule of ``planner.row_rules`` and ``planner.row_shapes`` on
a value holding the batch.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fairscale.loss_check import PROOF_ROWS, proven_row_by_row, row_problem
from passes.loss_weights import token_counter
from planner.capture import capture
from planner.row_flow import rows_independent, same_but_rows

D, S, V = 8, 6, 11


def _tokens(rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (rows, S), generator=g), torch.randint(0, V, (rows, S), generator=g)


def _features(rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, S, D, generator=g), torch.randn(rows, S, D, generator=g)


class Body(nn.Module):
    """Features (B, S, D) and targets: ``step`` is the op under test; the loss is an MSE mean."""

    def __init__(self, step: Callable[[Any, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.step = step

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.step(self, self.lin(x))
        return F.mse_loss(h, y)


class TinyLM(nn.Module):
    """nanoGPT's shape: embedding, attention, flatten(0, 1) logits, cross entropy."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, V)
        self.head = head

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        q, k, v = self.qkv(h).split(D, dim=2)
        q, k, v = (t.view(t.shape[0], S, 2, D // 2).transpose(1, 2) for t in (q, k, v))
        h = h + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(h.shape)
        if self.head is not None:
            h = self.head(h)
        return F.cross_entropy(self.out(h).flatten(0, 1), labels.flatten(), ignore_index=-1)


def _proven(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> bool:
    return proven_row_by_row(model, batch, None)


def _agrees_with_eager(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> None:
    gm = capture(model, batch, annotate=False).gm
    assert row_problem(model, batch, None, token_counter(gm), 2, gm=gm) is None


ROWWISE: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "softmax": lambda m, h: h.softmax(-1),
    "log_softmax over seq": lambda m, h: F.log_softmax(h, dim=1),
    "layer norm": lambda m, h: m.norm(h),
    "rms-style norm": lambda m, h: h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6),
    "mean over seq": lambda m, h: h.mean(1, keepdim=True).expand(-1, S, -1),
    "sum over features": lambda m, h: h + h.sum(-1, keepdim=True),
    "amax": lambda m, h: h - h.amax(-1, keepdim=True),
    "var and std": lambda m, h: h * h.var(-1, keepdim=True) + h.std(1, keepdim=True),
    "max.dim getitem": lambda m, h: h - h.max(-1, keepdim=True)[0],
    "transpose and back": lambda m, h: h.transpose(1, 2).contiguous().transpose(1, 2),
    "permute": lambda m, h: h.permute(0, 2, 1).permute(0, 2, 1),
    "flatten rows": lambda m, h: h.reshape(-1, D).relu().view(h.shape),
    "heads split": lambda m, h: h.view(h.shape[0], S, 2, D // 2).flatten(2),
    "unsqueeze squeeze": lambda m, h: h.unsqueeze(1).squeeze(1),
    "split and cat": lambda m, h: torch.cat(h.split(D // 2, dim=-1)[::-1], dim=-1),
    "chunk": lambda m, h: torch.cat(h.chunk(2, dim=1), dim=1),
    "slice and pad": lambda m, h: F.pad(h[:, 1:], (0, 0, 0, 1)),
    "narrow": lambda m, h: F.pad(torch.narrow(h, 1, 1, S - 1), (0, 0, 1, 0)),
    "select and stack back": lambda m, h: h + h.select(1, 0).unsqueeze(1),
    "index_select seq": lambda m, h: h.index_select(1, torch.tensor([2, 1, 0, 3, 4, 5])),
    "bmm within rows": lambda m, h: h @ h.transpose(1, 2) @ h / 10,
    "matmul by a weight": lambda m, h: h @ m.lin.weight,
    "where on a mask": lambda m, h: torch.where(h > 0, h, 0.1 * h),
    "gelu, tanh, sigmoid": lambda m, h: F.gelu(h) + torch.tanh(h) * torch.sigmoid(h),
    "expand a batch-free row": lambda m, h: h + m.lin.bias.view(1, 1, D).expand(h.shape[0], S, D),
    "a mask of ones the batch's size": lambda m, h: h * torch.ones(h.shape[0], S, 1),
    "in place on a fresh value": lambda m, h: F.relu(m.norm(h), inplace=True),
    "a class token expanded to the batch": lambda m, h: torch.cat([m.lin.bias.view(1, 1, D).expand(h.shape[0], 1, D),
                                                                   h[:, 1:]], dim=1),
    "type_as": lambda m, h: h + torch.ones(S, D).triu().type_as(h),
    "stack": lambda m, h: torch.stack([h, h * 2], dim=0).sum(0) + torch.stack([h, h], dim=2).mean(2),
    "cumsum and cummax over seq": lambda m, h: h.cumsum(1) / S + h.cummax(1).values,
    "sort, argsort and top-k over features": lambda m, h: h.sort(-1).values + h.argsort(-1, descending=True)
    + h.topk(2, dim=-1).values.sum(-1, keepdim=True),
    "flip and roll over seq": lambda m, h: h.flip(1) + h.roll(1, 1),
    "positions from a cumsum of ones the batch's size": lambda m, h: h + torch.where(
        torch.ones(h.shape[0], S).cumsum(1) > 2, 1.0, 0.0).unsqueeze(-1).to(h.dtype),
    "einsum attention and projection": lambda m, h: torch.einsum(
        "b i j, b j d -> b i d", torch.einsum("bid,bjd->bij", h, h).softmax(-1), h) + torch.einsum(
        "bsd,ed->bse", h, m.lin.weight),
    "conv, group norm and pool per sample": lambda m, h: F.avg_pool1d(
        F.group_norm(F.conv1d(h.transpose(1, 2), m.lin.weight.unsqueeze(-1)), 2), 1).transpose(1, 2),
}


@pytest.mark.parametrize("name", sorted(ROWWISE))
def test_each_rowwise_op_is_proven_and_the_eager_check_agrees(name: str) -> None:
    torch.manual_seed(0)
    model, batch = Body(ROWWISE[name]), _features()
    assert _proven(model, batch), name
    _agrees_with_eager(model, batch)


COUPLED: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    "centred over the batch": lambda m, h: h - h.mean(0, keepdim=True),
    "a batch statistic in the loss": lambda m, h: h / h.std(),
    "softmax over the batch": lambda m, h: h.softmax(0),
    "rows against rows": lambda m, h: (h.flatten(1) @ h.flatten(1).T) @ h.flatten(1) / 100,
    "scaled by the batch's size": lambda m, h: h * h.shape[0],
    "a row number": lambda m, h: h + torch.arange(h.shape[0]).view(-1, 1, 1),
    "rolled rows": lambda m, h: h.roll(1, 0),
    "flipped rows": lambda m, h: h.flip(0),
    "cumsum over rows": lambda m, h: h.cumsum(0),
    "positions numbered over the batch": lambda m, h: h + torch.ones(h.shape[0], S).cumsum(0).unsqueeze(-1),
    "cat along rows": lambda m, h: torch.cat([h[1:], h[:1]], 0),
    "some rows sliced": lambda m, h: torch.cat([h[:1], h[:-1]], 0),
    "the rows up to the batch's size": lambda m, h: h[0:h.shape[0]],
    "rows interleaved by a reshape": lambda m, h: h.transpose(0, 1).reshape(h.shape),
    "sorted over rows": lambda m, h: h.sort(0).values,
    "einsum over rows": lambda m, h: torch.einsum("bsd,csd->bsd", h, h),
    "einsum contracting rows": lambda m, h: h + torch.einsum("bsd,bsd->sd", h, h),
    "argsorted over rows": lambda m, h: h * h.argsort(0),
    "a scan over rows and seq": lambda m, h: h.flatten(0, 1).cummax(0).values.view(h.shape),
    "rolled over everything": lambda m, h: h.roll(1),
    "max over rows": lambda m, h: h - h.amax(0),
    "top-k over tokens": lambda m, h: h * (h.flatten(0, 1).sum(-1).topk(2).values.sum()),
    "in place": lambda m, h: h.add_(h.mean(0)),
    "in place through a view another reads": lambda m, h: h + h.view(-1, D).mul_(h.view(-1, D).mean(0)).view(h.shape),
    "batch norm": lambda m, h: F.batch_norm(h.transpose(1, 2), None, None, training=True).transpose(1, 2),
    "a python branch on the size": lambda m, h: h * 2 if h.shape[0] > 2 else h,
    "filled with the batch's size": lambda m, h: h * torch.full((h.shape[0], S, 1), float(h.shape[0])),
    "a convolution across the rows": lambda m, h: F.conv1d(h.permute(2, 0, 1), torch.ones(h.shape[0], h.shape[0], 1))
    .permute(1, 2, 0),
    "group norm across the rows": lambda m, h: F.group_norm(h.transpose(0, 1), 1).transpose(0, 1),
}


@pytest.mark.parametrize("name", sorted(COUPLED))
def test_each_way_of_coupling_the_rows_stays_unproven(name: str) -> None:
    torch.manual_seed(0)
    assert not _proven(Body(COUPLED[name]), _features()), name


class Losses(nn.Module):
    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.lin(x), y)


PROVEN_LOSSES = {
    "mse": F.mse_loss,
    "a linear combination of means": lambda h, y: F.mse_loss(h, y) + 0.5 * F.l1_loss(h, y) - (h * 0.1).mean(),
    "smooth l1": F.smooth_l1_loss,
}
UNPROVEN_LOSSES = {
    "a product of means": lambda h, y: F.mse_loss(h, y) * h.mean(),
    "a sum": lambda h, y: (h - y).pow(2).sum(),
    "a sum over a fixed divisor": lambda h, y: (h - y).pow(2).sum() / 8,
    "a log of a mean": lambda h, y: torch.log(F.mse_loss(h, y)),
    "a masked mean": lambda h, y: h[y > 0].mean(),
    "a weighted mean over the mask's count": lambda h, y: ((h - y) ** 2 * (y > 0)).sum() / (y > 0).sum(),
    "a mean beside a batch-free tensor": lambda h, y: F.mse_loss(h, y) + torch.ones(2, 2).sum() * h.mean(0).sum(),
}


@pytest.mark.parametrize("name", sorted(PROVEN_LOSSES))
def test_means_and_their_linear_combinations_are_proven(name: str) -> None:
    torch.manual_seed(0)
    model, batch = Losses(PROVEN_LOSSES[name]), _features()
    assert _proven(model, batch)
    _agrees_with_eager(model, batch)


@pytest.mark.parametrize("name", sorted(UNPROVEN_LOSSES))
def test_other_losses_are_left_to_the_eager_check(name: str) -> None:
    torch.manual_seed(0)
    assert not _proven(Losses(UNPROVEN_LOSSES[name]), _features())


def test_a_token_mean_language_model_is_proven() -> None:
    torch.manual_seed(0)
    model, batch = TinyLM(), _tokens()
    assert _proven(model, batch)
    _agrees_with_eager(model, batch)


class TokenTypes(nn.Module):
    """BERT's embeddings: token type ids from a buffer of zeros expanded to the batch's size."""

    def __init__(self) -> None:
        super().__init__()
        self.words, self.types, self.out = nn.Embedding(V, D), nn.Embedding(2, D), nn.Linear(D, V)
        self.register_buffer("type_ids", torch.zeros(1, S, dtype=torch.long), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.words(ids) + self.types(self.type_ids.expand(ids.shape[0], S))
        return F.cross_entropy(self.out(h).view(-1, V), labels.view(-1))


def test_embeddings_of_ids_expanded_to_the_batch_are_proven() -> None:
    torch.manual_seed(0)
    model, batch = TokenTypes(), _tokens()
    assert _proven(model, batch)
    _agrees_with_eager(model, batch)


def test_contrastive_in_batch_negatives_stay_unproven() -> None:
    class Contrastive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            za, zb = self.a(x.mean(1)), self.b(y.mean(1))
            return F.cross_entropy(za @ zb.T, torch.arange(za.shape[0]))

    assert not _proven(Contrastive(), _features())


def test_fewer_rows_than_the_two_captures_need_are_not_proven() -> None:
    model = Body(ROWWISE["softmax"])
    assert not _proven(model, _features(PROOF_ROWS[1] - 1))


def test_two_captures_that_differ_beyond_the_batch_size_are_named() -> None:
    model = Body(COUPLED["scaled by the batch's size"])
    a = capture(model, _features(2), annotate=False).gm
    b = capture(model, _features(4), annotate=False).gm
    why = same_but_rows(a, b, 2, 4)
    assert why is not None and "aten.mul" in why and "on 2 rows is" in why
    assert rows_independent(a, token_mean=False)  # one capture alone cannot see it: hence the second


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hugging_face_causal_lms_with_their_default_features_are_proven(family: str) -> None:
    transformers = pytest.importorskip("transformers")
    from fairscale.testing.corpus_hf import Labels

    torch.manual_seed(0)
    if family == "gpt2":
        inner = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=V))
    else:
        inner = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=V))
    assert inner.config.use_cache  # the default, whose cache the graph concatenates to (empty)
    model, batch = Labels(inner), _tokens()
    assert _proven(model, batch)
    _agrees_with_eager(model, batch)
