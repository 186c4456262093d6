"""Measure the runtime's own host work on real ``train_step`` calls: the step, microbatch,
data-parallel tensor and tensor-parallel op costs of ``planner.cost_host.runtime_host_s``.

Usage::

    from fairscale.calibrate_host import measure_runtime_host
    cal = fairscale.runtime.calibrate.calibrate_cpu(8, runtime_host=measure_runtime_host)

``measure_runtime_host(ranks)`` prepares the probe in the calling process and returns the
function every rank of the calibration's own launch runs after the rates (collective; it returns
the Cluster fields ``step_host_s``, ``microbatch_host_s``, ``dp_tensor_host_s``, ``tp_op_host_s``
and ``core_idle`` by name, the same on every rank). It builds
modules (``fairscale.build``), so it lives with the face and calibration takes it as an argument
(the runtime never imports the face): ``fairscale.plan``/``search``/``parallelize``, the CLI, the
demo and the end-to-end benchmark hand it to the calibration they start.

A training rank spends host time that the graph's ops do not: ``train_step`` zeroes gradients,
cuts the batch, gathers the loss and wraps the optimizer; the pipeline engine runs a forward and a
backward action per microbatch of each stage chunk (the stage call, the loss, posting sends and
receives); data parallelism hooks every parameter's gradient and copies it into and out of its
bucket; a tensor-parallel op wraps its gloo call in an autograd function. On CPU ranks that share
cores this is a cost of its own (10-30 ms of a rank's CPU per step for the end-to-end benchmark's
plans), so it is measured as what it is, with every rank of the cluster busy, as every other
calibrated rate is (two ranks alone on two cores measured it without the contention a training
step has): all ``ranks`` build a tiny GPT (width 8, 4 blocks, where arithmetic is nil) with
``fairscale.build.build_module`` under four plans of :func:`host_meshes` and time real steps, in
CPU seconds of the process (every thread):

* 2 pipeline stages × ranks/2 replicas, 2 and 4 microbatches: the step and microbatch costs;
* DDP over all ranks, one microbatch: the per-tensor cost of data parallelism;
* tensor parallelism over 2 × ranks/2 replicas (the TP pass's proposed rules), one microbatch: the
  cost per tensor-parallel collective op outside its wait (the plain forward and backward it is
  compared with runs every op once, as a tp rank does).

Every plan cuts the same microbatch (:data:`HOST_MICRO` sequences), so the ranks compile from one
capture, made here before the fork and inherited (``fairscale.capture_cache.rank_capture``).
Each rank's extra is its step's CPU less the CPU inside collective and point-to-point waits
(``fairscale.runtime.cpu_meter.CpuIn``), less the optimizer step's CPU (both costed by their own
terms), less the same model's forward and backward run plainly on the same rows (the graph's ops,
costed by ``op_overhead_s``; one microbatch's, timed once before the plans with every rank busy and
scaled by each plan's microbatches per rank, :func:`_plain_s`), mean over the ranks; ``planner.cost_host.fit_runtime_host`` fits the
four coefficients to the four plans. They are these CPU seconds times ``share``, the ranks per
core (on a machine whose cores the ranks share, a rank's wall seconds when all ranks work).

The same steps give ``core_idle``: when ranks share cores, the seconds the machine's cores sat
idle in the timed steps (each up to a barrier after it; ``fairscale.runtime.cpu_meter.core_times``)
over all ranks' CPU seconds in them, median of the four plans. Ranks that wait on each other leave
cores idle, which a CPU-time rate cannot see (6-9% of the CPU work in three calibrations of 8 ranks
on 2 cores); a step then takes its CPU work over the cores times ``1 + core_idle``. Another process's work fills
idle cores, so load makes it smaller, never larger (the wall clock's ratio to the CPU work, tried
first, gave 28% under a nice-5 neighbour); 0 where the ranks each have a core (their waits are
costed as waits) or the machine does not say (not Linux).
An odd number of ranks has no two-stage or tp-2 plan: the probe is skipped (None; the
calibration then says the runtime host terms were not measured).
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch
import torch.distributed as dist

from fairscale.build import build_module
from fairscale.capture_cache import rank_capture
from fairscale.runtime.calibrate import RankProbe
from fairscale.runtime.cpu_meter import CpuIn, core_times, cpu_s
from fairscale.testing.models import build
from planner.capture import capture
from planner.cost import layer_facts
from planner.cost_host import RuntimeHostRun, fit_runtime_host, tp_op_calls
from passes.tp.patterns import propose_tp_rules
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel
from planner.selectors import format_layers

__all__ = ["measure_runtime_host", "host_meshes", "host_plans", "HOST_MODEL", "HOST_MICRO", "MIN_STEPS"]

HOST_MODEL = {"dim": 8, "layers": 4, "heads": 2, "seq": 4, "vocab": 16}
"""The tiny GPT whose real training steps time the runtime's host work (its arithmetic is nil)."""
HOST_MICRO = 2
"""Sequences per microbatch of every calibration plan (global batch = this × dp × microbatches),
so one capture serves all four."""
MIN_STEPS = 6
"""Timed steps per plan at least (the median is taken). With every rank busy the ranks' medians
agree within 5-10%; two ranks alone with 5 steps had differed by up to 4× between calibrations."""


def host_meshes(ranks: int) -> list[tuple[int, int, int, int]]:
    """(pp, dp, tp, microbatches) of the four calibration plans on ``ranks`` (even) ranks.
    Example: 8 -> (2, 4, 1, 2), (2, 4, 1, 4), (1, 8, 1, 1), (1, 4, 2, 1)."""
    half = ranks // 2
    return [(2, half, 1, 2), (2, half, 1, 4), (1, ranks, 1, 1), (1, half, 2, 1)]


def host_plans(layer_names: list[str], rules: dict[str, str], ranks: int) -> list[Plan]:
    """The :func:`host_meshes` plans for a GPT whose layers are ``layer_names`` (two stages: the
    first half of the blocks and what comes before them, the rest), ``rules`` its tp rules."""
    half = len([n for n in layer_names if n.startswith("layers.")]) // 2
    first = next(i for i, name in enumerate(layer_names) if name.startswith(f"layers.{half}"))
    stages = [Stage(layers=format_layers(layer_names[:first])), Stage(layers=format_layers(layer_names[first:]))]
    return [Plan(mesh=Mesh(pp=pp, dp=dp, tp=tp),
                 schedule=Schedule(kind="1f1b", microbatches=m, global_batch=HOST_MICRO * dp * m),
                 stages=stages if pp > 1 else [], data_parallel=DataParallel(kind="ddp"),
                 tensor_parallel=TensorParallel(rules=rules if tp > 1 else {}))
            for pp, dp, tp, m in host_meshes(ranks)]


def _plain_s(case: Any, steps: int) -> float:
    """CPU seconds of one microbatch's forward and backward of the whole model run plainly (the
    graph's ops alone), median over ``steps`` runs of two, every rank at once: what each plan's
    step is compared with, in proportion to its microbatches per rank."""
    tokens, labels = case.make_batch(0, HOST_MICRO)

    def fwd_bwd() -> None:
        case.loss_fn(case.model(tokens), labels).backward()
    fwd_bwd()
    plain = []
    for _ in range(steps):
        dist.barrier()
        start = cpu_s()
        fwd_bwd()
        fwd_bwd()
        plain.append((cpu_s() - start) / 2)
    case.model.zero_grad(set_to_none=True)
    return statistics.median(plain)


def _extra(case: Any, plan: Plan, steps: int, plain_s: float) -> tuple[float, float, float, float]:
    """(this rank's extra CPU seconds per step, its parameter tensors, the seconds the machine's
    cores sat idle over the timed steps, each up to a barrier after it, and this rank's CPU
    seconds in them) under ``plan`` (module docstring); ``plain_s`` is :func:`_plain_s`."""
    size = plan.schedule.global_batch
    pm = build_module(case.model, plan, example_inputs=case.make_batch(0, size), loss_fn=case.loss_fn,
                      optimizer=functools.partial(torch.optim.Adam, lr=1e-3), device="cpu")
    tensors = sum(1 for s in pm.local_stages for _ in pm.modules[s].parameters())
    for step in range(2):  # warm-up: allocations, the batch check, the optimizer's states
        pm.train_step(case.make_batch(step, size))
    meter = CpuIn(pm)
    spent, idle, cpu = [], 0.0, 0.0
    for step in range(steps):
        batch = case.make_batch(10 + step, size)
        dist.barrier()
        meter.reset()
        start, cores = cpu_s(), core_times()
        pm.train_step(batch)
        spent.append(cpu_s() - start - meter.wait - meter.opt)
        cpu += cpu_s() - start
        dist.barrier()  # the step ends when its slowest rank's does (as the end-to-end benchmark times it)
        after = core_times()
        idle += after[0] - cores[0] if after and cores else 0.0
    meter.close()
    pm.close()  # its groups' threads would otherwise tax the later plans
    del pm
    # this rank's share of the plain forward and backward: its microbatches, the mean over the stages
    return statistics.median(spent) - plain_s * plan.schedule.microbatches / plan.mesh.pp, float(tensors), idle, cpu


def measure_runtime_host(ranks: int) -> RankProbe | None:
    """The probe for a calibration of ``ranks`` CPU ranks (module docstring), prepared here, before
    the calibration forks its ranks; None for an odd number of ranks."""
    if ranks < 2 or ranks % 2:
        return None
    case = build("gpt", **HOST_MODEL)
    micro = case.make_batch(0, HOST_MICRO)
    graph = capture(case.model, micro, loss_fn=case.loss_fn, tracer="fx")  # layer names, tp rules (fx: fast)
    rank_capture(case.model, micro, loss_fn=case.loss_fn)  # what every rank compiles, inherited by the fork
    rules = propose_tp_rules(graph.gm, tp=2).rules
    plans = host_plans([layer.name for layer in graph.layers], rules, ranks)
    split = [f.tp for f in layer_facts(graph, rules) if f.tp.sharded]
    per_micro = sum(sum(tp_op_calls(allreduce_fwd=t.allreduce_fwd, allreduce_bwd=t.allreduce_bwd,
                                    gathers=bool(t.gather_bytes), loss_tokens=bool(t.loss_tokens))) for t in split)

    def probe(rank: int, world: int, *, share: float, repeat: int) -> tuple[float, float, float, float]:
        if world != ranks:
            raise ValueError(f"the runtime-host probe was prepared for {ranks} ranks, the world has {world}")
        torch.manual_seed(0)
        steps = max(repeat, MIN_STEPS)
        plain_s = _plain_s(case, steps)
        measured = torch.tensor([_extra(case, plan, steps, plain_s) for plan in plans], dtype=torch.float64)
        dist.all_reduce(measured)
        measured /= world  # the mean over the ranks: the node's work per rank
        runs = [RuntimeHostRun(microbatches=plan.schedule.microbatches, dp=plan.mesh.dp, tensors=round(float(t)),
                               extra_s=float(e) * share,
                               tp_ops=per_micro * plan.schedule.microbatches if plan.mesh.tp > 1 else 0)
                for plan, (e, t, _, _) in zip(plans, measured)]
        step, micro, tensor, tp_op = fit_runtime_host(runs)
        # the cores' idle seconds over all ranks' CPU seconds in the same steps (mean over the ranks' readings)
        idle = statistics.median(float(i) / (float(c) * world) for _, _, i, c in measured) if share > 1 else 0.0
        return {"step_host_s": step, "microbatch_host_s": micro, "dp_tensor_host_s": tensor, "tp_op_host_s": tp_op,
                "core_idle": idle}
    return probe
