"""Checks of what users hand the public API, before anything is captured or launched.

Each check names the argument, says what it got and what forms are accepted, so a wrong call fails
at the call with a sentence instead of deep inside capture (``IndexError: tuple index out of
range`` in the annotator, for a bare tensor).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import weakref
from collections.abc import Mapping
from typing import Any, Sequence

import torch
from torch import nn

from fairscale.runtime.batch_form import KeywordBatch, keyword_example
from fairscale.runtime.optim_groups import OptimizerGroups, optimizer_groups
from fairscale.runtime.user_optimizer import refuse_schedulers
from planner.plan import Plan, PlanError

__all__ = ["check_all", "check_model", "check_allocated", "check_example_inputs", "check_loss_fn", "check_optimizer",
           "check_devices", "check_plan"]


def _got(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120] if not isinstance(value, (dict, list, tuple)) else \
        f"a {type(value).__name__}"


def check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {_got(model)}")
    if next(model.parameters(), None) is None:
        raise ValueError(f"model ({type(model).__name__}) has no parameters, so there is nothing to train or "
                         "parallelize; pass the module that owns the weights")


def check_allocated(model: nn.Module) -> None:
    """A model to train holds its weights: one built on ``meta`` is for planning only."""
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"model ({type(model).__name__}) has {len(meta)} parameters or buffers on the meta device "
                         f"({', '.join(meta[:3])}{', ...' if len(meta) > 3 else ''}), and parallelize trains real "
                         "weights. Plan a model on meta with fairscale.plan or `python -m fairscale plan`; to train "
                         "it, allocate and initialize it first (fairscale.runtime.init.materialize_meta(model, "
                         "seed=...) replays its construction under that seed), then call parallelize")


def check_example_inputs(example_inputs: Any, model: Any = None, loss_fn: Any = None) -> tuple[Any, ...]:
    """The example batch as a tuple of positional inputs (a dict of them by name, for a model that
    returns its loss, as the ``fairscale.runtime.batch_form.KeywordBatch`` of them); a clear error
    for any other form."""
    if isinstance(example_inputs, torch.Tensor):
        raise TypeError(f"example_inputs must be a tuple of the model's positional inputs, got {_got(example_inputs)}; "
                        "wrap a single input as (x,), or pass (inputs, labels)")
    if isinstance(example_inputs, Mapping) and isinstance(model, nn.Module):
        example_inputs = keyword_example(model, example_inputs, loss_fn)
    if not isinstance(example_inputs, (tuple, list)) or not example_inputs:
        raise TypeError(f"example_inputs must be a non-empty tuple of the model's positional inputs (one batch), "
                        f"got {_got(example_inputs)}")
    if not any(isinstance(t, torch.Tensor) and t.dim() > 0 for t in example_inputs):
        raise ValueError("example_inputs holds no tensor with a batch dimension; the first dim of each input "
                         "tensor is the batch that data parallelism and microbatches split")
    check_rows_agree(example_inputs)
    return example_inputs if isinstance(example_inputs, KeywordBatch) else tuple(example_inputs)


def check_rows_agree(example_inputs: Sequence[Any]) -> None:
    """Every input tensor with dims has the batch's rows first: the same size along dim 0."""
    rows = [(i, t) for i, t in enumerate(example_inputs) if isinstance(t, torch.Tensor) and t.dim() > 0]
    (first, lead), odd = rows[0], next(((i, t) for i, t in rows if t.shape[0] != rows[0][1].shape[0]), None)
    if odd is None:
        return
    i, t = odd
    raise PlanError([
        f"input {i} (shape {list(t.shape)}) has {t.shape[0]} rows along dim 0, but input {first} (shape "
        f"{list(lead.shape)}) has {lead.shape[0]}: fairscale reads dim 0 of every input tensor as the batch's rows "
        "(each rank's graph is captured at its rows, and data parallelism and microbatches cut them), so a "
        "tensor laid out otherwise (a [tables, batch] offsets tensor, a graph batch's [2, edges] edge index, "
        "[1, seq] positions broadcast over the batch) would be captured tiled and refused or cut wrongly at the "
        "first step. What to do: pass every input batch first with the batch's rows (per-row bags padded to "
        "one length, per-graph tensors padded to one size, positions expanded to the batch), or keep what is "
        "not per row in the model (a buffer) or as a 0-dim tensor"], source="example_inputs")


def check_loss_fn(loss_fn: Any) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, as loss_fn(model(batch[0]), *batch[1:]) -> a scalar, "
                        f"got {_got(loss_fn)}")


def check_optimizer(optimizer: Any, model: nn.Module | None = None) -> Any:
    """An optimizer class, a ``functools.partial`` of one, or an optimizer built over ``model``'s
    parameters (read into its groups, ``fairscale.runtime.optim_groups``): each rank builds it over
    its own shards. Returns the spec the ranks build from."""
    if optimizer is None or isinstance(optimizer, OptimizerGroups):
        return optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        if model is None:
            raise TypeError("an optimizer instance is read against the model it was built over; pass the class "
                            "or functools.partial of one here")
        refuse_schedulers(optimizer)
        groups = optimizer_groups(optimizer, model)
        return dataclasses.replace(groups, source=weakref.ref(optimizer))  # build_module disowns it
    func = optimizer.func if isinstance(optimizer, functools.partial) else optimizer
    if not (isinstance(func, type) and issubclass(func, torch.optim.Optimizer)):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer subclass, a functools.partial of one (e.g. "
                        f"functools.partial(torch.optim.AdamW, lr=3e-4)), or an optimizer built over the model's "
                        f"parameters; got {_got(optimizer)}")
    return optimizer


def check_devices(devices: Any) -> None:
    if devices is not None and (not isinstance(devices, int) or isinstance(devices, bool) or devices < 1):
        raise ValueError(f"devices must be a positive int (the number of ranks), got {_got(devices)}")


def check_plan(plan: Any, constraints: Any = None) -> None:
    """``parallelize``'s ``plan``: a Plan or a plan file's path; ``constraints`` only without one."""
    if isinstance(plan, dict):
        raise TypeError("plan must be a fairscale.Plan or the path of a plan file, got a dict. To fix some fields "
                        "and let the search choose the rest, pass them as constraints: parallelize(..., "
                        f"constraints={plan!r}); for a whole plan as a dict, pass fairscale.Plan.from_dict(...)")
    if plan is not None and not isinstance(plan, (Plan, str, os.PathLike)):
        raise TypeError(f"plan must be a fairscale.Plan or the path of a plan file, got {_got(plan)}")
    if plan is not None and constraints:
        raise ValueError("pass plan or constraints, not both: constraints steer the search, and a plan is used as "
                         "given (put those fields in the plan instead)")


def check_all(model: Any, example_inputs: Any, *, loss_fn: Any = None, optimizer: Any = None,
              devices: Any = None, plan: Any = None, constraints: Any = None) -> tuple[tuple[Any, ...], Any]:
    """Every check above; returns the example batch as a tuple and the optimizer's spec."""
    check_plan(plan, constraints)
    check_model(model)
    batch = check_example_inputs(example_inputs, model, loss_fn)
    check_loss_fn(loss_fn)
    spec = check_optimizer(optimizer, model)
    check_devices(devices)
    return batch, spec
