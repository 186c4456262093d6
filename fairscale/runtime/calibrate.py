"""Measure what one CPU rank gets when ``ranks`` gloo ranks share this machine, as a planner Cluster.

Usage::

    from fairscale.runtime.calibrate import calibrate_cpu, save_calibration, load_calibration
    cal = calibrate_cpu(8)                   # ~10-30 s: forks 8 ranks with fairscale.launch
    print(cal.table())                       # every measured rate and the fitted alpha-beta
    save_calibration(cal, "benchmarks/end_to_end/cpu_cluster.json")
    cluster = load_calibration("benchmarks/end_to_end/cpu_cluster.json")   # a planner.cluster.Cluster

Everything is measured with all ranks busy at once, since that is what a rank sees in training,
and in CPU time (every thread of the rank's process) times the ranks per core: on a machine whose
cores the ranks share, that is the rank's wall time when the machine is otherwise quiet, and other
users' load does not change it (wall time under load gave coefficients that followed the load):

* **matmul FLOP/s**: every rank multiplies fp32 matrices (1024×256 by 256×1024) with one
  intra-op thread (what ``fairscale.launch`` gives each rank); reported, and used to take the
  FLOPs out of the op-overhead timing. (Until version 7 a 2048×512×512 product too: 1.4 s of an
  8-rank calibration for a number nothing planned with; the linears by weight shape below are the
  GEMM rates the cost model reads.)
* **transformer block FLOP/s** (since version 4): every rank runs a GPT of width 128 (head
  dimension 16, 128 tokens, 2 sequences) forward and backward; its FLOPs over what is left of its
  time once its counted ops' host overhead and its memory traffic are taken out
  (:func:`block_flops_rate`) become ``peak_flops`` (bf16/fp16 at the same rate: CPUs without AMX
  run them no faster). Since version 8 it is the median of 10 samples, one call each, taken
  after each of the other measurements (``_BLOCK_AFTER_BYTES``), and the table prints their
  spread (``Calibration.block_flops_samples``); one timing early in the calibration followed the
  machine's moment (four calibrations: 9.7-11.9 GFLOP/s). A block's arithmetic is not all large GEMMs: CPU attention, GELU's erf
  and GEMMs of a rank's small shapes ran at 0.6-0.7 of the GEMM table's rate, so planning with
  the GEMMs' rate under-predicted compute by about that much.
* **GEMM rate by weight shape and rows** (since version 7; rows since 11): every rank runs a
  linear's forward and backward for the block model's widths whole and split over tp (128×512 ..
  128×16), each on 256 and 2048 rows; the rates, its op's host overhead taken out, become
  ``gemm_flops``, from which the cost model charges a tensor-parallel rank's narrower GEMMs at its
  rows (``planner.cost_gemm``: a 128×16 weight on 2048 rows ran at 0.46× the rate of a 128×512 one on 256).
* **whole ops per byte** (since version 7): every rank runs a layer norm's and an add's forward
  and backward on 128 KiB and 1 MiB; the slope per byte of output becomes ``whole_op_s``, what a
  tensor-parallel rank pays for the ops it runs on whole activations (``planner.cost_whole``).
* **the runtime's host work** (since version 4, with every rank busy since version 5;
  ``fairscale.calibrate_host``, handed in as ``runtime_host``): after the rates, every rank builds
  a tiny GPT under four plans filling the world and times real ``train_step`` calls; what a step
  costs beyond its graph's ops, waits and optimizer becomes ``step_host_s``, ``microbatch_host_s``,
  ``dp_tensor_host_s`` and ``tp_op_host_s`` (``planner.cost_host.runtime_host_s``), and (since
  version 10) how long the machine's cores sit idle in those steps per CPU second of the ranks,
  ``core_idle`` (cores idle while ranks wait on each other: ``planner.search.evaluate.shared_core_idle_s``).
* **host overhead per op**: every rank runs a tiny GPT (width 8) forward and backward, divided by
  3× the ops the planner counts in its capture; it becomes ``op_overhead_s`` (on CPU ranks the
  dispatcher and autograd cost as much as the arithmetic of a small model). A chain of tiny
  elementwise ops, timed before, gave 6× less per op than a transformer's op mix (linear,
  layer norm, attention, their backward), so small models were predicted several times too fast.
* **optimizer per tensor**: every rank times ``torch.optim.Adam`` steps over 1 and 64 tiny
  tensors; the fitted slope is ``optimizer_tensor_s`` (Adam's dozen ops per tensor, each paying dispatch).
* **collective calls by group size**: a 1 KiB all-reduce and all-gather with every rank in a
  group of 2, 4, ... ranks at once; the cost per call is ``collective_call_s`` (gloo's host work
  per call, which sequence parallelism pays twice per reduction: ``planner.cost_host``).
* **full recompute per op**: the tiny GPT again with every block under the runtime's
  non-reentrant checkpointing (``passes.ops.recompute_ops.recompute_call``); the extra time over
  the blocks' ops is ``recompute_op_s`` (the forward run again, and checkpointing's saved-tensor
  hooks in both runs).
* **memory bandwidth**: every rank runs ``add`` over 16 MiB arrays (2 reads + 1 write per element).
  It becomes ``hbm_bandwidth`` and ``host_memory_bandwidth``.
* **collectives**: gloo all-reduce, all-gather and reduce-scatter over all ranks for 4 KiB .. 16 MiB,
  each fitted to its ring formula in ``planner.cost_comm`` (``fit_link``: the bandwidth beta from
  the two largest messages, the latency alpha from the smallest; gloo's cost per byte grows once
  messages leave the cache). **Point-to-point** (since version 6): rank pairs post the pipeline
  engine's own batch (``fairscale.runtime.p2p.exchange``) of a send and the receive paired with it,
  every rank at once, fitted to ``alpha + n/beta`` per send. The Cluster's intra-node link is the
  all-reduce fit (the collective of every tensor-parallel layer and of DDP), ``collective_links``
  the all-gather, reduce-scatter (ZeRO's and FSDP's) and point-to-point fits (a pipeline's sends:
  a blocking send/recv pingpong, timed before, cost half a batch, and the model had charged a send
  the all-reduce's alpha, 2-3× under the batches' CPU); all fits, and a joint one, are reported.
  Since version 9 the all-gather, reduce-scatter and point-to-point are also fitted per size range,
  between each two measured sizes (``collective_ranges``, ``fit_ranges``), which plans use: gloo's
  cost per byte changes several-fold across the sizes, and one line through them all was 2.4× off
  for a mid-sized reduce-scatter, where ZeRO-2's and FSDP's buckets sit.

The measured numbers are achieved rates, so the returned Cluster has ``Efficiency(1, 1, 1)``,
and ``shared_cores`` = this machine's cores: when there are fewer cores than ranks, a rank that
waits frees its share (the cost model then charges a pipeline bubble no CPU time).
The runtime's overlap on CPU gloo (see :func:`planner.cost.CostOptions.for_runtime`): DDP/ZeRO
buckets reduce synchronously inside backward, pipeline sends are posted asynchronously but
receives wait, and FSDP's asynchronous prefetch shares the rank's cores with compute, so nothing
is counted as overlapped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from fairscale.testing.models import build
from passes.ops.recompute_ops import recompute_call
from planner.cluster import COLLECTIVE_LINK_OPS, Cluster, Efficiency, host_memory_bytes
from fairscale.runtime.p2p import Message, exchange
from planner.cost_whole import ELEMENTWISE, NORM
from fairscale.runtime.calibrate_fit import block_flops_rate, collective_ranges, fit_alpha_beta, fit_link, fit_slope, \
    per_op_overhead, ring_points, spread
from fairscale.runtime.calibration_record import CALIBRATION_VERSION, Calibration, machine_description
from planner.cost_host import per_recomputed_op

__all__ = ["CALIBRATION_VERSION", "Calibration", "calibrate_cpu", "save_calibration", "load_calibration", "machine_description",
           "fit_alpha_beta", "fit_slope", "per_op_overhead", "block_flops_rate"]

_MATMUL_SHAPES = ((1024, 256, 1024),)
_COLLECTIVE_BYTES = (4 * 2**10, 64 * 2**10, 512 * 2**10, 4 * 2**20, 16 * 2**20)
_BANDWIDTH_ELEMENTS = 4 * 2**20  # 16 MiB of fp32 per operand
_OP_MODEL = {"dim": 8, "layers": 2, "heads": 2, "seq": 4, "vocab": 16}
"""The tiny GPT whose forward and backward time the host overhead per op."""
_OPT_TENSORS = 64
_SUSTAIN_S = 0.05
"""CPU seconds one timed run of a short call lasts (:func:`_sustained`): long enough for the CPU
clock and the scheduler's slices (0.025 s saved about a second and let the op overhead of two
calibrations 20 minutes apart differ by half)."""
_CALL_ELEMENTS = 256
"""fp32 elements (1 KiB) of the small collective whose CPU per call is measured by group size."""
_BLOCK_MODEL = {"dim": 128, "layers": 2, "heads": 8, "seq": 128, "vocab": 256}
_BLOCK_ROWS = 2
"""The GPT whose forward and backward, ``_BLOCK_ROWS`` sequences per rank, times the FLOP rate of a
transformer block's arithmetic (width 128, head dimension 16, 128 tokens: the scale of a CPU
rank's share of the models trained on CPU ranks; the matmul above is 2-8× larger)."""
_BLOCK_AFTER_BYTES = (_COLLECTIVE_BYTES[2], _COLLECTIVE_BYTES[-1])
"""The collective sizes after which the block model is sampled again: with one sample after each of
the other measurements, 10 single forward+backward calls spread over the whole calibration. This
machine's rate wanders ±15% over seconds (a single process, nothing else running, medians of 10
calls: 16.0-23.0 ms); three back-to-back runs of two calls, timed before, caught one moment, and
four calibrations gave 9.7-11.9 GFLOP/s."""
_GEMM_SHAPES = tuple((_BLOCK_MODEL["dim"], _BLOCK_MODEL["dim"] * k // 8) for k in (32, 8, 4, 2, 1))
"""(in, out) of the linears timed by weight shape (``Cluster.gemm_flops``): the block model's MLP
(128×512) and attention (128×128) linears whole, and split over tp 2 to 8 (128×64 .. 128×16)."""
_GEMM_ROWS = (_BLOCK_ROWS * _BLOCK_MODEL["seq"], 8 * _BLOCK_ROWS * _BLOCK_MODEL["seq"])
"""Rows each shape is timed on (since version 11): the block model's rank (2 sequences of 128) and
8 times that (a tp-8 rank's rows for the same FLOPs). A narrow GEMM's rate depends on its rows
(128×64: 33 GFLOP/s on 256 rows, 49 on 2048, one thread), and version 7-10 timed each split shape
on 256 × tp rows only, so a tp-2 rank on 256 rows was charged 2048 rows' rate."""
_GEMM_RUN_S = 0.003
"""CPU seconds of one timed run of a shape (repeated calls; each shape takes about 4 runs)."""
_WHOLE_ROWS = (256, 2048)
"""Rows of width ``_BLOCK_MODEL["dim"]`` the whole-op costs are timed on: the block model's
activation on one rank without tp (2 sequences of 128, 128 KiB) and a tp-8 rank's (16, 1 MiB)."""


RankProbe = Callable[..., dict[str, float]]
"""``probe(rank, world, share=, repeat=) -> {Cluster field: value}`` (``step_host_s``,
``microbatch_host_s``, ``dp_tensor_host_s``, ``tp_op_host_s``, ``core_idle``), run by every
calibration rank after the rates, all ranks at once (collective)."""
RuntimeHostProbe = Callable[[int], RankProbe | None]
"""``runtime_host(ranks) -> RankProbe or None``, called before the calibration forks its ranks:
``fairscale.calibrate_host.measure_runtime_host`` (it builds modules, so the face hands it in)."""


def _time(fn: Any, *, repeat: int, share: float, inner: int = 1) -> float:
    """Median seconds of one ``fn()``, over ``repeat`` runs of ``inner`` back-to-back calls,
    ranks aligned by a barrier before each run, in this rank's CPU time (every thread of the
    process, user + system) times ``share``, the ranks per core.

    CPU time is what other users' load does not stretch: with ``ranks`` ranks on fewer cores, a
    rank gets ``cores / ranks`` of a core while all compute, so a quiet machine runs the work in
    CPU time × ranks per core of wall time, whatever the load was while it was measured (wall time
    under load gave coefficients that followed the load, e.g. the optimizer's 3× too high)."""
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.process_time()
        for _ in range(inner):
            fn()
        times.append((time.process_time() - start) / inner)
    return statistics.median(times) * share


def _sustained(fn: Any, *, repeat: int, share: float, seconds: float = _SUSTAIN_S) -> float:
    """Like :func:`_time`, with enough back-to-back calls that a run takes about ``seconds`` of
    CPU on the busiest rank (a single short call is below the CPU clock's useful resolution)."""
    one = _time(fn, repeat=1, share=1.0)
    inner = max(1, int(_slowest(seconds / max(one, 1e-9), largest=False)))
    return _time(fn, repeat=repeat, share=share, inner=inner)


def _mean(value: float) -> float:
    """Mean over the ranks: the node's CPU work per rank (what the ranks' shared cores must run)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def _slowest(value: float, *, largest: bool) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if largest else dist.ReduceOp.MIN)
    return float(t.item())


def op_model_counts() -> tuple[int, float, int]:
    """(ops the planner counts, forward+backward FLOPs, ops of its blocks) of the tiny GPT the op
    overhead and the recompute overhead are timed on."""
    facts = _facts(_OP_MODEL)
    blocks = sum(f.ops for f in facts if f.name.startswith("layers."))
    return sum(f.ops for f in facts), sum(f.flops_fwd + f.flops_bwd for f in facts), blocks


def block_model_counts() -> tuple[int, float, float]:
    """(ops the planner counts, forward+backward FLOPs per sequence, memory traffic bytes per
    sequence) of the GPT the block FLOP rate is timed on; the traffic is what
    ``planner.cost.layer_costs`` charges at tp 1 (saved bytes and attention matmul bytes, once
    forward and twice backward)."""
    facts = _facts(_BLOCK_MODEL)
    return (sum(f.ops for f in facts), sum(f.flops_fwd + f.flops_bwd for f in facts),
            sum(3 * (f.saved + f.bmm_bytes) for f in facts))


def _facts(config: dict[str, int]) -> list[Any]:
    from planner.capture import capture
    from planner.cost import layer_facts

    case = build("gpt", **config)
    return layer_facts(capture(case.model, case.make_batch(0, 1), loss_fn=case.loss_fn), {})


def _measure(rank: int, world: int, repeat: int, op_model: tuple[int, float, int], block_model: tuple[int, float, float],
             cores: int, probe: RankProbe | None) -> dict[str, Any]:
    share = max(1.0, world / cores)  # ranks per core: CPU seconds × this = a rank's wall seconds, all busy
    out = _rates(rank, world, repeat, op_model, block_model, share)
    start = time.perf_counter()
    out["runtime_host"] = probe(rank, world, share=share, repeat=repeat + 2) if probe else None
    out["probe_s"] = time.perf_counter() - start
    return out


def _rates(rank: int, world: int, repeat: int, op_model: tuple[int, float, int], block_model: tuple[int, float, float],
           share: float) -> dict[str, Any]:
    torch.manual_seed(rank)
    # a transformer block's arithmetic at a CPU rank's scale, every rank at once, sampled once
    # after each of the other measurements (see _BLOCK_MODEL): its FLOP rate is their median
    big = build("gpt", **_BLOCK_MODEL)
    block_batch = big.make_batch(0, _BLOCK_ROWS)
    block_times: list[float] = []

    def sample_block() -> None:
        block_times.append(_time(lambda: big.loss_fn(big.model(block_batch[0]), block_batch[1]).backward(),
                                 repeat=1, share=share))
    sample_block()  # a warm-up, dropped: a process's first backward of this size starts up its kernels
    block_times.clear()
    out: dict[str, Any] = {"matmul": {}, "coll": {}, "calls": _call_costs(rank, world, repeat, share)}
    sample_block()
    for m, k, n in _MATMUL_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        torch.mm(a, b)
        t = _sustained(lambda: torch.mm(a, b), repeat=repeat, share=share)
        out["matmul"][f"{m}x{k}x{n}"] = 2 * m * k * n / _mean(t)
    sample_block()
    # host overhead per op: a tiny GPT forward and backward (the op mix of the models the cost
    # model counts ops of, where no arithmetic counts); the cost model charges an op once forward
    # and twice backward, so divide by 3 per op the planner counts in it (``op_model``)
    case = build("gpt", **_OP_MODEL)
    tokens, labels = case.make_batch(0, 1)

    def fwd_bwd() -> None:
        case.loss_fn(case.model(tokens), labels).backward()
    fwd_bwd()
    t = _mean(_sustained(fwd_bwd, repeat=repeat, share=share))
    out["op_overhead"] = per_op_overhead(t, ops=op_model[0], flops=op_model[1],
                                         flops_per_s=statistics.median(out["matmul"].values()))
    sample_block()
    # full recompute: the same forward and backward with every block under the runtime's own
    # non-reentrant checkpointing; the extra host time per op of the recomputed blocks
    for block in case.model.layers:
        block.forward = functools.partial(recompute_call, block.forward, "full")
    fwd_bwd()
    ckpt = _mean(_sustained(fwd_bwd, repeat=repeat, share=share))
    out["recompute_op"] = per_recomputed_op(t, ckpt, ops=op_model[2])
    sample_block()
    out["optimizer_tensor"] = _optimizer_tensor_s(repeat, share)
    sample_block()
    x, y, z = (torch.randn(_BANDWIDTH_ELEMENTS) for _ in range(3))
    torch.add(x, y, out=z)
    t = _sustained(lambda: torch.add(x, y, out=z), repeat=repeat, share=share)
    out["bandwidth"] = 12 * _BANDWIDTH_ELEMENTS / _mean(t)
    sample_block()
    start = time.perf_counter()
    out["gemm"] = _gemm_rates(repeat, share, out["op_overhead"])
    sample_block()
    out["whole_op"] = _whole_op_costs(repeat, share)
    out["shapes_s"] = time.perf_counter() - start
    sample_block()
    for nbytes in _COLLECTIVE_BYTES:
        elems = max(world, nbytes // 4 // world * world)
        full = torch.ones(elems)
        shard = torch.ones(elems // world)
        dist.all_reduce(full)  # warm-up: the first call of each collective sets up its buffers
        _all_gather(full, shard)
        _reduce_scatter(shard, full)
        times = {
            "all_reduce": _time(lambda: dist.all_reduce(full), repeat=repeat, share=share),
            "all_gather": _time(lambda: _all_gather(full, shard), repeat=repeat, share=share),
            "reduce_scatter": _time(lambda: _reduce_scatter(shard, full), repeat=repeat, share=share),
        }
        peer = rank ^ 1  # pairs (0,1), (2,3), ...: every rank sends and receives at once
        into = torch.empty_like(full)

        def pipeline_send() -> None:  # as the pipeline engine posts one: the send and its paired receive
            if peer < world:
                exchange([Message(True, peer, full, "calibrate", "send"),
                          Message(False, peer, into, "calibrate", "recv")], group=None, axis="pp").wait()
        times["p2p"] = _time(pipeline_send, repeat=repeat, share=share)
        for name, t in times.items():
            out["coll"].setdefault(name, {})[elems * 4] = _mean(t)
        if nbytes in _BLOCK_AFTER_BYTES:
            sample_block()
    # each sample's mean over the ranks, as a FLOP rate: what is left once its counted ops' host
    # overhead and its memory traffic are taken out
    per_sample = torch.tensor(block_times, dtype=torch.float64)
    dist.all_reduce(per_sample)
    ops, flops, traffic = block_model
    out["block_flops"] = [block_flops_rate(t, flops=flops * _BLOCK_ROWS, ops=ops, op_overhead_s=out["op_overhead"],
                                           traffic_bytes=traffic * _BLOCK_ROWS, bandwidth=out["bandwidth"])
                          for t in (per_sample / world).tolist()]
    return out


def _gemm_rates(repeat: int, share: float, op_overhead_s: float) -> list[tuple[int, int, float, int]]:
    """(in, out, FLOP/s, rows) of an ``nn.functional.linear`` forward and backward (input and weight
    gradients) per shape of :data:`_GEMM_SHAPES` on each of :data:`_GEMM_ROWS`, every rank at once,
    mean over the ranks: 6 FLOPs per row and weight element, over the time left once the cost
    model's host overhead of the linear's op (``op_overhead_s`` forward, twice backward) is taken
    out (:func:`block_flops_rate`). Each run repeats the call for about ``_GEMM_RUN_S`` of CPU
    (about 0.5 s for the 10 runs on 8 ranks sharing 2 cores, once the block model has run: a
    process's first linear backward with a weight gradient of this size spent 0.7 s of CPU starting up)."""
    rates = []
    for (n_in, n_out), rows in ((shape, rows) for rows in _GEMM_ROWS for shape in _GEMM_SHAPES):
        x = torch.randn(rows, n_in, requires_grad=True)
        w = torch.randn(n_out, n_in, requires_grad=True)
        grad = torch.randn(rows, n_out)

        def linear() -> None:
            torch.nn.functional.linear(x, w).backward(grad)
        t = _mean(_sustained(linear, repeat=repeat, share=share, seconds=_GEMM_RUN_S))
        rates.append((n_in, n_out, block_flops_rate(t, flops=6 * rows * n_in * n_out, ops=1, op_overhead_s=op_overhead_s,
                                                    traffic_bytes=0.0, bandwidth=1.0), rows))
    return rates


def _whole_op_costs(repeat: int, share: float) -> dict[str, float]:
    """``norm`` / ``elementwise`` -> seconds per byte of output of a layer norm's / an add's forward
    and backward (``torch.autograd.grad``: input gradients as inside a graph, none accumulated),
    every rank at once, mean over the ranks: the slope between ``_WHOLE_ROWS``' two sizes, so the
    per-op host cost (the cost model's ``op_overhead_s``) drops out and the larger size's cache
    misses stay in."""
    dim = _BLOCK_MODEL["dim"]
    w, b = torch.ones(dim, requires_grad=True), torch.zeros(dim, requires_grad=True)
    ops = {NORM: lambda x, y: torch.nn.functional.layer_norm(x, (dim,), w, b), ELEMENTWISE: torch.add}
    out = {}
    for kind, op in ops.items():
        times = []
        for rows in _WHOLE_ROWS:
            x, y = torch.randn(rows, dim, requires_grad=True), torch.randn(rows, dim, requires_grad=True)
            grad = torch.randn(rows, dim)

            def run() -> None:
                torch.autograd.grad(op(x, y), (x, y) if kind == ELEMENTWISE else (x, w, b), grad)
            times.append(_mean(_sustained(run, repeat=repeat, share=share, seconds=_GEMM_RUN_S)))
        out[kind] = max(0.0, (times[1] - times[0]) / ((_WHOLE_ROWS[1] - _WHOLE_ROWS[0]) * dim * 4))
    return out


def _call_costs(rank: int, world: int, repeat: int, share: float) -> dict[str, dict[int, float]]:
    """CPU seconds × ranks per core of one small (1 KiB) all-reduce and all-gather call, per group
    size: every rank in a group of ``g`` consecutive ranks, all groups calling at once (as the
    tensor-parallel groups of a plan do), mean over the ranks."""
    out: dict[str, dict[int, float]] = {"all_reduce": {}, "all_gather": {}}
    sizes = sorted({g for g in (2, 4, world) if g <= world and world % g == 0})
    for g in sizes:
        # every rank takes part in creating every group (torch.distributed's rule)
        groups = [dist.new_group(list(range(k * g, (k + 1) * g))) if g < world else None for k in range(world // g)]
        mine = groups[rank // g]
        x = torch.ones(_CALL_ELEMENTS)
        full = torch.empty(_CALL_ELEMENTS * g)
        fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        dist.all_reduce(x, group=mine)  # warm-up: the first call sets up the group's buffers
        fn(full, x, group=mine)
        out["all_reduce"][g] = _mean(_sustained(lambda: dist.all_reduce(x, group=mine), repeat=repeat, share=share))
        out["all_gather"][g] = _mean(_sustained(lambda: fn(full, x, group=mine), repeat=repeat, share=share))
        dist.barrier()
        if mine is not None:  # an idle gloo group's threads would tax every later measurement
            dist.destroy_process_group(mine)
    return out


def _optimizer_tensor_s(repeat: int, share: float) -> float:
    """Host seconds per parameter tensor of an Adam step over tiny tensors (no arithmetic counts):
    the slope of :func:`fit_slope` over steps of 1 and ``_OPT_TENSORS`` tensors, slowest rank."""
    points = []
    for n in (1, _OPT_TENSORS):
        params = [torch.zeros(16, requires_grad=True) for _ in range(n)]
        for p in params:
            p.grad = torch.ones(16)
        opt = torch.optim.Adam(params, lr=1e-3)
        opt.step()
        points.append((float(n), _mean(_sustained(opt.step, repeat=repeat, share=share))))
    return fit_slope(points)[0]


def _all_gather(out: torch.Tensor, shard: torch.Tensor) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, shard)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, full)



def calibrate_cpu(ranks: int, *, repeat: int = 3, memory_bytes: int | None = None,
                  runtime_host: RuntimeHostProbe | None = None) -> Calibration:
    """Measure ``ranks`` concurrent gloo ranks on this machine and fit a :class:`Cluster` to them.
    ``runtime_host`` measures the runtime's host terms (``fairscale.calibrate_host``, most of the
    calibration's time); without it they stay 0 and the calibration says they were not measured."""
    if ranks < 2:
        raise ValueError(f"calibrate_cpu needs at least 2 ranks to measure collectives, got {ranks}")
    from fairscale.runtime.launch import launch

    cores = os.cpu_count() or 1
    start = time.perf_counter()
    probe = runtime_host(ranks) if runtime_host is not None else None  # prepared before the fork
    prepared = time.perf_counter() - start
    start = time.perf_counter()
    res = launch(_measure, devices=ranks, args=(repeat, op_model_counts(), block_model_counts(), cores, probe),
                 backend="gloo")[0]
    seconds = {"rates": time.perf_counter() - start - res["probe_s"], "runtime_host": prepared + res["probe_s"]}
    runtime = {k: float(v) for k, v in (res["runtime_host"] or {}).items()}
    coll: dict[str, dict[int, float]] = res["coll"]
    fits: dict[str, dict[str, float]] = {}
    combined: list[tuple[float, float, float]] = []
    for name, sizes in coll.items():
        pts = [pt[:3] for pt in ring_points(name, ranks, sizes)]
        alpha, beta, err = fit_link(pts)
        fits[name] = {"latency_s": alpha, "bandwidth": beta, "max_rel_error": err}
        if name != "p2p":
            combined += pts
    alpha, beta, err = fit_alpha_beta(combined)
    fits["combined"] = {"latency_s": alpha, "bandwidth": beta, "max_rel_error": err}
    # the Cluster's link is the all-reduce fit (tensor parallelism's and DDP's collective); the
    # all-gather and reduce-scatter of ZeRO and FSDP get their own (gloo's differ 2-5× per byte)
    link = fits["all_reduce"]
    links = {op: (fits[op]["bandwidth"], fits[op]["latency_s"]) for op in COLLECTIVE_LINK_OPS}
    ranges = collective_ranges(coll, ranks)
    block_samples = [float(r) for r in res["block_flops"]]
    flops = spread(block_samples)[0]  # the transformer block's rate; the GEMM table is reported beside it
    bw = float(res["bandwidth"])
    host = memory_bytes if memory_bytes is not None else host_memory_bytes() // ranks
    cluster = dataclasses.replace(
        Cluster.cpu(ranks, memory_bytes=host), name="cpu-calibrated",
        device=f"cpu ({ranks} gloo ranks, 1 thread each)",
        peak_flops={"fp32": flops, "tf32": flops, "bf16": flops, "fp16": flops},
        hbm_bandwidth=bw, host_memory_bandwidth=bw, intra_bandwidth=link["bandwidth"], intra_latency=link["latency_s"],
        op_overhead_s=float(res["op_overhead"]), shared_cores=cores, collective_call_s=res["calls"],
        collective_links=links, collective_ranges=ranges,
        recompute_op_s=float(res["recompute_op"]),
        optimizer_tensor_s=float(res["optimizer_tensor"]),
        **runtime, gemm_flops=tuple((int(i), int(o), float(r), int(n)) for i, o, r, n in res["gemm"]),
        whole_op_s={k: float(v) for k, v in res["whole_op"].items()},
        inter_bandwidth=link["bandwidth"], inter_latency=link["latency_s"],
        efficiency=Efficiency(matmul=1.0, memory=1.0, network=1.0))
    return Calibration(cluster=cluster, ranks=ranks, matmul_flops=res["matmul"], memory_bandwidth=bw,
                       op_overhead_s=float(res["op_overhead"]), optimizer_tensor_s=float(res["optimizer_tensor"]),
                       collective_call_s=res["calls"], recompute_op_s=float(res["recompute_op"]),
                       block_flops=flops, block_flops_samples=block_samples, **runtime,
                       runtime_measured=probe is not None, collectives=coll, fits=fits,
                       machine={**machine_description(), "calibration_s": seconds,
                                "shape_rates_s": res["shapes_s"]})  # of "rates": GEMMs by shape, whole ops


def save_calibration(cal: Calibration, path: str | Path) -> None:
    Path(path).write_text(json.dumps(cal.to_dict(), indent=1, sort_keys=True) + "\n")


def load_calibration(path: str | Path) -> Cluster:
    """The Cluster stored by :func:`save_calibration` (or a bare ``Cluster.to_dict`` JSON)."""
    data = json.loads(Path(path).read_text())
    return Calibration.from_dict(data).cluster if "cluster" in data else Cluster.from_dict(data)


if __name__ == "__main__":  # python -m fairscale.runtime.calibrate [ranks] [out.json]
    import sys

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    result = calibrate_cpu(n)
    print(result.table())
    if len(sys.argv) > 2:
        save_calibration(result, sys.argv[2])
