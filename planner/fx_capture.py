"""The two tracers behind ``planner.capture`` and the error a user sees when both fail.

* :func:`export_trace`: ``torch.export.export(strict=False)`` then ``ep.module()`` (ATen-level
  training IR: ``aten.linear``, ``aten.scaled_dot_product_attention``; no decompositions, because
  ``run_decompositions`` breaks SDPA on GPT-2). Export fixes train/eval mode at capture time.
* :func:`fx_trace`: ``torch.fx`` symbolic tracing that goes INSIDE every module (the default fx
  tracer stops at torch.nn modules), so parameters become get_attr nodes as in export and nodes
  carry ``nn_module_stack``. It runs no tensor code, so a 1T-parameter model on ``meta`` traces
  in about a second. Nodes are torch-level (``F.linear``, ``x.view``) rather than ATen; the facts
  written on them (``planner.graph`` meta keys, layers) are the same. When tracing fails inside a
  torch.nn module that fx cannot see through (``nn.TransformerEncoder``'s fast-path checks), that
  module class becomes a leaf (one ``call_module`` node) and tracing restarts.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import sysconfig
import traceback
from types import FunctionType, TracebackType
from typing import Any, Callable, Iterator, Sequence, cast

import torch
import torch.fx
from torch.fx.proxy import ParameterProxy
from torch import nn

from planner.fx_module import graph_module

__all__ = ["export_trace", "fx_trace", "failure_site", "failure_owner", "failure_owners", "fx_supports", "Failure", "META_FX_LEAVES"]

META_FX_LEAVES = "fs_fx_leaves"
"""gm.meta key of an fx trace: qualified names of the torch.nn module classes kept whole (leaves)."""

_TORCH_DIR = os.path.dirname(torch.__file__)
_HERE = os.path.dirname(os.path.abspath(__file__))
_STDLIB = sysconfig.get_paths()["stdlib"]


def export_trace(wrapper: nn.Module, batch: tuple[Any, ...]) -> torch.fx.GraphModule:
    ep = _without_partial_graph_dump(wrapper, batch)
    gm = ep.module()
    for node in list(gm.graph.nodes):  # export's input-shape guard: the runtime feeds other shapes
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
    gm.recompile()
    return gm


@contextlib.contextmanager
def _causal_hint_without_values() -> Any:
    """``nn.TransformerEncoder``/``nn.TransformerDecoder`` given a mask and no ``is_causal`` compare
    the mask with a causal one (``bool((mask == causal).all())``) to choose a kernel; a trace has no
    mask values, so export failed on torch's own line for every model that passes ``tgt_mask`` (the
    PyTorch tutorials' way). The answer only chooses between the causal kernel and applying the mask
    itself, which compute the same attention: while tracing, a mask whose values are unknown is
    applied as given (``False``: not known causal)."""
    from torch._subclasses.fake_tensor import is_fake
    from torch.nn.modules import transformer

    original = transformer._detect_is_causal_mask

    def detect(mask: torch.Tensor | None, is_causal: bool | None = None, size: int | None = None) -> bool:
        if is_causal is None and mask is not None and is_fake(mask):
            return False
        return original(mask, is_causal, size)

    transformer._detect_is_causal_mask = detect
    try:
        yield
    finally:
        transformer._detect_is_causal_mask = original


@contextlib.contextmanager
def _readable_cudnn_tf32() -> Iterator[None]:
    """While export traces: cuDNN's conv and RNN TF32 flags both at ``tf32``, restored after.
    Export reads the legacy ``torch.backends.cudnn.allow_tf32``, which raises unless both are
    ``tf32`` (torch 2.11 and 2.13), so a user who turned TF32 off for convolutions
    (``torch.backends.cudnn.conv.fp32_precision = "ieee"``) could capture nothing. Tracing runs no
    cuDNN kernel; the flags the model then trains with are the user's."""
    cudnn = cast(Any, torch.backends.cudnn)  # the flag modules are attached at run time
    conv, rnn = cudnn.conv, cudnn.rnn
    saved = conv.fp32_precision, rnn.fp32_precision
    conv.fp32_precision = rnn.fp32_precision = "tf32"
    try:
        yield
    finally:
        conv.fp32_precision, rnn.fp32_precision = saved


def _without_partial_graph_dump(wrapper: nn.Module, batch: tuple[Any, ...]) -> torch.export.ExportedProgram:
    """``torch.export.export(strict=False)``, minus the graph-so-far torch prints to stderr (once per
    wrapper it passes through) when a trace fails: the capture error says where, in the user's code.
    Whatever else export writes to stderr is passed on."""
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stderr(buffer), _causal_hint_without_values(), _readable_cudnn_tf32():
            return torch.export.export(wrapper, batch, strict=False)
    except Exception as exc:
        dump = getattr(exc, "partial_fx_graph", None)
        text = buffer.getvalue()
        buffer = io.StringIO(text.replace(f"{dump}\n", "") if isinstance(dump, str) and dump else text)
        raise
    finally:
        sys.stderr.write(buffer.getvalue())


class _Tracer(torch.fx.Tracer):
    def __init__(self, leaves: tuple[type, ...], wrap: tuple[Callable[..., Any], ...]) -> None:
        super().__init__(autowrap_functions=wrap, param_shapes_constant=True)
        self.leaves = leaves

    def trace(self, root: nn.Module | Callable[..., Any], concrete_args: Any = None) -> torch.fx.Graph:
        # fx finds a parameter's name by scanning named_parameters() on every access: O(P^2),
        # 6 s of a 175B GPT's trace. A table makes it O(P).
        assert isinstance(root, nn.Module)
        self._params = {id(p): n for n, p in root.named_parameters()}
        self._buffers = {id(b): n for n, b in root.named_buffers()}
        return super().trace(root, concrete_args)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if not isinstance(attr_val, torch.Tensor):
            return attr_val
        if isinstance(attr_val, nn.Parameter):
            name = self._params.get(id(attr_val))
        else:
            name = self._buffers.get(id(attr_val)) if self.proxy_buffer_attributes else None
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy(
                "get_attr", name, (), {},
                proxy_factory_fn=lambda node: ParameterProxy(self, node, name, cast(nn.Parameter, attr_val)))
        return parameter_proxy_cache[name]

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            name = self._params.get(id(a)) if isinstance(a, nn.Parameter) else self._buffers.get(id(a))
            if name is not None:
                return self.create_node("get_attr", name, (), {})
        return super().create_arg(a)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.leaves) if self.leaves else False

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception as exc:
            if not hasattr(exc, "_fs_module"):
                exc._fs_module = m  # type: ignore[attr-defined]  # innermost module that failed
            raise


def fx_trace(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, n_inputs: int, *,
             leaves: tuple[type, ...] = (), concrete_args: dict[str, Any] | None = None) -> torch.fx.GraphModule:
    """Trace ``model`` plus its loss into a graph of ``n_inputs`` placeholders (``batch_0`` ...)."""
    root = _flat_loss_module(model, loss_fn, n_inputs)
    leaves = tuple(leaves)
    for _ in range(8):
        tracer = _Tracer(leaves, _opaque_loss(loss_fn))
        try:
            graph = tracer.trace(root, concrete_args=concrete_args)
        except Exception as exc:
            failed = getattr(exc, "_fs_module", None)
            if failed is not None and type(failed).__module__.startswith("torch.nn") \
                    and type(failed) not in leaves and _site_in_torch(exc):
                leaves = leaves + (type(failed),)
                continue
            raise
        gm = graph_module(tracer.root, graph, root.__class__.__name__)
        gm.meta[META_FX_LEAVES] = [t.__qualname__ for t in leaves]
        return gm
    raise RuntimeError(f"torch.fx kept failing inside torch.nn modules; leaves tried: {leaves}")


def _flat_loss_module(model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None, n: int) -> nn.Module:
    """A module ``forward(batch_0, ..., batch_{n-1}) -> loss`` (fx cannot trace ``*batch``), with
    the user's model under ``model.`` as in ``LossModule`` so module paths match export's."""
    names = [f"batch_{i}" for i in range(n)]
    call = (f"fs_loss_fn(self.model({names[0]}), {', '.join(names[1:])})" if loss_fn is not None
            else f"self.model({', '.join(names)})")
    scope: dict[str, Any] = {"fs_loss_fn": loss_fn}
    exec(f"def forward(self, {', '.join(names)}):\n    return {call}\n", scope)  # noqa: S102
    cls = type("FlatLoss", (nn.Module,), {"forward": scope["forward"]})
    root = cls()
    root.model = model
    root.loss_fn = loss_fn
    return root


def _opaque_loss(loss_fn: Callable[..., Any] | None) -> tuple[Callable[..., Any], ...]:
    """A plain-function loss is one opaque call_function node: loss code often branches on the
    output type (``out if isinstance(out, Tensor) else out.logits``), which a Proxy cannot answer."""
    # torch's own functions already become one node through __torch_function__; autowrapping them
    # makes fx's codegen emit wrap("torch.nn.functional.x"), which breaks every later trace (torch 2.13)
    if isinstance(loss_fn, FunctionType) and not (loss_fn.__module__ or "").startswith("torch"):
        return (loss_fn,)
    return ()


class Failure:
    """Where a tracer failed in the user's code."""

    def __init__(self, tracer: str, exc: BaseException) -> None:
        self.tracer = tracer
        self.exc = exc
        self.site = failure_site(exc)
        self.owners = failure_owners(exc)
        """The modules whose code is on the stack at the failing line, innermost first: the first is
        the one whose forward ran it; the error names the first that is part of the model (a loss's
        helper module built in forward, as Hugging Face's HungarianMatcher, is not)."""
        self.owner = self.owners[0] if self.owners else None

    def describe(self) -> str:
        msg = (str(self.exc).strip().splitlines() or [""])[0][:300]
        where = "(no frame in the model's code)"
        if self.site is not None:
            file, line, func, text, owner = self.site
            where = f"at {file}:{line} in {func}" + (f" ({owner})" if owner else "") + (
                f": `{text}`" if text else "")
        return f"  {self.tracer} failed {where}\n    {type(self.exc).__name__}: {msg}"


def _user_frames(exc: BaseException) -> list[tuple[TracebackType, str]]:
    frames: list[tuple[TracebackType, str]] = []
    seen: set[int] = set()
    chain: BaseException | None = exc
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        tb = chain.__traceback__
        while tb is not None:
            raw = tb.tb_frame.f_code.co_filename
            file = os.path.abspath(raw)
            if not raw.startswith("<") and _is_user_file(file):  # <eval_with_key>: fx-generated code
                frames.append((tb, file))
            tb = tb.tb_next
        chain = chain.__cause__ or chain.__context__
    return frames


def _is_user_file(file: str) -> bool:
    if file.startswith(_TORCH_DIR) or file.startswith(_HERE) or file.startswith("<"):
        return False
    return "site-packages" in file or not file.startswith(_STDLIB)


def _site_in_torch(exc: BaseException) -> bool:
    """The innermost frame of ``exc`` outside fx's own code is in torch (a torch.nn module)."""
    tb = exc.__traceback__
    last = None
    while tb is not None:
        file = os.path.abspath(tb.tb_frame.f_code.co_filename)
        if not file.startswith(os.path.join(_TORCH_DIR, "fx")) and not file.startswith(_HERE):
            last = file
        tb = tb.tb_next
    return last is not None and last.startswith(_TORCH_DIR)


def failure_site(exc: BaseException) -> tuple[str, int, str, str, str] | None:
    """(file, line, function, source text, owning module class) of the innermost frame of the
    model's own code in ``exc``'s traceback (torch, the standard library and planner excluded)."""
    frames = _user_frames(exc)
    if not frames:
        return None
    # the first exception in the chain that has user frames is the original failure
    tb, file = frames[-1] if exc.__cause__ is None and exc.__context__ is None else _innermost(frames)
    summary = traceback.extract_tb(tb, limit=1)[0]
    owner_name = ""
    frame: Any = tb.tb_frame
    while frame is not None and not owner_name:  # the module whose forward runs the failing line
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and not _is_internal(owner):
            owner_name = type(owner).__name__
        frame = frame.f_back
    return file, tb.tb_lineno, summary.name, (summary.line or "").strip(), owner_name


def failure_owner(exc: BaseException) -> nn.Module | None:
    """The module instance whose forward runs the line :func:`failure_site` names."""
    owners = failure_owners(exc)
    return owners[0] if owners else None


def failure_owners(exc: BaseException) -> list[nn.Module]:
    """The module instances on the stack of the line :func:`failure_site` names, innermost first."""
    frames = _user_frames(exc)
    if not frames:
        return []
    tb, _ = frames[-1] if exc.__cause__ is None and exc.__context__ is None else _innermost(frames)
    frame: Any = tb.tb_frame
    owners: list[nn.Module] = []
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and not _is_internal(owner) and all(owner is not o for o in owners):
            owners.append(owner)
        frame = frame.f_back
    return owners


def _is_internal(module: nn.Module) -> bool:
    return type(module).__name__ == "FlatLoss" or type(module).__module__.startswith("planner.")


def _innermost(frames: list[tuple[TracebackType, str]]) -> tuple[TracebackType, str]:
    # frames are ordered outer->inner per exception; prefer the deepest frame of the model's code
    return max(frames, key=lambda f: _depth(f[0]))


def _depth(tb: TracebackType) -> int:
    depth, frame = 0, tb.tb_frame
    while frame is not None:
        depth += 1
        frame = frame.f_back  # type: ignore[assignment]
    return depth


def fx_supports(batch: Sequence[Any], concrete_args: dict[str, Any] | None = None) -> bool:
    """fx traces a flat tuple of tensors (non-tensors only where ``concrete_args`` fixes them)."""
    fixed = concrete_args or {}
    return all(isinstance(x, torch.Tensor) or f"batch_{i}" in fixed for i, x in enumerate(batch))
