"""Parameter groups: the optimizer a training script builds over its model, taken as it is.

Usage (nanoGPT's ``configure_optimizers``, Hugging Face's no-decay groups)::

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}], lr=6e-4, betas=(0.9, 0.95))
    pm = fairscale.parallelize(model, example_inputs=batch, optimizer=opt)
    sched = torch.optim.lr_scheduler.LambdaLR(pm.optimizer, [warmup, warmup])   # one per group

``parallelize`` reads the instance into an :class:`OptimizerGroups` (:func:`optimizer_groups`):
its class, its defaults, each group's options and the group of every parameter name. The
instance itself is not used again (``pm.optimizer`` steps the ranks' tensors). Each stage
optimizer of a rank then has the user's groups, in the user's order, with the user's options,
empty where the stage holds none of a group's parameters, and ``pm.optimizer.param_groups[g]`` is
group ``g`` (across a rank's interleaved stages, ``fairscale.runtime.stage_optimizers.UserGroup``),
so schedulers with one factor per group work.

A flat tensor the optimizer steps (a ZeRO bucket's master shard, an FSDP unit's shard) holds
parameters of several groups. It is stepped as segments (:class:`Segments`): views of its runs of
elements of one group, each in its group, each handed the matching view of the flat gradient
before a step. Elementwise optimizers (the only ones sharded kinds take) then update every element
as the user's optimizer would. Padding joins the run before it; its gradient is zero.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["OptimizerGroups", "optimizer_groups", "optimizer_parts", "Segments", "group_runs"]


@dataclass(frozen=True)
class OptimizerGroups:
    """An optimizer with parameter groups, by parameter name (see the module docstring)."""

    cls: type[torch.optim.Optimizer]
    defaults: dict[str, Any]
    """The constructor's options (``optimizer.defaults``)."""
    options: tuple[dict[str, Any], ...]
    """Each group's options, everything but ``params``, in the user's order."""
    group_of: dict[str, int]
    """Every name of every parameter in a group (tied names too) -> its group's index."""
    source: Callable[[], torch.optim.Optimizer | None] | None = field(default=None, compare=False, repr=False)
    """A weak reference to the instance read (``fairscale.runtime.user_optimizer``), if any."""

    def build(self, groups: list[list[torch.Tensor]]) -> torch.optim.Optimizer:
        """The optimizer over ``groups[g]`` with group ``g``'s options (empty groups kept)."""
        accepted = inspect.signature(self.cls.__init__).parameters
        kwargs = {k: v for k, v in self.defaults.items() if k in accepted}
        return self.cls([{**opts, "params": params} for opts, params in zip(self.options, groups)], **kwargs)


def optimizer_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> OptimizerGroups:
    """Read an optimizer built over ``model``'s parameters; raise if it cannot be followed exactly."""
    cls = type(optimizer)
    if optimizer.state:
        raise ValueError(f"optimizer: this {cls.__name__} has state (it has stepped, or loaded a state dict); "
                         "fairscale.parallelize builds the ranks' optimizers fresh from its groups, so that state "
                         "would be dropped. Pass an optimizer that has not stepped, and resume with "
                         "pm.save_checkpoint / fairscale.load_checkpoint")
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    group_of: dict[str, int] = {}
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(f"optimizer.param_groups[{g}] holds a tensor of shape {tuple(p.shape)} that is not "
                                 f"a parameter of the model given to fairscale.parallelize ({type(model).__name__}): "
                                 "build the optimizer over that model's parameters")
            group_of.update((n, g) for n in names[id(p)])
    missed = [ns[0] for ns in names.values() if ns[0] not in group_of
              and model.get_parameter(ns[0]).requires_grad]
    if missed:
        raise ValueError(f"optimizer: the trainable parameter(s) {', '.join(missed[:4])}"
                         f"{' ...' if len(missed) > 4 else ''} are in none of its {len(optimizer.param_groups)} "
                         "group(s); torch would compute their gradients and never update them. Add them to a "
                         "group, or freeze them (p.requires_grad_(False)) before fairscale.parallelize")
    options = tuple({k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups)
    return OptimizerGroups(cls=cls, defaults=dict(optimizer.defaults), options=options, group_of=group_of)


def optimizer_parts(spec: Any) -> tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]:
    """The optimizer class and keyword options of ``parallelize``'s ``optimizer`` (default Adam, lr 1e-3)."""
    if spec is None:
        return torch.optim.Adam, {"lr": 1e-3}
    if isinstance(spec, OptimizerGroups):
        return spec.cls, {"groups": spec}
    if isinstance(spec, functools.partial):
        if spec.args:
            raise ValueError("pass optimizer options by keyword: functools.partial(torch.optim.AdamW, lr=3e-4)")
        return spec.func, dict(spec.keywords)
    return spec, {}


def group_runs(param: torch.Tensor, pieces: list[tuple[str, int, int]],
               group_of: Callable[[str], int]) -> list[tuple[int, int, int]]:
    """(start, stop, group) runs covering ``param``'s flattened elements, from its pieces
    ``(user key, start, stop)``; adjacent pieces of one group merge, and elements no piece covers
    (padding) join the run before them (the first run, at the start)."""
    runs: list[tuple[int, int, int]] = []
    for key, start, stop in sorted(pieces, key=lambda x: x[1]):
        if stop <= start:
            continue
        g = group_of(key)
        if runs and runs[-1][2] == g:
            runs[-1] = (runs[-1][0], stop, g)
        else:
            runs.append((start, stop, g))
    bounds = [0] + [a for a, _, _ in runs[1:]] + [param.numel()]
    return [(bounds[i], bounds[i + 1], g) for i, (_, _, g) in enumerate(runs)]


class Segments(MutableMapping[torch.Tensor, dict[str, Any]]):
    """The state of an optimizer that steps some tensors as segments, keyed by the whole tensors.

    ``split`` maps a stepped tensor to its ``(view, start, stop)`` segments; other tensors are
    stepped whole and their state passes through. Reading a split tensor's state concatenates its
    segments' per-element states (scalars, such as Adam's ``step``, are the same in every segment:
    the first one's); writing it hands each segment its slice and its own copy of each scalar.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, split: dict[torch.Tensor, list[tuple[torch.Tensor, int, int]]]):
        self.optimizer = optimizer
        self.split = split

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        if p not in self.split:
            return self.optimizer.state[p]
        states = [self.optimizer.state.get(v) for v, _, _ in self.split[p]]
        if not all(states):
            raise KeyError(p)
        out: dict[str, Any] = {}
        for name, first in states[0].items():  # type: ignore[union-attr]
            if isinstance(first, torch.Tensor) and first.dim() > 0:
                out[name] = torch.cat([s[name] for s in states])  # type: ignore[index]
            else:
                out[name] = first
        return out

    def __setitem__(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        if p not in self.split:
            self.optimizer.state[p] = state
            return
        for v, a, b in self.split[p]:
            self.optimizer.state[v] = {
                name: value[a:b] if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == p.shape
                else value.clone() if isinstance(value, torch.Tensor) else value
                for name, value in state.items()}

    def __delitem__(self, p: torch.Tensor) -> None:
        for v, _, _ in self.split.get(p, [(p, 0, 0)]):
            self.optimizer.state.pop(v, None)

    def _whole(self) -> list[torch.Tensor]:
        views = {v for segs in self.split.values() for v, _, _ in segs}
        return [p for p in self.optimizer.state if p not in views] + \
            [p for p, segs in self.split.items() if all(v in self.optimizer.state for v, _, _ in segs)]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._whole())

    def __len__(self) -> int:
        return len(self._whole())

    def refresh_grads(self) -> None:
        """Hand every segment the matching view of its tensor's current gradient (None with none)."""
        for p, segs in self.split.items():
            g = p.grad
            for v, a, b in segs:
                v.grad = None if g is None else g.view(-1)[a:b]
