"""A small data-parallel runner (pp = tp = 1): capture → data-parallel pass → optimizer → steps.

Usage (inside ``fairscale.launch`` or torchrun)::

    graph = capture(model, example_batch, loss_fn=loss_fn)     # once, before forking
    plan = Plan(data_parallel=DataParallel(kind="fsdp", units="layers.*"))

    def train(rank, world):
        runner = DataParallelRunner.build(graph, plan, torch.optim.Adam, lr=1e-3)
        for step in range(steps):
            loss = runner.train_step(global_batch(step))        # this rank takes its slice
        print(runner.comm_summary())                           # bytes each collective moved
        return runner.full_state_dict()                        # rank 0: the user's state_dict

Every rank takes a contiguous ``1/dp`` slice of the global batch along dim 0, so the loss and
the update equal single-process training on the global batch: for losses that are means over
equally sized slices, and for token means (``passes.loss_weights``), whose pieces are weighted by
their share of the labels. The pipeline/tensor-parallel engine reuses the pass and the optimizer; this
runner is the dp-only path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx

from fairscale.runtime import state as _state
from fairscale.runtime import watchdog
from fairscale.runtime.data_parallel import local_slice, memory_bytes
from fairscale.runtime.device import collective_device
from fairscale.runtime.init import check_replicas, sync_params
from fairscale.runtime.launch import under_torchrun
from fairscale.runtime.optim import DataParallelOptimizer
from passes.dp.batch_norm import batch_norm_info, batch_norm_pass
from passes.dp.shard_data_parallel import no_sync, shard_data_parallel_pass
from passes.loss_count import TokenCounter, piece_weights
from passes.loss_weights import token_counter
from passes.ops import comm, groups
from passes.ops.flight import RECORDER
from planner.batch_stats import microbatch_problem
from planner.graph import ModelGraph
from planner.plan import DataParallel, Mesh, Plan

__all__ = ["DataParallelRunner"]


@dataclass
class DataParallelRunner:
    """One rank's compiled graph, its optimizer, and the step loop."""

    gm: torch.fx.GraphModule
    optimizer: DataParallelOptimizer
    graph: ModelGraph | None
    dp_index: int
    dp_size: int
    _grad_norm: torch.Tensor | None = field(default=None, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)
    token_counter: TokenCounter | None = None
    """The loss's token counter (``passes.loss_weights``), or None: pieces are then weighted alike."""

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm before clipping of the last ``train_step(..., clip_norm=...)``
        (read from the device only when asked for: no host sync in the step)."""
        return None if self._grad_norm is None else float(self._grad_norm)

    @classmethod
    def build(cls, graph: ModelGraph | torch.fx.GraphModule, plan: Plan | DataParallel,
              optimizer_cls: Callable[..., torch.optim.Optimizer] = torch.optim.Adam, *, axis: str = "dp",
              sync: bool | None = None, **optimizer_kwargs: Any) -> DataParallelRunner:
        """Bind the dp axis to the whole world, run the pass for this rank, make the optimizer.

        ``sync``: broadcast rank 0's weights into the captured graph first (default: only under
        torchrun, where each process built its own model; forked ranks inherited one). With
        ``sync=False`` the ranks' weights are checked to agree instead.
        """
        if isinstance(plan, Plan) and (plan.mesh.pp, plan.mesh.tp, plan.mesh.ep) != (1, 1, 1):
            raise ValueError(f"DataParallelRunner runs pp=tp=ep=1 plans; this plan has mesh pp={plan.mesh.pp}, "
                             f"tp={plan.mesh.tp}, ep={plan.mesh.ep}: use the full engine (fairscale.parallelize)")
        if not dist.is_initialized():
            raise RuntimeError("DataParallelRunner.build needs torch.distributed initialized; run it under "
                               "fairscale.launch(fn, devices=N), `python -m fairscale run`, or torchrun")
        if dist.get_backend() != "gloo":
            raise NotImplementedError(
                f"DataParallelRunner runs CPU ranks on gloo; this process group uses {dist.get_backend()!r}. "
                "Launch with fairscale.launch(fn, devices=N, backend='gloo'); GPU placement belongs to the "
                "full engine")
        world, rank = dist.get_world_size(), dist.get_rank()
        bound = groups.PROCESS.get(axis)  # the runner's dp is process-wide, as FairScale's groups are
        if bound is None or dist.get_world_size(bound) != world:
            comm.set_group(axis, dist.group.WORLD if world > 1 else None)
        watchdog.install(label=f"dp {rank}")  # the world group carries collective_timeout_s
        gm = graph.gm if isinstance(graph, ModelGraph) else graph
        if sync is None:
            sync = under_torchrun() and not os.environ.get("FAIRSCALE_LAUNCHED")
        if any(p.is_meta for p in gm.parameters()):
            pass  # a meta capture: fill the rank graph with fairscale.runtime.init.materialize_sharded
        elif sync:
            sync_params(gm)
        else:
            check_replicas(gm)
        # batch statistics over the global batch (plan.batch_norm; a DataParallel section: "sync")
        gm = batch_norm_pass(gm, plan if isinstance(plan, Plan) else Plan(mesh=Mesh(dp=world), data_parallel=plan),
                             axis=axis)
        rank_gm = shard_data_parallel_pass(gm, plan, dp_index=rank, dp_size=world, axis=axis)
        opt = DataParallelOptimizer(rank_gm, optimizer_cls, **optimizer_kwargs)
        return cls(gm=rank_gm, optimizer=opt, graph=graph if isinstance(graph, ModelGraph) else None,
                   dp_index=rank, dp_size=world, token_counter=token_counter(gm))

    def train_step(self, global_batch: Sequence[Any], *, microbatches: int = 1, clip_norm: float | None = None,
                   local: bool = False) -> float:
        """Forward, backward and optimizer step on this rank's slice of ``global_batch``
        (or on ``global_batch`` itself when ``local=True``). Returns the mean loss over the global batch.

        With ``microbatches > 1`` the slice is cut again; gradients accumulate under ``no_sync`` and
        are reduced once, on the last microbatch.
        """
        bn = batch_norm_info(self.gm)
        if microbatches > 1 and bn is not None and bn.mode == "sync" and bn.ops:
            raise ValueError(microbatch_problem(bn.ops, microbatches, where="train_step(microbatches=...)",
                                                opt_in='a Plan with batch_norm="local" given to DataParallelRunner.build'))
        mine = tuple(global_batch) if local else local_slice(global_batch, self.dp_index, self.dp_size)
        parts = [local_slice(mine, m, microbatches) if microbatches > 1 else mine for m in range(microbatches)]
        weights = self._weights(global_batch, parts, local=local) or [1.0 / microbatches] * microbatches
        self.optimizer.zero_grad(set_to_none=True)
        total: torch.Tensor | None = None  # summed on the device: one host sync per step, at the end
        for m, part in enumerate(parts):
            RECORDER.context = f"step {self._steps}, microbatch {m}"
            ctx = no_sync() if m < microbatches - 1 else _null()
            with ctx:
                loss = self.gm(*part)
                (loss * weights[m]).backward()
            if weights[m]:  # a piece that counts no labels weighs 0, and its own mean is 0/0: left out, not 0·nan
                share = loss.detach().to(torch.float64) * weights[m]
                total = share if total is None else total + share
        RECORDER.context = f"step {self._steps}, optimizer"
        self._steps += 1
        if clip_norm is not None:
            self._grad_norm = self.optimizer.clip_grad_norm_(clip_norm)
        self.optimizer.step()
        return self._mean(total if total is not None else torch.zeros((), dtype=torch.float64))

    def _weights(self, batch: Sequence[Any], parts: list[Sequence[Any]], *, local: bool) -> list[float] | None:
        """This rank's pieces' weights when the loss is a token mean whose pieces count different
        labels (``passes.loss_count.piece_weights``). Given the global batch, every rank counts
        every piece itself; given only its slice (``local``), the ranks gather their counts."""
        counter, m, dp = self.token_counter, len(parts), self.dp_size
        if counter is None or dp * m == 1:
            return None
        if not local:
            slices = [local_slice(batch, d, dp) for d in range(dp)]
            flat = counter.count_all([tuple(local_slice(s, i, m) if m > 1 else s) for s in slices for i in range(m)])
            return piece_weights(counter, [flat[d * m:(d + 1) * m] for d in range(dp)], self.dp_index)
        mine = counter.count_all([tuple(part) for part in parts])
        gathered: list[Any] = [None] * dp
        dist.all_gather_object(gathered, mine, group=comm.get_group(self.optimizer.info.axis))
        return piece_weights(counter, gathered, self.dp_index)

    def _mean(self, value: torch.Tensor | float) -> float:
        """Mean of a per-rank scalar over dp ranks (a reporting all-reduce, not counted as model traffic)."""
        if self.dp_size == 1:
            return float(value)
        t = torch.as_tensor(value, dtype=torch.float64, device=collective_device()).reshape(1)
        axis = self.optimizer.info.axis
        group = comm.get_group(axis)
        comm.traced("all_reduce", axis, t, lambda: dist.all_reduce(t, group=group))
        return float(t.item() / self.dp_size)

    # -- reports and state ------------------------------------------------------------------------

    def comm_summary(self) -> str:
        """Table of bytes each collective moved on this rank since the counter was last reset."""
        return comm.COUNTER.summary()

    def memory(self) -> dict[str, int]:
        return memory_bytes(self.gm, self.optimizer)

    def full_state_dict(self, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        aliases = self.graph.tied if self.graph is not None else ()
        return _state.full_state_dict(self.gm, aliases=aliases, rank0_only=rank0_only)

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        _state.load_full_state_dict(self.gm, state)
        for b in self.optimizer.info.buckets:
            if b.shard is not None:
                b.gather_params()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
