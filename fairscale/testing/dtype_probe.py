"""Which ATen ops refuse floating operands of different dtypes, asked of eager PyTorch.

A graph traced in bf16 records each op's operand dtypes, and torch.export's fake kernels accept
any mix; the ranks then run the real kernels, which may raise. :data:`planner.dtype_pins.MIXED_OPS`
says which ops do; this module is its evidence. An *example* is one call of an op as a capture
recorded it, in JSON (tensors by shape, stride, dtype and the id of the graph value they came
from, so a value fed to two operand slots stays one tensor); :func:`probe` runs it in eager on CPU
under dtype assignments of its floating operand slots (16-bit or float32) and reports which ones
raise, forward or backward.

Usage (``benchmarks/dtype_ops/mixed_dtype_ops.py`` collects the examples from corpus captures)::

    examples = [example_of(node) for node in gm.graph.nodes]        # None where not an aten call
    for outcome in probe(example):                                  # all-16-bit first
        outcome.dtypes, outcome.error                               # ('bfloat16', 'float32', ...), None | message
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx

__all__ = ["example_of", "float_slots", "probe", "assignments", "Outcome", "op_of", "slot_names"]

_ENUMS = {torch.dtype: "dtype", torch.device: "device", torch.memory_format: "memory_format", torch.layout: "layout"}


class _Unencodable(Exception):
    pass


def example_of(node: torch.fx.Node) -> dict[str, Any] | None:
    """The JSON example of a ``call_function`` node of an ATen op whose operands have recorded
    values (``meta["val"]``); None for anything else."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    ids: dict[torch.fx.Node, int] = {}

    def enc(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            val = a.meta.get("val")
            if isinstance(val, torch.Tensor):
                return {"tensor": [_size(d) for d in val.shape], "stride": [_size(d) for d in val.stride()],
                        "dtype": str(val.dtype).removeprefix("torch."), "grad": bool(val.requires_grad),
                        "id": ids.setdefault(a, len(ids))}
            if isinstance(val, (bool, int, float, torch.SymInt)):
                return _size(val) if isinstance(val, torch.SymInt) else val
            raise _Unencodable(a)
        if isinstance(a, (list, tuple)):
            return [enc(x) for x in a]
        if isinstance(a, dict):  # the kwargs
            return {k: enc(v) for k, v in a.items()}
        for kind, key in _ENUMS.items():
            if isinstance(a, kind):
                return {key: str(a).removeprefix("torch.")}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise _Unencodable(a)

    try:
        return {"op": str(node.target), "args": enc(list(node.args)), "kwargs": enc(dict(node.kwargs))}
    except _Unencodable:
        return None


def _size(d: int | torch.SymInt) -> int:
    """A recorded size; a data-dependent one (rows routed to an expert) as 2, the same in every
    operand that shares it."""
    if not isinstance(d, torch.SymInt):
        return d
    hint = d.node.hint
    return int(hint) if hint is not None else 2


def op_of(example: dict[str, Any]) -> torch._ops.OpOverload:
    """The op of an example (``"aten.linear.default"`` -> ``torch.ops.aten.linear.default``)."""
    ns, name, overload = example["op"].split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)


def _tensors(tree: Any) -> Iterator[dict[str, Any]]:
    if isinstance(tree, dict) and "tensor" in tree:
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, list):
        for v in tree:
            yield from _tensors(v)


def float_slots(example: dict[str, Any]) -> list[dict[str, Any]]:
    """The floating tensor operands of ``example``, in argument order (args, then kwargs)."""
    return [t for t in _tensors([example["args"], example["kwargs"]]) if t["dtype"] in _FLOATS]


def slot_names(example: dict[str, Any]) -> list[str]:
    """The schema name of each of :func:`float_slots` (``tensors[1]`` in a list argument)."""
    schema = op_of(example)._schema
    names = []
    for i, a in enumerate(example["args"]):
        names += _named(schema.arguments[i].name, a)
    for k, a in example["kwargs"].items():
        names += _named(k, a)
    return names


def _named(name: str, arg: Any) -> list[str]:
    if isinstance(arg, list):
        return [f"{name}[{i}]" for i, a in enumerate(arg) for _ in float_slots({"args": [a], "kwargs": {}})]
    return [name] * len(float_slots({"args": [arg], "kwargs": {}}))


_FLOATS = {"bfloat16", "float16", "float32", "float64"}


def assignments(n: int, *, limit: int = 7) -> list[tuple[bool, ...]]:
    """Which of ``n`` slots are float32 (True), the others 16-bit: every mix for ``n`` <= ``limit``,
    else each slot alone and all but each slot; all-16-bit first, all-float32 last."""
    if n <= limit:
        return sorted(itertools.product((False, True), repeat=n), key=sum)
    one = [tuple(i == j for j in range(n)) for i in range(n)]
    return [(False,) * n, *one, *[tuple(not x for x in s) for s in one], (True,) * n]


@dataclass(frozen=True)
class Outcome:
    fp32: tuple[bool, ...]
    """Per floating slot: float32 (True) or the 16-bit dtype."""
    error: str | None
    """The eager error (``forward: ...`` / ``backward: ...``), None when both ran."""


def _value(spec: dict[str, Any], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    shape, stride = spec["tensor"], spec["stride"]
    size = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
    if dtype.is_floating_point:  # in [0, 1): in the domain of log, sqrt, probabilities
        flat = torch.rand(size, generator=gen).to(dtype)
    elif dtype == torch.bool:
        flat = torch.rand(size, generator=gen) > 0.5
    else:  # indices, targets, counts: 0 is in range of every dimension a graph indexes
        flat = torch.zeros(size, dtype=dtype)
    return flat.as_strided(shape, stride)


def _decode(tree: Any, make: Any) -> Any:
    if isinstance(tree, list):
        return [_decode(x, make) for x in tree]
    if isinstance(tree, dict) and "tensor" in tree:
        return make(tree)
    if isinstance(tree, dict) and len(tree) == 1 and next(iter(tree)) in _ENUMS.values():
        key, value = next(iter(tree.items()))
        return torch.device(value) if key == "device" else getattr(torch, value)
    if isinstance(tree, dict):
        return {k: _decode(v, make) for k, v in tree.items()}
    return tree


def _run(example: dict[str, Any], fp32: tuple[bool, ...], low: torch.dtype, device: str) -> str | None:
    op = op_of(example)
    slots = {id(s): i for i, s in enumerate(float_slots(example))}
    gen = torch.Generator().manual_seed(0)
    leaves: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # one tensor per graph value and dtype

    def make(spec: dict[str, Any]) -> torch.Tensor:
        i = slots.get(id(spec))
        dtype = getattr(torch, spec["dtype"]) if i is None else (torch.float32 if fp32[i] else low)
        key = (spec["id"], dtype)
        if key not in leaves:
            leaves[key] = _value(spec, dtype, gen).to(device).requires_grad_(spec["grad"])
        return leaves[key].clone() if spec["grad"] else leaves[key]  # in-place ops write a copy

    args, kwargs = _decode(example["args"], make), _decode(example["kwargs"], make)
    try:
        out = op(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - what the kernel says is the finding
        return f"forward: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs:
        return None
    try:
        torch.autograd.backward([o.float().sum() for o in outs])
    except Exception as e:  # noqa: BLE001
        return f"backward: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def probe(example: dict[str, Any], *, low: torch.dtype = torch.bfloat16, limit: int = 7,
          device: str = "cpu") -> list[Outcome]:
    """Run ``example`` in eager on ``device`` under each of :func:`assignments` of its floating slots."""
    return [Outcome(fp32, _run(example, fp32, low, device))
            for fp32 in assignments(len(float_slots(example)), limit=limit)]
