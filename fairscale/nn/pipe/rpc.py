"""PipeRPCWrapper: drive an :class:`AsyncPipe` spread over the pipeline group from rank 0 alone
(FairScale 0.4.13's ``fairscale.nn.pipe.PipeRPCWrapper``).

    # every rank: torch.distributed initialized, model-parallel groups set, then rpc.init_rpc
    # (in that order: rank 0's first call builds the stage on ranks that must have their groups)
    if rank == 0:
        pipe = PipeRPCWrapper(layers, balance=[2, 2], worker_map=worker_map, chunks=4)
        pipe.foreach_worker(register_optimizer, include_self=True)   # callback(ctx, local AsyncPipe)
        out = pipe(x)                  # the last stage's output, on rank 0
        loss_fn(out, y).backward()     # gradients reach every stage's parameters
        pipe.foreach_worker(step_optimizer, include_self=True)
    rpc.shutdown()                     # the other ranks serve rank 0's calls until then

Construction builds the same AsyncPipe on every rank through RPC (each keeps only its stage's
layers). ``forward`` starts every stage (the others receive placeholder inputs of the same shapes:
only the first stage reads the data), brings the last stage's output to rank 0, and in training
routes ``backward``'s gradient to the last stage, returning once every stage has backpropagated.
Callbacks given to ``foreach_worker`` must be picklable (module-level functions).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import rpc

from fairscale.nn.model_parallel.initialize import get_pipeline_parallel_group
from fairscale.nn.pipe.async_pipe import AsyncPipe
from fairscale.nn.pipe.microbatch import TensorOrTensors

__all__ = ["PipeRPCWrapper"]

_REMOTE: dict[str, AsyncPipe] = {}  # on every rank: its stage of each wrapped pipe
_RESULTS: dict[str, Any] = {}  # on the last stage's rank: the output of the running forward
_IDS = itertools.count()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _build(pipe_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    model = AsyncPipe(*args, **kwargs)
    if model.pipeline is not None and model.pipeline.transport is not None:
        model.pipeline.transport.pipe_id = pipe_id  # the same key on every rank
    _REMOTE[pipe_id] = model


def _shapes(t: TensorOrTensors) -> Any:
    return (t.shape, t.dtype) if torch.is_tensor(t) else [(x.shape, x.dtype) for x in t]


def _placeholder(spec: Any) -> TensorOrTensors:
    if isinstance(spec, tuple):
        return torch.empty(spec[0], dtype=spec[1], device=_device())
    return tuple(torch.empty(s, dtype=d, device=_device()) for s, d in spec)


def _remote_forward(pipe_id: str, training: bool, spec: Any) -> Any:
    """A non-first stage's forward (and, in training, backward when the gradients arrive)."""
    model = _REMOTE[pipe_id]
    model.train(training)
    out = model(_placeholder(spec))
    if model.final_stage:
        _RESULTS[pipe_id] = out
        return _shapes(out)
    return None


def _remote_result(pipe_id: str) -> Any:
    out = _RESULTS[pipe_id]
    return out.detach().cpu() if torch.is_tensor(out) else tuple(t.detach().cpu() for t in out)


def _remote_backward(pipe_id: str, grads: list[torch.Tensor | None]) -> None:
    out = _RESULTS.pop(pipe_id)
    outs = (out,) if torch.is_tensor(out) else tuple(out)
    pairs = [(t, g.to(t.device)) for t, g in zip(outs, grads) if g is not None and t.requires_grad]
    with _REMOTE[pipe_id].lock:
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])


def _remote_call(pipe_id: str, callback: Callable[[Any, AsyncPipe], None], ctx: Any) -> None:
    model = _REMOTE[pipe_id]
    with model.lock:
        callback(ctx, model)


class _ToLastStage(torch.autograd.Function):
    """The last stage's output on rank 0; its gradient goes back to the last stage, and backward
    returns once every stage has backpropagated."""

    @staticmethod
    def forward(ctx: Any, wrapper: "PipeRPCWrapper", done: list[Any], *outs: torch.Tensor) -> Any:
        ctx.wrapper, ctx.done = wrapper, done
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        w = ctx.wrapper
        rpc.rpc_sync(w._name(w.group.size() - 1), _remote_backward,
                     args=(w.pipe_id, [None if g is None else g.detach().cpu() for g in grads]))
        for wait in ctx.done:  # the first stage's thread and every other stage's forward call
            wait()
        return (None, None) + tuple(None for _ in grads)


class PipeRPCWrapper(nn.Module):
    """Build and run an :class:`AsyncPipe` over the whole pipeline group from its rank 0 (see the
    module docstring). Takes AsyncPipe's arguments; ``worker_map`` is required, ``group`` must be
    the default pipeline group (groups cannot travel through RPC)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.group = kwargs.get("group") or get_pipeline_parallel_group()
        if self.group.rank() != 0:
            raise ValueError("PipeRPCWrapper is built on rank 0 of the pipeline group only; the other ranks "
                             "serve it until torch.distributed.rpc.shutdown()")
        if kwargs.get("group") not in (None, get_pipeline_parallel_group()):
            raise ValueError("PipeRPCWrapper needs group=get_pipeline_parallel_group() (a process group cannot be "
                             "sent to the other ranks)")
        if kwargs.get("worker_map") is None:
            raise ValueError("PipeRPCWrapper requires 'worker_map' ({global rank: rpc worker name})")
        kwargs = dict(kwargs, group=None, input_device=_device())
        self.worker_map = kwargs["worker_map"]
        self.pipe_id = f"rpc{next(_IDS)}"
        self.lock = threading.Lock()
        futures = [rpc.rpc_async(self._name(r), _build, args=(self.pipe_id, args, kwargs))
                   for r in range(1, self.group.size())]
        _build(self.pipe_id, args, kwargs)
        self.model = _REMOTE[self.pipe_id]
        for f in futures:
            f.wait()

    def _name(self, rank: int) -> str:
        return self.worker_map[dist.get_global_rank(self.group, rank)]

    @property
    def final_stage(self) -> bool:
        return self.model.final_stage

    def foreach_worker(self, callback: Callable[[Any, AsyncPipe], None], ctx: Any = None, *,
                       include_self: bool = False) -> None:
        """``callback(ctx, model)`` on every other rank's stage (and on this rank's if ``include_self``)."""
        futures = [rpc.rpc_async(self._name(r), _remote_call, args=(self.pipe_id, callback, ctx))
                   for r in range(1, self.group.size())]
        for f in futures:
            f.wait()
        if include_self:
            with self.model.lock:
                callback(ctx, self.model)

    def forward(self, tensor: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        spec = _shapes(tensor)
        futures = [rpc.rpc_async(self._name(r), _remote_forward, args=(self.pipe_id, self.model.training, spec))
                   for r in range(1, self.group.size())]
        if self.model.final_stage:  # a single stage: the other ranks hold nothing
            out = self.model(tensor)
            for f in futures:
                f.wait()
            return out
        errors: list[BaseException] = []

        def first_stage() -> None:
            try:
                self.model(tensor)
            except BaseException as e:  # surfaced to the caller below
                errors.append(e)

        thread = threading.Thread(target=first_stage, daemon=True)
        thread.start()
        futures[-1].wait()  # the last stage finished its forward
        out = rpc.rpc_sync(self._name(self.group.size() - 1), _remote_result, args=(self.pipe_id,))
        outs = (out,) if torch.is_tensor(out) else tuple(out)
        outs = tuple(t.to(_device()) for t in outs)

        def finish() -> None:
            thread.join()
            for f in futures:
                f.wait()
            if errors:
                raise errors[0]

        if not (self.model.training and torch.is_grad_enabled()):
            finish()
            _RESULTS.pop(self.pipe_id, None)
            return outs[0] if torch.is_tensor(out) else outs
        got = _ToLastStage.apply(self, [finish], *[t.requires_grad_(t.is_floating_point()) for t in outs])
        return got[0] if torch.is_tensor(out) else tuple(got)
