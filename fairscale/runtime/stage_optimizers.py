"""``pm.optimizer``: the optimizers of a rank's pipeline stages, seen as one ``torch.optim.Optimizer``.

Each local stage has its own :class:`fairscale.runtime.optim.DataParallelOptimizer` (its slices
and shards, its data-parallel kind). Training scripts treat ``pm.optimizer`` as one optimizer:

    sched = torch.optim.lr_scheduler.OneCycleLR(pm.optimizer, max_lr=3e-4, total_steps=1000)
    for batch in loader:
        pm.train_step(batch)
        sched.step()

so :class:`StageOptimizers` is a real ``torch.optim.Optimizer`` (schedulers check ``isinstance``),
whose ``param_groups`` are the user's groups, as in one process: every stage optimizer has the same
groups in the same order (one, or the user's, ``fairscale.runtime.optim_groups``). With one local
stage they are its own group dicts; a rank running several (interleaved virtual stages) sees one
:class:`UserGroup` per group, which reads the first stage's value and writes every stage's, so a
scheduler with one factor per group runs under any schedule. Step hooks (``register_step_pre_hook``,
global ones too) run around :meth:`step` as for any optimizer.

It keeps its identity when the closed loop switches the running plan (``ParallelModule.become``
calls :meth:`adopt`): a scheduler the user attached keeps driving the new plan's optimizers, whose
groups carry the old ones' hyperparameters (``initial_lr`` included) through the reshard.

Not supported, with an error that says so: ``add_param_group`` (the groups follow the plan's
layout). ``state_dict()`` is this rank's state, by stage, for this plan only; checkpoints that
resume under any plan are ``pm.save_checkpoint`` / ``fairscale.load_checkpoint``. It records where
it came from (:func:`optimizer_origin`: the plan's layout and the slices and shards this rank
holds), and ``load_state_dict`` refuses the state of a rank that holds other ones (nanoGPT's
``torch.save({'optimizer': optimizer.state_dict()})`` on rank 0 loaded on every rank: under tensor
parallelism each tp rank had taken rank 0's moments for its own slices, silently) or of another plan.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from typing import Any, Callable

import torch

from fairscale.runtime.optim import DataParallelOptimizer
from passes.ops.groups import AxisGroups


class StageOptimizers(torch.optim.Optimizer):
    """The optimizers of this rank's stages, stepped together (see the module docstring)."""

    # Optimizer.__init__ is not called: it would build groups of its own from a parameter list,
    # and these groups belong to the stage optimizers. What it sets up besides is set up here.
    def __init__(self, optimizers: list[DataParallelOptimizer], groups: AxisGroups,
                 origin: dict[str, Any] | None = None) -> None:
        self.optimizers = optimizers
        self._groups = groups
        self.origin = origin
        """Where this rank's state belongs (:func:`optimizer_origin`); ``state_dict`` records it."""
        self.defaults: dict[str, Any] = dict(optimizers[0].optimizer.defaults) if optimizers else {}
        self._optimizer_step_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict[int, Any] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict[int, Any] = OrderedDict()
        self._patch_step_function()  # wraps the class's step with the step hooks, as Optimizer does

    @property  # type: ignore[override]
    def param_groups(self) -> list[Any]:
        if len(self.optimizers) == 1:
            return self.optimizers[0].param_groups
        return [UserGroup(list(gs)) for gs in zip(*(o.param_groups for o in self.optimizers))]

    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, Any]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise TypeError("pm.optimizer.step(closure) is not supported: a closure would run the whole model once "
                            "per stage optimizer; call pm.train_step(batch), or backward yourself and then step()")
        with self._groups.active():
            for o in self.optimizers:
                o.step()
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        with self._groups.active():
            for o in self.optimizers:
                o.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise TypeError("pm.optimizer.add_param_group is not supported: its groups follow the plan's layout of "
                        "the model's parameters; give every parameter to the model before fairscale.parallelize")

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's optimizer state by local stage, for this plan only (``pm.save_checkpoint``
        writes one that any plan resumes)."""
        out: dict[str, Any] = {"stages": [o.state_dict() for o in self.optimizers]}
        if self.origin is not None:
            out["origin"] = dict(self.origin)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        stages = state_dict.get("stages") if isinstance(state_dict, dict) else None
        if not isinstance(stages, list) or len(stages) != len(self.optimizers):
            have = len(stages) if isinstance(stages, list) else "no"
            raise ValueError(f"this state dict has {have} stage entries but this rank runs {len(self.optimizers)} "
                             "stages: pm.optimizer.state_dict() is for the same plan and rank; use "
                             "pm.save_checkpoint / fairscale.load_checkpoint to resume under another plan")
        check_origin(state_dict.get("origin"), self.origin)
        for o, s in zip(self.optimizers, stages):
            o.load_state_dict(s)

    def adopt(self, other: StageOptimizers) -> None:
        """Take over ``other``'s stage optimizers (a switched plan's), keeping this object, its step
        hooks and any scheduler's hold on it."""
        self.optimizers = other.optimizers
        self._groups = other._groups
        self.defaults = other.defaults
        self.origin = other.origin

    def __repr__(self) -> str:
        kinds = ", ".join(type(o.optimizer).__name__ for o in self.optimizers) or "none"
        return f"StageOptimizers({len(self.optimizers)} stage optimizer(s): {kinds})"


class UserGroup(MutableMapping[str, Any]):
    """One of the user's parameter groups across a rank's stage optimizers (interleaved stages):
    reads the first stage's value, writes every stage's; ``params`` lists them all."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self._groups = groups

    def __getitem__(self, key: str) -> Any:
        if key == "params":
            return [p for g in self._groups for p in g["params"]]
        return self._groups[0][key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise TypeError("a parameter group's params follow the plan's layout; they cannot be replaced")
        for g in self._groups:
            g[key] = value

    def __delitem__(self, key: str) -> None:
        for g in self._groups:
            del g[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups[0])

    def __len__(self) -> int:
        return len(self._groups[0])

    def __repr__(self) -> str:
        return f"UserGroup({ {k: v for k, v in self._groups[0].items() if k != 'params'} }, {len(self._groups)} stages)"


_RESUME = ("pm.optimizer.state_dict() holds this rank's own slices and shards of the optimizer state: save every "
           "rank's to a file of its own (f'optimizer_rank{rank}.pt') and load each on the same rank under the same "
           "plan, or use pm.save_checkpoint(dir) / pm.load_checkpoint(dir), which hold the whole state and resume "
           "under any plan")


def optimizer_origin(plan: Any, coords: tuple[int, int, int], rank: int, kinds: list[str]) -> dict[str, Any]:
    """Where a rank's optimizer state belongs: the plan's layout of the tensors (mesh, stages,
    tensor-parallel rules, data-parallel kind and buckets; not the microbatches, which do not move
    state) and the part of it this rank holds, ``shard``: its pp and tp coordinates, and its dp
    coordinate where dp ranks hold different state (a sharded kind, or experts split over ep).
    DDP replicas hold the same state, so rank 0's loads on any replica."""
    pp, dp, tp = coords
    ep = plan.mesh.ep
    if all(k == "ddp" for k in kinds):
        dp_part: int | None = dp % ep if ep > 1 else None
    else:
        dp_part = dp
    layout = {"mesh": [plan.mesh.pp, plan.mesh.dp, plan.mesh.tp, ep], "stages": [s.layers for s in plan.stages],
              "schedule": [plan.schedule.kind, plan.schedule.virtual_stages],
              "tensor_parallel": [sorted(plan.tensor_parallel.rules.items()), plan.tensor_parallel.sequence_parallel],
              "data_parallel": [plan.data_parallel.kind, plan.data_parallel.units, plan.data_parallel.bucket_mb]}
    m = plan.mesh
    return {"layout": json.dumps(layout, sort_keys=True), "shard": [pp, dp_part, tp], "rank": rank,
            "coords": [pp, dp, tp],
            "plan": f"pp{m.pp} x dp{m.dp} x tp{m.tp}{f' x ep{ep}' if ep > 1 else ''}, {plan.data_parallel.kind}"}


def check_origin(saved: Any, mine: dict[str, Any] | None) -> None:
    """Refuse a state dict another plan's rank, or a rank holding other slices or shards, saved
    (one without an origin, made by hand or before origins were recorded, is taken as it is)."""
    if not isinstance(saved, dict) or mine is None:
        return

    def where(o: dict[str, Any]) -> str:
        pp, dp, tp = o.get("coords", ["?"] * 3)
        return f"rank {o.get('rank', '?')} (pp {pp}, dp {dp}, tp {tp}) under the plan {o.get('plan', '?')}"

    if saved.get("layout") != mine["layout"]:
        raise ValueError(f"pm.optimizer.load_state_dict: this state dict was saved by {where(saved)}, and this is "
                         f"{where(mine)}: another plan lays the optimizer state out otherwise. {_RESUME}")
    if list(saved.get("shard", [])) != list(mine["shard"]):
        raise ValueError(f"pm.optimizer.load_state_dict: this state dict was saved by {where(saved)}, and this is "
                         f"{where(mine)}, which holds other slices or shards of the model's tensors. {_RESUME}")
