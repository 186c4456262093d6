"""What a user reads when neither tracer can capture their model.

The message leads with the user's own source line and three lines around it (never an fx node or a
graph dump), says which of two kinds of failure it is, and suggests only changes to the model or
its inputs, which every way in (``fairscale.search``/``plan``/``parallelize``, the CLI) can act on (the tracer
options of ``planner.capture.capture`` are not remedies for them, so none is suggested):

* **data-dependent**: the code needs a tensor's *value* (``if x.sum() > 0``, ``.item()``, ``int(t)``,
  a shape that depends on the data such as ``x[x > 0]``). A trace has shapes only; marking the module
  as an fx leaf does not help either, because the planner's facts are computed on fake tensors,
  which have no values.
* anything else: either the forward fails on the example inputs (a shape mismatch: the inputs or
  the model are wrong) or the code is not traceable; both remedies are given, since telling them
  apart would mean running the user's forward outside the tracer.
"""

from __future__ import annotations

import linecache
import os
import re
from typing import Sequence

import torch
import torch.fx

from planner.fx_capture import Failure

__all__ = ["describe_capture_failure", "is_data_dependent", "source_context", "node_site", "DATA_DEPENDENT_ADVICE"]

DATA_DEPENDENT_ADVICE = (
    "What to do: compute both sides and select with torch.where(condition, a, b), keeping the condition a\n"
    "tensor, and keep shapes independent of the data (torch.where(m, x, 0).sum() rather than x[m].sum()); or\n"
    "decide with something fixed when the model is built (a constructor argument), not the data.")

_DATA_DEPENDENT_TYPES = ("GuardOnDataDependentSymNode", "DataDependentOutputException",
                         "DynamicOutputShapeException", "PendingUnbackedSymbolNotFound")
_DATA_DEPENDENT_TEXT = ("data-dependent", "data dependent", "cannot be used as inputs to control flow",
                        "_local_scalar_dense")


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return seen


def is_data_dependent(exc: BaseException) -> bool:
    """The failure needs a tensor's value (a branch, ``.item()`` or a size taken from the data)."""
    return any(type(e).__name__ in _DATA_DEPENDENT_TYPES or any(t in str(e) for t in _DATA_DEPENDENT_TEXT)
               for e in _chain(exc))


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ')
_TORCH = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_COMPILER = tuple(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), pkg) + os.sep
                  for pkg in ("planner", "passes"))


def node_site(node: torch.fx.Node) -> tuple[str, int] | None:
    """(file, line) of the innermost frame of the user's code in the stack trace export recorded on
    ``node`` (frames of torch and of planner/passes skipped); None without one."""
    found = None
    for path, line in _FRAME.findall(node.meta.get("stack_trace") or ""):
        full = os.path.abspath(path)
        if not (full.startswith(_TORCH) or full.startswith(_COMPILER) or path.startswith("<")):
            found = (path, int(line))
    return found


def source_context(file: str, line: int, *, around: int = 1) -> list[str]:
    """``around`` lines either side of ``file:line``, numbered, the line itself marked ``->``."""
    out = []
    for n in range(max(1, line - around), line + around + 1):
        text = linecache.getline(file, n).rstrip()
        if not text and n != line:
            continue
        out.append(f"  {'->' if n == line else '  '} {n:>4} | {text}")
    return out


def _last_traced_op(exc: BaseException) -> str:
    """The last ATen op torch.export traced before failing (from the partial graph it attaches):
    for a data-dependent guard, the op whose result has a size or value from the data."""
    chain: BaseException | None = exc
    while chain is not None:
        dump = getattr(chain, "partial_fx_graph", None)
        if isinstance(dump, str):
            ops = re.findall(r"torch\.ops\.aten\.(\w+\.\w+)\(", dump)
            return f"aten.{ops[-1]}" if ops else ""
        chain = chain.__cause__ or chain.__context__
    return ""


def _only_raises(file: str, line: int) -> bool:
    """``file:line`` is an ``if`` whose body is a ``raise`` (a check of the data, not a branch)."""
    text = linecache.getline(file, line).strip()
    if not text.startswith("if ") or not text.endswith(":"):
        return False
    for n in range(line + 1, line + 4):
        body = linecache.getline(file, n).strip()
        if body and not body.startswith("#"):
            return body.startswith("raise ")
    return False


def _sized_by_values(exc: BaseException) -> str:
    """The op whose fake kernel raised DynamicOutputShapeException in ``exc``'s chain (F.ctc_loss's
    aten._ctc_loss), which no trace gets past; '' for any other failure."""
    for e in _chain(exc):
        if type(e).__name__ == "DynamicOutputShapeException" and e.args:
            return f"aten.{getattr(e.args[0], '__name__', e.args[0])}" if isinstance(e.args[0], torch._ops.OpOverload) \
                else str(e.args[0])
    return ""


def describe_capture_failure(model_name: str, failures: Sequence[Failure],
                             paths: dict[int, str] | None = None) -> str:
    """The CaptureError text for ``failures`` (one per tracer tried, in order); ``paths`` (id of
    a module -> its path in the model) names the module that runs the failing line."""
    primary = next((f for f in failures if f.tracer == "torch.export"), failures[0])  # export runs the code as is
    site = primary.site or next((f.site for f in failures if f.site is not None), None)
    where, context = "", []
    if site is not None:
        file, line, func, _, owner = site
        owners = getattr(primary, "owners", None) or ([primary.owner] if getattr(primary, "owner", None) else [])
        path = next((p for p in ((paths or {}).get(id(o)) for o in owners) if p is not None), None)
        module = f"module {path or '(the model)'}, " if path is not None else ""
        where = f" at {file}:{line} ({module}{owner + '.' if owner else ''}{func})"
        context = source_context(file, line)
    tried = [f"  {f.tracer}: {type(f.exc).__name__}: {(str(f.exc).strip().splitlines() or [''])[0][:200]}"
             for f in failures]
    sized = _sized_by_values(primary.exc)
    if sized:
        head = (f"could not capture {model_name}: its forward calls an op whose output's size depends on its "
                f"inputs' values{where}, op {sized}:")
        advice = [
            "A rank's program is traced with torch.export, which has shapes but no values, and torch gives this op",
            "no size without them" + (" (its CTC loss sizes its alignment table by the longest target)."
                                      if "ctc_loss" in sized else "."),
            "What to do: compute it with ops whose output sizes follow from their inputs' sizes (a CTC loss written",
            "in tensor ops over padded targets), or train this model without fairscale."]
    elif is_data_dependent(primary.exc):
        op = _last_traced_op(primary.exc)
        head = (f"could not capture {model_name}: its forward needs a tensor's value, not only its shape{where}"
                + (f", at op {op}" if op else "") + ":")
        advice = [
            "fairscale plans from a trace of the model (torch.export, then torch.fx), which has shapes but no values,",
            "so it cannot decide this `if`, .item(), bool() or int() of a tensor, or a size taken from the data.",
            DATA_DEPENDENT_ADVICE]
        if site is not None and _only_raises(site[0], site[1]):
            advice[-1:] = [
                "This `if` only checks the data and raises (a check of the inputs, as Hugging Face's Wav2Vec2ForCTC",
                "checks its labels). What to do: leave out the input it checks where the model allows (call it without",
                "labels and compute the loss from its output in loss_fn), or take the check out of the model's code."]
    else:
        names = " nor ".join(f.tracer for f in failures)
        head = f"could not capture {model_name}: {'neither ' + names + ' can' if len(failures) > 1 else names + ' cannot'}" \
               f" trace its forward on the example inputs{where}:"
        advice = [
            "What to do: if model(*example_inputs) raises this outside fairscale too, fix the inputs or the model",
            "(example_inputs are the forward's positional arguments in order, shaped like one training batch; with",
            "loss_fn the loss is loss_fn(model(batch[0]), *batch[1:])). Otherwise this code is not traceable: rewrite",
            "it with tensor operations so that torch.export.export(model, example_inputs, strict=False) accepts it."]
    return "\n".join([head, *context, *advice, "What the tracers said:", *tried])
