"""The capture a rank compiles, made once per model, microbatch shape, loss and model state.

A rank's ``compile_program`` (``fairscale.build``) and the plan-time compile check
(``fairscale.compile_check``) capture the model the same way: ``torch.export`` at the shape one
microbatch has on one rank, not annotated. Both take it from :func:`rank_capture`, so a rank forked
after its parent checked the plan (``fairscale.launch``; the corpus runner; a test fixture) finds
the parent's capture instead of exporting the model again: the export was most of a rank's start
(the corpus default tier made 80 rank exports; without them it takes half its CPU time, 200 -> 101
CPU-seconds on a 2-core machine).

The capture holds no copy of the weights: its module holds the model's own parameter and buffer
tensors (``torch.export``'s module re-registers them), so the cache never serves stale values, and
keeping an entry costs the graph, not a model's weights. An entry lives as long as its model.

Never a stale graph: the key is the model's identity, the batch's shapes and dtypes, the loss
function's identity, and :func:`model_state`, everything of a live model that a capture bakes into
its graph and that can change while the model lives: which modules and tensors it holds, their
training flags, shapes, dtypes, devices and ``requires_grad``, the modules' hooks, and the plain
settings of each module and of the config objects it holds (a dropout's ``p``, ``use_cache``, which
function an attribute holds).
A change to any of them captures again. What no key can see (a forward that reads a global, or a
loss closure whose captured variables change) is the user's to keep fixed while training, as for
any capture.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fairscale.runtime.model_guard import is_guard
from passes.dp.graph import dtype_of
from planner.capture import capture
from planner.graph import ModelGraph
from planner.plan import Plan

__all__ = ["trace_dtype", "rank_capture", "model_state", "batch_key", "model_key"]

_CAPTURES: dict[tuple[Any, ...], ModelGraph] = {}
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def batch_key(batch: Sequence[Any]) -> tuple[Any, ...]:
    """Shapes and dtypes of the batch's tensors, ``repr`` of anything else."""
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in batch)


def model_key(model: nn.Module, batch: Sequence[Any], loss_fn: Callable[..., Any] | None) -> tuple[Any, ...]:
    """The key of everything cached per model, batch shapes and loss (this module's captures,
    ``fairscale.api.captured``, ``fairscale.compile_check.checker_for``): the model's identity and
    :func:`model_state`, :func:`batch_key`, the loss function's identity."""
    return id(model), batch_key(batch), id(loss_fn), model_state(model)


def _tensor(t: torch.Tensor) -> tuple[Any, ...]:
    return id(t), tuple(t.shape), t.dtype, t.device, t.requires_grad


def _settings(obj: Any, seen: dict[int, tuple[Any, ...]], depth: int = 0) -> tuple[Any, ...]:
    """``obj``'s public plain attributes (and tensors by identity), one level into held objects
    such as a Hugging Face config; memoized per object."""
    found = seen.get(id(obj))
    if found is not None:
        return found
    seen[id(obj)] = ()  # a cycle back here adds nothing
    items: list[tuple[Any, ...]] = []
    for name, value in sorted(vars(obj).items()):
        if name.startswith("_") or isinstance(value, nn.Module):
            continue
        if isinstance(value, _PLAIN):
            items.append((name, value))
        elif isinstance(value, torch.Tensor):
            items.append((name, _tensor(value)))
        elif isinstance(value, (tuple, list, frozenset)) and all(isinstance(v, _PLAIN) for v in value):
            items.append((name, type(value), tuple(value)))
        elif callable(value):  # a function held as a setting (an activation): which one
            items.append((name, "callable", id(value)))
        elif depth == 0 and hasattr(value, "__dict__"):
            items.append((name, _settings(value, seen, depth + 1)))
    seen[id(obj)] = out = tuple(items)
    return out


def _user_hooks(hooks: dict[int, Any]) -> tuple[int, ...]:
    """The hooks' handles, less fairscale's stale-model guard: it leaves a capture as it was, and a
    second ``parallelize`` of a model (a rank's next plan, ``switch_plan``) must find the first's
    capture instead of exporting the model again (the corpus's ranks exported each model anew for
    its second and third plan: 456 -> 1481 s)."""
    return tuple(k for k, hook in hooks.items() if not is_guard(hook))


def model_state(model: nn.Module) -> tuple[Any, ...]:
    """What of ``model`` a capture depends on besides its identity and weights' values (module
    docstring); equal before and after anything that leaves the traced graph as it was."""
    seen: dict[int, tuple[Any, ...]] = {}
    modules = tuple((name, type(m), m.training, _user_hooks(m._forward_pre_hooks), tuple(m._forward_hooks),
                     tuple(m._backward_pre_hooks), tuple(m._backward_hooks),
                     _settings(m, seen)) for name, m in model.named_modules(remove_duplicate=False))
    tensors = tuple((name, _tensor(t)) for name, t in
                    [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    return modules, tensors


def trace_dtype(plan: Plan) -> torch.dtype | None:
    """The dtype a rank of ``plan`` traces the model in (:mod:`planner.trace_dtype`): its compute
    dtype when that is bf16 or fp16, else None (the model as it is)."""
    return dtype_of(plan.data_parallel.param_dtype, "param_dtype")


def rank_capture(model: nn.Module, example: Sequence[Any], *,
                 loss_fn: Callable[..., torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> ModelGraph:
    """``planner.capture.capture(model, example, loss_fn=loss_fn, annotate=False, dtype=dtype, tracer="export")``:
    the graph a rank compiles at the microbatch shape ``example`` has (traced in ``dtype`` for a
    mixed-precision plan: :func:`trace_dtype`), cached (module docstring). Raises
    ``CaptureError`` as the capture does (a failure is not cached)."""
    key = (*model_key(model, example, loss_fn), dtype)
    found = _CAPTURES.get(key)
    if found is None:
        # torch.export only: the passes compile its ATen graph; a torch.fx trace (the fallback of a
        # planning capture) has no value on its nodes, and the error to give is export's own
        found = _CAPTURES[key] = capture(model, tuple(example), loss_fn=loss_fn, annotate=False, dtype=dtype,
                                         tracer="export")
        weakref.finalize(model, _CAPTURES.pop, key, None)
    return found
