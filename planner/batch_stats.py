"""Ops whose result depends on other samples of the batch ("batch statistics"), found in a graph.

Data parallelism and microbatching run the model on slices of the batch. Most ops do not care:
they act on each sample alone (linear, attention, LayerNorm, GroupNorm, RMSNorm, InstanceNorm's
output), and the loss, a mean over equal slices, is averaged back by the runtime. Batch
statistics do care: a slice's mean and variance are not the batch's. This module is the one
registry of those ops, read by validation (``planner.validate``), the search
(``planner.search.candidates``) and the pass that synchronizes them (``passes.dp.batch_norm``)::

    for op in find_batch_stat_ops(graph.gm):
        print(op.module, op.what, op.source)       # features.1 BatchNorm2d model.py:31 `x = self.bn(x)`

What counts (training mode only; eval-mode BatchNorm normalizes with its running statistics and
is elementwise):

* **batch norm**: ``aten.batch_norm`` with ``training=True`` (torch.export's form of
  ``nn.BatchNorm1d/2d/3d``, ``nn.SyncBatchNorm`` and ``F.batch_norm``; also eval-mode modules
  built with ``track_running_stats=False``), ``F.batch_norm``/``torch.batch_norm`` calls and
  ``_BatchNorm`` modules kept whole by torch.fx (``call_module``). Output, gradients and the
  running statistics all depend on the batch.
* **instance norm with running statistics**: ``aten.instance_norm``/``F.instance_norm`` with
  ``use_input_stats`` and running buffers (``nn.InstanceNorm*d(track_running_stats=True)`` in
  training). The output is per sample; only the running statistics (a mean over the batch of
  per-sample statistics) depend on the batch.
* **other batch-norm kernels** (``native_batch_norm``, ``_native_batch_norm_legit*``,
  ``_batch_norm_with_update*``, ``cudnn_batch_norm``, ``batch_norm_stats``, ...): what a decomposed
  graph would hold. :attr:`BatchStatOp.supported` is False: the pass cannot synchronize them.

Not found here, and not batch statistics in this sense: losses (a mean over the batch is the mean
of the slices' means only for equal slices and per-sample terms; the runtime relies on that), and
arbitrary ops that mix samples (``x.mean(0)``, in-batch contrastive logits ``a @ b.T``).
"""

from __future__ import annotations

import inspect
import linecache
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from planner.capture_errors import node_site
from planner.graph import META_MODULE, module_class

__all__ = ["BatchStatOp", "BatchStatCall", "find_batch_stat_ops", "batch_stat_call", "describe_ops",
           "microbatch_problem", "unsupported_problem", "rows_problem", "min_rows", "source_line"]

aten = torch.ops.aten


@dataclass(frozen=True)
class BatchStatOp:
    """One op of the graph that computes statistics over the batch."""

    node: str
    """Node name in the graph."""
    module: str
    """Path of the module that owns it in the user's model ('' = the model itself)."""
    kind: str
    """``batch_norm`` or ``instance_norm`` (running statistics only)."""
    what: str
    """What the user wrote: ``BatchNorm2d``, ``F.batch_norm``, ``InstanceNorm2d running statistics``, ..."""
    op: str
    """The graph's op (``aten.batch_norm.default``, ``call_module``, ...)."""
    source: str
    """The user's line that calls it (``model.py:31 `x = self.bn(x)```), or '' when not recorded."""
    supported: bool
    """Whether ``passes.dp.batch_norm`` can synchronize it."""
    per_sample: int = 0
    """Values each sample gives each channel's statistics (spatial positions; 1 for ``(N, C)``
    inputs; 0 when the graph recorded no shape)."""

    def describe(self) -> str:
        where = self.module or "(the model)"
        return f"{where} ({self.what}{', ' + self.source if self.source else ''})"


@dataclass
class BatchStatCall:
    """A supported batch-statistic call and its arguments: graph nodes (or None) for a function
    call; for a torch.fx ``call_module``, attribute names on :attr:`module` (or None)."""

    kind: str
    """``batch_norm`` or ``instance_norm``."""
    input: Any
    weight: Any
    bias: Any
    running_mean: Any
    running_var: Any
    momentum: float | None
    """Running-statistics momentum; None = cumulative average (``1 / num_batches_tracked``)."""
    eps: float
    num_batches_tracked: str | None = None
    """call_module form only: the module's counter, which its forward increments (the export form
    increments it with an ``add_`` node of its own)."""
    module: nn.Module | None = None
    """call_module form only: the module (its parameter and buffer attributes are read from it)."""


# The batch-norm forms a graph can hold, by target: (kind, argument names in order, label,
# defaults). The aten schema's order (input, weight, bias, running_mean, running_var, training,
# momentum, eps, cudnn_enabled) differs from F.batch_norm's (input, running_mean, running_var,
# weight, bias, training, momentum, eps); instance norm names its flag ``use_input_stats``.
_ATEN_BN = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps", "cudnn")
_ATEN_IN = tuple("use_input_stats" if a == "training" else a for a in _ATEN_BN)


def _python_form(kind: str, fn: Callable[..., Any]) -> tuple[str, tuple[str, ...], str, dict[str, Any]]:
    params = inspect.signature(fn).parameters
    defaults = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    return kind, tuple(params), f"F.{fn.__name__}", defaults


_FORMS: dict[Any, tuple[str, tuple[str, ...], str, dict[str, Any]]] = {
    aten.batch_norm.default: ("batch_norm", _ATEN_BN, "aten.batch_norm", {}),
    torch.batch_norm: ("batch_norm", _ATEN_BN, "torch.batch_norm", {}),
    F.batch_norm: _python_form("batch_norm", F.batch_norm),
    aten.instance_norm.default: ("instance_norm", _ATEN_IN, "aten.instance_norm", {}),
    torch.instance_norm: ("instance_norm", _ATEN_IN, "torch.instance_norm", {}),
    F.instance_norm: _python_form("instance_norm", F.instance_norm),
}

_OTHER_KERNELS = ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
                  "_batch_norm_with_update", "_batch_norm_with_update_functional", "cudnn_batch_norm",
                  "miopen_batch_norm", "batch_norm_stats", "batch_norm_gather_stats",
                  "batch_norm_gather_stats_with_counts")
"""aten batch-norm kernels below ``aten.batch_norm`` (decomposed graphs, SyncBatchNorm's internals);
``_native_batch_norm_legit_no_training`` is eval mode and elementwise, so it is not listed."""


def _bind(node: torch.fx.Node) -> dict[str, Any]:
    _, order, _, defaults = _FORMS[node.target]
    args = dict(defaults)
    args.update(zip(order, node.args))
    args.update(node.kwargs)
    return args


def batch_stat_call(node: torch.fx.Node, gm: torch.nn.Module) -> BatchStatCall | None:
    """The call's arguments if ``node`` is a supported training-mode batch-statistic op, else None."""
    if node.op == "call_module":
        return _module_call(node, gm.get_submodule(str(node.target)))
    if node.op != "call_function" or node.target not in _FORMS:
        return None
    kind = _FORMS[node.target][0]
    a = _bind(node)
    if kind == "instance_norm":
        if not a.get("use_input_stats") or a.get("running_mean") is None:
            return None  # per-sample statistics only, or eval with running statistics: per sample
    elif not a.get("training"):
        return None
    momentum = a.get("momentum", 0.1)
    return BatchStatCall(kind=kind, input=a["input"], weight=a.get("weight"), bias=a.get("bias"),
                         running_mean=a.get("running_mean"), running_var=a.get("running_var"),
                         momentum=float(momentum) if momentum is not None else None, eps=float(a.get("eps", 1e-5)))


def _module_call(node: torch.fx.Node, module: nn.Module) -> BatchStatCall | None:
    """The call a torch.fx ``call_module`` of a norm module makes, as its forward would make it;
    tensors are named by attribute (``weight``, ``running_mean``, ...) on the module."""
    def attr(name: str) -> str | None:
        return name if getattr(module, name, None) is not None else None

    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        # nn.BatchNorm's forward: batch statistics in training, or always without running buffers
        if not (module.training or (module.running_mean is None and module.running_var is None)):
            return None
        track = module.training and module.track_running_stats
        return BatchStatCall(kind="batch_norm", input=node.args[0], weight=attr("weight"), bias=attr("bias"),
                             running_mean=attr("running_mean") if track else None,
                             running_var=attr("running_var") if track else None,
                             momentum=module.momentum if track else 0.0, eps=module.eps,
                             num_batches_tracked=attr("num_batches_tracked") if track else None, module=module)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        if not (module.training and module.track_running_stats):
            return None
        return BatchStatCall(kind="instance_norm", input=node.args[0], weight=attr("weight"), bias=attr("bias"),
                             running_mean=attr("running_mean"), running_var=attr("running_var"),
                             momentum=module.momentum if module.momentum is not None else 0.0, eps=module.eps,
                             module=module)
    return None


def _other_kernel(node: torch.fx.Node) -> str | None:
    """The name of an unsupported batch-norm kernel in training mode, else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    name = node.target._schema.name.split("::")[-1]
    if name not in _OTHER_KERNELS:
        return None
    schema = node.target._schema
    for i, arg in enumerate(schema.arguments):
        if arg.name == "training":
            value = node.args[i] if i < len(node.args) else node.kwargs.get("training", arg.default_value)
            if value is False:
                return None
    return f"aten.{name}"


def find_batch_stat_ops(gm: torch.fx.GraphModule) -> list[BatchStatOp]:
    """Every training-mode batch-statistic op of ``gm``, in graph order."""
    out = []
    for node in gm.graph.nodes:
        other = _other_kernel(node)
        call = None if other else batch_stat_call(node, gm)
        if call is None and other is None:
            continue
        module = str(node.meta.get(META_MODULE, ""))
        if node.op == "call_module":
            what, op = type(gm.get_submodule(str(node.target))).__name__, "call_module"
        elif other is not None:
            what, op = other, other
        else:
            what = _norm_class(node) or _FORMS[node.target][2]
            op = str(node.target) if isinstance(node.target, torch._ops.OpOverload) else _FORMS[node.target][2]
        if call is not None and call.kind == "instance_norm":
            what += " running statistics"
        out.append(BatchStatOp(node=node.name, module=module, kind=call.kind if call is not None else "batch_norm",
                               what=what, op=op, source=source_line(node), supported=call is not None,
                               per_sample=_per_sample(node)))
    return out


def _per_sample(node: torch.fx.Node) -> int:
    x = node.args[0] if node.args else None
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.shape[0] * val.shape[1] == 0:
        return 0
    return int(val.numel() // (val.shape[0] * val.shape[1]))


def min_rows(ops: list[BatchStatOp]) -> int:
    """The fewest samples a slice of the batch (one rank's microbatch) must hold so that every
    batch norm has more than one value per channel (torch refuses one, in training and when the
    runtime traces the model at the slice's shape): 2 when some op sees one value per sample."""
    return 2 if any(op.per_sample == 1 and op.kind == "batch_norm" for op in ops) else 1


def rows_problem(ops: list[BatchStatOp], rows: int, *, dp: int, microbatches: int) -> str:
    """The refusal of slices too small for batch statistics (see :func:`min_rows`)."""
    bad = [op for op in ops if op.per_sample == 1 and op.kind == "batch_norm"]
    return (f"schedule.global_batch: each dp rank's microbatch holds {rows} sample{'s' if rows != 1 else ''} "
            f"(global batch / (dp({dp}) × microbatches({microbatches}))), but {describe_ops(bad)} normalizes one "
            "value per channel per sample, and torch's batch norm refuses a single value per channel in training "
            "(the runtime traces the model at that shape). Use a global batch of at least "
            f"{2 * dp * microbatches}, or fewer dp ranks or microbatches")


def _norm_class(node: torch.fx.Node) -> str:
    """Class name of the innermost module the node came from when it is a norm module (export's
    ``nn_module_stack``), else '' (a functional call inside some other module)."""
    name = module_class(node)
    return name if "Norm" in name else ""


def source_line(node: torch.fx.Node) -> str:
    """``file.py:LINE `code``` of the innermost frame of the user's code in the node's recorded
    stack trace (``planner.capture_errors.node_site``), or ''."""
    site = node_site(node)
    if site is None:
        return ""
    path, line = site
    return f"{os.path.basename(path)}:{line} `{linecache.getline(path, line).strip()}`"


def describe_ops(ops: list[BatchStatOp], *, limit: int = 4) -> str:
    """``features.1 (BatchNorm2d, model.py:31 `...`), features.4 (BatchNorm2d) and 3 more``."""
    shown = ", ".join(op.describe() for op in ops[:limit])
    return shown + (f" and {len(ops) - limit} more" if len(ops) > limit else "")


def microbatch_problem(ops: list[BatchStatOp], microbatches: int, *, where: str = "schedule.microbatches",
                       opt_in: str = '"batch_norm": "local"') -> str:
    """The refusal of more than one microbatch under ``"batch_norm": "sync"``, naming the ops;
    ``where`` names what set the microbatches and ``opt_in`` how to accept per-microbatch statistics."""
    norms = [op for op in ops if op.kind == "batch_norm"]
    what = "training-mode BatchNorm" if norms else "InstanceNorm with running statistics"
    one = '"microbatches": 1 (with pp > 1, schedule kind "gpipe")' if where == "schedule.microbatches" \
        else "microbatches=1"
    kernels = " / ".join(sorted({op.op for op in ops}))
    return (f"{where}: {microbatches} microbatches per step would give each microbatch its own batch "
            f"statistics, but the model has {what}: {describe_ops(ops)}. One process computes their statistics "
            f"(op {kernels} in each module) over the whole batch, which no pipeline can (each microbatch's forward "
            f"would need every other microbatch's statistics). Use {one}, or opt in to per-microbatch statistics with {opt_in} (each dp rank and "
            "microbatch normalizes with its own statistics and updates the running statistics once per "
            "microbatch, as torch DDP without SyncBatchNorm does)")


def unsupported_problem(ops: list[BatchStatOp]) -> str:
    """The refusal of batch-norm kernels the pass cannot synchronize, under ``"batch_norm": "sync"``."""
    bad = [op for op in ops if not op.supported]
    return (f'batch_norm: "sync" cannot synchronize {describe_ops(bad)}: the pass rewrites aten.batch_norm, '
            "F.batch_norm and nn.BatchNorm/InstanceNorm modules, not lower batch-norm kernels (a decomposed graph). "
            'Capture the model with planner.capture (it keeps aten.batch_norm), or set "batch_norm": "local" to '
            "accept per-rank, per-microbatch statistics")
