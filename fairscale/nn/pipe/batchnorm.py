"""BatchNorm whose running statistics are updated once per mini-batch, not once per micro-batch.

GPipe/torchgpipe's ``deferred_batch_norm`` (Kim et al. 2020, "torchgpipe", section 3.3): in
training each micro-batch is normalized by its own statistics (that is what the layer sees), while
the running mean and variance accumulate the sums of all ``chunks`` micro-batches and are updated
once, with the statistics of the whole mini-batch. As in FairScale 0.4.13 the running variance
takes the mini-batch's biased variance (``nn.BatchNorm`` takes the unbiased one), and ``sum`` and
``sum_squares`` are buffers of the state dict. Recomputation under activation checkpointing does
not count twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fairscale.nn.pipe.checkpoint import is_checkpointing, is_recomputing

__all__ = ["DeferredBatchNorm", "is_recomputing", "is_checkpointing"]


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """A BatchNorm of any dimensionality that commits running statistics every ``chunks`` calls."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 chunks: int = 1) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.chunks = chunks
        self.register_buffer("sum", torch.zeros_like(self.running_mean))  # in the state dict, as in 0.4.13
        self.register_buffer("sum_squares", torch.zeros_like(self.running_var))
        self.counter = 0
        self.tracked = 0

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2-D input (got {x.dim()}-D)")

    def _track(self, x: torch.Tensor) -> None:
        dims = [0] + list(range(2, x.dim()))
        with torch.no_grad():
            self.sum += x.sum(dims)
            self.sum_squares += (x ** 2).sum(dims)
        self.counter += x.numel() // x.shape[1]
        self.tracked += 1

    def _commit(self) -> None:
        self.num_batches_tracked += 1
        momentum = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
        mean = self.sum / self.counter
        var = self.sum_squares / self.counter - mean ** 2  # biased, as FairScale 0.4.13 (nn.BatchNorm's is unbiased)
        self.running_mean.mul_(1 - momentum).add_(mean * momentum)
        self.running_var.mul_(1 - momentum).add_(var * momentum)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.counter = 0
        self.tracked = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        if not is_recomputing():
            self._track(x)
            if self.tracked == self.chunks:
                self._commit()
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """Replace every BatchNorm in ``module`` by a DeferredBatchNorm (same parameters and stats)."""
        if isinstance(module, DeferredBatchNorm) and module.chunks == chunks:
            return module
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats:
            # a new module sharing the parameters and statistics (also to change a DeferredBatchNorm's chunks)
            new = cls(module.num_features, module.eps, module.momentum, module.affine, chunks)
            if module.affine:
                new.register_parameter("weight", module.weight)
                new.register_parameter("bias", module.bias)
            new.register_buffer("running_mean", module.running_mean)
            new.register_buffer("running_var", module.running_var)
            new.register_buffer("num_batches_tracked", module.num_batches_tracked)
            new.train(module.training)
            module = new
        for name, child in module.named_children():
            module.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return module
