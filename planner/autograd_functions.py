"""Custom ``torch.autograd.Function`` s in a forward: a trace keeps their forward, not their backward.

torch.export traces into ``Function.forward`` and records its ATen ops; the rank graphs are then
differentiated op by op, so a ``backward`` that is not the gradient of ``forward`` is dropped. A
straight-through estimator written as a Function (``forward: x.round()``, ``backward: grad``, as
quantized and VQ models write it) trained its encoder with round's gradient, zero, where one process
passes the gradient through, silently. A Function whose backward is its forward's gradient, written
by hand for memory or speed (BLOOM's GeLU), trains the same either way.

:func:`watch_functions` records each user-defined Function the capture's trace applies (its class,
call site and the shapes of its arguments); :func:`backward_problem` then runs each one's forward
and backward on random arguments of those shapes and compares its backward with the gradient of its
forward's ops, and says why the capture must refuse where they differ.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx
from torch import nn

from planner.host_random import call_site

__all__ = ["Applied", "watch_functions", "backward_problem"]

_OWN = ("torch.", "passes.")
"""Modules whose Functions are not the user's (torch's reentrant checkpoint, the rank graphs' collectives);
any other's, FairScale's classic modules' included, is checked."""


@dataclass
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass
class Applied:
    """One user-defined Function the trace applied."""

    cls: type
    site: str
    """``op Quant.apply at module enc (Encoder), source model.py:14``."""
    args: list[Any]
    """Its positional arguments, each tensor as its shape, dtype and whether it needs a gradient."""


@contextlib.contextmanager
def watch_functions(model: nn.Module) -> Iterator[list[Applied]]:
    """Record the user-defined Functions the code run inside applies (module docstring)."""
    found: list[Applied] = []
    raw = torch.autograd.Function.__dict__["apply"]

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if not cls.__module__.startswith(_OWN) and all(a.cls is not cls for a in found) \
                and not any(isinstance(a, torch.fx.Proxy) for a in args):  # (torch.fx: no shapes to check with)
            specs = [_Spec(tuple(int(d) for d in a.shape), a.dtype, bool(a.requires_grad))
                     if isinstance(a, torch.Tensor) else a for a in args]
            found.append(Applied(cls, call_site(f"{cls.__qualname__}.apply", model), specs))
        return raw.__func__(cls, *args, **kwargs)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment, method-assign]
    try:
        yield found
    finally:
        torch.autograd.Function.apply = raw  # type: ignore[method-assign]


class _Ctx:
    """What a Function's ``forward`` may call on its ``ctx``, run outside autograd's own."""

    def __init__(self, needs: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs
        self.saved_tensors: tuple[Any, ...] = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def mark_dirty(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _gradients(applied: Applied, *, custom: bool, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The gradient of the Function's outputs (random cotangents) with respect to its floating
    arguments that need one: through its own backward (``custom``), or through its forward's ops;
    floating arguments in ``dtype`` (None: as traced)."""
    gen = torch.Generator().manual_seed(0)
    args: list[Any] = []
    leaves: list[torch.Tensor] = []
    for a in applied.args:
        if isinstance(a, _Spec):
            if a.dtype.is_floating_point:
                t = torch.randn(a.shape, generator=gen, dtype=dtype or a.dtype).requires_grad_(a.requires_grad)
                leaves += [t] if a.requires_grad else []
            else:
                t = torch.zeros(a.shape, dtype=a.dtype)
            a = t
        args.append(a)
    with torch.enable_grad():
        if custom:
            out = applied.cls.apply(*args)  # type: ignore[attr-defined]
        elif "setup_context" in applied.cls.__dict__:  # forward(*args), the context set up apart
            out = applied.cls.forward(*args)  # type: ignore[attr-defined]
        else:
            needs = tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            out = applied.cls.forward(_Ctx(needs), *args)  # type: ignore[attr-defined]
    outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(o, torch.Tensor) and o.is_floating_point()]
    cot = torch.Generator().manual_seed(1)
    vs = [torch.randn(o.shape, generator=cot, dtype=o.dtype) for o in outs]
    pairs = [(o, v) for o, v in zip(outs, vs) if o.requires_grad]
    if not pairs or not leaves:
        return [torch.zeros_like(t) for t in leaves]
    grads = torch.autograd.grad([o for o, _ in pairs], leaves, [v for _, v in pairs], allow_unused=True)
    return [torch.zeros_like(t) if g is None else g.detach() for g, t in zip(grads, leaves)]


def backward_problem(applied: list[Applied], model_name: str) -> str | None:
    """Why the capture of ``model_name`` must refuse: the first Function of ``applied`` whose backward
    is not its forward's gradient on random arguments (or cannot be compared with it), else None."""
    for a in applied:
        name = a.cls.__qualname__
        try:  # in float64, where a hand-written exact backward matches to rounding; else as traced
            try:
                custom, derived, tol = _gradients(a, custom=True, dtype=torch.float64), \
                    _gradients(a, custom=False, dtype=torch.float64), 1e-6
            except Exception:  # noqa: BLE001 - a Function for one dtype
                custom, derived, tol = _gradients(a, custom=True, dtype=None), _gradients(a, custom=False, dtype=None), \
                    1e-2
        except Exception as exc:  # noqa: BLE001 - not comparable: refused, saying why
            return (f"could not capture {model_name}: its forward calls the custom autograd.Function {name} "
                    f"({a.site}), whose backward could not be compared with its forward's gradient "
                    f"({type(exc).__name__}: {exc}). A trace keeps only the forward's ops and differentiates them, "
                    f"so a backward that is not their gradient would be lost. {_REMEDY}")
        norm = max((float(c.norm()) for c in custom), default=0.0)
        err = max((float((c - d).norm()) for c, d in zip(custom, derived)), default=0.0)
        if err > tol * max(norm, 1.0):
            return (f"could not capture {model_name}: its forward calls the custom autograd.Function {name} "
                    f"({a.site}), whose backward is not the gradient of its forward (on random arguments of the "
                    f"traced shapes they differ by {err:.3g}, the backward's norm {norm:.3g}): a straight-through "
                    "or surrogate gradient. A trace keeps only the forward's ops and differentiates them, so training "
                    f"would take their gradient (zero for a round or a sign) instead of that backward. {_REMEDY}")
    return None


_REMEDY = ("What to do: write the estimator with detach, which the trace records: `x + (f(x) - x).detach()` "
           "computes f(x) and passes the gradient straight through")
