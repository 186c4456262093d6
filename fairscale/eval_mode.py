"""``pm.evaluate(batch)``: the loss of a batch in eval mode, under the plan that trains the model.

A training script validates every so often::

    for step in range(steps):
        pm.train_step(next(train))
        if step % 100 == 0:
            print("val", pm.evaluate(next(val)))     # as model.eval(); loss in one process

The rank graphs were compiled from a capture in training mode. :func:`eval_modules` (which
``fairscale.build`` hands the runtime in ``RankProgram.eval_modules``) rewrites this rank's stage
graphs to eval mode (:func:`passes.eval_mode.eval_graph`: dropout off, batch norm on
its running statistics), sharing their parameters, shards and buffers, and runs them forward only
through the plan's pipeline schedule (``PipelineExecutor.eval_step``: no gradients, no state
change). Before the first evaluation it proves the rewrite is the model's eval mode: the
training capture, rewritten, must compute what a capture of the model after ``model.eval()``
computes (:func:`passes.eval_mode.eval_difference`). A model whose Python code branches on
``self.training`` fails that with :class:`EvalModeError`, naming the op and source line where the
two modes part; evaluate such a model in one process.

Costs: the proof captures the model once more, in eval mode (the training capture is the rank's
own, cached), once per module; each evaluation is a forward of the schedule. The batch has the
training batch's size (the rank graphs are compiled for its microbatch shape).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from fairscale.capture_cache import rank_capture, trace_dtype
from fairscale.runtime.batch_form import microbatch_example
from fairscale.runtime.modes import attributes_kept, compiled_modes
from fairscale.runtime.program import RankProgram
from passes.eval_mode import eval_difference, eval_graph

__all__ = ["EvalModeError", "eval_modules", "capture_in_eval_mode"]


class EvalModeError(ValueError):
    """The model's eval mode is not its training graph with eval-mode ops (a Python branch on
    ``self.training``), so the compiled ranks cannot evaluate it."""


def capture_in_eval_mode(model: nn.Module, example: Sequence[Any], loss_fn: Callable[..., torch.Tensor] | None,
                          dtype: torch.dtype | None) -> torch.fx.GraphModule:
    """:func:`fairscale.capture_cache.rank_capture` of ``model`` with every module in eval mode;
    each module's flag is put back afterwards (``fairscale.runtime.modes.attributes_kept``; the
    capture itself leaves what the forward rebinds as it was)."""
    with attributes_kept(model):
        model.eval()
        return rank_capture(model, example, loss_fn=loss_fn, dtype=dtype).gm


def eval_modules(program: RankProgram, modules: dict[int, torch.fx.GraphModule]) -> dict[int, torch.fx.GraphModule]:
    """This rank's stages (``modules``, its training graphs) rewritten to eval mode, sharing their
    tensors; raises :class:`EvalModeError` when the rewrite is not the model's eval mode."""
    model = program.model()
    if model is None:
        raise RuntimeError("pm.evaluate checks the model's eval-mode code against its capture, and the model is "
                           "gone: keep a reference to the model passed to fairscale.parallelize while training")
    example, loss_fn = microbatch_example(program.example_inputs, program.microbatch_rows), program.loss_fn
    dtype = trace_dtype(program.plan)
    with compiled_modes(model, program.modes):  # the stages' own, whatever mode the user set since
        trained = rank_capture(model, example, loss_fn=loss_fn, dtype=dtype).gm
    reason = eval_difference(trained, capture_in_eval_mode(model, example, loss_fn, dtype))
    if reason is not None:
        raise EvalModeError(f"pm.evaluate cannot run {type(model).__name__} in eval mode from its training graph: "
                            f"{reason}. Its Python code takes another path when self.training is False; evaluate "
                            "it in one process (model.eval() on the state from pm.state_dict()), or make the "
                            "branch depend on an argument instead of the module's mode")
    return {s: eval_graph(gm) for s, gm in modules.items()}
