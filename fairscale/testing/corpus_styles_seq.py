"""Sequence models in the styles of independent codebases (our own code, written the way each
codebase writes it; shrunk in size only, dropout 0). Part of the conformance corpus
(:mod:`fairscale.testing.corpus_styles`).

* Mixtral reference (mistral-src): ``topk`` over the gate, softmax of the chosen logits, and a loop
  over experts gathering their tokens with ``torch.where(selected_experts == i)``.
* fairseq / Switch style: top-1 routing with ``nonzero`` and ``index_add_`` back into the output.
* lucidrains / x-transformers: ``einsum`` attention with einops-like reshapes, pre-norm, GEGLU,
  loss ``F.cross_entropy(out.flatten(0, 1), y.flatten())``.
* T5-style relative position bias written from scratch (buckets, one bias table shared by layers).
* BERT-like encoder: learned positional embedding, a [CLS] token pooled through tanh, classifier.
* A weight-tied encoder-decoder: one embedding for source, target and the output projection.
* An LSTM language model (``nn.LSTM``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MistralMoE", "SwitchMoE", "XTransformer", "RelPosT5", "ClsEncoder", "TiedSeq2Seq", "LSTMLM",
           "pairs"]


def pairs(vocab: int, src: int, tgt: int) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    """(step, batch) -> (source ids, decoder input ids, target ids) for a seq2seq model."""

    def make(step: int, batch: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(7100 + step)
        s = torch.randint(1, vocab, (batch, src), generator=g)
        t = torch.randint(1, vocab, (batch, tgt + 1), generator=g)
        return s, t[:, :-1].contiguous(), t[:, 1:].contiguous()

    return make


# ---------------------------------------------------------------------------------------------
# Mixtral reference MoE (mistral-src)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoeLayer(nn.Module):
    def __init__(self, experts: list[nn.Module], gate: nn.Module, num_experts_per_tok: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.gate = gate
        self.num_experts_per_tok = num_experts_per_tok

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, self.num_experts_per_tok)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results


class MoeBlock(nn.Module):
    def __init__(self, dim: int, heads: int, experts: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.attention = nn.MultiheadAttention(dim, heads, bias=False, batch_first=True)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.feed_forward = MoeLayer([FeedForward(dim, 2 * dim) for _ in range(experts)],
                                     nn.Linear(dim, experts, bias=False), num_experts_per_tok=2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.attention_norm(x)
        r, _ = self.attention(h, h, h, attn_mask=mask, need_weights=False)
        h = x + r
        b, s, d = h.shape
        r = self.feed_forward(self.ffn_norm(h).view(b * s, d)).view(b, s, d)
        return h + r


class MistralMoE(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 32, heads: int = 4, layers: int = 2, experts: int = 4,
                 seq: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(MoeBlock(dim, heads, experts) for _ in range(layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("mask", torch.full((seq, seq), float("-inf")).triu(1), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids)
        s = input_ids.shape[1]
        for layer in self.layers:
            h = layer(h, self.mask[:s, :s])
        return self.output(self.norm(h)).float()


# ---------------------------------------------------------------------------------------------
# fairseq / Switch-style top-1 MoE: nonzero + index_add_


class Top1Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.fc1(x)))


class Top1MoE(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.wg = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Top1Expert(dim, 2 * dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.softmax(self.wg(tokens), dim=-1)
        gate, index = probs.max(dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            idx = (index == e).nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            y = expert(tokens.index_select(0, idx)) * gate.index_select(0, idx).unsqueeze(-1)
            out.index_add_(0, idx, y)
        return out.reshape(shape)


class SwitchLayer(nn.Module):
    def __init__(self, dim: int, heads: int, experts: int) -> None:
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.self_attn_layer_norm = nn.LayerNorm(dim)
        self.moe = Top1MoE(dim, experts)
        self.final_layer_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        x, _ = self.self_attn(x, x, x, need_weights=False)
        x = self.self_attn_layer_norm(residual + x)
        return self.final_layer_norm(x + self.moe(x))


class SwitchMoE(nn.Module):
    """A post-norm encoder classifier whose FFNs are top-1 MoE layers."""

    def __init__(self, vocab: int = 96, dim: int = 32, heads: int = 4, layers: int = 2, experts: int = 4,
                 classes: int = 8, seq: int = 16) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.embed_scale = math.sqrt(dim)
        self.embed_positions = nn.Embedding(seq, dim)
        self.layers = nn.ModuleList(SwitchLayer(dim, heads, experts) for _ in range(layers))
        self.classifier = nn.Linear(dim, classes)

    def forward(self, src_tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(src_tokens.shape[1], device=src_tokens.device)
        x = self.embed_scale * self.embed_tokens(src_tokens) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x)
        return self.classifier(x.mean(dim=1))


# ---------------------------------------------------------------------------------------------
# lucidrains / x-transformers style: einsum, einops-like reshapes, GEGLU, flatten(0, 1) loss


def exists(val: object) -> bool:
    return val is not None


class PreNorm(nn.Module):
    def __init__(self, dim: int, fn: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(self.norm(x))


class GEGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gates = x.chunk(2, dim=-1)
        return x * F.gelu(gates)


class XAttention(nn.Module):
    def __init__(self, dim: int, heads: int = 4, dim_head: int = 8) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.to_out = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.heads
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        # rearrange('b n (h d) -> b h n d', h=h)
        q, k, v = (t.reshape(*t.shape[:2], h, -1).permute(0, 2, 1, 3) for t in (q, k, v))
        sim = torch.einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        i, j = sim.shape[-2:]
        causal = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
        sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = torch.einsum("b h i j, b h j d -> b h i d", attn, v)
        # rearrange('b h n d -> b n (h d)')
        out = out.permute(0, 2, 1, 3).flatten(2)
        return self.to_out(out)


class XTransformer(nn.Module):
    def __init__(self, num_tokens: int = 96, dim: int = 32, depth: int = 2, heads: int = 4, max_seq_len: int = 16,
                 ff_mult: int = 4) -> None:
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Parameter(torch.randn(max_seq_len, dim) * 0.02)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                PreNorm(dim, XAttention(dim, heads=heads, dim_head=dim // heads)),
                PreNorm(dim, nn.Sequential(nn.Linear(dim, dim * ff_mult * 2), GEGLU(), nn.Linear(dim * ff_mult, dim))),
            ]))
        self.norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        x = self.token_emb(x) + self.pos_emb[:n]
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.to_logits(self.norm(x))


# ---------------------------------------------------------------------------------------------
# T5-style relative position bias, from scratch


def relative_position_bucket(relative_position: torch.Tensor, num_buckets: int = 32, max_distance: int = 128
                             ) -> torch.Tensor:
    """Bidirectional buckets: half for each sign, exact below num_buckets // 4, log-spaced above."""
    num_buckets //= 2
    ret = (relative_position > 0).long() * num_buckets
    n = relative_position.abs()
    max_exact = num_buckets // 2
    is_small = n < max_exact
    val_if_large = max_exact + (torch.log(n.float() / max_exact + 1e-6) / math.log(max_distance / max_exact)
                                * (num_buckets - max_exact)).long()
    val_if_large = torch.min(val_if_large, torch.full_like(val_if_large, num_buckets - 1))
    return ret + torch.where(is_small, n, val_if_large)


class RelAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def shape(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = shape(self.q(x)), shape(self.k(x)), shape(self.v(x))
        scores = torch.matmul(q, k.transpose(3, 2)) + position_bias  # T5: no 1/sqrt(d) scaling
        weights = F.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(weights, v).transpose(1, 2).contiguous().view(b, n, d)
        return self.o(out)


class T5RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class RelBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = T5RMSNorm(dim)
        self.attn = RelAttention(dim, heads)
        self.ln2 = T5RMSNorm(dim)
        self.wi = nn.Linear(dim, 4 * dim, bias=False)
        self.wo = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), position_bias)
        return x + self.wo(F.relu(self.wi(self.ln2(x))))


class RelPosT5(nn.Module):
    """An encoder whose attention gets one learned relative-position bias table (made once by the
    first layer, shared by all, as T5 does), classifying the mean of its outputs."""

    def __init__(self, vocab: int = 96, dim: int = 32, heads: int = 4, layers: int = 2, classes: int = 8,
                 num_buckets: int = 32, max_distance: int = 128) -> None:
        super().__init__()
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.embed = nn.Embedding(vocab, dim)
        self.relative_attention_bias = nn.Embedding(num_buckets, heads)
        self.blocks = nn.ModuleList(RelBlock(dim, heads) for _ in range(layers))
        self.final_layer_norm = T5RMSNorm(dim)
        self.head = nn.Linear(dim, classes)

    def compute_bias(self, n: int, device: torch.device) -> torch.Tensor:
        context = torch.arange(n, dtype=torch.long, device=device)[:, None]
        memory = torch.arange(n, dtype=torch.long, device=device)[None, :]
        buckets = relative_position_bucket(memory - context, self.num_buckets, self.max_distance)
        values = self.relative_attention_bias(buckets)  # (n, n, heads)
        return values.permute([2, 0, 1]).unsqueeze(0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        bias = self.compute_bias(ids.shape[1], ids.device)
        for block in self.blocks:
            x = block(x, bias)
        return self.head(self.final_layer_norm(x).mean(1))


# ---------------------------------------------------------------------------------------------
# BERT-like encoder: learned positions, [CLS] pooled through tanh


class ClsEncoder(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 32, heads: int = 4, layers: int = 2, max_len: int = 16,
                 classes: int = 8) -> None:
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.word_embeddings = nn.Embedding(vocab, dim)
        self.position_embeddings = nn.Parameter(torch.zeros(1, max_len + 1, dim))
        self.embed_norm = nn.LayerNorm(dim, eps=1e-12)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.pooler = nn.Linear(dim, dim)
        self.classifier = nn.Linear(dim, classes)
        nn.init.trunc_normal_(self.position_embeddings, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1) + self.position_embeddings[:, : x.shape[1] + 1]
        x = self.encoder(self.embed_norm(x))
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(pooled)


# ---------------------------------------------------------------------------------------------
# Weight-tied encoder-decoder: one embedding for source, target and output projection


class TiedSeq2Seq(nn.Module):
    def __init__(self, vocab: int = 96, dim: int = 32, heads: int = 4, layers: int = 2, max_len: int = 16) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True),
            layers, norm=nn.LayerNorm(dim), enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True),
            layers, norm=nn.LayerNorm(dim))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.shared.weight
        self.scale = dim ** -0.5

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        s, t = src.shape[1], tgt_in.shape[1]
        memory = self.encoder(self.shared(src) + self.pos(torch.arange(s, device=src.device)))
        causal = nn.Transformer.generate_square_subsequent_mask(t, device=tgt_in.device)
        y = self.decoder(self.shared(tgt_in) + self.pos(torch.arange(t, device=src.device)), memory,
                         tgt_mask=causal, tgt_is_causal=True)
        logits = self.lm_head(y * self.scale)
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


# ---------------------------------------------------------------------------------------------
# LSTM language model (the PyTorch word_language_model example's shape)


class LSTMLM(nn.Module):
    def __init__(self, ntoken: int = 96, ninp: int = 32, nhid: int = 32, nlayers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=0.0, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        emb = self.encoder(input)
        output, _hidden = self.rnn(emb)
        return self.decoder(output)
