"""The captured-model IR that the planner reads and the passes rewrite.

Glossary (used everywhere in fairscale, planner and passes):

* **axis**: a mesh axis, one of ``pp`` (pipeline), ``dp`` (data parallel), ``tp`` (tensor parallel).
* **dim**: a tensor dimension.
* **layer**: a group of graph nodes owned by one module path (``model.layers.3``); the unit the
  planner cuts stages between and the unit FSDP and recompute act on.
* **block**: a set of layers that repeat with the same structure (``model.layers.*``).
* **stage**: a contiguous run of layers placed on one pipeline rank.
* **unit**: an FSDP unit, a set of parameters gathered and freed together.
* **microbatch**: one slice of the batch that flows through the pipeline.

``capture`` (``planner.capture``) produces a :class:`ModelGraph`. Each node of ``ModelGraph.gm``
carries the ``node.meta`` keys below; passes read them and add their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

# node.meta keys written by planner.capture
META_VAL = "val"
"""FakeTensor (or tuple of them) of the node's output. Written by torch.export / capture."""
META_MODULE = "fs_module"
"""str: path of the innermost module that owns the node, relative to the user's model ('' = root)."""
META_LAYER = "fs_layer"
"""str: name of the :class:`Layer` the node belongs to (every non-placeholder, non-output node has one)."""
META_FLOPS_FWD = "fs_flops_fwd"
"""int: forward FLOPs of the node, as torch.utils.flop_counter counts them."""
META_FLOPS_BWD = "fs_flops_bwd"
"""int: backward FLOPs of the node (only the gradients autograd actually computes)."""
META_SAVED_BYTES = "fs_saved_bytes"
"""int: bytes of tensors the node saves for backward that no other node already saved (deduplicated)."""
META_SAVED = "fs_saved"
"""tuple[tuple[str, int], ...]: the tensors behind ``META_SAVED_BYTES``, one (producer, storage bytes)
each: the name of the node whose output holds it (the node's own name for its outputs and the
temporaries its op keeps, such as a layer norm's mean), or '' for a constant. Lets the cost model
place each saved tensor under tensor parallelism (``planner.cost_memory.tp_whole_saved_bytes``)."""
META_SAVED_PARAMS = "fs_saved_params"
"""tuple[str, ...]: the nodes (``get_attr``) of the parameters and buffers the node's op saves for
backward, which ``META_SAVED_BYTES`` leaves out (they are not activations). A plan that casts
parameters for compute saves their 16-bit copies instead (``planner.cost_memory.saved_param_elements``)."""
META_PARAM = "fs_param"
"""str: on get_attr nodes of parameters and buffers, the state_dict key in the user's model."""


def module_class(node: torch.fx.Node) -> str:
    """Class name (``LayerNorm``) of the innermost module whose call made ``node``, from export's
    ``nn_module_stack``; '' for a node outside every module's call, or traced without the stack.
    (Its path is ``META_MODULE``, normalized by the capture.)"""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    cls = next(reversed(stack.values()))[1]
    return (cls.__qualname__ if isinstance(cls, type) else str(cls)).rpartition(".")[2]


_aten = torch.ops.aten
VALUE_KEEPING = {_aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default, _aten.clone.default,
                 _aten.alias.default, _aten.view.default, _aten.reshape.default, _aten.squeeze.default,
                 _aten.contiguous.default, _aten.detach.default}
"""Ops that keep their input's value (casts, copies, views), as between a loss and the graph's output."""


def past_value_keeping(node: torch.fx.Node) -> torch.fx.Node:
    """``node`` past the :data:`VALUE_KEEPING` ops that produced it: the loss a graph returns
    through a cast or a view (read by ``passes.loss_weights`` and ``planner.row_flow``)."""
    while node.op == "call_function" and node.target in VALUE_KEEPING and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def bodies(node: torch.fx.Node, owner: Any = None) -> list[torch.fx.GraphModule]:
    """The graphs a higher-order op ``node`` runs (export's ``wrap_with_set_grad_enabled`` body of
    a ``with torch.no_grad():`` block, say): its arguments that fetch a GraphModule from ``owner``
    (default: the module owning ``node``'s graph). Empty for any other node."""
    owner = owner if owner is not None else node.graph.owning_module
    if node.op != "call_function" or owner is None:
        return []
    found = []
    for arg in node.args:
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            body: Any = owner
            for part in str(arg.target).split("."):
                body = getattr(body, part, None)
            if isinstance(body, torch.fx.GraphModule):
                found.append(body)
    return found


def ancestors(node: torch.fx.Node, *, into_bodies: bool = False) -> list[torch.fx.Node]:
    """``node`` and every node it is computed from, in the order a depth-first walk meets them; with
    ``into_bodies``, the nodes of the higher-order ops' bodies among them too (a mask drawn inside
    ``with torch.no_grad():``)."""
    seen: dict[torch.fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen[n] = None
        stack.extend(n.all_input_nodes)
        if into_bodies:
            stack.extend(inner for body in bodies(n) for inner in body.graph.nodes)
    return list(seen)


def impure(node: torch.fx.Node, owner: Any = None) -> bool:
    """Whether dead-code elimination must keep ``node`` though nothing reads it: ``Node.is_impure``
    (in-place and random ops), or a higher-order op whose body holds such a node. Export puts a
    ``with torch.no_grad():`` block in a ``wrap_with_set_grad_enabled`` body, and one that only
    writes a buffer (an aux-loss-free router's bias, an EMA) returns nothing, which torch.fx takes
    for dead code (the capture, the stage split and the tp representative keep it with this).
    ``owner``: the module holding the bodies, for a graph not yet in a GraphModule (default: its own)."""
    return node.is_impure() or any(impure(n, body) for body in bodies(node, owner) for n in body.graph.nodes)


def tied_canonical(tied: list[list[str]]) -> dict[str, str]:
    """State-dict key of a tied parameter -> the first key of its group (``ModelGraph.tied``), under
    which it is counted once. Example: ``[["wte.weight", "lm_head.weight"]]`` maps both to ``wte.weight``."""
    return {k: group[0] for group in tied for k in group}


GROUPED_MM = "transformers.grouped_mm_fallback.default"
"""Hugging Face's grouped MoE matmul (``x [S, K]`` sorted by expert, ``w [E, K, N]``, ``offsets [E]``),
matched by name since transformers registers it."""

GROUPED_MMS = frozenset({GROUPED_MM, "aten._grouped_mm.default"})
"""Both forms of that matmul, the same positional arguments and meaning: transformers calls torch's
own (``torch.nn.functional.grouped_mm``: ``aten._grouped_mm``) where it can, as it does for a bf16
trace (every plan on GPUs) even on the CPU, and its fallback otherwise (fp32)."""


@dataclass(kw_only=True)
class ExpertFacts:
    """One MoE layer's experts (see :meth:`ModelGraph.experts`)."""

    num_experts: int
    """Experts in the layer (the length of the grouped matmuls' offsets)."""
    keys: list[str] = field(default_factory=list)
    """User keys of the expert weights (``[num_experts, ...]`` each)."""
    dispatch_bytes: int = 0
    """Bytes of the expert-sorted (token, expert) rows entering the experts, on the captured batch."""
    combine_bytes: int = 0
    """Bytes of the rows leaving the experts, on the captured batch."""


@dataclass(kw_only=True)
class Layer:
    """Facts about one layer, aggregated from its nodes. Units: bytes and FLOPs per step of the captured batch."""

    name: str
    """Module path of the layer in the user's model, e.g. ``model.layers.3``."""
    index: int
    """Position in execution order (0 = first layer to run)."""
    block: str | None = None
    """Key of the repeated block this layer belongs to (``model.layers.*``), or None if unique."""
    nodes: list[str] = field(default_factory=list)
    """Names of the graph nodes owned by the layer, in topological order."""
    params: list[str] = field(default_factory=list)
    """State-dict keys of the parameters the layer uses (a tied parameter is listed by every user)."""
    buffers: list[str] = field(default_factory=list)
    """State-dict keys of the buffers the layer reads (rotary ``inv_freq``, BERT ``position_ids``)."""
    param_count: int = 0
    """Number of parameter elements owned by the layer (a tied parameter counts in its first user)."""
    param_bytes: int = 0
    """Bytes of those parameters in their captured dtype."""
    flops_fwd: int = 0
    """Forward FLOPs for the captured batch."""
    flops_bwd: int = 0
    """Backward FLOPs for the captured batch."""
    saved_bytes: int = 0
    """Activation bytes saved for backward by the layer's nodes for the captured batch."""
    output_bytes: int = 0
    """Bytes of the values the layer produces that later layers consume (what a stage cut after it sends)."""
    input_bytes: int = 0
    """Bytes of the activations entering the layer; what a fully recomputed layer keeps for backward."""
    attention: dict[str, int] | None = None
    """For layers that hold attention: ``{"heads": h, "kv_heads": k, "head_dim": d}``, else None."""


@dataclass(kw_only=True)
class ModelGraph:
    """A captured model: the executable graph, its per-layer facts, and what identifies the model."""

    gm: torch.fx.GraphModule
    """Flat graph: placeholders are the flattened example inputs, the single output is the loss
    (or the model output when no loss was captured). Parameters are get_attr nodes."""
    layers: list[Layer]
    """Layers in execution order."""
    model_class: str
    """Class name of the user's model, e.g. ``LlamaForCausalLM``."""
    fingerprint: str
    """Stable hash of the parameter names and shapes; a plan records it to refuse another model."""
    num_parameters: int
    """Number of parameter elements (tied parameters counted once)."""
    param_shapes: dict[str, tuple[int, ...]]
    """State-dict key -> shape, for every parameter."""
    param_dtypes: dict[str, str]
    """State-dict key -> dtype name (``float32``)."""
    modules: dict[str, str]
    """Every module path in the user's model -> its class name (for validating plan globs)."""
    blocks: dict[str, list[str]] = field(default_factory=dict)
    """Repeated block key -> its layer names in order."""
    tied: list[list[str]] = field(default_factory=list)
    """Groups of state-dict keys that share one tensor (e.g. GPT-2's wte and lm_head)."""
    input_names: list[str] = field(default_factory=list)
    """Names of the graph placeholders, in call order."""
    batch_size: int = 1
    """Batch size of the example inputs, dim 0; per-layer facts scale linearly with it."""
    tracer: str = "export"
    """Which tracer produced ``gm``: ``export`` or ``fx``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form facts (capture time, sequence length) for reports."""

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer named {name!r}; layers are {[l.name for l in self.layers]}")

    def experts(self) -> dict[str, ExpertFacts]:
        """MoE expert layers by module path: a group of Hugging Face grouped matmuls (``GROUPED_MMS``)
        sharing one offsets tensor; its weights are the parameters feeding their weight argument."""
        out: dict[str, ExpertFacts] = {}
        for node in self.gm.graph.nodes:
            if node.op != "call_function" or str(node.target) not in GROUPED_MMS:
                continue
            offsets = node.args[2].meta.get(META_VAL) if isinstance(node.args[2], torch.fx.Node) else None
            module = str(node.meta.get(META_MODULE, node.name))
            facts = out.setdefault(module, ExpertFacts(
                num_experts=int(offsets.shape[0]) if isinstance(offsets, torch.Tensor) else 0))
            src = node.args[1]
            while isinstance(src, torch.fx.Node) and src.op != "get_attr" and src.all_input_nodes:
                src = src.all_input_nodes[0]
            key = src.meta.get(META_PARAM) if isinstance(src, torch.fx.Node) else None
            if key and key not in facts.keys:
                facts.keys.append(key)
            rows, result = node.args[0].meta.get(META_VAL), node.meta.get(META_VAL)
            if not facts.dispatch_bytes and isinstance(rows, torch.Tensor):  # the first matmul's rows go out
                facts.dispatch_bytes = rows.numel() * rows.element_size()
            if isinstance(result, torch.Tensor):  # the last matmul's rows come back
                facts.combine_bytes = result.numel() * result.element_size()
        return out

    @property
    def flops_per_step(self) -> int:
        """Forward + backward FLOPs of one step on the captured batch."""
        return sum(l.flops_fwd + l.flops_bwd for l in self.layers)
