"""The mode the eager loss check runs the model in (``fairscale.loss_check``).

The check compares the loss of two pieces of the example batch with the loss of both together.
It runs the model in **eval mode** (dropout off, batch norm on its running statistics), where the
forward is deterministic and, for most models, the training graph with those ops switched. A
model whose Python code takes another path in eval mode (``if self.training: loss = loss +
aux``, an auxiliary load-balancing term over the whole batch; a router's jitter) would be judged
on a loss that never trains: :func:`eval_path` finds that path by comparing the two modes'
captures (``passes.eval_mode.eval_difference``, as ``pm.evaluate`` does), and the check then runs
the model in **training mode** with :class:`ConstantDraws`: every random draw the forward makes is
a constant (a row's draws would otherwise depend on how many rows were drawn before it, and the
pieces would differ from the whole for no fault of the loss), and batch norm, whose batch
statistics the runtime makes exact by its own means (``plan.batch_norm``), on its running
statistics.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["eval_path", "ConstantDraws", "checking_mode"]

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
    """The block runs ``model`` in eval mode, or in training mode with its draws constant and its
    batch and instance norms in eval mode; the caller restores the flags
    (``fairscale.runtime.modes.attributes_kept``)."""
    model.train(training)
    if not training:
        yield
        return
    for m in model.modules():
        if isinstance(m, _NORMS):
            m.training = False
    with ConstantDraws():
        yield


class ConstantDraws(TorchDispatchMode):
    """Every elementwise random draw made constant, at its distribution's mean: ``rand``,
    ``uniform_`` (the interval's middle), ``randn``, ``normal_`` (the mean), ``bernoulli`` (1: a
    dropout mask keeps everything), ``exponential_``; ``native_dropout`` keeps its input. Other
    random ops (``randperm``, ``multinomial``) draw as they would: their pieces then differ from the
    whole, and the check refuses, which errs on the safe side."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name == "native_dropout":
            x = args[0]
            return x.clone(), torch.ones_like(x, dtype=torch.bool)
        out = func(*args, **kwargs)
        if name in ("rand", "rand_like"):
            return out.fill_(0.5)
        if name == "uniform_":
            low, high = (list(args[1:3]) + [0.0, 1.0][len(args[1:3]):])
            return out.fill_((kwargs.get("from", low) + kwargs.get("to", high)) / 2)
        if name in ("randn", "randn_like"):
            return out.fill_(0.0)
        if name == "normal_":
            return out.fill_(kwargs.get("mean", args[1] if len(args) > 1 else 0.0))
        if name in ("bernoulli", "bernoulli_"):
            return out.fill_(1.0)
        if name == "exponential_":
            return out.fill_(1.0 / kwargs.get("lambd", args[1] if len(args) > 1 else 1.0))
        return out
