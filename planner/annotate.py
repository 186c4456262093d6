"""Per-node facts of a captured graph, computed on fake tensors (a model on ``meta`` costs no memory).

:func:`annotate_graph` interprets ``gm`` under :class:`FakeTensorMode` and writes, on every node:

* ``META_VAL``: the fake output (shapes, strides, dtypes; ``requires_grad`` as autograd would set it);
* ``META_FLOPS_FWD`` / ``META_FLOPS_BWD``: FLOPs as :class:`torch.utils.flop_counter.FlopCounterMode`
  counts them, forward and backward. Backward counts only the gradients autograd really computes:
  a pass in reverse topological order gives each node the outputs that receive a gradient, and its
  inputs that require one (the first layer gets no grad-input for the token ids);
* ``META_SAVED_BYTES``: bytes of the tensors autograd saves for backward (captured with
  :func:`torch.autograd.graph.saved_tensors_hooks`), mapped back to the storage of the node that
  produced them and counted once per storage across the graph (``x`` saved by the q, k and v
  projections counts once, at q). Parameters and buffers are not activations and are not counted.
* ``META_SAVED``: the same tensors one by one, each with the node whose output holds it (what
  tensor parallelism needs to tell a replicated saved input from a sharded one);
* ``META_SAVED_PARAMS``: the parameters (their ``get_attr`` nodes) the op saves, which a plan
  casting them for compute saves as 16-bit copies.

How: each node runs in isolation on detached fake inputs that require grad exactly when the
producing value does; its backward runs in isolation with fake ``ones`` gradients. Results are
cached by (op, argument shapes/strides/dtypes/requires_grad, other arguments), and the backward by
(that key, outputs that receive a gradient), so the 95 repeats of a 96-layer GPT block cost one
dictionary lookup per node each.

FLOPs are counted with :func:`planner.flops.flop_formulas` added to FlopCounterMode's table (torch
2.13 counts 0 for CPU flash attention and grouped matmuls).
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Iterator

import torch
import torch.fx
import torch.utils.flop_counter as fc
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from planner.fake_device import fix_device, with_device
from planner.flops import flop_formulas, register_flop_formula
from planner.annotate_errors import AnnotateError, dynamic_shape, example_values, explain
from planner.annotate_state import AnnotateStats, _OpFacts, _Record, _State
from planner.graph import (META_FLOPS_BWD, META_FLOPS_FWD, META_LAYER, META_SAVED, META_SAVED_BYTES, META_SAVED_PARAMS,
                           META_VAL)
from planner.modpath import fetch_attr

__all__ = ["annotate_graph", "flop_formulas", "register_flop_formula", "AnnotateStats", "AnnotateError"]


def _leaves(value: Any) -> list[Any]:
    """``tree_flatten(value)[0]``, without pytree for a tensor (a leaf), as most values are."""
    return [value] if isinstance(value, torch.Tensor) else tree_flatten(value)[0]


def _input_specs(flat: list[Any]) -> tuple[Any, ...]:
    return tuple((tuple(x.shape), x.dtype) for x in flat if isinstance(x, torch.Tensor))


_FWD_CACHE_LIMIT = 100_000


class _Annotator:
    def __init__(self, gm: torch.fx.GraphModule, inputs: tuple[Any, ...], device: torch.device,
                 replicas: dict[str, str]) -> None:
        self.gm = gm
        self.inputs = inputs
        self.device = device
        self.remap_meta = device.type != "meta"
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.fakes: dict[int, torch.Tensor] = {}
        self.shared: dict[Any, torch.Tensor] = {}
        self.remaps: dict[int, torch.fx.GraphModule] = {}
        self.replicas = replicas
        self.by_name: dict[str, torch.fx.Node] = {}
        self.fwd_cache: dict[Any, _OpFacts] = {}
        self.bwd_cache: dict[Any, tuple[int, tuple[int, ...]]] = {}
        self.stats = AnnotateStats()
        self.formulas = flop_formulas()
        self.s = _State()
        self.real: dict[str, Any] | None = None
        """Node values on the example batch, computed on the first data-dependent op (``_real_value``)."""

    # -- helpers -----------------------------------------------------------------------------

    def _fake(self, t: torch.Tensor, requires_grad: bool, *, share: bool = False) -> torch.Tensor:
        """A fake tensor standing for ``t``. Parameters (``share``) of one shape share one fake:
        they are never counted as activations, and 1T parameters' worth of fakes is 10k fake ops."""
        cached = self.fakes.get(id(t))
        if cached is None:
            rg = requires_grad and (t.is_floating_point() or t.is_complex())
            spec = (tuple(t.shape), tuple(t.stride()), t.dtype, rg)
            cached = self.shared.get(spec) if share else None
            if cached is None:
                cached = torch.empty_strided(spec[0], spec[1], dtype=t.dtype, device=self.device)
                if rg:
                    cached.requires_grad_(True)
                if share:
                    self.shared[spec] = cached
            self.fakes[id(t)] = cached
        return cached

    def _skey(self, t: torch.Tensor) -> int:
        key = t.untyped_storage()._cdata
        return self.s.alias.get(key, key)

    def _fix_device(self, a: Any) -> Any:
        return fix_device(a, self.device)

    def _substitute(self, node: torch.fx.Node) -> tuple[tuple[Any, ...], dict[str, Any], list[tuple[str, int] | None]]:
        """Node arguments with values filled in, plus where each tensor in the flat list came from."""
        prov: list[tuple[str, int] | None] = []

        def sub(a: Any) -> Any:
            if isinstance(a, torch.fx.Node):
                value = self.s.env[a.name]
                flat = _leaves(value)
                prov.extend((a.name, j) for j, x in enumerate(flat) if isinstance(x, torch.Tensor))
                return value
            if isinstance(a, (tuple, list)):
                return type(a)(sub(x) for x in a)
            if isinstance(a, dict):
                return {k: sub(v) for k, v in a.items()}
            if isinstance(a, torch.Tensor):
                prov.append(None)
                return self._fake(a, False)
            return self._fix_device(a) if self.remap_meta else a

        def sub_value(v: Any) -> Any:
            # a higher-order op's body (export's wrap_with_set_grad_enabled) is a GraphModule whose
            # nodes carry device=meta for a meta model: run a copy that says the annotation device
            if self.remap_meta and isinstance(v, torch.fx.GraphModule):
                return self._remapped(v)
            return v

        args = tuple(sub_value(sub(a)) for a in node.args)
        kwargs = {k: sub_value(sub(v)) for k, v in node.kwargs.items()}
        return args, kwargs, prov

    def _remapped(self, sub: torch.fx.GraphModule) -> torch.fx.GraphModule:
        copy = self.remaps.get(id(sub))
        if copy is None:
            copy = self.remaps[id(sub)] = with_device(sub, self.device)
        return copy

    def _call(self, node: torch.fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if node.op == "call_function":
            return node.target(*args, **kwargs)  # type: ignore[operator]
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        module = self.gm.get_submodule(str(node.target))
        return torch.func.functional_call(module, self._module_state(module), args, kwargs, tie_weights=False)

    def _module_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Fake parameters and buffers of a leaf module (fx ``call_module``), registered as params."""
        state = {n: self._fake(t, isinstance(t, torch.nn.Parameter) and t.requires_grad, share=True)
                 for n, t in itertools.chain(module.named_parameters(remove_duplicate=False),
                                             module.named_buffers(remove_duplicate=False))}
        self.s.params.update(self._skey(t) for t in state.values())
        return state

    def _key(self, node: torch.fx.Node, flat: list[Any], spec: Any) -> Any:
        if node.op == "call_module":
            module = self.gm.get_submodule(str(node.target))
            target: Any = ("module", type(module).__qualname__, repr(module))
        elif node.op == "call_method":
            target = ("method", node.target)
        else:
            target = node.target
        storages: dict[int, int] = {}
        parts: list[Any] = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                skey = self._skey(x)
                parts.append((tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, x.requires_grad,
                              storages.setdefault(skey, len(storages))))
            elif isinstance(x, torch.nn.Module):
                parts.append(("module", id(x)))
            else:
                try:
                    hash(x)
                    parts.append((type(x), x))
                except TypeError:
                    parts.append((type(x), repr(x)))
        return (target, str(spec), tuple(parts))

    # -- forward -----------------------------------------------------------------------------

    def _mutates(self, node: torch.fx.Node) -> bool:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            return bool(target._schema.is_mutable)
        name = str(target) if node.op == "call_method" else getattr(target, "__name__", "")
        return (name.endswith("_") and not name.endswith("__")) or node.kwargs.get("inplace") is True

    def _run(self, node: torch.fx.Node, flat: list[Any], spec: Any) -> tuple[_OpFacts, _Record, list[Any]]:
        """Run the node alone with autograd on, counting FLOPs and recording saved tensors."""
        self.stats.runs += 1
        mutates = self._mutates(node)
        leaves: list[torch.Tensor | None] = []
        call_flat: list[Any] = []
        with torch.enable_grad():
            for x in flat:
                if isinstance(x, torch.Tensor):
                    leaves.append(x if x.requires_grad else None)
                    if mutates:
                        clone = x.clone()
                        self.s.alias[clone.untyped_storage()._cdata] = self._skey(x)
                        x = clone
                call_flat.append(x)
        if node.op == "call_module":  # a leaf's parameters are inputs of its backward too
            state = self._module_state(self.gm.get_submodule(str(node.target)))
            leaves.extend(t for t in state.values() if t.requires_grad)
        in_keys = {self._skey(x): i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)}
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        args, kwargs = tree_unflatten(call_flat, spec)
        any_grad = any(leaf is not None for leaf in leaves)
        with torch.set_grad_enabled(any_grad), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                fc.FlopCounterMode(display=False, custom_mapping=self.formulas) as counter:
            out = self._call(node, args, kwargs)
        out_flat, out_spec = tree_flatten(out)
        out_keys = {self._skey(o): j for j, o in enumerate(out_flat) if isinstance(o, torch.Tensor)}
        saved_facts: list[tuple[str, int, int]] = []
        tmps: dict[int, int] = {}
        for t in saved:
            skey, nbytes = self._skey(t), t.untyped_storage().nbytes()
            if skey in self.s.params:  # not an activation; which ones, for a plan that saves their casts
                if skey in in_keys:
                    saved_facts.append(("param", in_keys[skey], nbytes))
                continue
            if skey in in_keys:
                saved_facts.append(("in", in_keys[skey], nbytes))
            elif skey in out_keys:
                saved_facts.append(("out", out_keys[skey], nbytes))
            elif skey not in tmps:
                tmps[skey] = len(tmps)
                saved_facts.append(("tmp", tmps[skey], nbytes))
        specs = [(tuple(o.shape), tuple(o.stride()), o.storage_offset(), o.dtype, o.requires_grad,
                  in_keys.get(self._skey(o), -1)) if isinstance(o, torch.Tensor) else o for o in out_flat]
        facts = _OpFacts(flops=counter.get_total_flops(), saved=saved_facts, outs=(specs, out_spec))
        return facts, _Record(leaves=leaves, outs=out_flat), out_flat

    def _real_value(self, node: torch.fx.Node) -> Any:
        """The node's value on the example batch (``planner.annotate_errors.example_values``) for an
        op whose output size depends on the data (``nonzero``, masked indexing: MoE routing); None
        on meta, which has no values."""
        if self.real is None:
            params = list(itertools.chain(self.gm.parameters(), self.gm.buffers()))
            if any(t.device.type == "meta" for t in params) or not all(
                    not isinstance(x, torch.Tensor) or x.device.type != "meta" for x in self.inputs):
                self.real = {}
                return None
            self.real = example_values(self.gm, self.inputs)
        return self.real.get(node.name)

    def _from_real(self, real: Any) -> tuple[_OpFacts, _Record, list[Any]]:
        """Facts of a data-dependent op from its value on the example batch: its output shapes (a
        fake of each), no FLOPs, nothing saved, no gradient through it (its outputs are indices)."""
        flat, spec = tree_flatten(real)
        outs = [torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=self.device)
                if isinstance(t, torch.Tensor) else t for t in flat]
        specs = [(tuple(o.shape), tuple(o.stride()), 0, o.dtype, False, -1) if isinstance(o, torch.Tensor) else o
                 for o in outs]
        return _OpFacts(flops=0, saved=[], outs=(specs, spec)), _Record(leaves=[], outs=outs), outs

    def _rebuild(self, facts: _OpFacts, flat: list[Any]) -> Any:
        specs, out_spec = facts.outs
        outs: list[Any] = []
        for s in specs:
            if not (isinstance(s, tuple) and len(s) == 6 and isinstance(s[3], torch.dtype)):
                outs.append(s)
                continue
            shape, stride, offset, dtype, rg, alias = s
            if alias >= 0:  # set_, not as_strided: a view may change the dtype (aten.real, view_as_complex)
                t = torch.empty(0, dtype=dtype, device=self.device).set_(
                    flat[alias].untyped_storage(), offset, shape, stride)
            else:
                t = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
            outs.append(t.requires_grad_(True) if rg else t)
        return tree_unflatten(outs, out_spec)

    def forward(self, node: torch.fx.Node) -> None:
        s = self.s
        args, kwargs, prov = self._substitute(node)
        flat, spec = tree_flatten((args, kwargs))
        s.prov[node.name] = prov
        if node.op == "call_function" and node.target is operator.getitem and not isinstance(args[0], torch.Tensor):
            s.env[node.name] = args[0][args[1]]
            node.meta.update({META_VAL: s.env[node.name], META_FLOPS_FWD: 0, META_SAVED_BYTES: 0})
            return
        template = self.replicas.get(node.name)
        s.inputs[node.name] = specs = _input_specs(flat)
        # planner.replicate matches a block by its ops and wiring; an input from another layer can
        # still differ in shape (VGG's ReLU after 16- and after 32-channel batch norms): then run it
        if template is not None and template in s.facts and s.inputs.get(template) == specs:
            self._copy(node, template, flat)
            return
        key = self._key(node, flat, spec)
        s.keys[node.name] = key
        facts = self.fwd_cache.get(key)
        if facts is None:
            try:
                facts, record, out_flat = self._run(node, flat, spec)
            except Exception as exc:  # noqa: BLE001 - re-raised with the node and the source line
                real = self._real_value(node) if dynamic_shape(exc) else None
                if real is None:
                    raise AnnotateError(explain(node, exc)) from exc
                facts, record, out_flat = self._from_real(real)
            else:
                if len(self.fwd_cache) < _FWD_CACHE_LIMIT:
                    self.fwd_cache[key] = facts
            if any(isinstance(o, torch.Tensor) and o.requires_grad for o in out_flat):
                s.records[node.name] = record
            value = tree_unflatten([o.detach().requires_grad_(o.requires_grad)
                                    if isinstance(o, torch.Tensor) else o for o in out_flat], facts.outs[1])
        else:
            value = self._rebuild(facts, flat)
        s.env[node.name] = value
        s.facts[node.name] = facts
        out_flat = _leaves(value)
        saved: list[tuple[str, int]] = []
        params: list[str] = []
        for kind, index, nbytes in facts.saved:
            if kind == "tmp":
                saved.append((node.name, nbytes))
                continue
            if kind == "param":
                params.append(_producer(node.name, prov, flat, index))
                continue
            t = flat[index] if kind == "in" else out_flat[index]
            skey = self._skey(t)
            if skey not in s.counted:
                s.counted.add(skey)
                saved.append((_producer(node.name, prov, flat, index) if kind == "in" else node.name,
                              t.untyped_storage().nbytes()))
        node.meta.update({META_VAL: value, META_FLOPS_FWD: facts.flops, META_SAVED_BYTES: sum(n for _, n in saved),
                          META_SAVED: tuple(saved), META_SAVED_PARAMS: tuple(params)})

    def _copy(self, node: torch.fx.Node, template: str, flat: list[Any]) -> None:
        """Facts of a replica node (``planner.replicate``): the template's, with no fake op run.
        Values used only inside the block are the template's own fakes; values leaving the block get
        fresh storage so that the next layer's saved-bytes accounting sees a new tensor."""
        s = self.s
        s.keys[node.name] = s.keys[template]
        s.facts[node.name] = facts = s.facts[template]
        layer = node.meta.get(META_LAYER)
        if any(u.meta.get(META_LAYER) != layer for u in node.users):
            value = self._rebuild(facts, flat)
            out_flat = _leaves(value)
            for kind, index, _ in facts.saved:  # saved here: no later node may count them again
                if kind in ("in", "out"):
                    s.counted.add(self._skey(flat[index] if kind == "in" else out_flat[index]))
        else:
            value = s.env[template]
        s.env[node.name] = value
        t = self.by_name[template]
        # the template's saved tensors come from its own inputs: the replica's inputs in the same places
        rename = {a[0]: b[0] for a, b in zip(s.prov[template], s.prov[node.name]) if a is not None and b is not None}
        rename[template] = node.name
        node.meta.update({META_VAL: value, META_FLOPS_FWD: t.meta[META_FLOPS_FWD],
                          META_SAVED_BYTES: t.meta[META_SAVED_BYTES],
                          META_SAVED: tuple((rename.get(p, p), n) for p, n in t.meta[META_SAVED]),
                          META_SAVED_PARAMS: tuple(rename.get(p, p) for p in t.meta.get(META_SAVED_PARAMS, ()))})

    # -- backward ----------------------------------------------------------------------------

    def backward(self, node: torch.fx.Node, received: dict[str, set[int]]) -> None:
        got = received.get(node.name, set())
        prov = self.s.prov.get(node.name, [])
        if node.op == "call_function" and node.target is operator.getitem and node.name not in self.s.keys:
            if got and prov:
                src = node.args[0]
                assert isinstance(src, torch.fx.Node)
                flat_src = tree_flatten(self.s.env[src.name])[0]
                chosen = self.s.env[node.name]
                for j, x in enumerate(flat_src):
                    if x is chosen or (isinstance(chosen, (tuple, list)) and any(x is c for c in chosen)):
                        received.setdefault(src.name, set()).add(j)
            node.meta[META_FLOPS_BWD] = 0
            return
        key = self.s.keys.get(node.name)
        if key is None or not got:
            node.meta[META_FLOPS_BWD] = 0
            return
        bkey = (key, tuple(sorted(got)))
        cached = self.bwd_cache.get(bkey)
        if cached is None:
            cached = self._run_backward(node, got)
            self.bwd_cache[bkey] = cached
        flops, grads_to = cached
        node.meta[META_FLOPS_BWD] = flops
        for i in grads_to:
            source = prov[i] if i < len(prov) else None
            if source is not None:
                received.setdefault(source[0], set()).add(source[1])

    def _inputs_of(self, node: torch.fx.Node) -> Any:
        args, kwargs, _ = self._substitute(node)
        return (args, kwargs)

    def _run_backward(self, node: torch.fx.Node, got: set[int]) -> tuple[int, tuple[int, ...]]:
        self.stats.backward_runs += 1
        record = self.s.records.get(node.name)
        if record is None:  # forward came from the cache: run it again to get an autograd graph
            flat, spec = tree_flatten(self._inputs_of(node))
            _, record, _ = self._run(node, flat, spec)
        outs = [o for j, o in enumerate(record.outs)
                if j in got and isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [(i, leaf) for i, leaf in enumerate(record.leaves) if leaf is not None]
        if not outs or not wrt:
            return 0, ()
        with fc.FlopCounterMode(display=False, custom_mapping=self.formulas) as counter:
            grads = torch.autograd.grad(outs, [leaf for _, leaf in wrt], [torch.ones_like(o) for o in outs],
                                        allow_unused=True)
        return counter.get_total_flops(), tuple(i for (i, _), g in zip(wrt, grads) if g is not None)

    # -- driver ------------------------------------------------------------------------------

    def run(self) -> AnnotateStats:
        nodes = list(self.gm.graph.nodes)
        self.by_name = {n.name: n for n in nodes}
        inputs: Iterator[Any] = iter(self.inputs)
        with self.mode:
            for node in nodes:
                self.stats.nodes += 1
                if node.op == "placeholder":
                    x = next(inputs, None)
                    value = self._fake(x, x.requires_grad) if isinstance(x, torch.Tensor) else x
                    self.s.env[node.name] = value
                    node.meta.update({META_VAL: value, META_FLOPS_FWD: 0, META_FLOPS_BWD: 0, META_SAVED_BYTES: 0})
                elif node.op == "get_attr":
                    attr = fetch_attr(self.gm, str(node.target))
                    if isinstance(attr, torch.Tensor):
                        value = self._fake(attr, isinstance(attr, torch.nn.Parameter) and attr.requires_grad,
                                           share=True)
                        self.s.params.add(self._skey(value))
                    else:
                        value = attr
                    self.s.env[node.name] = value
                    node.meta.update({META_VAL: value, META_FLOPS_FWD: 0, META_FLOPS_BWD: 0, META_SAVED_BYTES: 0})
                elif node.op == "output":
                    node.meta.update({META_FLOPS_FWD: 0, META_FLOPS_BWD: 0, META_SAVED_BYTES: 0})
                else:
                    self.forward(node)
            received: dict[str, set[int]] = {}
            out_node = nodes[-1]
            for arg in tree_flatten(out_node.args)[0]:
                if isinstance(arg, torch.fx.Node):
                    flat = tree_flatten(self.s.env[arg.name])[0]
                    received.setdefault(arg.name, set()).update(
                        j for j, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad)
            for node in reversed(nodes):
                if node.op in ("call_function", "call_method", "call_module"):
                    self.backward(node, received)
        self.s.records.clear()
        return self.stats


def _producer(name: str, prov: list[tuple[str, int] | None], flat: list[Any], index: int) -> str:
    """The node whose output is ``flat[index]``, an input of node ``name`` ('' for a constant):
    ``prov`` lists the sources of the tensors in ``flat``, in order."""
    source = prov[sum(isinstance(x, torch.Tensor) for x in flat[:index])]
    return source[0] if source is not None else ""


def annotate_graph(gm: torch.fx.GraphModule, example_inputs: tuple[Any, ...], *,
                   device: torch.device | str | None = None, replicas: dict[str, str] | None = None) -> AnnotateStats:
    """Write ``META_VAL``, ``META_FLOPS_FWD``, ``META_FLOPS_BWD`` and ``META_SAVED_BYTES`` on every node.

    ``example_inputs`` are the graph's flat inputs, real or meta; only their shapes, strides and
    dtypes are read. ``device`` is where the fake tensors claim to live: by default the device of the
    parameters, or CPU for a model on ``meta`` (``meta`` would send attention down the math path and
    miscount it). FLOPs are what that device's kernels count. ``replicas`` (replica node -> template
    node, from :func:`planner.replicate.replica_map`) copies facts instead of recomputing them."""
    if device is None:
        first = next(itertools.chain(gm.parameters(), gm.buffers()), None)
        device = first.device if first is not None and first.device.type != "meta" else torch.device("cpu")
    return _Annotator(gm, tuple(example_inputs), torch.device(device), replicas or {}).run()
