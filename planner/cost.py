"""Per-layer compute and memory costs for one choice of tp degree, microbatch size and dtype.

``LayerFacts`` are read once from a :class:`planner.graph.ModelGraph` (per sample, with the
tensor-parallel facts of the chosen rules); :func:`layer_costs` turns them into seconds and bytes
per microbatch on one rank. ``planner.search`` adds stages, schedules and data parallelism.

Units: seconds, bytes, FLOPs, FLOP/s, parameter elements.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

from planner.cluster import Cluster
from planner.cost_options import CostOptions
from planner.cost_comm import all_gather_time, all_gather_volume, all_reduce_time, all_reduce_volume
from planner.cost_memory import (DTYPE_BYTES, kept_bytes, saved_input_bytes, saved_param_elements, selective_output_bytes,
                                  tp_split_nodes, tp_whole_saved_bytes, tp_whole_selective_bytes)
from planner.cost_whole import whole_op_bytes, whole_op_seconds
from planner.cost_host import tp_link, tp_op_calls
from planner.cost_gemm import graph_gemms, layer_gemms, tp_gemm_factor
from planner.cost_types import LayerCost, LayerFacts, TPInfo
from planner.graph import GROUPED_MMS, META_FLOPS_BWD, META_FLOPS_FWD, META_LAYER, ModelGraph
from planner.selectors import parse_selector
from planner.tp_styles import STYLES

__all__ = ["CostOptions", "TPInfo", "LayerFacts", "LayerCost", "compute_time", "layer_facts", "layer_costs",
           "ATTENTION_REPLICATED_INPUTS"]

ATTENTION_REPLICATED_INPUTS = 5.0
"""Activations a tensor-parallel transformer block keeps unsharded, in multiples of its input, for
graphs that do not list their saved tensors (``LayerFacts.saved_whole`` is None: the analytic
Megatron GPT of ``planner.cost_gpt``, whose saved bytes are this paper's count).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", Eq. 2)
count ``s·b·h·(10 + 24/t + 5·a·s/(h·t))`` bytes per layer in fp16 without sequence parallelism:
the 10·sbh part (layer-norm inputs, dropout outputs and masks) is replicated on every tp rank,
which is 5× the 2·sbh bytes of the layer's input. Other tensor-parallel layers keep 1× their input.
"""


def compute_time(flops: float, traffic_bytes: float, *, peak_flops: float, hbm_bandwidth: float,
                 matmul_efficiency: float, memory_efficiency: float) -> float:
    """Roofline time of a layer, seconds: ``flops/(peak·e_mm) + traffic/(bw·e_mem)``.

    The roofline (Williams, Waterman & Patterson 2009) bounds each kernel by
    max(FLOPs/peak, bytes/bandwidth). A layer runs its kernels one after another: the FLOPs that
    capture counts are GEMM/attention FLOPs, compute-bound at these sizes; the elementwise and
    normalization kernels do ~no counted FLOPs and are memory-bound. Taking the max per kernel
    class and adding the classes gives this sum. Example: 1e12 FLOPs at 312e12·0.5 plus 1e9 bytes
    at 2e12·0.5 = 6.41 ms + 1 ms = 7.41 ms.
    """
    return flops / (peak_flops * matmul_efficiency) + traffic_bytes / (hbm_bandwidth * memory_efficiency)


def _module_params(graph: ModelGraph) -> dict[str, int]:
    """Module path -> parameter elements directly owned by it (``path.weight``, ``path.bias``)."""
    out: dict[str, int] = {}
    for key, shape in graph.param_shapes.items():
        mod = key.rpartition(".")[0]
        out[mod] = out.get(mod, 0) + math.prod(shape)
    return out


@dataclass
class _GraphTables:
    """What :func:`layer_facts` reads from a graph that does not depend on the tp rules."""

    owned: dict[str, int]
    inside: dict[str, list[str]]
    """Layer name -> the module paths inside it (the layer's own included)."""
    tied: dict[str, tuple[tuple[int, int], ...]]
    selective: dict[str, int]
    saved_input: dict[str, int] | None
    ops: dict[str, int]
    tensors: dict[str, int]
    experts: dict[str, tuple[int, float, float, float]]
    """Layer name -> (expert parameter elements, rows bytes, forward FLOPs, backward FLOPs)."""
    gemms: dict[str, list[tuple[str, int, int, float, float]]]
    """Layer name -> its matmuls with a weight (``planner.cost_gemm.graph_gemms``)."""
    saved_params: dict[str, float]
    """Layer name -> elements of the parameters its ops save (``saved_param_elements``)."""


_TABLES: dict[int, tuple[weakref.ref[ModelGraph], _GraphTables]] = {}
"""id(graph) -> (the graph, weakly: a cache must not keep a capture and the weights it shares alive)."""


def _tables(graph: ModelGraph) -> _GraphTables:
    """The tp-independent tables of ``graph``, built once per graph (a search asks for several tp)."""
    hit = _TABLES.get(id(graph))
    if hit is not None and hit[0]() is graph:
        return hit[1]
    # a tied weight may be listed under each alias (``lm_head.weight`` for GPT's ``wte.weight``):
    # count it under the one key param_shapes holds
    alias: dict[str, str] = {}
    for group in graph.tied:
        canon = next((k for k in group if k in graph.param_shapes), group[0])
        alias.update({k: canon for k in group})
    first_user: dict[str, int] = {}
    for layer in graph.layers:
        for key in layer.params:
            first_user.setdefault(alias.get(key, key), layer.index)
    names = {layer.name for layer in graph.layers}
    inside: dict[str, list[str]] = {n: [] for n in names}
    for mod in sorted(graph.modules):
        parts = mod.split(".")
        for i in range(len(parts), 0, -1):  # the innermost layer holding the module
            owner = ".".join(parts[:i])
            if owner in names:
                inside[owner].append(mod)
                break
    tied = {}
    for layer in graph.layers:
        keys = dict.fromkeys(alias.get(k, k) for k in layer.params)
        tied[layer.name] = tuple((first_user[k], math.prod(graph.param_shapes[k])) for k in keys
                                 if k in graph.param_shapes and first_user[k] < layer.index)
    layer_of_node: dict[str, str] = {}
    ops: dict[str, int] = {}
    calls = {n.name for n in graph.gm.graph.nodes if n.op == "call_function"}
    for layer in graph.layers:
        ops[layer.name] = sum(1 for n in layer.nodes if n in calls)
        layer_of_node.update({n: layer.name for n in layer.nodes})
    experts: dict[str, tuple[int, float, float, float]] = {}
    moe = graph.experts()
    if moe:
        flops: dict[str, tuple[float, float]] = {}
        for node in graph.gm.graph.nodes:
            if node.op == "call_function" and str(node.target) in GROUPED_MMS and META_LAYER in node.meta:
                fwd, bwd = flops.get(node.meta[META_LAYER], (0.0, 0.0))
                flops[node.meta[META_LAYER]] = (fwd + node.meta.get(META_FLOPS_FWD, 0),
                                                bwd + node.meta.get(META_FLOPS_BWD, 0))
        for layer in graph.layers:
            prefix = layer.name + "."
            mine = [e for m, e in moe.items() if m == layer.name or m.startswith(prefix)]
            if mine or layer.name in flops:
                experts[layer.name] = (sum(math.prod(graph.param_shapes[k]) for e in mine for k in e.keys
                                           if k in graph.param_shapes),
                                       float(sum(e.dispatch_bytes + e.combine_bytes for e in mine)),
                                       *flops.get(layer.name, (0.0, 0.0)))
    tensors = {layer.name: sum(1 for i in first_user.values() if i == layer.index) for layer in graph.layers}
    tables = _GraphTables(owned=_module_params(graph), inside=inside, tied=tied, tensors=tensors,
                          selective=selective_output_bytes(graph), saved_input=saved_input_bytes(graph),
                          ops=ops, experts=experts, gemms=graph_gemms(graph), saved_params=saved_param_elements(graph))
    if len(_TABLES) > 8:
        _TABLES.clear()
    _TABLES[id(graph)] = (weakref.ref(graph), tables)
    weakref.finalize(graph, _TABLES.pop, id(graph), None)
    return tables


def layer_facts(graph: ModelGraph, tp_rules: dict[str, str]) -> list[LayerFacts]:
    """Per-sample facts of every layer, with what ``tp_rules`` (selector -> style) does to each."""
    batch = max(1, graph.batch_size)
    rules = [(parse_selector(sel), style) for sel, style in sorted(tp_rules.items()) if style != "replicate"]
    t = _tables(graph)
    styled = {m: style for mods in t.inside.values() for m in mods for sel, style in rules if sel.matches(m)}
    split = tp_split_nodes(list(graph.gm.graph.nodes), styled) if rules else set()
    whole = tp_whole_saved_bytes(graph, styled, split=split) if rules else None
    whole_sel = tp_whole_selective_bytes(graph, styled, split=split) if rules else None
    ops_whole = whole_op_bytes(graph, split) if rules else {}
    bmm = graph.extra.get("attention_bmm", {})  # layer -> (forward FLOPs, bytes) of unfused attention
    out: list[LayerFacts] = []
    for layer in graph.layers:
        styles = {m: style for m in t.inside[layer.name] for sel, style in rules if sel.matches(m)}
        info = _tp_info(styles, t.owned, layer.attention, layer.param_count,
                        _vocab_traffic(styles, graph, layer.input_bytes / batch))
        e_params, e_rows, e_fwd, e_bwd = t.experts.get(layer.name, (0, 0.0, 0.0, 0.0))
        w_ops = ops_whole.get(layer.name, (0.0, 0.0))
        out.append(LayerFacts(name=layer.name, index=layer.index, block=layer.block,
                              flops_fwd=layer.flops_fwd / batch, flops_bwd=layer.flops_bwd / batch,
                              saved=layer.saved_bytes / batch, input=layer.input_bytes / batch,
                              output=layer.output_bytes / batch, params=layer.param_count, tied=t.tied[layer.name],
                              tp=info, attention=layer.attention is not None,
                              saved_whole=whole[layer.name] / batch if whole is not None else None,
                              selective_whole=whole_sel[layer.name] / batch if whole_sel is not None else None,
                              saved_input=t.saved_input[layer.name] / batch if t.saved_input is not None else None,
                              selective=t.selective.get(layer.name, 0) / batch, ops=t.ops[layer.name],
                              param_tensors=t.tensors[layer.name],
                              expert_params=e_params, expert_rows=e_rows / batch,
                              expert_flops_fwd=e_fwd / batch, expert_flops_bwd=e_bwd / batch,
                              bmm_flops=bmm.get(layer.name, (0, 0))[0] / batch,
                              bmm_bytes=bmm.get(layer.name, (0, 0))[1] / batch,
                              gemms=layer_gemms(t.gemms.get(layer.name, []), styles, batch),
                              whole_ops=(w_ops[0] / batch, w_ops[1] / batch),
                              saved_params=t.saved_params.get(layer.name, 0.0)))
    return out


def _vocab_traffic(styles: dict[str, str], graph: ModelGraph, input_bytes: float) -> tuple[float, float]:
    """(gathered output bytes, loss tokens) per sample for a layer's ``colwise_gather`` and
    ``vocab_loss`` modules, from their weights ``[out, in]``: the layer's input holds
    ``input_bytes / (in · itemsize)`` tokens, and a gathered output ``out`` values per token."""
    gathered = tokens = 0.0
    for mod, style in styles.items():
        if style not in ("colwise_gather", "vocab_loss"):
            continue
        key = f"{mod}.weight"
        shape = graph.param_shapes.get(key)
        if not shape or len(shape) != 2:
            continue
        itemsize = DTYPE_BYTES.get(graph.param_dtypes.get(key, "float32"), 4)
        rows = input_bytes / (shape[1] * itemsize)
        if style == "colwise_gather":
            gathered += rows * shape[0] * itemsize
        else:
            tokens = max(tokens, rows)
    return gathered, tokens


def _tp_info(styles: dict[str, str], owned: dict[str, int], attention: dict[str, int] | None,
             layer_params: int, vocab: tuple[float, float] = (0.0, 0.0)) -> TPInfo:
    if not styles:
        return TPInfo()
    # a partial-sum output costs one forward reduction (expert weights of one MoE block share it),
    # and a replicated input feeding sharded compute one backward all-reduce per parent module
    # (q|k|v share their input): the forward_reduce / backward_reduce columns of planner.tp_styles
    grouped = {m.rpartition(".")[0] for m, s in styles.items() if STYLES[s].reduce_per_parent}
    rowwise = sum(1 for s in styles.values() if STYLES[s].forward_reduce and not STYLES[s].reduce_per_parent) \
        + len(grouped)
    col_parents = {m.rpartition(".")[0] for m, s in styles.items() if STYLES[s].backward_reduce}
    heads = attention.get("heads", 0) if attention else 0
    # a tied weight is owned by its first user, so a split module may own fewer elements than it holds
    split = min(layer_params, sum(owned.get(m, 0) for m in styles))
    return TPInfo(sharded=True, param_count=split,
                  allreduce_fwd=rowwise, allreduce_bwd=len(col_parents), heads=heads,
                  kv_heads=attention.get("kv_heads", heads) if attention else 0,
                  gather_bytes=vocab[0], loss_tokens=vocab[1])


def layer_costs(facts: list[LayerFacts], cluster: Cluster, *, tp: int, micro: int, compute_dtype: str,
                captured_dtype: str = "fp32", sequence_parallel: bool = False,
                options: CostOptions = CostOptions()) -> list[LayerCost]:
    """Seconds and bytes of each layer for one microbatch of ``micro`` samples on one rank.

    Activation bytes scale from the captured dtype to ``compute_dtype``. Under tp a sharded layer
    divides its FLOPs and its sharded parameters by tp, keeps its saved tensors that stay whole
    (``LayerFacts.saved_whole``; without it ``ATTENTION_REPLICATED_INPUTS`` or 1 × its input) unsharded
    unless ``sequence_parallel``, and adds its all-reduces of the
    activation width (ring, within the tp group's node). A head split on the vocabulary adds the
    all-gather of its logits (``colwise_gather``) or, with the fused vocabulary-parallel loss
    (``vocab_loss``), three all-reduces of one fp32 number per token instead.

    Memory-bound traffic: a forward writes each saved tensor once and its elementwise kernels read
    about as much, so forward traffic ≈ the saved bytes; backward reads them and writes the
    gradients, ≈ 2× (an estimate; it is the second term of :func:`compute_time`).

    Selective recompute (Korthikanti et al. 2022, §5) keeps the input plus the matmul/attention
    outputs (:func:`planner.cost_memory.kept_bytes`) and recomputes the rest: the memory-bound
    traffic of the saved bytes that are not matmul/attention outputs, ``max(0, act - sel)/(bw·e_mem)``
    (no counted FLOPs: capture counts only GEMM and attention FLOPs, which are not redone).

    Host overhead: each of the layer's ``ops`` costs ``cluster.op_overhead_s`` forward and twice
    that backward (autograd runs about two kernels per forward op: input and weight gradients).

    Unfused attention (``LayerFacts.bmm_flops``): its two batched matmuls' bytes (Q, K, V, the
    output, the ``heads × s × s`` scores) join the memory-bound traffic, on top of their FLOPs.
    Their intensity is about the head dimension (64-160 FLOP/byte, near the A100's ridge ~150)
    and the scores matmul's main loop is only the head dimension long (2-5 k-steps per tile), so
    its s×s store follows its FLOPs instead of hiding under them (a roofline's max would hide it).

    Narrow GEMMs under tp (CPU ranks, ``Cluster.gemm_flops`` measured): a split layer's matmul
    FLOPs (``LayerFacts.gemms``) take ``planner.cost_gemm.tp_gemm_factor`` times as long as at the
    planning rate, the measured rate of their unsplit shapes over that of the rank's; the extra
    seconds are ``LayerCost.gemm_shape_s``. Its layer norms and elementwise ops that stay whole
    (``LayerFacts.whole_ops``, ``Cluster.whole_op_s`` measured) add ``planner.cost_whole.whole_op_seconds``
    (``LayerCost.whole_op_s``), a third forward and two thirds backward.
    """
    eff = cluster.efficiency
    scale = DTYPE_BYTES[compute_dtype] / DTYPE_BYTES[captured_dtype]
    peak = cluster.compute_flops(compute_dtype)
    bw, lat = tp_link(cluster, tp, sequence_parallel=sequence_parallel)  # per-call host cost on CPU ranks
    bw *= eff.network
    out: list[LayerCost] = []
    for f in facts:
        sharded = f.tp.sharded and tp > 1
        div = tp if sharded else 1
        saved = f.saved * micro * scale
        inp = f.input * micro * scale
        sel = f.selective * micro * scale
        if sharded and not sequence_parallel:
            rep = f.saved_whole * micro * scale if f.saved_whole is not None else \
                min(saved, (ATTENTION_REPLICATED_INPUTS if f.attention else 1.0) * inp)
            act = rep + (saved - rep) / tp
            kept = inp
        else:
            act = saved / div
            kept = inp / div
        in_saved = min(kept, (f.saved_input or 0.0) * micro * scale * kept / inp) if inp else 0.0
        # matmul outputs of a split layer: column shards split, row-parallel partial sums whole;
        # without the graph's facts (or under sequence parallelism) all counted split, an estimate
        if sharded and not sequence_parallel and f.selective_whole is not None:
            sel_whole = f.selective_whole * micro * scale
            sel_out = sel_whole + (sel - sel_whole) / tp
        else:
            sel_out = sel / div
        act_sel = kept_bytes("selective", saved=act, input=kept, selective=sel_out)
        # rowwise / vocab-embedding outputs are all-reduced forward; colwise input grads backward
        out_b = f.output * micro * scale
        t_f, v_f = (all_reduce_time(out_b, tp, bandwidth=bw, latency=lat), all_reduce_volume(out_b, tp)) \
            if sharded else (0.0, 0.0)
        t_b, v_b = (all_reduce_time(inp, tp, bandwidth=bw, latency=lat), all_reduce_volume(inp, tp)) \
            if sharded else (0.0, 0.0)
        # vocabulary-parallel heads: a gathered output forward, or the fused loss's per-token all-reduces
        t_x = v_x = 0.0
        if sharded and f.tp.gather_bytes:
            g_b = f.tp.gather_bytes * micro * scale
            t_x += all_gather_time(g_b, tp, bandwidth=bw, latency=lat)
            v_x += all_gather_volume(g_b, tp)
        if sharded and f.tp.loss_tokens:
            l_b = f.tp.loss_tokens * micro * 4  # fp32 per token
            t_x += 3 * all_reduce_time(l_b, tp, bandwidth=bw, latency=lat)
            v_x += 3 * all_reduce_volume(l_b, tp)
        exposed = 0.0 if options.overlap_tp else 1.0
        # unfused attention matmuls move their s×s scores through HBM after their FLOPs (backward:
        # both matmuls' input gradients, twice the FLOPs and the bytes)
        traffic = act + f.bmm_bytes * micro * scale / div
        # a split layer's GEMMs are narrower on the rank: their FLOPs at the measured rate of those shapes
        g_fwd = g_bwd = 0.0
        if sharded and cluster.gemm_flops and f.gemms:
            slow = tp_gemm_factor(f.gemms, cluster.gemm_flops, tp, float(micro)) - 1.0
            g_fwd = slow * sum(g[2] for g in f.gemms) * micro / div
            g_bwd = slow * sum(g[3] for g in f.gemms) * micro / div
        fwd = compute_time(f.flops_fwd * micro / div + g_fwd, traffic, peak_flops=peak, hbm_bandwidth=cluster.hbm_bandwidth,
                           matmul_efficiency=eff.matmul, memory_efficiency=eff.memory)
        bwd = compute_time(f.flops_bwd * micro / div + g_bwd, 2 * traffic, peak_flops=peak, hbm_bandwidth=cluster.hbm_bandwidth,
                           matmul_efficiency=eff.matmul, memory_efficiency=eff.memory)
        n_fwd = f.tp.allreduce_fwd if sharded else 0
        n_bwd = f.tp.allreduce_bwd if sharded else 0
        params = (f.params - f.tp.param_count) + f.tp.param_count / div if sharded else float(f.params)
        output = f.output * micro * scale / (tp if sharded and sequence_parallel else 1)
        # host overhead per op: not hidden on CPU ranks (0 on GPUs); backward runs ~2 ops per forward op
        fwd += f.ops * cluster.op_overhead_s
        bwd += 2 * f.ops * cluster.op_overhead_s
        # norms and elementwise ops a tp rank runs whole: what flops / tp took off them (CPU ranks)
        w_s = whole_op_seconds(f.whole_ops, cluster.whole_op_s, tp) * micro * scale \
            if sharded and not sequence_parallel and cluster.whole_op_s else 0.0
        fwd += w_s / 3  # the cost model's forward : backward split of memory-bound work, 1 : 2
        bwd += 2 * w_s / 3
        if sharded:  # the runtime's tensor-parallel ops around their calls (CPU ranks; 0 on GPUs)
            ops_f, ops_b = tp_op_calls(allreduce_fwd=n_fwd, allreduce_bwd=n_bwd, gathers=bool(f.tp.gather_bytes),
                                       loss_tokens=bool(f.tp.loss_tokens))
            fwd += ops_f * cluster.tp_op_host_s
            bwd += ops_b * cluster.tp_op_host_s
        rec_sel = compute_time(0.0, max(0.0, act - sel_out), peak_flops=peak, hbm_bandwidth=cluster.hbm_bandwidth,
                               matmul_efficiency=eff.matmul, memory_efficiency=eff.memory)
        rec_sel += f.ops * cluster.op_overhead_s
        out.append(LayerCost(fwd=fwd + exposed * (n_fwd * t_f + t_x), bwd=bwd + exposed * n_bwd * t_b, act=act,
                             act_recompute=kept, params=params, tp_bytes=n_fwd * v_f + n_bwd * v_b + v_x,
                             tp_bytes_recompute=n_fwd * v_f + v_x, output=output,
                             tp_s=exposed * (n_fwd * t_f + n_bwd * t_b + t_x), act_selective=act_sel,
                             input_saved=in_saved,
                             rec_selective=rec_sel + exposed * (n_fwd * t_f + t_x),
                             experts=float(f.expert_params),  # never tp-split when ep > 1 (validate)
                             expert_rows=f.expert_rows * micro * scale,
                             experts_held=f.expert_params / (div if f.tp.param_count >= f.expert_params else 1),
                             expert_fwd_s=f.expert_flops_fwd * micro / div / (peak * eff.matmul),
                             expert_bwd_s=f.expert_flops_bwd * micro / div / (peak * eff.matmul),
                             gemm_shape_s=(g_fwd + g_bwd) / (peak * eff.matmul), whole_op_s=w_s))
    return out
