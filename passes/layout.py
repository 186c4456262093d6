"""Where each of a rank's parameters came from: the record that passes leave for the runtime.

A rank's GraphModule holds only its local tensors. ``gm.meta[META_LAYOUT]`` is a
:class:`ParamLayout` that says how to rebuild the user's full state_dict from them:

* a parameter left whole: ``layout.keys[attr] = key``;
* a tensor-parallel slice (``passes.tp.shard_tensor_parallel``): ``layout.tp[key] = TensorShard``;
* an FSDP flat shard (``passes.dp.fsdp``): ``layout.flat[attr] = FlatShard`` whose members are
  (possibly TP-sliced) tensors named by their user keys.

``attr`` is the parameter's attribute path in the GraphModule; ``key`` is the user's state_dict key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx

from planner.graph import META_PARAM

META_LAYOUT = "fs_layout"
"""gm.meta key holding the rank's :class:`ParamLayout`."""
INSIDE_DP = frozenset({"ep"})
"""Axes whose groups lie inside the dp axis (expert parallelism): a tensor sharded on one of them
differs between dp ranks, so it is never treated as replicated over dp."""


@dataclass(frozen=True, kw_only=True)
class TensorShard:
    """A rank-local slice of the full tensor ``key``: chunk ``index`` of ``count`` along ``dim``.

    With ``parts > 1`` the dim is first cut into ``parts`` equal blocks (a fused q|k|v weight, a
    gate|up pair) and each block is chunked, so the local tensor is the concatenation of chunk
    ``index`` of every block.
    """

    key: str
    global_shape: tuple[int, ...]
    dim: int
    index: int
    count: int
    parts: int = 1
    axis: str = "tp"

    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.global_shape)
        shape[self.dim] //= self.count
        return tuple(shape)

    def slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full`` (a copy, contiguous)."""
        blocks = full.chunk(self.parts, dim=self.dim)
        return torch.cat([b.chunk(self.count, dim=self.dim)[self.index] for b in blocks], dim=self.dim).contiguous()

    def assemble(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`slice`: ``pieces[i]`` is rank ``i``'s local tensor."""
        if len(pieces) != self.count:
            raise ValueError(f"{self.key}: need {self.count} pieces, got {len(pieces)}")
        per_rank = [p.chunk(self.parts, dim=self.dim) for p in pieces]
        blocks = [torch.cat([per_rank[r][j] for r in range(self.count)], dim=self.dim) for j in range(self.parts)]
        return torch.cat(blocks, dim=self.dim)


@dataclass(kw_only=True)
class FlatShard:
    """An FSDP flat parameter: ``members`` flattened and concatenated in order, zero-padded to
    ``padded`` (a multiple of ``count``), of which this rank holds ``[index*padded/count, (index+1)*padded/count)``."""

    members: list[tuple[str, tuple[int, ...]]]
    """(user state_dict key, rank-local shape before flattening) in flat order."""
    numel: int
    padded: int
    index: int
    count: int
    axis: str = "dp"

    @property
    def shard_numel(self) -> int:
        return self.padded // self.count

    def offsets(self) -> list[tuple[str, int, int]]:
        """(key, start, numel) of each member inside the unsharded flat tensor."""
        out, start = [], 0
        for key, shape in self.members:
            n = 1
            for s in shape:
                n *= s
            out.append((key, start, n))
            start += n
        return out

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of each member inside an unsharded flat tensor."""
        return {key: flat[start:start + n].view(shape)
                for (key, start, n), (_, shape) in zip(self.offsets(), self.members)}


@dataclass(kw_only=True)
class ParamLayout:
    """Provenance of every local parameter and buffer of one rank's GraphModule."""

    keys: dict[str, str] = field(default_factory=dict)
    """attr -> user key, for tensors held as ordinary (possibly TP-sliced) parameters and buffers."""
    tp: dict[str, TensorShard] = field(default_factory=dict)
    """user key -> how its local tensor is sliced on the tp axis (absent = replicated)."""
    flat: dict[str, FlatShard] = field(default_factory=dict)
    """attr of a flat FSDP shard -> what it holds."""


def find_layout(gm: torch.nn.Module) -> ParamLayout | None:
    """The layout a pass recorded on ``gm``, or None (an uncompiled module)."""
    meta = getattr(gm, "meta", None)
    return meta.get(META_LAYOUT) if isinstance(meta, dict) else None


def layout_of(gm: torch.fx.GraphModule) -> ParamLayout:
    """The layout recorded on ``gm``, creating an identity layout from capture's ``fs_param`` meta."""
    layout = gm.meta.get(META_LAYOUT)
    if layout is None:
        layout = ParamLayout()
        for node in gm.graph.nodes:
            if node.op == "get_attr" and META_PARAM in node.meta:
                layout.keys[str(node.target)] = node.meta[META_PARAM]
        gm.meta[META_LAYOUT] = layout
    return layout
