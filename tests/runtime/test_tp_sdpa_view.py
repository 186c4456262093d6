"""A ``view`` of SDPA's transposed output runs on tensor-parallel ranks (torchtitan's Llama).

torchtitan (and Meta's Llama reference) write ``output.transpose(1, 2).contiguous().view(bs, seqlen,
-1)`` after ``F.scaled_dot_product_attention``. In the trace SDPA's output is laid out (b, t, h, d),
so the transpose is already contiguous and export drops the ``.contiguous()``. Under the searched
tp2 plan the attention stays whole and the MLP is split with sequence parallelism; the complex
rotary runs on the sequence shard, and SDPA reads q, k and v all-gathered right before it,
contiguous, and returns a (b, h, t, d) layout: the rank's ``view``
failed on every rank at the first step ('view size is not compatible with input tensor's size and
stride'). The tensor-parallel pass now writes ``reshape`` for ``view`` (the same tensor wherever
the view is possible, a copy where it is not).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fairscale

V, D, T, B, HEADS = 32, 16, 8, 8, 4


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end, device=freqs.device), freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[0:xq_.shape[1]].view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))
        self.w1, self.w2, self.w3 = nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False), \
            nn.Linear(D, 2 * D, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        bs, seqlen, _ = h.shape
        xq, xk, xv = (w(h).view(bs, seqlen, HEADS, -1) for w in (self.wq, self.wk, self.wv))
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        output = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        output = output.transpose(1, 2).contiguous()
        x = x + self.wo(output.view(bs, seqlen, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Titan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(V, D)
        self.register_buffer("freqs_cis", precompute_freqs_cis(D // HEADS, 2 * T), persistent=True)
        self.layers = nn.ModuleDict({str(i): TitanBlock() for i in range(2)})
        self.norm, self.output = nn.RMSNorm(D), nn.Linear(D, V, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return F.cross_entropy(self.output(self.norm(h)).flatten(0, 1), labels.flatten())


def test_the_searched_tp2_plan_of_torchtitans_attention_trains_exactly() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g))
    report = fairscale.check(Titan(), batch, devices=2, constraints={"mesh": {"pp": 1, "dp": 1, "tp": 2}})
    assert report.plan.mesh.tp == 2 and report.ok, report.describe()
    assert report.plan.tensor_parallel.sequence_parallel, report.plan.tensor_parallel
