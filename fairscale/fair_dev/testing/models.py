"""Small models that tests written against FairScale 0.4.13 build from ``fair_dev.testing.testing``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["IdentityLayer", "GPT2", "DeviceAndTypeCheckModule"]


class IdentityLayer(nn.Module):
    """A module whose output is its one parameter, ``scale * randn(size)``, whatever the input."""

    def __init__(self, size: Any, scale: float = 1.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(scale * torch.randn(size))

    def forward(self, *_: Any, **__: Any) -> torch.Tensor:
        return self.weight


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP, each with a residual."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(embed_dim)
        self.ln_2 = nn.LayerNorm(embed_dim)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(), nn.Linear(4 * embed_dim, embed_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[0]
        causal = torch.full((seq, seq), float("-inf"), device=x.device, dtype=x.dtype).triu(1)
        h = self.ln_1(x)  # the residual adds to the normalized input (image-GPT's formulation)
        attn, _ = self.attn(h, h, h, attn_mask=causal, need_weights=False)
        h = h + attn
        return h + self.mlp(self.ln_2(h))


class GPT2(nn.Module):
    """A GPT-2-style decoder over token ids shaped (sequence, batch), as in image-GPT: a learned
    start token is prepended (the last position dropped), learned positions are added, and
    ``forward(x, classify=False)`` returns next-token logits (sequence, batch, num_vocab), or
    ``(class logits (batch, num_classes), next-token logits)`` with ``classify=True`` (mean-pooled)."""

    def __init__(self, embed_dim: int, num_heads: int, num_layers: int, num_positions: int, num_vocab: int,
                 num_classes: int) -> None:
        super().__init__()
        self.embed_dim = embed_dim
        self.sos = nn.Parameter(torch.randn(embed_dim))
        self.token_embeddings = nn.Embedding(num_vocab, embed_dim)
        self.position_embeddings = nn.Embedding(num_positions, embed_dim)
        self.layers = nn.ModuleList([_Block(embed_dim, num_heads) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_vocab, bias=False)
        self.clf_head = nn.Linear(embed_dim, num_classes)

    def forward(self, x: torch.Tensor, classify: bool = False) -> Any:
        length, batch = x.shape
        h = self.token_embeddings(x)
        start = self.sos.expand(1, batch, self.embed_dim)
        h = torch.cat([start, h[:-1]], dim=0)
        h = h + self.position_embeddings(torch.arange(length, device=x.device)).unsqueeze(1)
        for layer in self.layers:
            h = layer(h)
        h = self.ln_f(h)
        logits = self.head(h)
        if not classify:
            return logits
        return self.clf_head(h.mean(dim=0)), logits


class DeviceAndTypeCheckModule(nn.Module):
    """``Linear(5, 5)`` plus a buffer, asserting in ``forward`` the dtype and device of its input,
    parameter, buffer and loss against the expectations given (``None``: not checked)."""

    def __init__(self, expected_input_dtype: torch.dtype | None = None,
                 expected_input_device: torch.device | None = None, expected_param_dtype: torch.dtype | None = None,
                 expected_param_device: torch.device | None = None, expected_loss_dtype: torch.dtype | None = None,
                 expected_loss_device: torch.device | None = None,
                 expected_buffer_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.expected_input_dtype = expected_input_dtype
        self.expected_input_device = expected_input_device
        self.expected_param_dtype = expected_param_dtype
        self.expected_param_device = expected_param_device
        self.expected_loss_dtype = expected_loss_dtype
        self.expected_loss_device = expected_loss_device
        self.expected_buffer_dtype = expected_buffer_dtype
        self.linear = nn.Linear(5, 5)
        self.register_buffer("buffer", torch.rand((5,)))

    @staticmethod
    def _check(what: str, found: Any, expected: Any) -> None:
        assert expected in {None, found}, f"{what} ({found}) != expected ({expected})"

    def forward(self, *inputs: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        x = inputs[0]
        self._check("input.dtype", x.dtype, self.expected_input_dtype)
        self._check("input.device", x.device, self.expected_input_device)
        weight = self.linear.weight
        self._check("param.dtype", weight.dtype, self.expected_param_dtype)
        self._check("param.device", weight.device, self.expected_param_device)
        self._check("buffer.dtype", self.buffer.dtype, self.expected_buffer_dtype)
        loss = (self.linear(x + self.buffer) + self.buffer).sum()
        self._check("loss.dtype", loss.dtype, self.expected_loss_dtype)
        self._check("loss.device", loss.device, self.expected_loss_device)
        return loss
