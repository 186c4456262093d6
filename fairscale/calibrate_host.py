"""Measure the runtime's own host work on real ``train_step`` calls: the step, microbatch and
data-parallel tensor costs of ``planner.cost_host.runtime_host_s``.

Usage::

    from fairscale.calibrate_host import measure_runtime_host
    step_s, micro_s, tensor_s, tp_op_s = measure_runtime_host(share=4.0, repeat=3)
    cal = fairscale.runtime.calibrate.calibrate_cpu(8, runtime_host=measure_runtime_host)

It builds modules (``fairscale.build``), so it lives with the face and calibration takes it as
an argument (the runtime never imports the face): ``fairscale.plan``/``search``/``parallelize``,
the CLI, the demo and the end-to-end benchmark hand it to the calibration they start.

A training rank spends host time that the graph's ops do not: ``train_step`` zeroes gradients,
cuts the batch, gathers the loss and wraps the optimizer; the pipeline engine runs a forward and a
backward action per microbatch of each stage chunk (the stage call, the loss, posting sends and
receives); data parallelism hooks every parameter's gradient and copies it into and out of its
bucket. On CPU ranks that share cores this is a cost of its own (about 10-30 ms of a rank's CPU
per step for the end-to-end benchmark's plans), so it is measured here as what it is: two ranks
build a tiny GPT (width 8, 4 blocks, where arithmetic is nil) with ``fairscale.build.build_module``
under four plans and time real steps, in CPU seconds of the process (every thread):

* 2 pipeline stages, 2 and 8 microbatches (no data parallelism): the step and microbatch costs
  (``planner.cost_host.fit_runtime_host``);
* 2 data-parallel replicas (DDP), one microbatch: the per-tensor cost of data parallelism;
* tensor parallelism over 2 (the TP pass's proposed rules), one microbatch: the cost per
  tensor-parallel collective op outside its wait (``Cluster.tp_op_host_s``; the plain
  forward and backward it is compared with runs every op once, as a tp rank does).

Each rank's extra is its step's CPU less the CPU inside collective and point-to-point waits
(``fairscale.runtime.cpu_meter.CpuIn``), less the optimizer step's CPU (both costed by their own terms), less the same
model's forward and backward run plainly on the same rows (the graph's ops, costed by
``op_overhead_s``), mean over the ranks. The coefficients are these CPU seconds times ``share``,
the ranks per core of the cluster being calibrated (on a machine whose cores the ranks share, a
rank's wall seconds when all ranks work). Building the three plans costs most of its ~10 s.
"""

from __future__ import annotations

import functools
import statistics
from typing import Any

import torch
import torch.distributed as dist

from fairscale.build import build_module
from fairscale.runtime.cpu_meter import CpuIn, cpu_s
from fairscale.runtime.launch import launch
from fairscale.testing.models import build
from planner.capture import capture
from planner.cost_host import RuntimeHostRun, fit_runtime_host, tp_op_calls
from passes.tp.patterns import propose_tp_rules
from planner.cost import layer_facts
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel
from planner.selectors import format_layers

__all__ = ["measure_runtime_host", "host_plans", "HOST_MODEL", "HOST_BATCH", "HOST_PLANS"]

HOST_MODEL = {"dim": 8, "layers": 4, "heads": 2, "seq": 4, "vocab": 16}
"""The tiny GPT whose real training steps time the runtime's host work (its arithmetic is nil)."""
HOST_BATCH = 8
"""Global batch of every calibration plan (one capture serves all three)."""
MIN_STEPS = 12
"""Timed steps per plan at least: a step of the tiny GPT is 10-80 ms of CPU, and with 5 steps two
calibrations 10 minutes apart differed by up to 4× per term on a shared 2-core machine; the
builds, not the steps, are most of the time."""
HOST_PLANS = ((2, 1, 1, 2), (2, 1, 1, 8), (1, 2, 1, 1), (1, 1, 2, 1))
"""(pp, dp, tp, microbatches) of the calibration plans: 1F1B over 2 stages at 2 and 8 microbatches,
DDP over 2, tensor parallelism over 2 (the TP pass's own proposed rules)."""


def host_plans(layer_names: list[str], rules: dict[str, str]) -> list[Plan]:
    """The :data:`HOST_PLANS` for a GPT whose layers are ``layer_names`` (two stages: the first
    half of the blocks and what comes before them, the rest), ``rules`` its tensor-parallel rules."""
    half = len([n for n in layer_names if n.startswith("layers.")]) // 2
    first = next(i for i, name in enumerate(layer_names) if name.startswith(f"layers.{half}"))
    stages = [Stage(layers=format_layers(layer_names[:first])), Stage(layers=format_layers(layer_names[first:]))]
    return [Plan(mesh=Mesh(pp=pp, dp=dp, tp=tp), schedule=Schedule(kind="1f1b", microbatches=m, global_batch=HOST_BATCH),
                 stages=stages if pp > 1 else [], data_parallel=DataParallel(kind="ddp"),
                 tensor_parallel=TensorParallel(rules=rules if tp > 1 else {}))
            for pp, dp, tp, m in HOST_PLANS]


def _rank(rank: int, world: int, case: Any, plans: list[Plan], repeat: int) -> list[float]:
    torch.manual_seed(0)
    batch = case.make_batch(0, HOST_BATCH)
    extras = []
    for plan in plans:
        pm = build_module(case.model, plan, example_inputs=batch, loss_fn=case.loss_fn,
                          optimizer=functools.partial(torch.optim.Adam, lr=1e-3), device="cpu")
        for step in range(2):  # warm-up: allocations, the batch check, the optimizer's states
            pm.train_step(case.make_batch(step, HOST_BATCH))
        meter = CpuIn(pm)
        steps = []
        for step in range(max(repeat, MIN_STEPS)):
            b = case.make_batch(10 + step, HOST_BATCH)
            dist.barrier()
            meter.reset()
            start = cpu_s()
            pm.train_step(b)
            steps.append(cpu_s() - start - meter.wait - meter.opt)
        meter.close()
        del pm
        m, pp, dp = plan.schedule.microbatches, plan.mesh.pp, plan.mesh.dp  # tp: the full model's ops on each rank
        tokens, labels = case.make_batch(0, HOST_BATCH // dp // m)

        def fwd_bwd() -> None:
            case.loss_fn(case.model(tokens), labels).backward()
        fwd_bwd()
        plain = []
        for _ in range(max(repeat, MIN_STEPS)):
            dist.barrier()
            start = cpu_s()
            for _ in range(m):
                fwd_bwd()
            plain.append((cpu_s() - start) / pp)  # this rank's share: the mean over the stages
        case.model.zero_grad(set_to_none=True)
        extras.append(statistics.median(steps) - statistics.median(plain))
    t = torch.tensor(extras, dtype=torch.float64)
    dist.all_reduce(t)
    return [float(x) / world for x in t]


def measure_runtime_host(*, share: float, repeat: int = 3) -> tuple[float, float, float, float]:
    """(``step_host_s``, ``microbatch_host_s``, ``dp_tensor_host_s``, ``tp_op_host_s``) of this
    machine for a cluster of ``share`` ranks per core: two forked ranks time real steps of
    :data:`HOST_PLANS` (module docstring)."""
    case = build("gpt", **HOST_MODEL)
    graph = capture(case.model, case.make_batch(0, HOST_BATCH), loss_fn=case.loss_fn)  # its layer names
    rules = propose_tp_rules(graph.gm, tp=2).rules
    plans = host_plans([layer.name for layer in graph.layers], rules)
    extras = launch(_rank, devices=2, args=(case, plans, repeat), backend="gloo")[0]
    tensors = len(list(case.model.parameters()))
    split = [f.tp for f in layer_facts(graph, rules) if f.tp.sharded]
    per_micro = sum(sum(tp_op_calls(allreduce_fwd=t.allreduce_fwd, allreduce_bwd=t.allreduce_bwd,
                                    gathers=bool(t.gather_bytes), loss_tokens=bool(t.loss_tokens))) for t in split)
    runs = [RuntimeHostRun(microbatches=m, dp=dp, tensors=tensors, extra_s=e * share, tp_ops=per_micro * m if tp > 1 else 0)
            for (_, dp, tp, m), e in zip(HOST_PLANS, extras)]
    return fit_runtime_host(runs)
