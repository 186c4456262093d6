"""What the face hands the runtime: one rank's compiled part of a plan.

``fairscale.parallelize`` captures the model at the microbatch shape, runs the pass pipeline for
this rank (``passes.compile_rank``) and packs the result in a :class:`RankProgram`; a
:class:`fairscale.runtime.engine.ParallelModule` runs it. The runtime never captures, compiles or
renders: everything it needs to run, save and describe the rank is here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch import nn

from passes.loss_count import TokenCounter
from passes.program import StagedProgram
from planner.plan import Plan
from planner.schedule_ir import PipelineSchedule

__all__ = ["RankProgram", "MEMORY_PARTS"]

MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "buffers")
"""The categories the planner predicts a rank's memory in (``Breakdown.memory_parts``) and the
runtime measures (``ParallelModule.memory_report``)."""


@dataclass(kw_only=True)
class RankProgram:
    """One rank's compiled program: its stage graphs, the schedule and where it sits in the mesh."""

    plan: Plan
    """The plan every rank compiled (validated, with ``schedule.global_batch`` set)."""
    stages: StagedProgram
    """Every pipeline stage's boundary specs, batch inputs and tied-weight groups; the stage graphs
    themselves are released (``stages.stages[s].gm`` is this rank's module for its own stages)."""
    schedule: PipelineSchedule
    """The pipeline schedule (one stage and no point-to-point when pp = 1)."""
    modules: dict[int, torch.fx.GraphModule]
    """Stage index -> this rank's compiled stage graph, for the stages the schedule gives it."""
    coords: tuple[int, int, int]
    """This rank's (pp_index, dp_index, tp_index) in the plan's mesh (``RankMesh.coords``)."""
    device: torch.device
    """Where this rank's shards, activations and collectives live."""
    global_batch: int
    """Samples per optimizer step, over all data-parallel ranks."""
    microbatch_rows: int
    """Rows of one microbatch on one rank: global batch / (dp × microbatches)."""
    tied: list[list[str]] = field(default_factory=list)
    """Groups of the user's state_dict keys that name one tensor (tied weights)."""
    report: str = ""
    """The plan's text report, rendered by the face that compiled the program."""
    model: Callable[[], nn.Module | None] = lambda: None
    """The user's model, weakly (``weakref.ref``): ``pm.state_dict()`` runs its state-dict hooks
    (``fairscale.runtime.state_hooks``); the rank keeps no reference that would hold it alive."""
    token_counter: TokenCounter | None = None
    """Counts the labels a token-mean loss averages over in a piece of the batch
    (``passes.loss_weights``): the step weighs each microbatch by its count; None for other losses."""
    example_inputs: Sequence[Any] = ()
    """The global example batch the plan was compiled from (``fairscale.switch_plan`` compiles
    another plan from it); a ``fairscale.runtime.batch_form.KeywordBatch`` where it was given by
    name, whose ``batch_keys`` turn later batches into its positional form."""
    loss_fn: Callable[..., Any] | None = None
    """The user's loss function, as ``parallelize`` took it."""
    modes: tuple[bool | None, ...] = ()
    """Every module's ``training`` flag when the model was captured (``fairscale.runtime.modes``):
    the mode the rank graphs run; None for a module whose mode the forward sets itself (a
    distillation teacher's ``self.teacher.eval()``: ``planner.mode_setters``); empty when not
    recorded."""
    trainable: tuple[tuple[str, bool], ...] = ()
    """Every parameter's name and ``requires_grad`` when the model was compiled
    (``fairscale.runtime.frozen``): which parameters the rank trains; empty when not recorded."""
    eval_modules: Callable[[RankProgram, dict[int, torch.fx.GraphModule]], dict[int, torch.fx.GraphModule]] | None = None
    """The face's rewrite of this rank's stage graphs to eval mode, called as ``f(program, modules)``
    on ``pm.evaluate``'s first call (``fairscale.eval_mode.eval_modules``); None: not available."""
    predicted_memory: dict[str, float] = field(default_factory=dict)
    """Bytes this rank is predicted to hold at its peak, per :data:`MEMORY_PARTS` category (the
    planner's cost model for this rank's pipeline position); empty when not costed."""

    @property
    def local_stages(self) -> list[int]:
        """The stages this rank runs, in schedule order."""
        return self.schedule.rank_stages(self.coords[0])
