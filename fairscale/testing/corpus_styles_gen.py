"""Vector-quantized autoencoders as their codebases write them (our own code; shrunk in size only).
Part of the conformance corpus (:mod:`fairscale.testing.corpus_styles`). Each found a bug:

* ``VQVAEEMA``: an EMA codebook updated in forward, in place under ``torch.no_grad()``
  (``cluster_size.mul_(decay).add_(...)``, ``embed.copy_(...)``); plans that cut the batch are
  refused, and the refusal named the buffers' lines but not their module and op.
* ``ZalandoVQVAE``: zalandoresearch's pytorch-vq-vae notebook, which rebinds its buffer and a new
  ``nn.Parameter`` in forward (``self._ema_w = nn.Parameter(...)``): refused at capture, where a
  parameter rebound alone had trained with its first value at every step.
* ``STEQuantizer``: a finite-scalar quantizer whose rounding passes the gradient straight through
  a custom ``torch.autograd.Function``: refused at capture, where the trace had kept round's zero
  gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VQVAEEMA", "ZalandoVQVAE", "STEQuantizer", "vq_loss"]


def _coder(quantizer: nn.Module, dim: int = 8) -> tuple[nn.Module, nn.Module, nn.Module]:
    enc = nn.Sequential(nn.Conv2d(3, 16, 4, 2, 1), nn.ReLU(), nn.Conv2d(16, dim, 4, 2, 1))
    dec = nn.Sequential(nn.ConvTranspose2d(dim, 16, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(16, 3, 4, 2, 1))
    return enc, quantizer, dec


def vq_loss(out: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Reconstruction over the data variance plus the quantizer's loss (MishaLaskin/vqvae's train.py)."""
    vq, x_hat = out
    return torch.mean((x_hat - x) ** 2) / 0.06 + vq


class VectorQuantizerEMA(nn.Module):
    """The EMA codebook of VQ-VAE-2 implementations, written in place under torch.no_grad()."""

    def __init__(self, num_embeddings: int = 16, embedding_dim: int = 8, commitment_cost: float = 0.25,
                 decay: float = 0.99, epsilon: float = 1e-5) -> None:
        super().__init__()
        self.dim, self.n = embedding_dim, num_embeddings
        self.register_buffer("embed", torch.randn(num_embeddings, embedding_dim))
        self.register_buffer("cluster_size", torch.zeros(num_embeddings))
        self.register_buffer("embed_avg", self.embed.clone())
        self.beta, self.decay, self.eps = commitment_cost, decay, epsilon

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.permute(0, 2, 3, 1).contiguous()
        flat = inputs.view(-1, self.dim)
        distances = torch.sum(flat ** 2, dim=1, keepdim=True) + torch.sum(self.embed ** 2, dim=1) \
            - 2 * torch.matmul(flat, self.embed.t())
        encodings = F.one_hot(torch.argmin(distances, dim=1), self.n).type(flat.dtype)
        quantized = torch.matmul(encodings, self.embed).view(inputs.shape)
        if self.training:
            with torch.no_grad():
                self.cluster_size.mul_(self.decay).add_(encodings.sum(0), alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(encodings.t() @ flat, alpha=1 - self.decay)
                n = self.cluster_size.sum()
                size = (self.cluster_size + self.eps) / (n + self.n * self.eps) * n
                self.embed.copy_(self.embed_avg / size.unsqueeze(1))
        loss = self.beta * F.mse_loss(quantized.detach(), inputs)
        quantized = inputs + (quantized - inputs).detach()
        return loss, quantized.permute(0, 3, 1, 2).contiguous()


class ZalandoQuantizer(nn.Module):
    """zalandoresearch/pytorch-vq-vae's VectorQuantizerEMA: new tensors and parameters bound in forward."""

    def __init__(self, num_embeddings: int = 16, embedding_dim: int = 8, decay: float = 0.99,
                 epsilon: float = 1e-5) -> None:
        super().__init__()
        self._embedding_dim, self._num_embeddings = embedding_dim, num_embeddings
        self._embedding = nn.Embedding(num_embeddings, embedding_dim)
        self._embedding.weight.data.normal_()
        self.register_buffer("_ema_cluster_size", torch.zeros(num_embeddings))
        self._ema_w = nn.Parameter(torch.Tensor(num_embeddings, embedding_dim))
        self._ema_w.data.normal_()
        self._decay, self._epsilon = decay, epsilon

    def forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.permute(0, 2, 3, 1).contiguous()
        flat_input = inputs.view(-1, self._embedding_dim)
        distances = (torch.sum(flat_input ** 2, dim=1, keepdim=True) + torch.sum(self._embedding.weight ** 2, dim=1)
                     - 2 * torch.matmul(flat_input, self._embedding.weight.t()))
        encodings = F.one_hot(torch.argmin(distances, dim=1), self._num_embeddings).type(flat_input.dtype)
        quantized = torch.matmul(encodings, self._embedding.weight).view(inputs.shape)
        if self.training:
            self._ema_cluster_size = self._ema_cluster_size * self._decay + \
                (1 - self._decay) * torch.sum(encodings, 0)
            n = torch.sum(self._ema_cluster_size.data)
            self._ema_cluster_size = (self._ema_cluster_size + self._epsilon) / \
                (n + self._num_embeddings * self._epsilon) * n
            dw = torch.matmul(encodings.t(), flat_input)
            self._ema_w = nn.Parameter(self._ema_w * self._decay + (1 - self._decay) * dw)
            self._embedding.weight = nn.Parameter(self._ema_w / self._ema_cluster_size.unsqueeze(1))
        loss = 0.25 * F.mse_loss(quantized.detach(), inputs)
        quantized = inputs + (quantized - inputs).detach()
        return loss, quantized.permute(0, 3, 1, 2).contiguous()


class RoundSTE(torch.autograd.Function):
    """Rounding whose gradient passes straight through."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.round()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad


class FSQ(nn.Module):
    """Finite scalar quantization (Mentzer et al.): bound each channel with tanh, round to its levels."""

    def __init__(self, levels: int = 5) -> None:
        super().__init__()
        self.half = (levels - 1) / 2

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bounded = torch.tanh(z) * self.half
        return z.new_zeros(()), RoundSTE.apply(bounded) / self.half


class _VQModel(nn.Module):
    def __init__(self, quantizer: nn.Module) -> None:
        super().__init__()
        self.encoder, self.vq, self.decoder = _coder(quantizer)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loss, q = self.vq(self.encoder(x))
        return loss, self.decoder(q)


def VQVAEEMA() -> nn.Module:
    return _VQModel(VectorQuantizerEMA())


def ZalandoVQVAE() -> nn.Module:
    return _VQModel(ZalandoQuantizer())


def STEQuantizer() -> nn.Module:
    return _VQModel(FSQ())
