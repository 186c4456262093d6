"""Shared harness for the data-parallel tests: model cases in a chosen dtype, and one launch that
runs every data-parallel kind for one (family, world size).

Why float64 for the exactness matrix: with Adam at lr 1e-2, parameters whose true gradient is
(nearly) zero, e.g. attention key biases (softmax is invariant to them) or q/k weights at init,
get an update of ±lr·g/(|g|+eps) from pure rounding noise, so a reassociated fp32 sum (rank slices
summed by the all-reduce instead of inside one matmul) moves them by 1e-5 or more, depending on
the machine. In float64 the same code paths are checked against the same 1e-5 tolerances on
parameters with the noise far below them; float32 runs are checked on what the standard is made
of, the losses of every step and the first step's full gradients
(``fairscale.testing.reference.compare_grads``), which carry the rounding without Adam's
amplification.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

import fairscale
from fairscale.runtime import state
from fairscale.data_parallel import DataParallelRunner
from fairscale.testing.models import Case, build
from fairscale.testing.reference import Trajectory, train_reference
from passes.ops import comm
from planner.capture import capture
from planner.plan import DataParallel

UNITS = {"mlp": "layers.*", "gpt": "layers.*", "llama": "layers.*", "t5": "block.*", "bert": "layer.*",
         "gpt2": "h.*", "cnn": "features.*", "encoder": "layers.*"}

KINDS: dict[str, dict[str, Any]] = {
    "ddp": dict(kind="ddp"),
    "zero1": dict(kind="zero1"),
    "zero2": dict(kind="zero2"),
    "fsdp_reshard": dict(kind="fsdp", reshard_after_forward=True),
    "fsdp_keep": dict(kind="fsdp", reshard_after_forward=False),
}
GLOBAL_BATCH = 8
STEPS = 3


def make_case(family: str, dtype: torch.dtype = torch.float64, *, freeze_key_bias: bool = False) -> Case:
    case = build(family)
    case.model.to(dtype)
    if freeze_key_bias:  # their true gradient is exactly zero (softmax shift invariance)
        for name, p in case.model.named_parameters():
            if name.endswith("k_proj.bias"):
                p.requires_grad_(False)
    make = case.make_batch

    def batch(step: int, n: int) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(dtype) if t.is_floating_point() else t for t in make(step, n))

    return dataclasses.replace(case, make_batch=batch)


def config(family: str, name: str, **extra: Any) -> DataParallel:
    options = {**KINDS[name], **extra}
    units = UNITS[family] if options["kind"] == "fsdp" else ""
    return DataParallel(units=units, bucket_mb=0.05, **options)


def run_kinds(family: str, world: int, *, dtype: torch.dtype = torch.float64, kinds: list[str] | None = None,
              freeze_key_bias: bool = False) -> tuple[Trajectory, dict[str, dict[str, Any]]]:
    """Reference trajectory, and per kind: rank 0's trajectory plus every rank's comm and memory."""
    kinds = kinds or list(KINDS)
    factory = lambda: make_case(family, dtype, freeze_key_bias=freeze_key_bias)  # noqa: E731
    case = factory()
    graph = capture(case.model, case.make_batch(0, GLOBAL_BATCH // world), loss_fn=case.loss_fn, annotate=False)
    ref = train_reference(factory, steps=STEPS, global_batch=GLOBAL_BATCH)

    def rank_fn(rank: int, n: int) -> dict[str, Any]:
        out = {}
        for name in kinds:
            runner = DataParallelRunner.build(graph, config(family, name), torch.optim.Adam, lr=1e-2)
            comm.COUNTER.reset()
            losses, grads = [], {}
            for s in range(STEPS):
                losses.append(runner.train_step(case.make_batch(s, GLOBAL_BATCH)))
                if s == 0:  # the first step's gradients, read before the next zero_grad (uncounted)
                    grads = {k: v.numpy() for k, v in state.full_grads(runner.gm, aliases=graph.tied).items()}
            traffic = {k: dict(v) for k, v in comm.COUNTER.snapshot().items()}
            info = runner.optimizer.info
            out[name] = dict(
                losses=losses, traffic=traffic, memory=runner.memory(),
                units=[dict(name=u.name, padded=u.padded, numel=u.numel, reshard=u.reshard,
                            itemsize=u.full.element_size()) for u in info.units],
                buckets=[dict(padded=b.padded, numel=b.numel, itemsize=b.flat.element_size() if b.flat is not None
                              else b.param_dtype.itemsize) for b in info.buckets],
                params={k: v.numpy() for k, v in runner.full_state_dict().items()}, grads=grads)
        return out

    results = fairscale.launch(rank_fn, devices=world)
    per_kind = {}
    for name in kinds:
        r0 = results[0][name]
        per_kind[name] = dict(trajectory=Trajectory(r0["losses"], {k: torch.from_numpy(np.asarray(v))
                                                                  for k, v in r0["params"].items()},
                                                    grads={k: torch.from_numpy(np.asarray(v))
                                                           for k, v in r0["grads"].items()}),
                              ranks=[r[name] for r in results])
    return ref, per_kind
