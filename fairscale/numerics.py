"""How close is close enough: losses and gradients of a parallel run against one process.

The standard every plan is held to is "the same losses and gradients as the unparallelized model
within float tolerance". This module is that tolerance, in one place: ``fairscale check``
(:mod:`fairscale.check`) and the exactness tests (:mod:`fairscale.testing.reference`) both call
:func:`compare`.

Usage::

    result = compare(ref_losses, got_losses, ref_grads, got_grads, order=forward_param_order)
    print(result.describe())       # per-loss and per-gradient errors, the first module that differs
    result.assert_ok()             # AssertionError with the same text

Why gradients, not parameters after some optimizer steps. A parallel plan computes the same sums in
another order: rank slices added by an all-reduce, microbatches accumulated one by one,
tensor-parallel partial sums. That changes a float result by rounding only, but Adam's update
``m/(√v+eps)`` is scale-free: an entry whose true gradient is ~0 (an attention key bias, q/k weights
at init) takes a full ``±lr`` step in the direction of its rounding noise, so parameters after a few
Adam steps differ by up to ``lr`` on some machines and not others. Gradients and losses carry the
rounding error without that amplification.

The bound. A sum of ``K`` terms computed in floating point is off by at most ``γ_K·Σ|terms|``
(``γ_K = Ku/(1-Ku)``; Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., §4.2) and,
with rounding errors modelled as independent and mean zero, by about ``√K·u·Σ|terms|`` with high
probability (Higham & Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci.
Comput. 41(5), 2019); ``u`` is the unit roundoff (2⁻²⁴ for float32, 2⁻⁵³ for float64) of the
least precise dtype in the computation (a float64 model with float32 experts computes every
gradient through float32 arithmetic, so all of them carry float32 rounding). A
gradient is such a sum (over tokens and, through backward, over hidden units), and both runs carry
their own rounding, so each tensor is compared by

    error = ‖g_parallel − g_reference‖₂ / scale,   scale = max(‖g_reference‖₂, ‖G‖₂·√(n/N))

and must satisfy ``error <= GRAD_ULPS·u``, ``GRAD_ULPS = 2¹⁰ = 2·√K`` for ``K = 2¹⁸`` terms, more
than the longest reduction of a check-sized batch (tokens × widest hidden dim). Relative to a
norm, the ``Σ|terms|`` of the bound stays within a small factor of ``‖g‖`` unless the whole tensor
cancels: ``G`` is the whole model's gradient (``N`` elements) and ``n`` the tensor's size, so a
tensor whose gradient vanishes mathematically (a key bias, by softmax's shift invariance) and
holds only rounding noise is measured against the model's typical gradient entry, not its own
near-zero norm. Losses are means of per-token terms and are held to ``LOSS_ULPS = 2⁸`` units
(float32: 1.5e-5). Measured on the test families (DDP, ZeRO, FSDP, TP): losses agree to ~5e-8,
gradients to ~3e-7 = 5u, far inside the bound; a real bug (a missing or doubled reduction, a wrong
slice, a partial sum used twice) moves a gradient by a visible fraction of its norm (≥ 1e-3), far
above it. For 16-bit dtypes the formula would exceed 1, so their tolerance is capped at 2⁻⁵ (a
coarse check).

Ill-conditioned models. The bound assumes a gradient is about as large as the sum of the
magnitudes it is made of. Some models are far from that in float32: Hugging Face T5's encoder
gradients computed in float32 in ONE process differ from the same computation in float64 by up to
4.4e-3 of their norm (ReLU units whose pre-activation sits within rounding of 0, and its
unscaled attention), 70 times the bound, while two float32 runs in different row orders agree
to 2e-7. A parallel run sums in another order, so it lands elsewhere within that spread. The
reference is then known only to within its own distance from the exact result, measured as the
model's float32 **floor** (:func:`precision_floor`: the largest error of the float32 reference's
gradients against the same step in float64). A parallel run as accurate as the reference lies
within the floor of the exact result too, so within ``2 · floor`` of the reference (triangle
inequality): ``compare(..., floor=f)`` holds gradients to ``max(GRAD_ULPS·u, 2f)``. Losses keep
their bound. The floor is measured, never chosen, and a model whose float32 reference agrees with
float64 has a floor below the bound and no relaxation (every model of the test families).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch

__all__ = ["GRAD_ULPS", "LOSS_ULPS", "grad_rtol", "loss_rtol", "TensorDiff", "LossDiff", "Comparison", "compare",
           "unit_roundoff", "least_precise", "precision_floor"]

GRAD_ULPS = 2.0 ** 10
"""Gradient tolerance in units of the dtype's roundoff (λ·√K with λ = 2, K = 2¹⁸; module docstring)."""
LOSS_ULPS = 2.0 ** 8
"""Loss tolerance in units of roundoff."""
_CAP = 2.0 ** -5
"""Largest relative tolerance any dtype gets (16-bit types would otherwise exceed 1)."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps/2``: 2⁻²⁴ for float32, 2⁻⁵³ for float64, 2⁻⁸ for bfloat16."""
    return torch.finfo(dtype).eps / 2


def grad_rtol(dtype: torch.dtype) -> float:
    """Relative (to the tensor's scale) gradient tolerance for ``dtype``: 6.1e-5 for float32."""
    return min(GRAD_ULPS * unit_roundoff(dtype), _CAP)


def loss_rtol(dtype: torch.dtype) -> float:
    """Relative loss tolerance for ``dtype``: 1.5e-5 for float32."""
    return min(LOSS_ULPS * unit_roundoff(dtype), _CAP)


@dataclass(frozen=True)
class LossDiff:
    """One step's loss against the reference."""

    step: int
    reference: float
    got: float
    rtol: float

    @property
    def error(self) -> float:
        """``|got - reference| / |reference|`` (absolute when the reference is 0)."""
        return abs(self.got - self.reference) / (abs(self.reference) or 1.0)

    @property
    def ok(self) -> bool:
        return math.isfinite(self.got) and self.error <= self.rtol


@dataclass(frozen=True)
class TensorDiff:
    """One tensor's gradient against the reference (see the module docstring for ``error``)."""

    key: str
    error: float
    """``‖Δ‖₂ / scale``."""
    rtol: float
    norm: float
    """``‖g_reference‖₂``."""
    max_abs: float
    """Largest entry of ``|Δ|``."""
    problem: str = ""
    """Set when the tensors cannot be compared (missing, shape) instead of differing."""

    @property
    def ok(self) -> bool:
        return not self.problem and self.error <= self.rtol

    @property
    def module(self) -> str:
        """The module path owning the tensor (``layers.0.mlp`` for ``layers.0.mlp.fc.weight``'s ``fc``)."""
        return self.key.rpartition(".")[0] or "<root>"


@dataclass
class Comparison:
    """Per-step losses and per-tensor gradients of a run against one process."""

    losses: list[LossDiff] = field(default_factory=list)
    grads: list[TensorDiff] = field(default_factory=list)
    """In the ``order`` given to :func:`compare` (backward order: the last module to run first)."""
    order_note: str = ""

    @property
    def ok(self) -> bool:
        return all(d.ok for d in self.losses) and all(d.ok for d in self.grads)

    def first_bad(self) -> TensorDiff | None:
        """The first gradient, in :attr:`grads` order, that differs beyond tolerance."""
        return next((d for d in self.grads if not d.ok), None)

    def worst(self) -> TensorDiff | None:
        return max(self.grads, key=lambda d: (bool(d.problem), d.error / d.rtol if d.rtol else d.error), default=None)

    def describe(self, *, limit: int = 12) -> str:
        """A readable report: verdict, losses, the first differing module, and the worst tensors."""
        lines = []
        bad_losses = [loss for loss in self.losses if not loss.ok]
        bad = [d for d in self.grads if not d.ok]
        verdict = "MATCH" if self.ok else "DIFFERENT"
        lines.append(f"{verdict}: {len(self.losses)} loss(es), {len(self.grads)} gradient tensors compared with the "
                     "unparallelized model")
        for loss in self.losses:
            mark = "ok " if loss.ok else "BAD"
            lines.append(f"  {mark} loss step {loss.step}: {loss.got:.9g} vs {loss.reference:.9g} (relative error "
                         f"{loss.error:.2e}, tolerance {loss.rtol:.1e})")
        if self.grads:
            worst = self.worst()
            assert worst is not None
            lines.append(f"  gradients: {len(self.grads) - len(bad)} of {len(self.grads)} within tolerance; largest "
                         f"error {worst.error:.2e} ({worst.key}, tolerance {worst.rtol:.1e})")
        first = self.first_bad()
        if first is not None:
            where = f"first module whose gradient differs{self.order_note}: {first.module} ({first.key}: "
            where += f"{first.problem})" if first.problem else f"error {first.error:.2e} > {first.rtol:.1e})"
            lines.append("  " + where)
            if bad_losses:
                lines.append("  the loss already differs, so the forward pass differs: every gradient downstream "
                             "of the difference moves with it, and gradients alone cannot place it")
        shown = sorted(bad, key=lambda d: -(d.error / d.rtol if d.rtol else d.error))[:limit] if bad else []
        for d in shown:
            text = d.problem or f"error {d.error:.2e} (‖g‖ {d.norm:.3g}, max |Δ| {d.max_abs:.3g})"
            lines.append(f"    {d.key}: {text}")
        if len(bad) > len(shown):
            lines.append(f"    ... and {len(bad) - len(shown)} more")
        return "\n".join(lines)

    def assert_ok(self) -> None:
        """Raise AssertionError with :meth:`describe` unless everything is within tolerance."""
        if not self.ok:
            raise AssertionError(self.describe())


def least_precise(dtypes: Iterable[torch.dtype | None]) -> torch.dtype:
    """The floating dtype with the largest unit roundoff among ``dtypes`` (float32 if none)."""
    floating = [d for d in dtypes if d is not None and d.is_floating_point]
    return max(floating, key=unit_roundoff) if floating else torch.float32


def compare(ref_losses: Sequence[float], got_losses: Sequence[float], ref_grads: Mapping[str, torch.Tensor],
            got_grads: Mapping[str, torch.Tensor], *, order: Iterable[str] | None = None, order_note: str = "",
            dtype: torch.dtype | None = None, loss_dtype: torch.dtype | None = None, floor: float = 0.0) -> Comparison:
    """Compare losses step by step and gradients tensor by tensor (module docstring: the bound).

    Args:
        ref_grads: the reference's gradients by user key; keys missing from ``got_grads`` are
            reported, keys only in ``got_grads`` are ignored (a tied weight's second name).
        order: the keys in the order to report (and to find the first differing module in);
            default ``ref_grads``' order. Keys not in ``ref_grads`` are skipped.
        order_note: words saying what the order is (printed after "first module whose gradient differs").
        dtype: the precision of the computation, which sets every tolerance; default the least
            precise dtype among ``ref_grads``. A float64 model with float32 experts computes every
            gradient through float32 arithmetic, so all of them carry float32 rounding.
        loss_dtype: the precision the losses were reported in, when it is coarser than ``dtype``.
        floor: the model's measured precision floor in ``dtype`` (:func:`precision_floor`);
            gradients are held to ``max(grad_rtol(dtype), 2 * floor)`` (module docstring).
    """
    out = Comparison(order_note=order_note)
    dtype = least_precise([dtype] if dtype is not None else [t.dtype for t in ref_grads.values()])
    loss_dtype = least_precise([dtype, loss_dtype])
    if len(ref_losses) != len(got_losses):
        raise AssertionError(f"{len(got_losses)} losses, but the reference has {len(ref_losses)}: "
                             f"{list(got_losses)} vs {list(ref_losses)}")
    out.losses = [LossDiff(i, float(a), float(b), loss_rtol(loss_dtype))
                  for i, (a, b) in enumerate(zip(ref_losses, got_losses))]
    keys = [k for k in (order if order is not None else ref_grads) if k in ref_grads]
    keys += [k for k in ref_grads if k not in set(keys)]
    total_sq = sum(float(t.detach().double().norm()) ** 2 for t in ref_grads.values())
    total_n = sum(t.numel() for t in ref_grads.values()) or 1
    for key in keys:
        ref = ref_grads[key].detach()
        rtol = max(grad_rtol(dtype), 2 * floor)
        got = got_grads.get(key)
        norm = float(ref.double().norm())
        if got is None:
            out.grads.append(TensorDiff(key, math.inf, rtol, norm, math.inf, problem="no gradient in the parallel run"))
            continue
        if tuple(got.shape) != tuple(ref.shape):
            out.grads.append(TensorDiff(key, math.inf, rtol, norm, math.inf,
                                        problem=f"shape {tuple(got.shape)} != {tuple(ref.shape)}"))
            continue
        diff = got.detach().double() - ref.double()
        dnorm = float(diff.norm())
        scale = max(norm, math.sqrt(total_sq * ref.numel() / total_n))
        error = dnorm / scale if scale > 0 else (0.0 if dnorm == 0 else math.inf)
        if not math.isfinite(dnorm):
            error = math.inf
        out.grads.append(TensorDiff(key, error, rtol, norm, float(diff.abs().max()) if diff.numel() else 0.0))
    return out


def precision_floor(grads: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor]) -> float:
    """How far a computation's gradients are from the same computation in higher precision:
    the largest error (as in :func:`compare`, relative to each tensor's scale) of ``grads``
    against ``exact`` (the same step with the model and batch in float64)."""
    result = compare([0.0], [0.0], exact, grads, dtype=torch.float64)
    return max((d.error for d in result.grads if not d.problem), default=0.0)
