"""The one table of tensor-parallel styles: what each style splits, for each kind of module.

Validation (``planner.validate_tp``), the search's degree filter (``planner.search.tp``), the cost
model (``planner.cost``) and the tensor-parallel pass (``passes.tp.shard_tensor_parallel``) all read
this table; adding a style means adding its :class:`Style` entry here and its op rule in the pass.

Module kinds and their weight layouts (the dim numbers below index these)::

    linear      nn.Linear (and subclasses)      weight [out_features, in_features], y = x W^T + b
    conv1d      Hugging Face ``Conv1D`` (GPT-2)  weight [in_features, out_features], y = x W + b
    embedding   nn.Embedding                     weight [num_embeddings, embedding_dim]
    experts     grouped MoE weights              every own parameter [num_experts, ...]

Styles (Megatron-LM, Shoeybi et al. 2019, section 3; vocab-parallel embedding and cross-entropy,
ibid. section 3 and Megatron's ``VocabParallelEmbedding`` / ``_VocabParallelCrossEntropy``):

* ``colwise``: output features split; the output stays sharded on its last dim; a fused output
  later split into equal blocks (q|k|v) is split block by block. Bias split like the output.
* ``colwise_gather``: colwise, then the output is all-gathered.
* ``rowwise``: input features split (an embedding: its rows); the output is a partial sum, reduced
  where it is consumed; the bias (replicated) is added once.
* ``vocab_embedding``: embedding rows (the vocabulary) split; masked lookup, partial-sum output.
* ``vocab_loss``: a colwise head whose vocab-sharded logits must reach the cross-entropy, which
  becomes a vocab-parallel cross-entropy (no gather of the logits).
* ``expert``: MoE expert weights split on the expert dim; each rank runs its experts' tokens.
* ``replicate``: parameters kept whole.

The cost columns: ``forward_reduce`` (the module's output is a partial sum, reduced in forward:
one all-reduce, or reduce-scatter under sequence parallelism) and ``backward_reduce`` (its
replicated input feeds sharded compute, so the input's gradient is all-reduced in backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from planner.graph import ModelGraph

__all__ = ["TPRules", "Style", "STYLES", "TP_STYLES", "MODULE_KINDS", "module_kind", "split_dim", "dim_name",
           "shard_problem", "own_param_shapes", "module_shard_problem",
           "param_shapes_by_module"]

MODULE_KINDS = ("linear", "conv1d", "embedding", "experts")


class TPRules(dict[str, str]):
    """Selector -> style rules as a pattern detector returns them, with ``reason``: why it left
    modules (or the whole model) without tensor parallelism (the op and the model's source line),
    so a refusal can say so instead of blaming divisibility."""

    def __init__(self, rules: Mapping[str, str] | None = None, *, reason: str = "") -> None:
        super().__init__(rules or {})
        self.reason = reason


@dataclass(frozen=True)
class Style:
    """One tensor-parallel style (see the module docstring)."""

    name: str
    weight_dim: Mapping[str, int] = field(default_factory=dict)
    """Module kind -> the dim of its weight the style splits. A kind not listed cannot take the style."""
    bias: str = "none"
    """``"split"`` (with the output features), ``"replicated"`` (added once after the reduction) or ``"none"``."""
    output: str = "replicated"
    """The module output's placement: ``"sharded"`` (last dim), ``"partial"`` or ``"replicated"``."""
    fused_blocks: bool = False
    """Whether an output later split into equal blocks (fused q|k|v, gate|up) is split block by block."""
    forward_reduce: bool = False
    backward_reduce: bool = False
    reduce_per_parent: bool = False
    """The forward reduction is shared by the styled modules of one parent (an MoE block's experts)."""


_COL = {"linear": 0, "conv1d": 1, "embedding": 1}
STYLES: dict[str, Style] = {s.name: s for s in (
    Style("colwise", _COL, bias="split", output="sharded", fused_blocks=True, backward_reduce=True),
    Style("colwise_gather", _COL, bias="split", output="replicated", fused_blocks=True, backward_reduce=True),
    Style("rowwise", {"linear": 1, "conv1d": 0, "embedding": 0}, bias="replicated", output="partial",
          forward_reduce=True),
    Style("vocab_embedding", {"embedding": 0}, output="partial", forward_reduce=True),
    Style("vocab_loss", {"linear": 0, "conv1d": 1}, bias="split", output="sharded", backward_reduce=True),
    Style("expert", {"experts": 0}, output="partial", forward_reduce=True, backward_reduce=True,
          reduce_per_parent=True),
    Style("replicate"),
)}
"""Style name -> :class:`Style`."""

TP_STYLES: tuple[str, ...] = tuple(STYLES)
"""The style names a plan may use."""

_DIM_NAMES = {("linear", 0): "output features", ("linear", 1): "input features",
              ("conv1d", 1): "output features", ("conv1d", 0): "input features",
              ("embedding", 0): "vocabulary rows", ("embedding", 1): "embedding columns",
              ("experts", 0): "experts"}
_KIND_CLASSES = {"linear": "Linear", "conv1d": "Conv1D", "embedding": "Embedding", "experts": "grouped experts"}


def module_kind(cls: str, own_shapes: Mapping[str, tuple[int, ...]] | None = None) -> str | None:
    """The kind of a module from its class name (and its own parameters' shapes, for experts)."""
    if cls.endswith("Linear"):
        return "linear"
    if cls == "Conv1D":
        return "conv1d"
    if cls.endswith("Embedding"):
        return "embedding"
    if own_shapes and any(len(s) >= 3 for s in own_shapes.values()):
        return "experts"
    return None


def split_dim(style: str, kind: str | None) -> int | None:
    """The weight dim ``style`` splits on a module of ``kind`` (None: it does not apply)."""
    return STYLES[style].weight_dim.get(kind) if kind is not None else None


def dim_name(kind: str, dim: int) -> str:
    return _DIM_NAMES.get((kind, dim), f"dim {dim}")


def shard_problem(style: str, module: str, cls: str, own_shapes: Mapping[str, tuple[int, ...]], tp: int) -> str | None:
    """Why ``style`` cannot split ``module`` (class ``cls``, own parameters ``own_shapes``) over
    ``tp`` ranks, or None. ``replicate`` always can."""
    st = STYLES[style]
    if not st.weight_dim:
        return None
    kind = module_kind(cls, own_shapes)
    dim = split_dim(style, kind)
    if kind is None or dim is None:
        if set(st.weight_dim) == {"experts"}:
            return (f"{style} splits the experts (dim 0) of a module's own [experts, ...] parameters, but {module} "
                    f"({cls}) has none")
        kinds = " / ".join(sorted(_KIND_CLASSES[k] for k in st.weight_dim))
        return f"{style} applies to {kinds} modules, but {module} is {cls}"
    if kind == "experts":
        for name, shape in own_shapes.items():
            if len(shape) >= 3 and shape[0] % tp:
                return (f"{style} splits {module}.{name} {shape} along dim 0 ({shape[0]} experts), but "
                        f"{shape[0]} % tp({tp}) = {shape[0] % tp}")
        return None
    weight = own_shapes.get("weight")
    if weight is None or len(weight) != 2:
        return f"{style} splits the 2-D weight of a {_KIND_CLASSES[kind]}, but {module} ({cls}) has none"
    size = weight[dim]
    if size % tp:
        return (f"{style} splits {module}.weight {weight} along dim {dim} ({size} {dim_name(kind, dim)}), "
                f"but {size} % tp({tp}) = {size % tp}")
    return None


def param_shapes_by_module(graph: ModelGraph) -> dict[str, dict[str, tuple[int, ...]]]:
    """:func:`own_param_shapes` of every module that owns a parameter, built in one pass (for
    callers asking about many modules)."""
    shapes = dict(graph.param_shapes)
    for group in graph.tied:
        known = next((shapes[k] for k in group if k in shapes), None)
        if known is not None:
            shapes.update({k: known for k in group if k not in shapes})
    out: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        module, _, leaf = key.rpartition(".")
        out.setdefault(module, {})[leaf] = shape
    return out


def own_param_shapes(graph: ModelGraph, module: str) -> dict[str, tuple[int, ...]]:
    """The shapes of ``module``'s own parameters by leaf name; a tied alias (``lm_head.weight`` of
    a weight tied to the embedding) takes the shape of its group."""
    return dict(param_shapes_by_module(graph).get(module, {}))


def module_shard_problem(graph: ModelGraph, module: str, style: str, tp: int, *,
                         by_module: dict[str, dict[str, tuple[int, ...]]] | None = None) -> str | None:
    """:func:`shard_problem` for a module of a captured model (``by_module``: what
    :func:`param_shapes_by_module` returns for ``graph``, when the caller asks about many modules)."""
    shapes = (by_module if by_module is not None else param_shapes_by_module(graph)).get(module, {})
    return shard_problem(style, module, graph.modules.get(module, "?"), dict(shapes), tp)
