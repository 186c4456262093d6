"""FSDP gradient reduce-scatters are asynchronous: a unit's backward launches its reduce-scatter and
returns; the result reaches ``flat.grad`` when the next unit's reduce-scatter is launched (at most one
unit's full-size gradient is in flight) or at the end of backward.

One launch of 2 gloo ranks; rank 1 arrives 0.5 s late at its first reduce-scatter, so rank 0's
first launch returning before rank 1 even joined proves the op did not wait for its collective.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import fairscale
from fairscale.runtime.data_parallel import local_slice
from fairscale.testing.models import build
from passes.dp.shard_data_parallel import META_DP, shard_data_parallel_pass
from passes.ops import comm, dp_ops
from planner.capture import LossModule, capture
from planner.plan import DataParallel

WORLD, GLOBAL_BATCH, DELAY_S = 2, 8, 0.5


def _case():
    case = build("gpt", layers=2)
    case.model.double()
    return case


def _rank(rank: int, world: int, graph: Any, ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    comm.set_group("dp", dist.group.WORLD)
    log: list[tuple] = []
    orig = comm.reduce_scatter_flat

    def watched(*a: Any, async_op: bool = False, **k: Any) -> Any:
        if rank == 1 and not log:
            time.sleep(DELAY_S)
        joined = time.monotonic()
        work = orig(*a, async_op=async_op, **k)
        log.append(("launch", async_op, dp_ops.pending_reductions(), joined, time.monotonic()))
        return work

    comm.reduce_scatter_flat = watched
    gm = shard_data_parallel_pass(graph.gm, DataParallel(kind="fsdp", units="layers.*"), dp_index=rank, dp_size=world)
    units = gm.meta[META_DP].units
    batch = local_slice(_case().make_batch(0, GLOBAL_BATCH), rank, world)
    dist.barrier()
    gm(*batch).backward()
    err = 0.0
    for u in units:
        full = torch.zeros(u.padded, dtype=torch.float64)
        full[:u.numel] = torch.cat([ref[k].reshape(-1) for k in u.keys])
        per = u.padded // world
        err = max(err, float((u.flat.grad - full[rank * per:(rank + 1) * per]).abs().max()))
    first = list(log)
    pending = dp_ops.pending_reductions()
    for u in units:
        u.flat.grad = None
    log.clear()
    grads = torch.autograd.grad(gm(*batch), [u.flat for u in units])  # no accumulation: synchronous
    sync_log = list(log)
    return dict(units=len(units), log=first, pending=pending, err=err, sync_log=sync_log,
                untouched=all(u.flat.grad is None for u in units), grads=len(grads))


def test_fsdp_reduce_scatters_return_before_their_collectives_complete():
    case = _case()
    graph = capture(case.model, case.make_batch(0, GLOBAL_BATCH // WORLD), loss_fn=case.loss_fn, annotate=False)
    LossModule(case.model, case.loss_fn)(*case.make_batch(0, GLOBAL_BATCH)).backward()
    ref = {k: p.grad.detach().clone() for k, p in case.model.named_parameters(remove_duplicate=False)}
    records = fairscale.launch(_rank, devices=WORLD, args=(graph, ref))
    for r in records:
        assert r["units"] == 3 and len(r["log"]) == 3
        assert all(async_op for _, async_op, _, _, _ in r["log"])
        assert all(in_flight == 0 for _, _, in_flight, _, _ in r["log"])  # the previous one finished first
        assert r["pending"] == 0 and r["err"] < 1e-10  # every shard's gradient arrived, exact
        assert r["sync_log"] and not any(async_op for _, async_op, _, _, _ in r["sync_log"])
        assert r["untouched"]
    # rank 0's first reduce-scatter returned before rank 1 had joined it: it did not wait
    assert records[0]["log"][0][4] < records[1]["log"][0][3]
