"""Capture a model into a :class:`planner.graph.ModelGraph`.

Usage::

    from planner.capture import capture
    graph = capture(model, (input_ids, labels), loss_fn=None)
    graph.gm(input_ids, labels)            # -> loss, same as the model

Calling convention: ``example_inputs`` is the batch, a tuple. Without ``loss_fn`` the model is
called as ``model(*batch)`` and must return a scalar loss, or an object with a ``loss`` field (as
Hugging Face models do when given labels). With ``loss_fn`` the model is called on ``batch[0]``
and the loss is ``loss_fn(output, *batch[1:])``. The captured graph takes the flat batch and
returns the loss, so every rank graph derived from it does too.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch import nn

from planner.graph import META_LAYER, META_MODULE, META_PARAM, Layer, ModelGraph

__all__ = ["capture", "CaptureError", "LossModule"]


class CaptureError(RuntimeError):
    """The model could not be traced; the message names the source line and what to try."""


class LossModule(nn.Module):
    """``model`` followed by its loss, so that the captured graph returns a scalar loss."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor] | None) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: Any) -> torch.Tensor:
        if self.loss_fn is None:
            return _loss_of(self.model(*batch))
        return self.loss_fn(self.model(batch[0]), *batch[1:])


def _loss_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        raise CaptureError(
            f"the model returned {type(out).__name__}, not a loss: pass loss_fn=, or give the model "
            "the labels it needs to compute its own loss (e.g. labels= for Hugging Face models)")
    return loss


_PREFIX = "model."


def _strip(path: str) -> str:
    """Path in the LossModule wrapper -> path in the user's model."""
    if path == "model":
        return ""
    return path[len(_PREFIX):] if path.startswith(_PREFIX) else path


def capture(model: nn.Module, example_inputs: Sequence[Any], *, loss_fn: Callable[..., torch.Tensor] | None = None,
            annotate: bool = True) -> ModelGraph:
    """Trace ``model`` (real or on ``meta``) with its loss into a flat graph and per-layer facts."""
    batch = tuple(example_inputs)
    wrapper = LossModule(model, loss_fn)
    try:
        ep = torch.export.export(wrapper, batch, strict=False)
    except Exception as exc:  # noqa: BLE001 - re-raised with guidance
        raise CaptureError(f"torch.export could not trace {type(model).__name__}: {exc}") from exc
    gm = ep.module()
    _drop_guards(gm)
    _annotate_paths(gm)
    layers = _group_layers(gm)
    return _model_graph(model, gm, layers)


def _drop_guards(gm: torch.fx.GraphModule) -> None:
    """Remove export's input-shape guard call: the runtime feeds microbatches of other sizes and
    re-captures when a shape-specialized graph is needed."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    gm.graph.lint()
    gm.recompile()


def _annotate_paths(gm: torch.fx.GraphModule) -> None:
    tensors = {k for k, _ in gm.named_parameters(remove_duplicate=False)}
    tensors |= {k for k, _ in gm.named_buffers(remove_duplicate=False)}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in tensors:
            node.meta[META_PARAM] = _strip(str(node.target))
            node.meta[META_MODULE] = _strip(str(node.target).rpartition(".")[0])
        elif node.op == "call_function":
            stack = node.meta.get("nn_module_stack") or {}
            path = next(reversed(stack.values()))[0] if stack else ""
            node.meta[META_MODULE] = _strip(_clean(path))


def _clean(path: str) -> str:
    # export writes some paths as L['self'].model.layers[0]; normalize to dotted form
    path = path.replace("L['self'].", "").replace("L['self']", "")
    return path.replace("[", ".").replace("]", "").replace("'", "")


def _group_layers(gm: torch.fx.GraphModule) -> list[Layer]:
    """Group call_function nodes into layers by module path at the granularity of the largest
    repeated container (``model.layers.N``); nodes outside any layer join the next layer that runs
    (or the last one), so layers stay contiguous in execution order."""
    paths = [n.meta[META_MODULE] for n in gm.graph.nodes if n.op == "call_function"]
    container = _repeated_container(paths)
    order: list[str] = []
    owner: dict[str, str] = {}
    pending: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        name = _layer_of(node.meta[META_MODULE], container)
        if name is None:
            pending.append(node)
            continue
        if name not in owner.values() or (order and order[-1] != name and name not in order):
            order.append(name)
        for p in pending:
            owner[p.name] = name
        pending.clear()
        owner[node.name] = name
    if pending:
        last = order[-1] if order else "<root>"
        if not order:
            order.append(last)
        for p in pending:
            owner[p.name] = last
    layers = {name: Layer(name=name, index=i) for i, name in enumerate(order)}
    for node in gm.graph.nodes:
        if node.name in owner:
            node.meta[META_LAYER] = owner[node.name]
            layers[owner[node.name]].nodes.append(node.name)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and META_PARAM in node.meta and node.users:
            first_user = min(node.users, key=lambda u: u.name not in owner)
            layer = owner.get(first_user.name)
            if layer is not None:
                node.meta[META_LAYER] = layer
                key = node.meta[META_PARAM]
                for user in node.users:
                    if user.name in owner and key not in layers[owner[user.name]].params:
                        layers[owner[user.name]].params.append(key)
    return list(layers.values())


def _repeated_container(paths: Sequence[str]) -> str | None:
    """The module path whose numbered children hold the most nodes (``model.layers``), if any."""
    counts: dict[str, set[str]] = {}
    for path in paths:
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                counts.setdefault(".".join(parts[:i]), set()).add(part)
                break
    repeated = {k: v for k, v in counts.items() if len(v) > 1}
    if not repeated:
        return None
    return max(repeated, key=lambda k: (len(repeated[k]), -k.count(".")))


def _layer_of(path: str, container: str | None) -> str | None:
    """Layer name for a node owned by ``path``: a numbered child of the container, or the child of
    an ancestor of the container, or the top-level child when there is no container."""
    if not path:
        return None
    parts = path.split(".")
    if container is None:
        return parts[0]
    cparts = container.split(".") if container else []
    if parts == cparts[: len(parts)]:
        return None  # glue code in an ancestor of the container (mask and position computation)
    depth = 0
    while depth < len(cparts) and depth < len(parts) and parts[depth] == cparts[depth]:
        depth += 1
    if depth == len(cparts):
        return ".".join(parts[: depth + 1]) if len(parts) > depth else None
    return ".".join(parts[: depth + 1])


def _model_graph(model: nn.Module, gm: torch.fx.GraphModule, layers: list[Layer]) -> ModelGraph:
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    seen: dict[int, str] = {}
    tied: dict[str, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shapes[name] = tuple(p.shape)
        dtypes[name] = str(p.dtype).replace("torch.", "")
        if id(p) in seen:
            tied.setdefault(seen[id(p)], [seen[id(p)]]).append(name)
        else:
            seen[id(p)] = name
    num = sum(p.numel() for p in model.parameters())
    digest = hashlib.sha256(
        "\n".join(f"{k}:{list(v)}" for k, v in sorted(shapes.items())).encode()).hexdigest()[:16]
    for layer in layers:
        counted: set[str] = set()
        for other in layers[: layer.index]:
            counted.update(other.params)
        own = [k for k in layer.params if k in shapes and k not in counted]
        layer.param_count = sum(_numel(shapes[k]) for k in own)
        layer.param_bytes = sum(_numel(shapes[k]) * _itemsize(dtypes[k]) for k in own)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return ModelGraph(gm=gm, layers=layers, model_class=type(model).__name__, fingerprint=digest,
                      num_parameters=num, param_shapes=shapes, param_dtypes=dtypes,
                      modules={n: type(m).__name__ for n, m in model.named_modules()},
                      tied=list(tied.values()), input_names=placeholders)


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype), device="meta").element_size()
