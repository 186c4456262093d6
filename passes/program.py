"""The records a pipeline split leaves for the runtime: stage boundaries and tied weights.

:func:`passes.split_stages.split_stages_pass` returns a :class:`StagedProgram`; the executor
(``fairscale.runtime.pipeline``) reads its stages' boundary specs, batch inputs and tied-weight
groups. A leaf: the runtime imports it, never the pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
import torch.fx

__all__ = ["ValueSpec", "StageGraph", "StagedProgram"]


@dataclass(frozen=True, kw_only=True)
class ValueSpec:
    """A tensor crossing a stage boundary (or a batch input), as captured."""

    name: str
    """Node name in the captured graph."""
    shape: tuple[int, ...]
    """Shape for the captured microbatch."""
    dtype: torch.dtype
    """Its dtype."""
    grad: bool
    """Whether a gradient flows back for it (floating point and computed from parameters)."""

    def describe(self) -> str:
        return f"{self.name}{list(self.shape)}:{str(self.dtype).replace('torch.', '')}"


@dataclass(kw_only=True)
class StageGraph:
    """One (virtual) stage: its GraphModule and what flows in and out of it."""

    index: int
    """Stage index (stage s runs on pipeline rank s % pp)."""
    layers: list[str]
    """Layer names the stage holds, in execution order."""
    batch_inputs: list[int]
    """Indices into the flat batch of the batch inputs the stage reads, in placeholder order."""
    batch_specs: list[ValueSpec]
    """Their captured shapes (a microbatch must match them)."""
    inputs: list[ValueSpec]
    """Values received from the previous stage, in placeholder order."""
    outputs: list[ValueSpec]
    """Values sent to the next stage, in output order (last stage: the loss)."""

    keys: dict[str, str] = field(default_factory=dict)
    """attr -> user state_dict key of the stage's parameters and buffers (kept when ``gm`` is released)."""
    builder: Callable[[], torch.fx.GraphModule] | None = field(default=None, repr=False, compare=False)
    """Builds the stage graph the first time :attr:`gm` is read (the split builds only the stages used)."""
    blueprint: Any = field(default=None, repr=False, compare=False)
    """What the split read the stage off the capture as (``passes.stage_blueprint.Blueprint``)."""
    _gm: torch.fx.GraphModule | None = field(default=None, repr=False, compare=False)

    def build(self) -> None:
        """Build the stage graph now (nothing if it is built or released)."""
        if self._gm is None and self.builder is not None:
            self._gm, self.builder = self.builder(), None

    @property
    def gm(self) -> torch.fx.GraphModule | None:
        """``gm(*batch inputs, *received) -> tuple of sent values`` (last stage: ``(loss,)``), built
        on first use; None once released (:meth:`StagedProgram.release`: a compiled rank keeps only
        its own stages' rank graphs)."""
        self.build()
        return self._gm

    @gm.setter
    def gm(self, value: torch.fx.GraphModule | None) -> None:
        self._gm, self.builder, self.blueprint = value, None, None

    def param_keys(self) -> dict[str, str]:
        """attr -> user state_dict key of the stage's parameters and buffers."""
        return dict(self.keys)


@dataclass(kw_only=True)
class StagedProgram:
    """What :func:`split_stages_pass` returns: the stages in order plus cross-stage facts."""

    stages: list[StageGraph]
    """All stages in order."""
    shared: dict[str, list[int]] = field(default_factory=dict)
    """Canonical user key -> stages holding a copy, for parameters held by more than one stage
    (tied weights; the canonical key is the first name of the tied group)."""
    aliases: dict[str, list[str]] = field(default_factory=dict)
    """User key -> every state_dict name of that tensor (tied groups), for rebuilding a full state_dict."""
    microbatch: int = 1
    """Batch size (dim 0) the graph was captured for."""

    def canonical(self, key: str) -> str:
        """The first name of ``key``'s tied group (``key`` itself when untied)."""
        return self.aliases.get(key, [key])[0]

    def shared_keys(self, stage: int) -> list[str]:
        """User keys (as this stage names them) of its parameters that other stages also hold: what
        ``shard_data_parallel_pass(..., replicate=)`` must keep whole for the tied-gradient sum."""
        keys = self.stages[stage].param_keys().values()
        return sorted({k for k in keys if self.canonical(k) in self.shared})

    def boundary_specs(self) -> tuple[dict[int, list[tuple[tuple[int, ...], torch.dtype]]],
                                      dict[int, list[tuple[tuple[int, ...], torch.dtype]]]]:
        """(send_specs, recv_specs) per stage for ``planner.schedule.simulate``'s shape check."""
        send = {st.index: [(v.shape, v.dtype) for v in st.outputs] for st in self.stages[:-1]}
        recv = {st.index: [(v.shape, v.dtype) for v in st.inputs] for st in self.stages[1:]}
        return send, recv

    def release(self, modules: Mapping[int, torch.fx.GraphModule]) -> None:
        """Drop the split stage graphs (and with them any reference to the capture's tensors):
        stage ``s`` keeps ``modules[s]``, the graph compiled from it, and the other stages keep
        only their boundary specs and parameter keys."""
        for st in self.stages:
            st.gm = modules.get(st.index)

    def summary(self) -> str:
        """One line per stage: layers, inputs received, outputs sent."""
        from planner.selectors import format_layers

        rows = []
        for st in self.stages:
            ins = ", ".join(v.describe() for v in st.inputs) or "-"
            outs = ", ".join(v.describe() for v in st.outputs)
            rows.append(f"stage {st.index}: {format_layers(st.layers)} | recv {ins} | send {outs}")
        for key, holders in sorted(self.shared.items()):
            rows.append(f"shared {key}: stages {holders}")
        return "\n".join(rows)
