"""The facts and costs of one layer that ``planner.cost`` reads and computes: :class:`TPInfo` (what
tensor parallelism does to it), :class:`LayerFacts` (per sample, read once from a capture) and
:class:`LayerCost` (one microbatch on one rank). ``planner.cost`` re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.cost_gemm import Gemm

__all__ = ["TPInfo", "LayerFacts", "LayerCost"]


@dataclass(kw_only=True, frozen=True)
class TPInfo:
    """What tensor parallelism does to one layer under the chosen rules."""

    sharded: bool = False
    """Some module of the layer is split over tp; its FLOPs are divided by tp."""
    param_count: int = 0
    """Parameter elements (owned by the layer) inside split modules; divided by tp."""
    allreduce_fwd: int = 0
    """Forward all-reduces of the layer's activation width (one per rowwise module or vocab embedding)."""
    allreduce_bwd: int = 0
    """Backward all-reduces of the input gradient (one per group of colwise modules sharing an input)."""
    heads: int = 0
    """Attention heads (0 if none); tp must divide heads and kv_heads."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); equal to heads otherwise."""
    gather_bytes: float = 0.0
    """Bytes per sample (captured dtype) of outputs all-gathered forward: ``colwise_gather`` modules,
    e.g. an LM head split on the vocabulary whose full logits the loss then reads."""
    loss_tokens: float = 0.0
    """Tokens per sample reaching a vocabulary-parallel cross-entropy (``vocab_loss``): it all-reduces
    three fp32 numbers per token forward (the logits' max, the target logit, the sum of exponentials;
    Megatron-LM's ``vocab_parallel_cross_entropy``), so the logits are never gathered."""


@dataclass(kw_only=True, frozen=True)
class LayerFacts:
    """One layer's facts per sample (batch element), in the dtype it was captured in."""

    name: str
    """Layer name (module path)."""
    index: int
    """Position in execution order."""
    block: str | None
    """Repeated-block key, or None."""
    flops_fwd: float
    """Forward FLOPs per sample."""
    flops_bwd: float
    """Backward FLOPs per sample."""
    saved: float
    """Bytes saved for backward per sample."""
    input: float
    """Bytes of the layer's input per sample (kept when the layer is fully recomputed)."""
    output: float
    """Bytes of the layer's output per sample (sent when a stage ends after it)."""
    params: int
    """Parameter elements the layer owns."""
    tied: tuple[tuple[int, int], ...] = ()
    """(owner layer index, elements) for tied parameters the layer uses but another layer owns:
    a stage holding this layer without its owner keeps its own copy."""
    tp: TPInfo = field(default_factory=TPInfo)
    """Tensor-parallel facts under the chosen rules."""
    attention: bool = False
    """Holds attention (selects the replicated-activation factor under tp)."""
    saved_whole: float | None = None
    """Bytes per sample of ``saved`` that every tp rank keeps whole under the chosen rules (the rest
    is split over tp; ``planner.cost_memory.tp_whole_saved_bytes``). None: not known from the graph."""
    selective_whole: float | None = None
    """Bytes per sample of ``selective`` that every tp rank holds whole (row-parallel outputs are
    full-size partial sums; ``planner.cost_memory.tp_whole_selective_bytes``). None: not known."""
    saved_input: float | None = None
    """Bytes per sample of ``saved`` that are the layer's own input (``planner.cost_memory.
    saved_input_bytes``). None: not known from the graph (then counted as not saved)."""
    selective: float = 0.0
    """Bytes per sample of the matmul/attention outputs selective recompute caches
    (``planner.cost_memory.selective_output_bytes``)."""
    ops: int = 0
    """Graph ops the layer executes per forward (each pays ``Cluster.op_overhead_s``)."""
    param_tensors: int = 0
    """Parameter tensors the layer owns (an optimizer step pays ``Cluster.optimizer_tensor_s`` per tensor)."""
    expert_params: int = 0
    """Parameter elements of MoE expert weights the layer owns (split over ep under expert parallelism)."""
    expert_rows: float = 0.0
    """Bytes per sample of the rows the layer's experts take in and give back (what expert
    parallelism's dispatch and combine all-to-alls carry, forward)."""
    expert_flops_fwd: float = 0.0
    """Forward FLOPs per sample of the layer's expert matmuls (part of ``flops_fwd``)."""
    expert_flops_bwd: float = 0.0
    """Backward FLOPs per sample of the layer's expert matmuls (part of ``flops_bwd``)."""
    bmm_flops: float = 0.0
    """Forward FLOPs per sample of unfused attention matmuls (scores ``QKᵀ`` and ``PV`` as separate
    kernels, as Megatron-LM 2021 ran them; part of ``flops_fwd``). 0 for fused (flash) attention."""
    bmm_bytes: float = 0.0
    """Bytes per sample (captured dtype) those matmuls read and write in HBM: Q, K, V and the
    output, and the ``heads × s × s`` scores written by the first and read by the second."""
    gemms: tuple[Gemm, ...] = ()
    """The layer's matmuls with a weight, per sample, and what the rules split of each
    (``planner.cost_gemm``): under tp their FLOPs run at the rate of the rank's narrower shapes."""
    whole_ops: tuple[float, float] = (0.0, 0.0)
    """Bytes per sample of the normalization and elementwise outputs the rules leave whole
    (``planner.cost_whole``): every tp rank runs those ops on the full activations."""
    saved_params: float = 0.0
    """Elements of the layer's parameters its ops save for backward, for the whole layer (not per
    sample; ``planner.cost_memory.saved_param_elements``): a plan that keeps fp32 parameters
    and casts them for compute holds 16-bit copies of these through the step."""


@dataclass(kw_only=True, frozen=True)
class LayerCost:
    """One layer on one rank for one microbatch."""

    fwd: float
    """Forward seconds, including exposed tensor-parallel collectives."""
    bwd: float
    """Backward seconds, including exposed tensor-parallel collectives."""
    act: float
    """Activation bytes kept for backward without recompute."""
    act_recompute: float
    """Activation bytes kept when the layer is fully recomputed (its input)."""
    params: float
    """Parameter elements on the rank (after the tp split)."""
    tp_bytes: float
    """Bytes this rank sends in tensor-parallel collectives (forward + backward, no recompute)."""
    tp_bytes_recompute: float
    """Extra bytes sent when the forward is recomputed."""
    output: float
    """Bytes of the output a stage ending here sends (per rank)."""
    tp_s: float = 0.0
    """Exposed tensor-parallel seconds inside ``fwd`` + ``bwd``."""
    act_selective: float = 0.0
    """Activation bytes kept under selective recompute (input + cached matmul/attention outputs)."""
    input_saved: float = 0.0
    """Bytes of ``act_recompute`` (the kept input) that ``act`` holds too: the same storage, which
    the layer's recompute saves again (``planner.search.memory`` counts it once)."""
    rec_selective: float = 0.0
    """Seconds the backward spends recomputing the cheap (memory-bound) ops under selective recompute."""
    experts: float = 0.0
    """MoE expert parameter elements on the rank without expert parallelism (part of ``params``)."""
    expert_rows: float = 0.0
    """Bytes of rows the experts take in and give back for one microbatch (dispatch + combine payload)."""
    experts_held: float = 0.0
    """MoE expert parameter elements on the rank without expert parallelism (after a tensor-parallel
    split of the experts, when the rules split them)."""
    expert_fwd_s: float = 0.0
    """Seconds of the expert matmuls' FLOPs inside ``fwd`` (at the matmul rate, every expert on the rank)."""
    expert_bwd_s: float = 0.0
    """Seconds of the expert matmuls' FLOPs inside ``bwd``."""
    gemm_shape_s: float = 0.0
    """Seconds inside ``fwd`` + ``bwd`` that the rank's narrower tensor-parallel GEMMs add over the
    same FLOPs at the unsplit shapes' rate (``planner.cost_gemm.tp_gemm_factor``; 0 on GPUs)."""
    whole_op_s: float = 0.0
    """Seconds inside ``fwd`` + ``bwd`` of the ops a tp rank runs whole beyond their FLOPs' share
    (``planner.cost_whole.whole_op_seconds``; 0 on GPUs and under sequence parallelism)."""
