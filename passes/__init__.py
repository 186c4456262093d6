"""Graph passes: a captured GraphModule and a Plan in, per-rank GraphModules out.

The pipeline is one flat function, :func:`compile_rank`, with the verifier at both ends::

    batch_norm → verify → split_stages → for each of this rank's stages:
                 shard_tensor_parallel → shard_experts → insert_recompute → shard_data_parallel → verify

Batch norm comes first, on the whole graph: training-mode batch statistics are taken over the dp
group's global batch (``plan.batch_norm``), and norm modules that torch.fx kept whole are inlined,
so every later pass sees their parameters as get_attr nodes.

Parameters that several stages hold (tied embeddings) are kept whole on the dp axis whatever the
data-parallel kind, because the pipeline sums the stage copies' gradients after backward.

Expert parallelism splits MoE experts over groups of ``mesh.ep`` consecutive dp ranks
(``ep_index = dp_index % ep``); the data-parallel pass then averages those experts' gradients over
the ranks that hold the same experts instead of sharding them.

Order matters once: recompute runs before data parallelism, so a recompute region holds the
layer's compute (and its tensor-parallel collectives, repeated in backward as in Megatron-LM),
while FSDP's gathers of parameters stay outside it and are never repeated by recomputation.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx

from passes.dp.batch_norm import batch_norm_pass, has_batch_norm
from passes.ep.shard_experts import shard_experts_pass
from passes.insert_recompute import insert_recompute_pass
from passes.dp.shard_data_parallel import shard_data_parallel_pass
from passes.tp.shard_tensor_parallel import shard_tensor_parallel_pass
from passes.program import StagedProgram
from passes.split_stages import resolve_stages, split_stages_pass
from passes.verify import verify_pass
from planner.graph import ModelGraph
from planner.plan import Plan, PlanError

__all__ = ["compile_rank", "split_program", "split_key", "has_batch_norm", "batch_norm_pass", "split_stages_pass", "shard_tensor_parallel_pass",
           "insert_recompute_pass", "shard_data_parallel_pass", "shard_experts_pass", "verify_pass", "StagedProgram"]


def compile_rank(graph: ModelGraph, plan: Plan, *, stages: Iterable[int], dp_index: int, tp_index: int,
                 device: torch.device | str | None = None,
                 program: StagedProgram | None = None) -> tuple[StagedProgram, dict[int, torch.fx.GraphModule]]:
    """The rewritten graphs of one rank: for each stage in ``stages``, its tensor-parallel slice
    ``tp_index``, its experts (``dp_index % mesh.ep``), recompute regions, and data-parallel shard
    ``dp_index``, placed on ``device`` (default: where the capture's parameters are) by the
    data-parallel pass, the last one. ``graph`` is left intact. ``program``: the split of ``graph``
    for ``plan`` when the caller already has it (:func:`split_program`), left as it is.

    Without ``program``, nothing returned refers to ``graph``'s tensors: the stage graphs of the
    split hold the capture's own tensors (no copy; the data-parallel pass, last, copies what the
    rank keeps, one parameter at a time onto the device) and are released afterwards
    (``program.stages[s].gm`` is this rank's compiled module for its stages, None for the others),
    so the rank holds one copy of its share of the weights and the capture can be freed."""
    owned = program is None
    if program is None:
        program = split_program(graph, plan, share_weights=True)
    modules: dict[int, torch.fx.GraphModule] = {}
    for s in stages:
        stage_gm = program.stages[s].gm
        if stage_gm is None:
            raise ValueError(f"stage {s} of this program was released by the compile_rank that split it; "
                             "split again (split_program) to compile it once more")
        gm = stage_gm
        gm = shard_tensor_parallel_pass(gm, plan, tp_index=tp_index, tp_size=plan.mesh.tp)
        if plan.mesh.ep > 1 and _has_experts(gm):  # a pipeline stage may hold no MoE layer
            gm = shard_experts_pass(gm, plan, ep_index=dp_index % plan.mesh.ep, ep_size=plan.mesh.ep)
        gm = insert_recompute_pass(gm, plan)
        # weights shared by several stages stay whole: the pipeline sums their copies' gradients
        gm = shard_data_parallel_pass(gm, plan, dp_index=dp_index, dp_size=plan.mesh.dp,
                                      replicate=program.shared_keys(s), ep_size=plan.mesh.ep, device=device,
                                      model_keys=graph.param_shapes)
        modules[s] = verify_pass(gm, where=f"for stage {s}")
    if owned:
        program.release(modules)  # the rank keeps its compiled stages; no reference to the capture's tensors
    return program, modules


def split_program(graph: ModelGraph, plan: Plan, *, share_weights: bool = False) -> StagedProgram:
    """The whole-graph passes: batch norm, the verifier, and the cut into stages
    (``share_weights``: see ``split_stages_pass``)."""
    gm = batch_norm_pass(graph.gm, plan)
    verify_pass(gm, where="after capture")
    return split_stages_pass(gm, plan, graph=graph, share_weights=share_weights)


def split_key(graph: ModelGraph, plan: Plan) -> tuple[Any, ...] | None:
    """Everything :func:`split_program` (``share_weights`` aside) reads from ``plan``: two plans with
    the same key on the same graph split into the same stages, so their programs are one (what the
    plan-time compile check shares between the plans it checks). It reads ``batch_norm`` (and, when
    ``graph`` has batch norm, ``mesh.dp`` and ``schedule.microbatches``) and the layers of each
    stage as ``stages``, ``mesh.pp`` and ``schedule.virtual_stages`` resolve them. None when they do
    not resolve: the split raises, from that plan's own fields."""
    try:
        layers = resolve_stages(plan, graph)
    except PlanError:
        return None
    norm: tuple[Any, ...] = (plan.batch_norm,)
    if has_batch_norm(graph.gm):
        norm += (plan.mesh.dp, plan.schedule.microbatches)
    return norm, tuple(tuple(names) for names in layers)


def _has_experts(gm: torch.fx.GraphModule) -> bool:
    from planner.graph import GROUPED_MM

    return any(n.op == "call_function" and str(n.target) == GROUPED_MM for n in gm.graph.nodes)
