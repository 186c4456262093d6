"""Switch a running ParallelModule to another plan, in memory: ``fairscale.switch_plan``.

Usage (every rank calls it with the same plan)::

    pm = fairscale.parallelize(model, example_inputs=batch, plan="pp4.json")
    for step in range(10):
        pm.train_step(next_batch(step))
    pm = fairscale.switch_plan(pm, "dp4.json")      # same ranks, another mesh, no disk
    for step in range(10, 100):
        pm.train_step(next_batch(step))             # continues exactly where it was

The training state moves through the same mapping an any-plan checkpoint uses
(``fairscale.runtime.engine_checkpoint``): the full state in the user's keys. Each stage's dp × tp
ranks gather their tensors one at a time and keep a share of them on the host
(``full_state_share``: parameters, buffers and the optimizer's moments and step counts, a tied
weight and its optimizer state under every name of the tie); the old module is then released, the
new plan is compiled, and each rank receives from their holders exactly the keys its new stages
load (``wanted_keys``), then cuts its own slices and shards (``load_full_state``). A rank's host
holds its share of the old stages plus the full tensors of its new stages at the peak.

The new plan is checked as ``parallelize(plan=...)`` checks one (validated against the model,
re-costed, compiled on rank 0 first), so a plan the passes refuse raises ``PlanCompileError`` on
every rank before any state moves; it must keep the global batch. The old module is unusable
afterwards (its calls raise), and learning-rate schedulers must be re-attached to the new
module's optimizer (its hyperparameters, ``lr`` included, are carried over).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from fairscale.build import build_module, predicted_memory
from fairscale.runtime.engine import ParallelModule
from fairscale.runtime.engine_checkpoint import full_state_share, load_full_state, wanted_keys
from planner.cluster import Cluster
from planner.plan import Plan

__all__ = ["switch_plan", "redistribute"]


def switch_plan(pm: ParallelModule, plan: Plan | str | Path, *, cluster: Cluster | str | None = None,
                ) -> ParallelModule:
    """``pm``'s whole training state resharded, in memory, to ``plan`` on the same ranks; returns
    the new module (``pm`` is retired). Collective: every rank calls it with the same plan.

    Args:
        pm: a module built by ``fairscale.parallelize``; the user's model it was built from must
            still be alive (its structure is compiled again; its weights are not read).
        plan: a Plan or the path of a plan file, for the same number of ranks and global batch.
        cluster: what the plan is costed for (default: as ``parallelize``, the detected devices).
    """
    from fairscale.api import (_same_on_every_rank, captured, check_compiles_on_ranks, load_and_check,
                               resolve_cluster)

    if pm.retired:
        raise RuntimeError(pm.retired)
    program = pm.rank_program
    model = program.model()
    if model is None:
        raise RuntimeError("switch_plan compiles the new plan from the user's model, which is gone: keep a "
                           "reference to the model passed to fairscale.parallelize while training")
    batch, loss_fn = program.example_inputs, program.loss_fn
    graph = captured(model, batch, loss_fn=loss_fn)
    cl = _same_on_every_rank(resolve_cluster(dist.get_world_size(), cluster, device=pm.device))
    chosen = load_and_check(plan, graph, cl, global_batch=pm.global_batch)
    if chosen.schedule.global_batch != pm.global_batch:
        raise ValueError(f"the new plan's global batch is {chosen.schedule.global_batch}, but this run trains on "
                         f"{pm.global_batch} samples per step; a live switch keeps the global batch (set "
                         f"schedule.global_batch to {pm.global_batch}, or leave it out)")
    check_compiles_on_ranks(model, batch, chosen, loss_fn=loss_fn,
                            source=str(plan) if isinstance(plan, (str, Path)) else "plan")
    with pm.mesh.groups.active():
        share = full_state_share(pm._stage_states(), pm.mesh, program.tied)
    old = pm.plan.mesh
    pm.retire(f"this ParallelModule (pp{old.pp}×dp{old.dp}×tp{old.tp}) was switched to another plan; use the "
              "module fairscale.switch_plan returned")
    predicted = predicted_memory(chosen, graph, cl, optimizer=pm.optimizer_spec)
    new = build_module(model, chosen, example_inputs=batch, loss_fn=loss_fn, optimizer=pm.optimizer_spec,
                       device=pm.device, tf32=pm.tf32_requested, predicted=predicted)
    stages = new._stage_states()
    state = redistribute(share, lambda available: wanted_keys(stages, available), device=new.device)
    with new.mesh.groups.active():
        load_full_state(stages, state)
    dist.barrier()
    return new


def redistribute(share: dict[str, Any], wanted: Callable[[set[str]], set[str]], *,
                 device: torch.device) -> dict[str, Any]:
    """Every rank holds ``share`` (key -> host tensor; the JSON ``optim.param_groups`` is the same
    everywhere) and returns the keys ``wanted(all keys)`` names, from whichever rank holds each.
    Collective over the world: the keys are sent point to point in one global order (the lowest
    holder sends to each rank that wants a key), which every rank walks alike, so the blocking
    sends and receives never wait on each other in a cycle. Tensors travel on ``device`` (the
    process group's device) and arrive in host memory."""
    world, me = dist.get_world_size(), dist.get_rank()
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in share.items() if isinstance(v, torch.Tensor)}
    held: list[Any] = [None] * world
    dist.all_gather_object(held, shapes)
    owner: dict[str, int] = {}
    for rank, keys in enumerate(held):
        for key in keys:
            owner.setdefault(key, rank)
    mine = wanted(set(owner))
    needs: list[Any] = [None] * world
    dist.all_gather_object(needs, sorted(mine))
    wants = [set(n) for n in needs]
    out: dict[str, Any] = {k: v for k, v in share.items() if not isinstance(v, torch.Tensor)}
    for key in sorted(owner):
        src = owner[key]
        if me == src:
            if key in mine:
                out[key] = share[key]
            t = share[key].to(device).contiguous()
            for dst in range(world):
                if dst != src and key in wants[dst]:
                    dist.send(t, dst)
        elif key in mine:
            shape, dtype = held[src][key]
            buf = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buf, src)
            out[key] = buf.cpu()
    return out
