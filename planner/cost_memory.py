"""Memory per rank: model states (parameters, gradients, Adam), activations, FSDP unshard buffers.

Units: bytes. ``params`` is a count of parameter elements held by the rank before data-parallel
sharding (tensor parallelism already applied).

Source for model states: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", §3.1 (mixed-precision Adam holds 2Ψ fp16 parameters + 2Ψ fp16
gradients + KΨ optimizer states with K = 12: fp32 master copy, momentum, variance) and §5.1-5.3
(stage 1 shards the K part over the data-parallel degree, stage 2 also the gradients, stage 3 =
FSDP also the parameters).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from planner.graph import (META_LAYER, META_MODULE, META_PARAM, META_SAVED, META_SAVED_PARAMS, META_VAL, ModelGraph,
                           tied_canonical)
from planner.selectors import parse_selector
from planner.tp_styles import STYLES

__all__ = ["DTYPE_BYTES", "model_state_bytes", "model_state_parts", "activation_bytes", "unshard_buffer_bytes",
           "SELECTIVE_SAVED_OPS", "selective_output_bytes", "kept_bytes", "recompute_kinds", "saved_activation_bytes",
           "tp_split_nodes", "tp_whole_saved_bytes", "tp_whole_selective_bytes", "saved_input_bytes", "STATE_SHARDED", "stepped_elements",
           "OPTIMIZER_MOMENTS", "runtime_mixed_parts", "saved_param_elements"]

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "float32": 4, "bfloat16": 2, "float16": 2}


OPTIMIZER_ACCESSES = {"adam": 18, "sgd": 8}
"""fp32 element reads and writes per parameter element of one optimizer step as torch runs it
(``torch.optim.Adam`` / ``SGD``, per tensor or foreach; no weight decay, no amsgrad): Adam's
``exp_avg.lerp_(grad)`` 3, ``exp_avg_sq.mul_`` 2 and ``.addcmul_(grad, grad)`` 3, the
denominator's ``sqrt`` 2, ``div_`` 2 and ``add_(eps)`` 2, then ``param.addcdiv_(exp_avg, denom)``
4; SGD with momentum: ``buf.mul_`` 2, ``.add_(grad)`` 3, ``param.add_(buf)`` 3. (One read and one
write of the states, 2 × 16 bytes for fp32 Adam, was the model until 2026-11-28: on an H200 the
step took 3× that.)"""


OPTIMIZER_MOMENTS = {"adam": 8, "sgd": 4}
"""fp32 bytes of optimizer state per parameter element it updates: Adam's momentum and variance,
SGD's momentum buffer."""


def optimizer_step_bytes(optimizer: str, param_dtype: str) -> float:
    """Memory traffic of one optimizer step per element it updates: :data:`OPTIMIZER_ACCESSES` of
    fp32 (the states, the gradient and the fp32 master it steps), and with a lower-precision
    ``param_dtype`` the master copied into the parameter (4 bytes read, the parameter written).
    Example: Adam, bf16: 18·4 + 4 + 2 = 78 bytes."""
    if optimizer not in OPTIMIZER_ACCESSES:
        raise ValueError(f"unknown optimizer {optimizer!r}; the cost model knows {sorted(OPTIMIZER_ACCESSES)}")
    p = DTYPE_BYTES[param_dtype]
    return OPTIMIZER_ACCESSES[optimizer] * 4 + (4 + p if p < 4 else 0)


STATE_SHARDED: dict[str, tuple[bool, bool, bool]] = {
    "ddp": (False, False, False), "zero1": (False, False, True), "zero2": (False, True, True), "fsdp": (True, True, True),
}
"""Data-parallel kind -> whether it shards (parameters, gradients, optimizer states) over dp (ZeRO §5)."""


def _sharded(dp_kind: str) -> tuple[bool, bool, bool]:
    if dp_kind not in STATE_SHARDED:
        *others, last = STATE_SHARDED
        raise ValueError(f"unknown data-parallel kind {dp_kind!r}; use {', '.join(others)} or {last}")
    return STATE_SHARDED[dp_kind]


def stepped_elements(params: float, *, dp_kind: str, dp: int) -> float:
    """Parameter elements one rank's optimizer updates: its shard of the optimizer states
    (:data:`STATE_SHARDED`), all of them under ddp."""
    return params / dp if _sharded(dp_kind)[2] else params


def model_state_bytes(params: float, *, dp_kind: str, dp: int, param_dtype: str = "fp32",
                      optimizer: str = "adam") -> float:
    """Bytes of parameters + gradients + optimizer states one rank keeps between steps
    (the sum of :func:`model_state_parts`)."""
    return sum(model_state_parts(params, dp_kind=dp_kind, dp=dp, param_dtype=param_dtype,
                                 optimizer=optimizer).values())


def model_state_parts(params: float, *, dp_kind: str, dp: int, param_dtype: str = "fp32",
                      optimizer: str = "adam", as_run: bool = False) -> dict[str, float]:
    """Bytes of ``parameters``, ``gradients`` and ``optimizer`` states one rank keeps between steps.

    Per parameter element (ZeRO §3.1): parameters ``P`` = bytes of ``param_dtype``, gradients
    ``G`` = the same, optimizer ``K`` = 8 for Adam in fp32 (momentum + variance; the parameter is
    its own master copy) or 12 with a lower-precision ``param_dtype`` (fp32 master + momentum +
    variance); SGD with momentum has K = 4 (+4 master). Sharding over ``dp`` (ZeRO §5,
    :data:`STATE_SHARDED`): ddp ``P+G+K``, zero1 ``P+G+K/dp``, zero2 ``P+(G+K)/dp``, fsdp ``(P+G+K)/dp``.
    Example: 1e9 parameters, bf16, ddp: 1e9·(2+2+12) = 16e9 bytes.

    ``as_run`` (``CostOptions.runtime_mixed_precision``): a 16-bit ``param_dtype``'s states as
    fairscale's runtime holds them (:func:`runtime_mixed_parts`) instead.
    """
    p = DTYPE_BYTES[param_dtype]
    g = p
    if optimizer not in OPTIMIZER_MOMENTS:
        raise ValueError(f"unknown optimizer {optimizer!r}; the cost model knows adam and sgd")
    if as_run and p < 4:
        return runtime_mixed_parts(params, dp_kind=dp_kind, dp=dp, param_dtype=param_dtype, optimizer=optimizer)
    k = OPTIMIZER_MOMENTS[optimizer] + (4 if p < 4 else 0)
    parts = [per / dp if sharded else per for per, sharded in zip((p, g, k), _sharded(dp_kind))]
    return {"parameters": params * parts[0], "gradients": params * parts[1], "optimizer": params * parts[2]}



def runtime_mixed_parts(params: float, *, dp_kind: str, dp: int, param_dtype: str,
                        optimizer: str = "adam") -> dict[str, float]:
    """Bytes of ``parameters``, ``gradients`` and ``optimizer`` states of a 16-bit ``param_dtype``
    plan as fairscale's runtime holds them (measured per category by ``pm.memory_report()``;
    ``tests/runtime/test_bf16_memory.py``). Its gradients are fp32 (an fp32 master's, whatever
    the reduce dtype), its optimizer holds only the moments, and the fp32 master is a parameter:

    * ddp keeps the fp32 parameters themselves and casts them for compute (``passes.ops.dp_ops``),
      so ``P = 4``; the 16-bit copies that its ops save for backward are activations, one set
      shared by the step's microbatches (``planner.search.memory.rank_memory_parts``);
    * zero1 / zero2 keep the 16-bit parameters and an fp32 master shard: ``P = p + 4/dp``;
    * fsdp keeps an fp32 shard (``P = 4/dp``) and gathers 16-bit units (buffers).

    Gradients and moments are sharded as :data:`STATE_SHARDED` says. Against ZeRO §3.1's
    :func:`model_state_parts` the sum is the same for ddp and fsdp, ``2`` bytes more per element
    for zero1 and ``2/dp`` more for zero2 (their gradients are fp32, not 16-bit).
    Example: 1e9 parameters, bf16, zero1, dp 4: P = 1e9·(2+1), G = 4e9, K = 2e9."""
    p = DTYPE_BYTES[param_dtype]
    shard_p, shard_g, shard_k = _sharded(dp_kind)
    if shard_p:
        held = 4 / dp
    elif shard_k:
        held = p + 4 / dp
    else:
        held = 4.0
    k = OPTIMIZER_MOMENTS[optimizer]
    return {"parameters": params * held, "gradients": params * (4 / dp if shard_g else 4.0),
            "optimizer": params * (k / dp if shard_k else k)}


def activation_bytes(saved_per_microbatch: float, in_flight: float) -> float:
    """Activations held at the peak: bytes saved for backward by one microbatch × microbatches in
    flight for the schedule (``planner.schedule_cost.in_flight``)."""
    return saved_per_microbatch * in_flight


def unshard_buffer_bytes(unit_params: list[float], *, param_dtype: str, reshard_after_forward: bool,
                         prefetch: bool, grad_dtype: str | None = None, root: float = 0.0,
                         reduce_in_flight: bool = True) -> float:
    """Peak bytes of gathered (unsharded) FSDP parameters plus their unsharded gradients, as the
    runtime holds them (``passes.ops.dp_ops``; FSDP paper, Zhao et al. 2023, §3.2-3.3).

    ``unit_params``: the units' element counts in forward order; parameters in bytes of
    ``param_dtype``, gradients in ``grad_dtype`` (the reduce dtype; default ``param_dtype``).
    ``root``: the elements of the root unit, which is never resharded after forward (as PyTorch's
    FSDP2: backward needs it first), so it stays gathered until its own backward, the last.

    With ``reshard_after_forward`` a unit's parameters live only while it runs: in forward, unit k
    and (``prefetch``) unit k+1; in backward, unit k and the unit before it, prefetched, beside the
    gradient of the unit after it while its reduce-scatter is in flight (``reduce_in_flight``:
    asynchronous, dp > 1; at most one). When unit k's backward is done its parameters are freed and
    that reduce-scatter finished before its own gradient buffer is made. Without it every unit stays
    gathered from its forward to its backward."""
    if not unit_params and not root:
        return 0.0
    b = DTYPE_BYTES[param_dtype]
    g = DTYPE_BYTES[grad_dtype or param_dtype]
    u = list(unit_params)
    n = len(u)

    def ahead(k: int) -> float:  # a unit's neighbour gathered beside it (prefetched), in forward or backward
        return u[k] if prefetch and 0 <= k < n else 0.0

    def flight(k: int) -> float:  # the gradient of unit k, still in its reduce-scatter
        return u[k] * g if reduce_in_flight and k < n else 0.0

    peak = 0.0
    for k in range(n):
        if reshard_after_forward:
            forward = root + u[k] + ahead(k + 1)
            running, made = root + u[k] + ahead(k - 1), root + ahead(k - 1)
        else:
            forward = running = root + sum(u[:k + 1])
            made = root + sum(u[:k])
        peak = max(peak, forward * b, running * b + flight(k + 1), made * b + u[k] * g)
    # the root's backward runs last, beside the first unit's gradient in flight; then its own gradient
    return max(peak, root * b + (flight(0) if n else 0.0), root * g)


# --- activations kept for backward under recompute ------------------------------------------------

SELECTIVE_SAVED_OPS = frozenset({
    "linear", "matmul", "mm", "addmm", "bmm", "baddbmm", "einsum", "convolution", "conv1d", "conv2d", "conv3d",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention"})
"""Captured aten op names whose outputs selective recompute saves. The runtime's policy
(``passes.insert_recompute``) marks mm/addmm/bmm/baddbmm/convolution and the SDPA kernels
MUST_SAVE; the captured graph holds them before dispatch (``aten.linear``, ``aten.matmul``,
``aten.scaled_dot_product_attention``), which lower to exactly those kernels with outputs of the
same size."""

_SDPA = "scaled_dot_product"


def selective_output_bytes(graph: ModelGraph) -> dict[str, int]:
    """Per layer, bytes of the outputs of :data:`SELECTIVE_SAVED_OPS` nodes that depend on an
    activation, for the captured batch: what selective recompute caches besides the layer's input.

    Attention kernels also return the row-wise log-sum-exp of the scores (fp32, batch × heads ×
    queries), which the cache keeps too (FlashAttention, Dao et al. 2022, Alg. 1 saves it for the
    backward). Example: GPT block with batch 8, 32 tokens, width 64, 4 heads, fp32: six linears
    (5 × 8·32·64 + 8·32·256 elements × 4 B = 589,824 B) + attention output 65,536 B + log-sum-exp
    8·4·32·4 = 4,096 B = 659,456 B.

    A graph without nodes (an analytic one, ``planner.cost_gpt``) gives these facts in
    ``graph.extra["selective_bytes"]`` (layer -> bytes), which take precedence.
    """
    given = graph.extra.get("selective_bytes")
    if given is not None:
        return {layer.name: int(given.get(layer.name, 0)) for layer in graph.layers}
    out: dict[str, int] = {layer.name: 0 for layer in graph.layers}
    for layer, nbytes in _selective_nodes(graph).values():
        out[layer] = out.get(layer, 0) + nbytes
    return out


def _selective_nodes(graph: ModelGraph) -> dict[str, tuple[str, int]]:
    """Node name -> (layer, bytes) of the outputs selective recompute caches (see above)."""
    out: dict[str, tuple[str, int]] = {}
    depends: set[Any] = set()
    for node in graph.gm.graph.nodes:
        if node.op == "placeholder" or any(a in depends for a in node.all_input_nodes):
            depends.add(node)
        if node.op != "call_function" or node not in depends or META_LAYER not in node.meta:
            continue
        name = _op_name(node.target)
        if name not in SELECTIVE_SAVED_OPS:
            continue
        val = node.meta.get(META_VAL)
        vals = val if isinstance(val, (tuple, list)) else (val,)
        nbytes = sum(_tensor_bytes(v) for v in vals)
        if _SDPA in name and not isinstance(val, (tuple, list)) and getattr(val, "dim", lambda: 0)() >= 2:
            nbytes += math.prod(val.shape[:-1]) * 4
        out[node.name] = (node.meta[META_LAYER], nbytes)
    return out


def _op_name(target: Any) -> str:
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _tensor_bytes(v: Any) -> int:
    shape = getattr(v, "shape", None)
    if shape is None or not hasattr(v, "element_size"):
        return 0
    return int(math.prod(shape)) * int(v.element_size())


def kept_bytes(kind: str, *, saved: float, input: float, selective: float) -> float:
    """Bytes one layer keeps for backward after its forward, by recompute kind.

    none: what autograd saves (``Layer.saved_bytes``). full: only the layer's input
    (``Layer.input_bytes``; non-reentrant checkpointing holds the region's inputs). selective:
    the input plus the cached outputs of matmuls and attention (:func:`selective_output_bytes`),
    Korthikanti et al. 2022, §5. Example: input 65,536 B + 659,456 B of matmul outputs = 724,992 B.
    """
    if kind == "none":
        return saved
    if kind == "full":
        return input
    if kind == "selective":
        return input + selective
    raise ValueError(f"recompute kind must be full, selective or none, got {kind!r}")


def recompute_kinds(layer_names: list[str], recompute: Mapping[str, str]) -> dict[str, str]:
    """Layer name -> recompute kind for a plan's ``recompute`` map (selector or layer name -> kind;
    later entries win; unmatched layers are ``none``)."""
    out = {name: "none" for name in layer_names}
    for text, kind in recompute.items():
        if kind not in ("full", "selective", "none"):
            raise ValueError(f'recompute["{text}"]: kind must be full, selective or none, got {kind!r}')
        for name in parse_selector(text).select(layer_names):
            out[name] = kind
    return out


def saved_activation_bytes(graph: ModelGraph, recompute: Mapping[str, str] | None = None, *,
                           microbatch_rows: int | None = None) -> float:
    """Bytes of activations held for backward after one forward of ``microbatch_rows`` samples
    (default: the captured batch), with ``recompute`` (selector -> full/selective/none) applied.

    The sum over layers of :func:`kept_bytes`, scaled linearly from the captured batch; the cost
    model (``planner.cost.layer_costs``) uses the same per-layer rule per microbatch.
    """
    kinds = recompute_kinds([layer.name for layer in graph.layers], recompute or {})
    sel = selective_output_bytes(graph)
    total = sum(kept_bytes(kinds[layer.name], saved=layer.saved_bytes, input=layer.input_bytes,
                           selective=sel.get(layer.name, 0)) for layer in graph.layers)
    rows = graph.batch_size if microbatch_rows is None else microbatch_rows
    return total * rows / max(1, graph.batch_size)


# --- activations under tensor parallelism -----------------------------------------------------------

def tp_whole_saved_bytes(graph: ModelGraph, styles: Mapping[str, str], *,
                         split: set[str] | None = None) -> dict[str, int] | None:
    """Per layer, bytes of its saved tensors (``META_SAVED``, the captured batch) that every
    tensor-parallel rank keeps whole under ``styles`` (module path -> style); the rest are split
    over tp. None when the capture did not record the saved tensors (an analytic graph).

    A value is split from the output of a module whose style leaves it sharded
    (``Style.output == "sharded"``: colwise, vocab_loss) through every op that reads a split value
    (views, elementwise ops, attention over split heads), up to a module whose style reduces or
    gathers its output (partial or replicated: rowwise, colwise_gather, vocab_embedding, expert),
    whose output is whole again. Inputs, parameters and constants are whole. Example, GPT block
    with Megatron's rules: whole are the block's input, the layer norms' outputs (and their
    per-token mean and 1/std) and the residual sum after attention (4 × the input + the norms'
    statistics); split are q, k, v, the attention output and its log-sum-exp, and the MLP's
    hidden activations. An op the tensor-parallel pass cannot run split gathers its inputs there
    (``passes.tp.rules.fallback``); this rule still counts its output split. ``split``: those
    nodes (:func:`tp_split_nodes`), when the caller has them (``planner.cost.layer_facts`` works them
    out once per placement for this, :func:`tp_whole_selective_bytes` and ``planner.cost_whole``).
    """
    nodes = list(graph.gm.graph.nodes)
    if not any(META_SAVED in n.meta for n in nodes):
        return None
    split = tp_split_nodes(nodes, styles) if split is None else split
    out = {layer.name: 0 for layer in graph.layers}
    for node in nodes:
        layer = node.meta.get(META_LAYER)
        if layer in out:
            out[layer] += sum(n for producer, n in node.meta.get(META_SAVED, ()) if producer not in split)
    return out


def tp_whole_selective_bytes(graph: ModelGraph, styles: Mapping[str, str], *,
                             split: set[str] | None = None) -> dict[str, int] | None:
    """Per layer, bytes of the outputs selective recompute caches (:func:`selective_output_bytes`)
    that every tensor-parallel rank holds whole under ``styles``, placed as in
    :func:`tp_whole_saved_bytes`: a row-parallel matmul's output is a partial sum of full size, a
    column-parallel one's and attention over split heads are split. None for a graph without nodes
    (analytic facts). ``split`` as in :func:`tp_whole_saved_bytes`."""
    nodes = list(graph.gm.graph.nodes)
    if graph.extra.get("selective_bytes") is not None or not nodes:
        return None
    split = tp_split_nodes(nodes, styles) if split is None else split
    out = {layer.name: 0 for layer in graph.layers}
    for name, (layer, nbytes) in _selective_nodes(graph).items():
        if name not in split and layer in out:
            out[layer] += nbytes
    return out


def tp_split_nodes(nodes: list[Any], styles: Mapping[str, str]) -> set[str]:
    """Names of the nodes whose outputs tensor parallelism splits (:func:`tp_whole_saved_bytes`)."""
    found: dict[str, str | None] = {}

    def style_of(module: str) -> str | None:
        """The style of the innermost styled module holding ``module`` (its path or a prefix of it)."""
        if module not in found:
            style = styles.get(module)
            if style is None and "." in module:
                style = style_of(module.rpartition(".")[0])
            found[module] = style
        return found[module]

    split: set[str] = set()
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        style = style_of(str(node.meta.get(META_MODULE, "")))
        if style is not None and style != "replicate":
            if STYLES[style].output == "sharded":
                split.add(node.name)
        elif any(a.name in split for a in node.all_input_nodes):
            split.add(node.name)
    return split


def saved_input_bytes(graph: ModelGraph) -> dict[str, int] | None:
    """Per layer, bytes of its saved tensors (``META_SAVED``) that are its own inputs (outputs of
    other layers or of the graph's inputs), for the captured batch; None when the capture did not
    record the saved tensors. Under recompute the layer keeps its input, and its recompute in
    backward saves that same storage again: these bytes are held once, not twice. Example: a
    pre-norm GPT block's first layer norm saves the block's input, so all of it (B·S·D values)."""
    nodes = list(graph.gm.graph.nodes)
    if not any(META_SAVED in n.meta for n in nodes):
        return None
    layer_of = {n.name: n.meta.get(META_LAYER) for n in nodes}
    out = {layer.name: 0 for layer in graph.layers}
    for node in nodes:
        layer = node.meta.get(META_LAYER)
        if layer in out:
            out[layer] += sum(n for producer, n in node.meta.get(META_SAVED, ())
                              if producer and layer_of.get(producer) != layer)
    return out


def saved_param_elements(graph: ModelGraph) -> dict[str, float]:
    """Per layer, elements of the parameters its ops save for backward (``META_SAVED_PARAMS``),
    each parameter once in the graph (a tied weight where it is first saved), 0 for a graph whose
    capture did not record them. What a plan that keeps fp32 parameters and casts them for compute
    holds as 16-bit copies during the step (``runtime_mixed_parts``: ddp). Example, a Llama
    block: its linears' and norms' weights, all of its parameters; an embedding saves the ids,
    not its table."""
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    tied = tied_canonical(graph.tied)
    out = {layer.name: 0.0 for layer in graph.layers}
    seen: set[str] = set()
    for node in graph.gm.graph.nodes:
        layer = node.meta.get(META_LAYER)
        for producer in node.meta.get(META_SAVED_PARAMS, ()):
            key = by_name[producer].meta.get(META_PARAM) if producer in by_name else None
            if key not in graph.param_shapes or tied.get(key, key) in seen or layer not in out:
                continue
            seen.add(tied.get(key, key))
            out[layer] += math.prod(graph.param_shapes[key])
    return out
