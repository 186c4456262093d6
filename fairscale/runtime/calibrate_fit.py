"""The pure fits of CPU calibration (:mod:`fairscale.runtime.calibrate`): alpha-beta of a collective,
a line's slope, and the per-op and FLOP rates left once the cost model's other terms are taken out.

Usage::

    from fairscale.runtime.calibrate_fit import fit_alpha_beta, fit_slope, per_op_overhead, block_flops_rate
    alpha, beta, err = fit_alpha_beta([(1, 0, 1e-4), (1, 1e6, 1.1e-3)])    # 1e-4 s, 1e9 B/s
"""

from __future__ import annotations

from planner.cluster import COLLECTIVE_LINK_OPS

__all__ = ["fit_alpha_beta", "fit_link", "fit_ranges", "fit_slope", "per_op_overhead", "block_flops_rate", "spread",
           "ring_points", "collective_ranges", "FLAT_BANDWIDTH"]


def fit_alpha_beta(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Fit ``t = a·x_lat + x_bytes / beta`` to ``(x_lat, x_bytes, t)`` points, minimizing the
    relative error ``Σ((pred - t)/t)²`` (so small messages weigh as much as large ones).

    Returns ``(alpha seconds, beta bytes/s, max relative error)``. Negative coefficients are
    clamped (alpha to 0, beta to a huge rate) and the other refitted alone.
    Example: points (1, 0, 1e-4), (1, 1e6, 1.1e-3) give alpha = 1e-4 s, beta = 1e9 B/s.
    """
    rows = [(xl / t, xb / t) for xl, xb, t in points]
    s11 = sum(a * a for a, _ in rows)
    s12 = sum(a * b for a, b in rows)
    s22 = sum(b * b for _, b in rows)
    y1 = sum(a for a, _ in rows)
    y2 = sum(b for _, b in rows)
    det = s11 * s22 - s12 * s12
    alpha, inv_beta = ((y1 * s22 - y2 * s12) / det, (s11 * y2 - s12 * y1) / det) if det > 0 else (-1.0, -1.0)
    if alpha < 0:
        alpha, inv_beta = 0.0, (y2 / s22 if s22 > 0 else 0.0)
    if inv_beta <= 0:
        alpha, inv_beta = (y1 / s11 if s11 > 0 else 0.0), 1e-15
    err = max(abs(alpha * xl + xb * inv_beta - t) / t for xl, xb, t in points)
    return alpha, 1.0 / inv_beta, err


def fit_link(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """``t = a·x_lat + x_bytes / beta`` fitted to ``(x_lat, x_bytes, t)`` points the way plans use
    a link: beta from the two largest messages (the bytes a data-parallel bucket or an FSDP unit
    moves), alpha from the smallest (what a latency-bound call costs). A single relative-error fit
    (:func:`fit_alpha_beta`) is pulled to the small messages, and gloo on CPU ranks moves large
    messages several times slower per byte than mid-sized ones once they leave the cache: the 8-rank
    all-reduce fitted 1.73 GB/s over 4 KiB-4 MiB, while 12.8 MB took 62 ms, 2.4× that fit.
    Falls back to :func:`fit_alpha_beta` when the two largest do not grow in time.
    Returns ``(alpha s, beta bytes/s, max relative error over the points)``.
    Example: (1, 0, 1e-4), (1, 1e6, 1.2e-3), (1, 4e6, 4.2e-3): beta 3e6 / 3e-3 s = 1e9 B/s,
    alpha 1e-4 s, error 1e-4 / 1.2e-3 = 8% at the middle point."""
    pts = sorted(points, key=lambda p: p[1])
    if len(pts) < 3 or pts[-1][2] <= pts[-2][2] or pts[-1][1] <= pts[-2][1]:
        return fit_alpha_beta(points)
    (_, b0, t0), (_, b1, t1) = pts[-2], pts[-1]
    inv_beta = (t1 - t0) / (b1 - b0)
    xl, xb, t = pts[0]
    alpha = max(0.0, (t - xb * inv_beta) / xl) if xl > 0 else 0.0
    err = max(abs(alpha * xl + xb * inv_beta - t) / t for xl, xb, t in points)
    return alpha, 1.0 / inv_beta, err


FLAT_BANDWIDTH = 1e15
"""Bytes/s of a size range whose time does not grow with its bytes (latency only, within noise)."""


def fit_ranges(points: list[tuple[float, float, float, float]]) -> tuple[tuple[float, float, float], ...]:
    """``(up to bytes, bandwidth, latency)`` rows (``planner.cluster.Cluster.collective_ranges``) of
    ``t = a·x_lat + x_bytes / beta`` between each two consecutive ``(x_lat, x_bytes, t, size)``
    points by ``size`` (the message as ``planner.cost_comm`` sizes it); each row reaches the larger
    size. The line through both points where its latency comes out >= 0; a range whose time grows
    faster than its bytes (a cache knee somewhere inside it, which two points do not locate) is
    charged the line through the origin and its smaller point, so messages just above that size,
    the common case, cost about what it measured. A time that does not grow gives a latency-only
    row (:data:`FLAT_BANDWIDTH`).
    Example: (7, 3.5e3, 20e-3, 4e3), (7, 3.5e6, 32e-3, 4e6), (7, 14e6, 100e-3, 16e6) ->
    (4e6, 2.9e8 B/s, 2.9e-3 s), (16e6, 1.5e8 B/s, 1.3e-3 s); with 302e-3 at 16e6 (measured once)
    the second range has no line of latency >= 0 through both points: (16e6, 1.1e8 B/s, 0 s)."""
    pts = sorted(points, key=lambda p: p[3])
    rows = []
    for (xl0, xb0, t0, _), (_, xb1, t1, size1) in zip(pts, pts[1:]):
        slope = (t1 - t0) / (xb1 - xb0) if xb1 > xb0 else 0.0
        bandwidth = min(FLAT_BANDWIDTH, 1.0 / slope) if slope > 0 else FLAT_BANDWIDTH
        alpha = (t0 - xb0 / bandwidth) / xl0 if xl0 > 0 else 0.0
        if alpha < 0:
            alpha, bandwidth = 0.0, min(FLAT_BANDWIDTH, xb0 / t0) if t0 > 0 else FLAT_BANDWIDTH
        rows.append((float(size1), float(bandwidth), float(alpha)))
    return tuple(rows)


def per_op_overhead(seconds: float, *, ops: int, flops: float, flops_per_s: float) -> float:
    """Host seconds per counted op of a forward+backward that took ``seconds``, ran ``ops`` ops
    (the planner's count: one forward, two backward each) and ``flops`` FLOPs at ``flops_per_s``.
    Example: 3.7 ms for 49 ops and 1 MFLOP at 10 GFLOP/s: (3.7 - 0.1) ms / 147 = 24.5 us."""
    return max(0.0, seconds - flops / flops_per_s) / (3 * ops)


def block_flops_rate(seconds: float, *, flops: float, ops: int, op_overhead_s: float, traffic_bytes: float,
                     bandwidth: float) -> float:
    """FLOP/s of a forward+backward that took ``seconds`` for ``flops`` FLOPs, once the host
    overhead of its ``ops`` counted ops (one forward, two backward each, ``op_overhead_s``) and its
    ``traffic_bytes`` at ``bandwidth`` are taken out: the cost model's own decomposition
    (``planner.cost.compute_time`` plus the per-op term) solved for the FLOP rate. At least a
    tenth of ``seconds`` is left for the FLOPs (a block whose other terms over-fill its time
    measures those, not the rate). Example: 80 ms, 3 GFLOP, 100 ops at 20 us, 40 MB at 4 GB/s:
    3e9 / (80 - 6 - 10) ms = 46.9 GFLOP/s."""
    rest = seconds - 3 * ops * op_overhead_s - traffic_bytes / bandwidth
    return flops / max(rest, 0.1 * seconds)


def fit_slope(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line ``t = slope·n + intercept`` through ``(n, t)`` points; the slope is clamped
    at 0. Example: (1, 3e-4), (16, 1.05e-3), (64, 3.45e-3) give slope 5e-5, intercept 2.5e-4."""
    k = len(points)
    mx = sum(n for n, _ in points) / k
    my = sum(t for _, t in points) / k
    sxx = sum((n - mx) ** 2 for n, _ in points)
    slope = sum((n - mx) * (t - my) for n, t in points) / sxx if sxx > 0 else 0.0
    slope = max(0.0, slope)
    return slope, my - slope * mx


def spread(samples: list[float]) -> tuple[float, float, float]:
    """``(median, low quartile, high quartile)`` of repeated timings of one thing, the quartiles by
    linear interpolation between the sorted samples (a single sample is all three). Example:
    [9, 12, 10, 8, 11] give median 10, quartiles 9 and 11."""
    if not samples:
        raise ValueError("spread needs at least one sample")
    ordered = sorted(samples)

    def quantile(q: float) -> float:
        pos = q * (len(ordered) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
    return quantile(0.5), quantile(0.25), quantile(0.75)


def ring_points(op: str, ranks: int, times: dict[int, float]) -> list[tuple[float, float, float, float]]:
    """``(latencies, wire bytes, seconds, bytes)`` per measured size of collective ``op`` over
    ``ranks`` ranks: the ring formula's terms of ``planner.cost_comm`` (``p2p``: one send)."""
    p = ranks
    lat, per = {"all_reduce": (2 * (p - 1), 2 * (p - 1) / p), "all_gather": (p - 1, (p - 1) / p),
                "reduce_scatter": (p - 1, (p - 1) / p), "p2p": (1, 1.0)}[op]
    return [(lat, per * n, t, n) for n, t in sorted(times.items())]


def collective_ranges(collectives: dict[str, dict[int, float]], ranks: int) -> dict[str, tuple[tuple[float, float, float], ...]]:
    """``Cluster.collective_ranges`` from a calibration's ``collectives`` (op -> bytes -> seconds,
    measured over ``ranks`` ranks): each op of ``COLLECTIVE_LINK_OPS`` fitted per size range."""
    return {op: fit_ranges(ring_points(op, ranks, {int(n): t for n, t in collectives[op].items()}))
            for op in COLLECTIVE_LINK_OPS}
