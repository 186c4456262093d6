"""The mode the eager loss check runs the model in (``fairscale.loss_check``).

The check compares the loss of two pieces of the example batch with the loss of both together.
It runs the model in **eval mode** (dropout off, batch norm on its running statistics), where the
forward is deterministic and, for most models, the training graph with those ops switched. A
model whose Python code takes another path in eval mode (``if self.training: loss = loss +
aux``, an auxiliary load-balancing term over the whole batch; a router's jitter) would be judged
on a loss that never trains: :func:`eval_path` finds that path by comparing the two modes'
captures (``passes.eval_mode.eval_difference``, as ``pm.evaluate`` does), and the check then runs
the model in **training mode**, batch norm (whose batch statistics the runtime makes exact by its
own means, ``plan.batch_norm``) on its running statistics. In either mode :class:`ConstantDraws`
makes every random draw the forward makes a constant: a row's draws would otherwise depend on how
many rows were drawn before it, and the pieces would differ from the whole for no fault of the
loss (``ViTMAEForPreTraining``'s masking noise, a router's jitter). The ranks draw their own
numbers, as they do for dropout.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["eval_path", "ConstantDraws", "CONSTANT_DRAWS", "draws_constant", "checking_mode"]

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def eval_path(model: nn.Module, batch: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None) -> str | None:
    """Where ``model``'s code parts between training and eval mode on ``batch`` (the op and
    source line of each), or None where the two modes' captures agree up to the ops eval mode
    switches, or where the model cannot be captured on these rows (the check then runs in eval
    mode as before)."""
    from fairscale.capture_cache import rank_capture
    from fairscale.eval_mode import capture_in_eval_mode
    from passes.eval_mode import eval_difference

    try:
        trained = rank_capture(model, tuple(batch), loss_fn=loss_fn).gm
        return eval_difference(trained, capture_in_eval_mode(model, tuple(batch), loss_fn, None))
    except Exception:  # noqa: BLE001 - not captured: the check runs in eval mode
        return None


@contextlib.contextmanager
def checking_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """The block runs ``model`` in eval mode, or in training mode with its batch and instance norms
    in eval mode, its random draws constant either way; the caller restores the flags
    (``fairscale.runtime.modes.attributes_kept``)."""
    model.train(training)
    for m in model.modules() if training else ():
        if isinstance(m, _NORMS):
            m.training = False
    with ConstantDraws():
        yield


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], at: int, name: str, default: float) -> float:
    return kwargs.get(name, args[at] if len(args) > at else default)


_MEANS: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], float]] = {
    "rand": lambda a, k: 0.5, "rand_like": lambda a, k: 0.5,
    "uniform_": lambda a, k: (_arg(a, k, 1, "from", 0.0) + _arg(a, k, 2, "to", 1.0)) / 2,
    "randn": lambda a, k: 0.0, "randn_like": lambda a, k: 0.0, "normal_": lambda a, k: _arg(a, k, 1, "mean", 0.0),
    "bernoulli": lambda a, k: 1.0, "bernoulli_": lambda a, k: 1.0,
    "exponential_": lambda a, k: 1.0 / _arg(a, k, 1, "lambd", 1.0),
}
"""Random op (its schema's name) -> the constant :class:`ConstantDraws` fills its draws with."""

CONSTANT_DRAWS = frozenset(_MEANS) | {"native_dropout", "randint", "randint_like"}
"""The random ops the check makes deterministic; any other still draws."""


def draws_constant(op: Any) -> bool:
    """Whether :class:`ConstantDraws` makes ATen ``op``'s draws constant."""
    return isinstance(op, torch._ops.OpOverload) and op._schema.name.split("::")[-1] in CONSTANT_DRAWS


class ConstantDraws(TorchDispatchMode):
    """Every elementwise random draw made constant, at its distribution's mean (:data:`_MEANS`:
    ``rand`` and ``uniform_`` the interval's middle, ``randn`` and ``normal_`` the mean,
    ``bernoulli`` 1, so that a dropout mask keeps everything); ``native_dropout`` keeps its input;
    ``randint`` draws its lowest value (a diffusion model's timestep per row).
    Other random ops (``multinomial``) draw as they would: their pieces then differ from the whole,
    and the check refuses, naming the op. ``randperm(n)`` is the reversal of ``arange(n)``, which
    moves rows across any cut of them: a shuffle of the batch's rows (mixup's partners) then
    differs between the whole and its pieces, where a seeded draw could be the identity and mix
    nothing; a permutation along a row's own dims stays the same in both."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name == "native_dropout":
            return args[0].clone(), torch.ones_like(args[0], dtype=torch.bool)
        out = func(*args, **kwargs)
        if name in ("randint", "randint_like"):  # each row's draw (a diffusion step's timestep): the lowest value
            low = args[int(name == "randint_like")] if func._overloadname.startswith("low") else 0
            return out.fill_(low)
        if name == "randperm":  # never the identity (seeded, randperm(2) was: mixup's shuffle then mixed nothing)
            return out.copy_(torch.arange(out.numel() - 1, -1, -1, dtype=out.dtype, device=out.device))
        return out.fill_(_MEANS[name](args, kwargs)) if name in _MEANS else out
