"""Decoder-only language models in the styles of independent codebases (our own code, written the
way each codebase writes it; shrunk in size only, dropout 0). Part of the conformance corpus
(:mod:`fairscale.testing.corpus_styles`).

* nanoGPT: fused ``c_attn`` split with ``.split``, ``F.scaled_dot_product_attention(is_causal=True)``,
  ``wte``/``lm_head`` tied, ``forward(idx, targets)`` returning ``(logits, loss)``.
* minGPT: explicit attention with a registered causal-mask buffer, ``masked_fill`` and softmax.
* Meta's Llama reference: in :mod:`fairscale.testing.corpus_styles_llama`.
* GPT-NeoX / Megatron: fused ``query_key_value`` laid out per head, split into q/k/v by
  state-dict hooks on save and merged on load; parallel residual; an RMSNorm written ``x * x``
  applied straight to the attention and MLP outputs (row-parallel matmuls under TP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["NanoGPT", "MinGPT", "NeoX", "tokens"]


def tokens(vocab: int, seq: int) -> Callable[[int, int], tuple[torch.Tensor, ...]]:
    """(step, batch) -> (inputs, next-token targets), deterministic in step."""

    def make(step: int, batch: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(7000 + step)
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    return make


# ---------------------------------------------------------------------------------------------
# nanoGPT


@dataclass
class NanoConfig:
    block_size: int = 16
    vocab_size: int = 96
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class NanoLayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class NanoCausalSelfAttention(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        return self.dropout(x)


class NanoBlock(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.ln_1 = NanoLayerNorm(config.n_embd, bias=config.bias)
        self.attn = NanoCausalSelfAttention(config)
        self.ln_2 = NanoLayerNorm(config.n_embd, bias=config.bias)
        self.mlp = NanoMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    def __init__(self, config: NanoConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([NanoBlock(config) for _ in range(config.n_layer)]),
            ln_f=NanoLayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Any]:
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


# ---------------------------------------------------------------------------------------------
# minGPT


class MinCausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, pdrop: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(pdrop)
        self.resid_dropout = nn.Dropout(pdrop)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size))
                             .view(1, 1, block_size, block_size))
        self.n_head = n_head
        self.n_embd = n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NewGELU(nn.Module):
    """The tanh approximation of GELU, written out (as minGPT does)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class MinBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, pdrop: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = MinCausalSelfAttention(n_embd, n_head, block_size, pdrop)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd), c_proj=nn.Linear(4 * n_embd, n_embd),
                                      act=NewGELU(), dropout=nn.Dropout(pdrop)))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlpf(self.ln_2(x))
        return x


class MinGPT(nn.Module):
    """minGPT's GPT: untied head, returns (logits, loss) with ignore_index=-1."""

    def __init__(self, vocab_size: int = 96, block_size: int = 16, n_layer: int = 2, n_head: int = 4,
                 n_embd: int = 32, pdrop: float = 0.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(pdrop),
            h=nn.ModuleList([MinBlock(n_embd, n_head, block_size, pdrop) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            torch.nn.init.zeros_(module.bias)
            torch.nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Any]:
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device).unsqueeze(0)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


# ---------------------------------------------------------------------------------------------
# GPT-NeoX / Megatron: fused per-head QKV with state-dict hooks, x * x RMSNorm, parallel residual


class NeoXRMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = (x * x).mean(dim=-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class NeoXAttention(nn.Module):
    """``query_key_value`` holds, per head, that head's q, k and v rows (Megatron's layout, so a
    split over heads keeps each head whole). The state dict stores q, k and v separately."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.head_size = hidden // heads
        self.hidden = hidden
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self._register_state_dict_hook(NeoXAttention._split_qkv)
        self._register_load_state_dict_pre_hook(self._merge_qkv)

    @staticmethod
    def _split_qkv(module: "NeoXAttention", state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for kind in ("weight", "bias"):
            fused = state_dict.pop(prefix + "query_key_value." + kind)
            per_head = fused.view(module.num_heads, 3, module.head_size, *fused.shape[1:])
            for i, name in enumerate(("query", "key", "value")):
                state_dict[f"{prefix}{name}.{kind}"] = per_head[:, i].reshape(module.hidden, *fused.shape[1:])

    def _merge_qkv(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        for kind in ("weight", "bias"):
            if prefix + "query." + kind not in state_dict:
                continue
            parts = [state_dict.pop(f"{prefix}{name}.{kind}") for name in ("query", "key", "value")]
            per_head = torch.stack([p.view(self.num_heads, self.head_size, *p.shape[1:]) for p in parts], dim=1)
            state_dict[prefix + "query_key_value." + kind] = per_head.reshape(3 * self.hidden, *parts[0].shape[1:])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        b, s, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states)
        qkv = qkv.view(b, s, self.num_heads, 3 * self.head_size)
        query = qkv[..., : self.head_size].permute(0, 2, 1, 3)
        key = qkv[..., self.head_size: 2 * self.head_size].permute(0, 2, 1, 3)
        value = qkv[..., 2 * self.head_size:].permute(0, 2, 1, 3)
        context = F.scaled_dot_product_attention(query, key, value, is_causal=True)
        context = context.permute(0, 2, 1, 3).reshape(b, s, self.hidden)
        return self.dense(context)


class NeoXMLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class NeoXLayer(nn.Module):
    """Parallel residual: x + attn(ln1(x)) + mlp(ln2(x)), with each branch's output normalized
    (a sandwich norm straight on the row-parallel output)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.attention = NeoXAttention(hidden, heads)
        self.mlp = NeoXMLP(hidden)
        self.attn_out_norm = NeoXRMSNorm(hidden)
        self.mlp_out_norm = NeoXRMSNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn = self.attn_out_norm(self.attention(self.input_layernorm(x)))
        mlp = self.mlp_out_norm(self.mlp(self.post_attention_layernorm(x)))
        return x + attn + mlp


class NeoX(nn.Module):
    def __init__(self, vocab: int = 96, hidden: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(NeoXLayer(hidden, heads) for _ in range(layers))
        self.final_layer_norm = nn.LayerNorm(hidden)
        self.embed_out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_in(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.embed_out(self.final_layer_norm(x))
