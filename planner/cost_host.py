"""Host (CPU) cost of a collective call, by group size: what CPU ranks pay per call beyond the bytes.

Usage::

    from planner.cost_host import call_seconds, tp_link
    call_seconds({2: 1e-3, 8: 8e-3}, 4)          # 3.0e-3: linear in the group's other ranks (g - 1)
    bw, hop = tp_link(cluster, tp=2, sequence_parallel=True)

The runtime's own host work per step, per microbatch and per data-parallel tensor
(:func:`runtime_host_s`, fitted by :func:`fit_runtime_host` to real ``train_step`` calls) is
here too: on CPU ranks it is a term of its own next to the graph's ops.

On CPU gloo ranks a collective call costs host work (the call's setup, a TCP round per ring step,
waking the rank's threads) that grows with the group and that ranks sharing cores pay out of the
same cores as compute. Calibration (``fairscale.runtime.calibrate``) measures it per call, in CPU
seconds per rank times the ranks per core, for a small all-reduce and all-gather with every rank
in a group of ``g`` at once (``Cluster.collective_call_s``). Without measurements (GPUs) the
cluster's link latency is used unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from planner.cluster import Cluster

__all__ = ["call_seconds", "tp_link", "recompute_host_s", "per_recomputed_op", "runtime_host_s", "fit_runtime_host",
           "RuntimeHostRun", "tp_op_calls"]


def call_seconds(calls: Mapping[int, float], group: int) -> float:
    """Seconds one call costs a rank in a group of ``group`` ranks, from ``calls`` (measured group
    size -> seconds): linear in ``group - 1`` (the peers a ring call steps through) between the
    measured sizes, proportional to ``group - 1`` beyond the largest, the smallest's below it.

    Example: calls {2: 1 ms, 8: 8 ms}: group 4 -> 1 + (8 - 1)·(3 - 1)/(7 - 1) = 3.33 ms;
    group 16 -> 8 ms · 15/7 = 17.1 ms; group 1 -> 0 (no call).
    """
    if group <= 1 or not calls:
        return 0.0
    sizes = sorted(calls)
    if group <= sizes[0]:
        return calls[sizes[0]]
    if group >= sizes[-1]:
        return calls[sizes[-1]] * (group - 1) / (sizes[-1] - 1)
    lo = max(g for g in sizes if g <= group)
    hi = min(g for g in sizes if g >= group)
    if hi == lo:
        return calls[lo]
    w = (group - lo) / (hi - lo)
    return calls[lo] + w * (calls[hi] - calls[lo])


def tp_link(cluster: Cluster, tp: int, *, sequence_parallel: bool = False) -> tuple[float, float]:
    """(bandwidth bytes/s, latency per ring step s) for a tensor-parallel group of ``tp`` ranks.

    The cost model charges a tensor-parallel reduction as a ring all-reduce, ``2(tp-1)`` steps of
    the latency. With measured per-call costs (``cluster.collective_call_s``) the latency is set
    so that those steps sum to what the reduction's calls cost: one all-reduce call, or under
    sequence parallelism an all-gather and a reduce-scatter (two calls, each costed as an
    all-gather call of the group). Example: tp 2, all-reduce call 1.2 ms, all-gather call 1 ms:
    latency 0.6 ms per step without sequence parallelism, 1 ms with it (2 calls of 1 ms over 2 steps).
    """
    bw, lat = cluster.link(tp)
    calls = cluster.collective_call_s
    kind = "all_gather" if sequence_parallel else "all_reduce"
    if tp <= 1 or not calls.get(kind):
        return bw, lat
    per_reduction = call_seconds(calls[kind], tp) * (2 if sequence_parallel else 1)
    return bw, per_reduction / (2 * (tp - 1))


def recompute_host_s(cluster: Cluster, ops: int) -> float:
    """Host seconds that fully recomputing a layer of ``ops`` graph ops adds per microbatch beyond
    what its forward's cost (``LayerCost.fwd``, which charges ``op_overhead_s`` per op) already
    counts: ``ops · max(0, recompute_op_s - op_overhead_s)``. Example: 20 ops, 80 us measured per
    recomputed op, 30 us per forward op: 20 · 50 us = 1 ms more than a second forward."""
    return ops * max(0.0, cluster.recompute_op_s - cluster.op_overhead_s)


def per_recomputed_op(plain_s: float, checkpointed_s: float, *, ops: int) -> float:
    """Host seconds per op that checkpointing adds, from a forward+backward timed plain
    (``plain_s``) and with ``ops`` of its ops in fully recomputed regions (``checkpointed_s``).
    Example: 4.0 ms plain, 6.0 ms checkpointed, 40 ops recomputed: 50 us per op."""
    return max(0.0, checkpointed_s - plain_s) / ops if ops > 0 else 0.0


def runtime_host_s(cluster: Cluster, *, chunks: int, dp: int, tensors: int) -> tuple[float, float]:
    """(seconds per step, seconds per microbatch) of the runtime's own host work on one rank that
    runs ``chunks`` stage chunks (1, or v under an interleaved schedule) of a plan with ``dp``
    data-parallel replicas, holding ``tensors`` parameter tensors.

    Per step: ``step_host_s`` (``train_step``'s machinery) plus, when ``dp > 1``,
    ``tensors · dp_tensor_host_s`` (gradient hooks and bucket copies); per microbatch:
    ``chunks · microbatch_host_s`` (the engine's forward and backward action of each chunk).
    Example: step 2 ms, microbatch 3 ms, 40 us per tensor; 2 chunks, dp 4, 100 tensors:
    (2 + 4 ms, 6 ms).
    """
    per_step = cluster.step_host_s + (tensors * cluster.dp_tensor_host_s if dp > 1 else 0.0)
    return per_step, chunks * cluster.microbatch_host_s


def tp_op_calls(*, allreduce_fwd: int, allreduce_bwd: int, gathers: bool, loss_tokens: bool) -> tuple[int, int]:
    """(forward, backward) tensor-parallel collective ops of a split layer per microbatch, as
    ``planner.cost.layer_costs`` charges their calls: its all-reduces each way, one all-gather of a
    ``colwise_gather`` output, three all-reduces of a vocabulary-parallel loss.
    Example: a Megatron block (2 forward, 2 backward): (2, 2); a vocabulary-parallel head: (3, 0)."""
    return allreduce_fwd + (1 if gathers else 0) + (3 if loss_tokens else 0), allreduce_bwd


@dataclass(frozen=True)
class RuntimeHostRun:
    """One calibration run of real ``train_step`` calls: the plan's microbatches per step, its
    data-parallel size and parameter tensors per rank, and the extra host seconds per step
    measured (a rank's step less its waits, its optimizer step and the graph's forward+backward
    run plainly on the same rows)."""

    microbatches: int
    dp: int
    tensors: int
    extra_s: float
    tp_ops: int = 0
    """Tensor-parallel collective ops per step (:func:`tp_op_calls` × microbatches); 0 without tp."""


def fit_runtime_host(runs: list[RuntimeHostRun]) -> tuple[float, float, float, float]:
    """(``step_host_s``, ``microbatch_host_s``, ``dp_tensor_host_s``, ``tp_op_host_s``) from runs
    of one stage chunk per rank: the non-negative least-squares fit of

        extra = step + microbatches · microbatch + [dp > 1] · tensors · tensor + tp_ops · tp_op

    over the runs (every subset of the four coefficients is solved and the best fit with none
    negative is kept: exact for four well-spread runs, and a noisy run cannot give a negative
    cost). The runs without tensor parallelism must cover two or more microbatch counts, else the
    step and microbatch costs are one unknown.

    Example: extra 8 ms at m = 2 and 26 ms at m = 8 alone, 15 ms at m = 1 with dp and 100
    tensors, 9 ms at m = 1 with 8 tp ops: 3 ms per microbatch, 2 ms per step,
    (15 - 2 - 3) / 100 = 100 us per tensor, (9 - 2 - 3) / 8 = 500 us per tp op.
    """
    if len({r.microbatches for r in runs if not r.tp_ops}) < 2:
        raise ValueError("fit_runtime_host needs runs without tensor parallelism at two or more microbatch counts, "
                         f"got {runs}")
    rows = [(1.0, float(r.microbatches), float(r.tensors if r.dp > 1 else 0), float(r.tp_ops)) for r in runs]
    ys = [r.extra_s for r in runs]
    best: tuple[float, list[float]] | None = None
    for mask in range(1, 16):
        cols = [j for j in range(4) if mask >> j & 1]
        coef = _least_squares([[row[j] for j in cols] for row in rows], ys)
        if coef is None or min(coef) < 0:
            continue
        full = [0.0] * 4
        for j, c in zip(cols, coef):
            full[j] = c
        residual = sum((y - sum(a * c for a, c in zip(row, full))) ** 2 for row, y in zip(rows, ys))
        if best is None or residual < best[0] - 1e-18:
            best = (residual, full)
    step, micro, tensor, tp_op = best[1] if best is not None else [0.0] * 4
    return step, micro, tensor, tp_op


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Solution of the normal equations of ``rows · x = ys`` (Gauss-Jordan with partial pivoting),
    or None when a column is all zero or the columns are dependent."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(n)]
    scale = max(abs(a[i][i]) for i in range(n))
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]
