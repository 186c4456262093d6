"""Group the nodes of a captured graph into layers, find repeated blocks, and aggregate layer facts.

Grouping (the rule, in words)::

    repeated containers: outermost module paths with >= 2 numbered children that run nodes
                         (model.layers, or encoder.block and decoder.block for T5)
    node in container child C.N.*          -> layer C.N
    node in an ancestor of a container     -> glue: joins the next layer that runs (mask, positions)
    any other node                         -> the shallowest module path that is not an ancestor
                                              of a container (embed_tokens, lm_head)
    no container at all                    -> the children of the deepest module every node runs
                                              in (a wrapper's ``inner.albert``, ``inner.predictions``
                                              rather than one layer ``inner``); nodes of that
                                              module's own forward (the loss) are glue
    a module outside the containers that owns no parameters (rotary_emb, dropout) is glue too
    a layer that runs again after another layer started (a module called twice) -> the running layer

so that layers are contiguous in execution order, which is what a pipeline cut needs.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

import torch
import torch.fx
from torch import nn
from torch.utils._pytree import tree_flatten

from planner.modpath import fetch_attr, install_attr
from planner.graph import (META_FLOPS_BWD, META_FLOPS_FWD, META_LAYER, META_MODULE, META_PARAM,
                           META_SAVED_BYTES, META_VAL, Layer)

__all__ = ["group_layers", "split_tied_uses", "aggregate", "find_blocks", "attention_facts", "model_config",
           "COMPUTE_OPS"]

COMPUTE_OPS = ("call_function", "call_method", "call_module")
"""Node ops that run code; each belongs to exactly one layer."""


def _containers(paths: Iterable[str]) -> list[str]:
    children: dict[str, set[str]] = {}
    for path in paths:
        parts = path.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                children.setdefault(".".join(parts[:i]), set()).add(part)
    repeated = [k for k, v in children.items() if len(v) > 1]
    # outermost only: T5's block.N.layer.M repeats inside block.N
    return sorted(c for c in repeated
                  if not any(c != o and _inside(c, o) for o in repeated))


def _inside(path: str, container: str) -> bool:
    """``path`` is within a numbered child of ``container``."""
    prefix = f"{container}." if container else ""
    if not path.startswith(prefix):
        return False
    head = path[len(prefix):].split(".", 1)[0]
    return head.isdigit()


def _is_ancestor(path: str, container: str) -> bool:
    return path == container or container.startswith(f"{path}.") or path == ""


def _common_root(paths: Iterable[str]) -> str:
    """The deepest module path that every non-empty path is in, when at least two of its children
    run nodes; '' otherwise (HF ALBERT under a wrapper: ``inner``, whose children ``albert`` and
    ``predictions`` are the layers, as they are without the wrapper)."""
    split = [p.split(".") for p in set(paths) if p]
    root: list[str] = []
    while len(below := {p[len(root)] for p in split if len(p) > len(root)}) == 1:
        root.append(below.pop())
    return ".".join(root) if len(below) > 1 else ""


def _layer_of(path: str, containers: list[str], root: str = "") -> str | None:
    for c in containers:
        if _inside(path, c):
            rest = path[len(c) + 1:] if c else path
            return f"{c}.{rest.split('.', 1)[0]}" if c else rest.split(".", 1)[0]
    if any(_is_ancestor(path, c) for c in containers) or not path or _is_ancestor(path, root):
        return None
    parts = path.split(".")
    for depth in range(root.count(".") + 2 if root else 1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        if not any(_is_ancestor(prefix, c) for c in containers):
            return prefix
    return path


def _owns_params(model: nn.Module, path: str) -> bool:
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return True  # a path we cannot resolve (a function scope): keep it as a layer
    return next(module.parameters(), None) is not None


def group_layers(gm: torch.fx.GraphModule, model: nn.Module) -> tuple[list[Layer], list[str]]:
    """Set ``META_LAYER`` on every compute and parameter node; return the layers and the containers."""
    param_keys = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    containers = _containers(n.meta.get(META_MODULE, "") for n in compute)
    root = "" if containers else _common_root(n.meta.get(META_MODULE, "") for n in compute)
    order: list[str] = []
    owner: dict[torch.fx.Node, str] = {}
    pending: list[torch.fx.Node] = []
    owns: dict[str, bool] = {}
    for node in compute:
        name = _layer_of(node.meta.get(META_MODULE, ""), containers, root)
        if name is not None and not any(_inside(name, c) for c in containers):
            if name not in owns:
                owns[name] = _owns_params(model, name)
            if not owns[name]:
                name = None
        if name is not None and name in order and order[-1] != name:
            name = order[-1]  # the module runs again later: keep layers contiguous
        if name is None:
            pending.append(node)
            continue
        if not order or order[-1] != name:
            order.append(name)
        for p in pending:
            owner[p] = name
        pending.clear()
        owner[node] = name
    if pending:
        if not order:
            order.append("<root>")
        for p in pending:
            owner[p] = order[-1]
    layers = {name: Layer(name=name, index=i) for i, name in enumerate(order)}
    for node in gm.graph.nodes:
        if node in owner:
            node.meta[META_LAYER] = owner[node]
            layers[owner[node]].nodes.append(node.name)
        elif node.op == "get_attr" and node.users:
            users = [u for u in node.users if u in owner]
            if not users:
                continue
            node.meta[META_LAYER] = owner[min(users, key=lambda u: layers[owner[u]].index)]
            key = node.meta.get(META_PARAM)
            if key is not None:
                for u in users:
                    keys = layers[owner[u]].params if key in param_keys else layers[owner[u]].buffers
                    if key not in keys:
                        keys.append(key)
    for node in compute:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            path = node.meta.get(META_MODULE, "")
            for pname, _ in module.named_parameters(remove_duplicate=False):
                key = f"{path}.{pname}" if path else pname
                if key not in layers[owner[node]].params:
                    layers[owner[node]].params.append(key)
            for bname, _ in module.named_buffers(remove_duplicate=False):
                key = f"{path}.{bname}" if path else bname
                if key not in layers[owner[node]].buffers:
                    layers[owner[node]].buffers.append(key)
    return list(layers.values()), containers


def split_tied_uses(gm: torch.fx.GraphModule, tied: list[list[str]], prefix: str) -> None:
    """Give each user of a tied parameter a get_attr of the key its own module uses.

    ``ep.module()`` (and fx) read a tied tensor through ONE get_attr target for every use (for the
    nanoGPT GPT: ``model.lm_head.weight`` feeds both the embedding and the LM head, and the
    ``model.wte.weight`` get_attr is left without users). The planner and the passes need the
    embedding layer to name ``wte.weight``, so this adds a get_attr per (tensor, key) that is used,
    pointing at the same Parameter, and drops get_attr nodes left without users."""
    group_of = {k: g for g in tied for k in g}
    changed = False
    for node in list(gm.graph.nodes):
        key = node.meta.get(META_PARAM) if node.op == "get_attr" else None
        if key not in group_of:
            continue
        tensor = fetch_attr(gm, str(node.target))
        made: dict[str, torch.fx.Node] = {key: node}
        for user in list(node.users):
            want = _preferred(group_of[key], user.meta.get(META_MODULE, ""), key)
            if want not in made:
                target = f"{prefix}{want}"
                _ensure_attr(gm, target, tensor)
                # keep get_attrs in the model's parameter order: a GraphModule built from this
                # graph registers the shared tensor under the first target it meets
                group = group_of[key]
                where = gm.graph.inserting_before(node) if group.index(want) < group.index(key) \
                    else gm.graph.inserting_after(node)
                with where:
                    new = gm.graph.get_attr(target)
                new.meta.update(node.meta)
                new.meta[META_PARAM] = want
                new.meta[META_MODULE] = want.rpartition(".")[0]
                made[want] = new
            if want != key:
                user.replace_input_with(node, made[want])
                changed = True
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users and node.meta.get(META_PARAM) in group_of:
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _preferred(group: list[str], module: str, default: str) -> str:
    best, depth = default, -1
    for key in group:
        owner = key.rpartition(".")[0]
        if (module == owner or module.startswith(f"{owner}.")) and owner.count(".") > depth:
            best, depth = key, owner.count(".")
    return best


def _ensure_attr(gm: torch.fx.GraphModule, target: str, tensor: Any) -> None:
    try:
        if fetch_attr(gm, target) is tensor:
            return
    except AttributeError:
        pass
    install_attr(gm, target, tensor, buffer=False)


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def aggregate(gm: torch.fx.GraphModule, layers: list[Layer]) -> None:
    """Sum node facts into layers: FLOPs, saved bytes, and the bytes crossing layer boundaries."""
    by_name = {layer.name: layer for layer in layers}
    index = {layer.name: layer.index for layer in layers}
    for node in gm.graph.nodes:
        name = node.meta.get(META_LAYER)
        if name is None or node.op not in COMPUTE_OPS:
            continue
        layer = by_name[name]
        layer.flops_fwd += int(node.meta.get(META_FLOPS_FWD, 0))
        layer.flops_bwd += int(node.meta.get(META_FLOPS_BWD, 0))
        layer.saved_bytes += int(node.meta.get(META_SAVED_BYTES, 0))
        if any(u.meta.get(META_LAYER) not in (None, name) and index[u.meta[META_LAYER]] > layer.index
               for u in node.users):
            layer.output_bytes += _nbytes(node.meta.get(META_VAL))
    table = {n.name: n for n in gm.graph.nodes}
    for layer in layers:
        seen: set[str] = set()
        for node_name in layer.nodes:
            node = table[node_name]
            for arg in node.all_input_nodes:
                if arg.name in seen or arg.op == "get_attr":
                    continue
                if arg.op == "placeholder" or arg.meta.get(META_LAYER) != layer.name:
                    seen.add(arg.name)
                    layer.input_bytes += _nbytes(arg.meta.get(META_VAL))


def find_blocks(model: nn.Module, layers: list[Layer], containers: list[str]) -> dict[str, list[str]]:
    """Repeated blocks: children of a container of the same class. The key is ``C.*`` when every
    child repeats, else a range ``C.[0-2]`` (plan-file syntax). Members may differ in small ways
    (T5's block 0 owns the relative-position bias; the first member also runs the glue), so the
    planner reads each layer's own facts; the block says which layers an FSDP unit or a glob spans."""
    blocks: dict[str, list[str]] = {}
    names = [layer.name for layer in layers]
    for c in containers:
        children = [n for n in names if n.rpartition(".")[0] == c and n.rpartition(".")[2].isdigit()]
        groups: dict[Any, list[str]] = {}
        for child in children:
            groups.setdefault(type(model.get_submodule(child)), []).append(child)
        for members in groups.values():
            if len(members) < 2:
                continue
            idx = [int(m.rpartition(".")[2]) for m in members]
            if len(members) == len(children):
                key = f"{c}.*"
            elif idx == list(range(idx[0], idx[-1] + 1)):
                key = f"{c}.[{idx[0]}-{idx[-1]}]"
            else:
                key = f"{c}.[{','.join(map(str, idx))}]"
            blocks[key] = members
    for key, members in blocks.items():
        for layer in layers:
            if layer.name in members:
                layer.block = key
    return blocks


_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "heads")
_KV = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads")
_HEAD_DIM = ("head_dim", "attention_head_size", "key_value_proj_dim", "d_kv")
_ATTN = re.compile(r"Attention|MultiheadAttention")


def _first_int(objs: Iterable[Any], names: tuple[str, ...]) -> int | None:
    for obj in objs:
        for name in names:
            value = getattr(obj, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def attention_facts(model: nn.Module, layer: str, *, config: Any = None) -> dict[str, int] | None:
    """``{heads, kv_heads, head_dim}`` of the first attention module under ``layer``, from module
    attributes (ours: ``heads``; nn.MultiheadAttention: ``num_heads``) or the model config (Hugging
    Face: ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``; ``config`` is the model's,
    see :func:`model_config`); None if none is found."""
    try:
        root = model.get_submodule(layer)
    except AttributeError:
        return None
    attn = next((m for _, m in root.named_modules() if _ATTN.search(type(m).__name__)), None)
    if attn is None:
        return None
    config = getattr(attn, "config", None) or config
    inner = list(attn.modules())
    scopes = inner + ([config] if config is not None else [])
    heads = _first_int(scopes, _HEADS)
    if heads is None:
        return None
    kv = _first_int(scopes, _KV) or heads
    head_dim = _first_int(scopes, _HEAD_DIM)
    if head_dim is None:
        proj = next((m for n, m in attn.named_modules() if isinstance(m, nn.Linear)
                     and n.rpartition(".")[2] in ("q_proj", "query", "q", "c_attn", "in_proj")), None)
        hidden = _first_int(inner, ("embed_dim", "hidden_size")) or (
            _first_int([config], ("hidden_size", "n_embd", "d_model")) if config is not None else None)
        if hidden is None and proj is not None:
            hidden = proj.out_features
        if hidden is None:
            return None
        head_dim = hidden // heads
    return {"heads": heads, "kv_heads": kv, "head_dim": head_dim}


def model_config(model: nn.Module) -> Any:
    """The first ``config`` attribute in the module tree (Hugging Face models keep it on the root)."""
    return next((m.config for m in model.modules() if getattr(m, "config", None) is not None), None)
