"""The matmul rate of a tensor-parallel rank's narrower GEMMs, from the rates calibration measured by shape.

A layer split over tp runs each of its linears with the output (``colwise``) or input (``rowwise``)
features divided by tp, on tp times the rows for the same FLOPs. On CPU ranks a GEMM whose weight
is narrow runs slower per FLOP (measured with 8 ranks on 2 cores: 18-21 GFLOP/s for a 128×16
weight, 28 for 128×128, 42-50 for 128×512), so a tp rank's share of a block costs more than its
FLOPs at the block's rate. The planning rate (``Cluster.peak_flops``) is what the layer's own
shapes run at without tp; under tp a linear's FLOPs are charged ``rate(unsplit) / rate(split)``
times longer, with ``rate`` read from ``Cluster.gemm_flops`` (calibration's linear forward+backward
by weight shape and rows), interpolated on the log of the weight's elements between the measured
shapes and on the log of the rows between the measured row counts, and held at the ends (a narrow
GEMM on few rows is slower still: since calibration version 11 each shape is timed on two row
counts). Without measured rates (GPUs) the factor is 1.

Usage::

    from planner.cost_gemm import graph_gemms, layer_gemms, tp_gemm_factor
    factor = tp_gemm_factor(layer_gemms(graph_gemms(graph)["layers.0"], styles), cluster.gemm_flops, tp=8, samples=2)
"""

from __future__ import annotations

import functools
import math

from planner.graph import META_FLOPS_BWD, META_FLOPS_FWD, META_LAYER, META_MODULE, META_VAL, ModelGraph
from planner.tp_styles import STYLES

__all__ = ["Gemm", "graph_gemms", "layer_gemms", "gemm_rate", "tp_gemm_factor", "SPLIT_NONE", "SPLIT_OUT", "SPLIT_IN"]

SPLIT_NONE, SPLIT_OUT, SPLIT_IN = -1, 0, 1
"""Which features of a linear's weight ``[out, in]`` tp divides: none, the output's, the input's."""

Gemm = tuple[int, int, float, float, int]
"""(in features, out features, forward FLOPs per sample, backward FLOPs per sample, split)."""

_LINEAR_OPS = {"aten.linear.default": 1, "aten.mm.default": 1, "aten.addmm.default": 2, "aten.matmul.default": 1}
"""Matmul op -> position of its weight argument (``linear``: ``[out, in]``; the others: ``[in, out]``)."""


def graph_gemms(graph: ModelGraph) -> dict[str, list[tuple[str, int, int, float, float]]]:
    """Layer name -> (module path, in features, out features, forward FLOPs, backward FLOPs) of
    each 2-D-weight matmul node the capture counted FLOPs for (whole batch). Batched matmuls of
    two activations (attention) are not GEMMs with a weight and are left out."""
    out: dict[str, list[tuple[str, int, int, float, float]]] = {}
    for node in graph.gm.graph.nodes:
        pos = _LINEAR_OPS.get(str(node.target)) if node.op == "call_function" else None
        if pos is None or not node.meta.get(META_FLOPS_FWD) or META_LAYER not in node.meta:
            continue
        weight = node.args[pos] if len(node.args) > pos else None
        val = getattr(weight, "meta", {}).get(META_VAL)
        shape = tuple(getattr(val, "shape", ()))
        if len(shape) != 2:
            continue
        n_in, n_out = (int(shape[1]), int(shape[0])) if str(node.target) == "aten.linear.default" \
            else (int(shape[0]), int(shape[1]))
        out.setdefault(node.meta[META_LAYER], []).append(
            (str(node.meta.get(META_MODULE, "")), n_in, n_out, float(node.meta[META_FLOPS_FWD]),
             float(node.meta.get(META_FLOPS_BWD, 0))))
    return out


def layer_gemms(entries: list[tuple[str, int, int, float, float]], styles: dict[str, str], batch: int = 1
                ) -> tuple[Gemm, ...]:
    """A layer's GEMMs per sample with what the rules' ``styles`` (module -> style) split of each."""
    gemms = []
    for module, n_in, n_out, fwd, bwd in entries:
        style = styles.get(module)
        dim = STYLES[style].weight_dim.get("linear") if style in STYLES else None
        split = SPLIT_OUT if dim == 0 else SPLIT_IN if dim == 1 else SPLIT_NONE
        gemms.append((n_in, n_out, fwd / batch, bwd / batch, split))
    return tuple(gemms)


def _rate_by_size(points: list[tuple[int, float]], elements: float) -> float:
    """Linear in ``log(elements)`` between the two ``(weight elements, FLOP/s)`` points around it
    (points of equal size averaged), the nearest outside them."""
    by_size: dict[int, list[float]] = {}
    for size, rate in points:
        by_size.setdefault(size, []).append(rate)
    pts = sorted((size, sum(r) / len(r)) for size, r in by_size.items())
    if elements <= pts[0][0]:
        return pts[0][1]
    for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
        if elements <= s1:
            w = math.log(elements / s0) / math.log(s1 / s0)
            return r0 + w * (r1 - r0)
    return pts[-1][1]


def gemm_rate(rates: tuple[tuple[int, int, float, int], ...], elements: float, rows: float = 0.0) -> float:
    """FLOP/s of a GEMM on ``rows`` rows whose weight has ``elements`` elements, from measured
    ``(in, out, FLOP/s, rows)``: at each measured row count, linear in ``log(elements)`` between
    the two shapes around it (:func:`_rate_by_size`); between the two row counts around ``rows``,
    linear in ``log(rows)``; the nearest outside them. A narrow weight's rate depends on its rows
    (one CPU thread: 128×64 at 33 GFLOP/s on 256 rows, 49 on 2048). Rows 0 (not recorded, or not
    known) reads every measured shape by size alone. Example: rates 20e9 at 2048 elements and 28e9
    at 16384, one row count: 8192 elements (2/3 of the way in log2) give 20 + 8·2/3 = 25.3 GFLOP/s."""
    levels = sorted({r for _, _, _, r in rates})
    if rows <= 0 or len(levels) == 1 or 0 in levels:
        return _rate_by_size([(i * o, f) for i, o, f, _ in rates], elements)

    def at(level: int) -> float:
        return _rate_by_size([(i * o, f) for i, o, f, r in rates if r == level], elements)
    if rows <= levels[0]:
        return at(levels[0])
    for lo, hi in zip(levels, levels[1:]):
        if rows <= hi:
            w = math.log(rows / lo) / math.log(hi / lo)
            return at(lo) + w * (at(hi) - at(lo))
    return at(levels[-1])


@functools.lru_cache(maxsize=4096)
def tp_gemm_factor(gemms: tuple[Gemm, ...], rates: tuple[tuple[int, int, float, int], ...], tp: int,
                   samples: float = 0.0) -> float:
    """How much longer a layer's GEMM FLOPs take per FLOP on a tp rank than unsplit:
    ``Σ F·/rate(split shape) / Σ F/rate(whole shape)`` over its GEMMs' forward+backward FLOPs F,
    each on the rows ``samples`` samples give it (its per-sample forward FLOPs / (2·in·out) rows
    per sample; 0: rows not known, :func:`gemm_rate` by size alone); 1 when tp is 1, no rates were
    measured, or the layer has no GEMMs. Example: one 128×128 colwise linear at tp 8 (128×16),
    rates 20e9 at 2048 elements and 28e9 at 16384: 28/20 = 1.4."""
    if tp <= 1 or not rates or not gemms:
        return 1.0
    whole = split = 0.0
    for n_in, n_out, fwd, bwd, how in gemms:
        flops = fwd + bwd
        rows = samples * fwd / (2 * n_in * n_out)
        whole += flops / gemm_rate(rates, n_in * n_out, rows)
        shrunk = n_in * n_out / tp if how != SPLIT_NONE else n_in * n_out
        split += flops / gemm_rate(rates, shrunk, rows)
    return split / whole if whole > 0 else 1.0
