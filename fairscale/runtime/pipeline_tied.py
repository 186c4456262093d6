"""Parameters held by several pipeline stages (tied embeddings): checks and gradient sums.

A tied weight used on several stages is a separate copy in each stage graph
(``StagedProgram.shared``: canonical key -> holder stages). After a step's last backward,
:class:`fairscale.runtime.pipeline.PipelineExecutor` calls :meth:`TiedParams.sum_grads`: the
holders' ranks exchange their copies' gradients over the pp axis (one batch of sends and receives
in an order both sides agree on) and every copy gets the sum,
added in stage order on every holder so the copies stay bitwise identical and the optimizer
steps them alike. :meth:`TiedParams.check` refuses, when the executor is built, copies that a
data-parallel pass sharded (their sharded master copies would never see the sum).

:func:`stage_layout` and :func:`fetch_attr` find a stage's parameters by user key; the executor's
``state_dict`` uses them too.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fairscale.runtime.p2p import Check, Message, exchange
from fairscale.runtime.pipeline_io import PipelineError
from passes.ops import comm
from passes.dp.info import find_dp_info
from passes.layout import ParamLayout, find_layout
from passes.program import StagedProgram
from planner.schedule import PipelineSchedule

__all__ = ["TiedParams", "stage_layout", "fetch_attr"]


class TiedParams:
    """The tied copies this rank's ``local_stages`` hold, in ``modules`` (stage -> module run)."""

    def __init__(self, program: StagedProgram, schedule: PipelineSchedule, *, axis: str,
                 modules: Mapping[int, nn.Module], local_stages: Sequence[int]) -> None:
        self.program = program
        self.schedule = schedule
        self.axis = axis
        self.modules = modules
        self.local_stages = local_stages

    def sum_grads(self, *, check: Check | None = None) -> None:
        """Give every copy of a shared parameter the sum of all copies' gradients, in stage order.

        The holders' ranks exchange their copies' gradients in ONE ``batch_isend_irecv`` (all keys):
        every rank posts, per key in sorted order, its sends to each other holder rank and its
        receives from each, both sides naming a message by (key, sending stage), so the pairs agree
        on the order and no side waits on a send before its receive is posted (the send-send
        deadlock of separate calls under NCCL). ``check``: the NCCL semantics checker, if on."""
        if not self.program.shared:
            return
        messages: list[Message] = []
        local: list[tuple[str, dict[int, nn.Parameter], dict[int, torch.Tensor]]] = []
        group = comm.get_group(self.axis)
        for key, holders in sorted(self.program.shared.items()):
            mine = [s for s in holders if s in self.local_stages]
            if not mine:
                continue
            params = {s: self._param_of(s, key) for s in mine}
            grads: dict[int, torch.Tensor] = {}
            for s, p in params.items():
                grads[s] = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
            for r in sorted({self.schedule.stage_rank(s) for s in holders if s not in mine}):
                peer = dist.get_global_rank(group, r)
                messages += [Message(True, peer, grads[own].contiguous(), f"tied {key}@{own}", "tied") for own in mine]
                for s in holders:
                    if self.schedule.stage_rank(s) == r:
                        grads[s] = torch.empty_like(grads[mine[0]])
                        messages.append(Message(False, peer, grads[s], f"tied {key}@{s}", "tied"))
            local.append((key, params, grads))
        exchange(messages, group=group, axis=self.axis, check=check).wait()
        for key, params, grads in local:
            holders = self.program.shared[key]
            total = grads[holders[0]].clone()
            for s in holders[1:]:
                total += grads[s]
            for p in params.values():
                p.grad = total.clone()

    def check(self) -> None:
        """Tied copies are summed through ``.grad`` after the step, so each copy must be a whole
        parameter that the optimizer steps from its ``.grad``: any parameter without a
        data-parallel pass, and under one the all-reduced ("plain") ones, which are every
        parameter for ddp and those compiled with ``replicate=`` for zero1, zero2 and fsdp."""
        for key, holders in self.program.shared.items():
            for s in holders:
                if s not in self.local_stages:
                    continue
                info = find_dp_info(self.modules[s])
                if info is None:
                    self._param_of(s, key)
                    continue
                plain = info.plain_params()
                found = [p for a, k in stage_layout(self.program, self.modules, s).keys.items()
                         if self.program.canonical(k) == key
                         for p in [fetch_attr(self.modules[s], a)] if isinstance(p, nn.Parameter)]
                if not any(p is q for p in found for q in plain):
                    raise PipelineError(
                        f"{key} is used by stages {holders} (tied weights), and stage {s} shards it with "
                        f"data-parallel kind {info.kind!r}: the pipeline sums the tied copies' gradients after "
                        f"backward, which a sharded master copy does not see. Compile the stage with "
                        f"shard_data_parallel_pass(..., replicate={self.program.shared_keys(s)!r}) "
                        f"(StagedProgram.shared_keys), use kind 'ddp', or put every use of {key} in one stage")

    def _param_of(self, stage: int, key: str) -> nn.Parameter:
        for attr, k in stage_layout(self.program, self.modules, stage).keys.items():
            if self.program.canonical(k) == key:
                value = fetch_attr(self.modules[stage], attr)
                if isinstance(value, nn.Parameter):
                    return value
        raise PipelineError(f"stage {stage} holds no whole parameter {key!r} to sum the gradients of its tied "
                            "copies; tied parameters across stages need unsharded copies (ddp, zero1) or both "
                            "uses in one stage")


def stage_layout(program: StagedProgram, modules: Mapping[int, nn.Module], stage: int) -> ParamLayout:
    """Where ``stage``'s parameters live: the layout of the module run, else the split's parameter keys."""
    return find_layout(modules[stage]) or ParamLayout(keys=program.stages[stage].param_keys())


def fetch_attr(mod: nn.Module, attr: str) -> Any:
    """``mod``'s attribute at dotted path ``attr``."""
    obj: Any = mod
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
