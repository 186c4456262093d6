"""Tensor-parallel rules simulated in one process: every tp rank of a tiny graph, in threads.

``run_case`` builds a one-op (or few-op) fx graph, gives each input a placement (replicated, a
shard of some dim, a partial sum, a disjoint partial sum), rewrites it for every tp rank with the
real rule table (``passes.tp.model_rules.rule_for``) and the real :class:`Rewriter`, runs the rank
graphs in threads whose collectives meet in memory (``passes.ops.comm``'s primitives patched to
sum / gather / scatter across the threads), and compares with the op on the full tensors:

* forward: the ranks' outputs, assembled by their placements (R: every rank holds it, S: chunks
  concatenated, P: summed), equal the single-device output;
* backward: with a random cotangent fed by the gradient convention (R and P: the full cotangent;
  S: its chunk), every rank's input gradient equals the convention applied to the full gradient
  (R and P inputs: the full gradient; S inputs: their chunk of it).

A rule may instead refuse (``TPShardError``); any other exception is a bug in the rule.
"""

from __future__ import annotations

import itertools
import operator
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.fx
from torch import nn

from passes.layout import TensorShard
from passes.ops import comm
from passes.tp.model_rules import rule_for
from passes.tp.placement import PD, P, Placement, R, S
from passes.tp.rewrite import Rewriter, TPShardError

__all__ = ["In", "I", "O", "Step", "Case", "Outcome", "run_case", "placements_for", "all_placements",
           "simulated_comm"]

SUPPORT = "rows"  # the partition every disjoint partial input in a case shares


@dataclass(frozen=True)
class In:
    """One input of a case: an activation (placeholder), a parameter (get_attr) or integer data."""

    shape: tuple[int, ...]
    kind: str = "act"  # "act" | "pos" (positive floats) | "f32" | "param" | "int" | "bool" | "const"
    high: int = 4  # integers are drawn from [0, high)
    fused: bool = False  # also try a fused shard (2 blocks) of the last dim
    value: Any = None  # for "const": the tensor itself (replicated only)
    ignore: bool = False  # for "int": set some entries to -100 (ignore_index)


@dataclass(frozen=True)
class Step:
    """``target(*args, **kwargs)``; arguments name case inputs (``I(0)``) or earlier steps (``O(0)``)."""

    target: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """A chain of ops on some inputs; the output is the last step's. ``mul(x, x)`` is
    ``Case("mul", (In((4, 8)),), (Step(aten.mul.Tensor, (I(0), I(0))),))``."""

    name: str
    inputs: tuple[In, ...]
    steps: tuple[Step, ...]
    compare: str = "value"  # "value" | "shape" (empty_like) | "none" (no tensor output)
    grad: bool = True
    functionalize: bool = False  # run passes.tp.functionalize on the graph first (in-place on intermediates)
    tol: float = 1e-7
    partial: bool = True  # try partial-sum inputs
    limit: int = 0  # at most this many placement combinations (a deterministic sample), 0: all

    @property
    def targets(self) -> list[Any]:
        return [s.target for s in self.steps]


@dataclass(frozen=True)
class I:  # noqa: E742 - reads like the notation
    """Input ``i`` of a case, as an argument."""

    i: int


@dataclass(frozen=True)
class O:  # noqa: E742 - reads like the notation
    """The output of step ``k`` of a case, as an argument."""

    k: int


@dataclass
class Outcome:
    placements: tuple[Placement, ...]
    refused: str = ""
    out_places: Any = None


# ------------------------------------------------------------------------------------------ comm


class _Group:
    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n, timeout=30)
        self.slots: list[Any] = [None] * n
        self.local = threading.local()

    def exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        r = self.local.rank
        self.slots[r] = t.detach().clone()
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got


@contextmanager
def simulated_comm(n: int) -> Iterator[_Group]:
    """``passes.ops.comm``'s primitives on ``n`` threads of this process (each thread sets
    ``group.local.rank``)."""
    g = _Group(n)

    def all_reduce_(t: torch.Tensor, axis: str, *, op: Any = None, async_op: bool = False) -> None:
        got = g.exchange(t)
        is_max = op is not None and "MAX" in str(op).upper()
        out = torch.stack(got).amax(0) if is_max else torch.stack(got).sum(0)
        with torch.no_grad():
            t.copy_(out)

    def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, axis: str, *, async_op: bool = False) -> None:
        got = g.exchange(shard.contiguous())
        with torch.no_grad():
            out.copy_(torch.cat([x.reshape(-1) for x in got]).reshape(out.shape))

    def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, axis: str, *, async_op: bool = False) -> None:
        got = g.exchange(full.contiguous())
        total = torch.stack(got).sum(0).reshape(-1)
        with torch.no_grad():
            out.copy_(total.chunk(n)[g.local.rank].reshape(out.shape))

    saved = {k: getattr(comm, k) for k in ("all_reduce_", "all_gather_flat", "reduce_scatter_flat", "group_size",
                                            "group_rank")}
    comm.all_reduce_ = all_reduce_  # type: ignore[assignment]
    comm.all_gather_flat = all_gather_flat  # type: ignore[assignment]
    comm.reduce_scatter_flat = reduce_scatter_flat  # type: ignore[assignment]
    comm.group_size = lambda axis: n  # type: ignore[assignment]
    comm.group_rank = lambda axis: g.local.rank  # type: ignore[assignment]
    try:
        yield g
    finally:
        for k, v in saved.items():
            setattr(comm, k, v)


# ------------------------------------------------------------------------------------------ placements


def placements_for(spec: In, tp: int, *, partial: bool = True) -> list[Placement]:
    """Every placement worth trying for one input at ``tp``."""
    if spec.kind == "const":
        return [R]
    if spec.kind in ("int", "bool"):
        return [R] + [S(d) for d, n in enumerate(spec.shape) if n % tp == 0 and n > 1]
    out = [R] + [S(d) for d, n in enumerate(spec.shape) if n % tp == 0 and n > 1]
    if spec.fused and spec.shape and spec.shape[-1] % (2 * tp) == 0:
        out.append(S(len(spec.shape) - 1, 2))
    if spec.kind in ("act", "pos", "f32") and partial:
        out.append(P)
        if spec.shape:
            out.append(PD(SUPPORT, 0))
    return out


def _local(full: torch.Tensor, place: Placement, tp: int, r: int, weights: dict[Any, list[torch.Tensor]]) -> torch.Tensor:
    if place.is_r:
        return full.clone()
    if place.is_s:
        return TensorShard(key="x", global_shape=tuple(full.shape), dim=place.dim, index=r, count=tp,
                           parts=place.parts).slice(full).clone()
    if place.disjoint:
        owner = torch.arange(full.shape[place.dim]) % tp
        shape = [1] * full.dim()
        shape[place.dim] = full.shape[place.dim]
        return full * (owner == r).reshape(shape).to(full.dtype)
    # a random split: rank r holds full * w_r with weights summing to 1
    key = (tuple(full.shape), full.dtype)
    if key not in weights:  # one random split per shape and dtype: pieces sum to the value exactly enough
        gen = torch.Generator().manual_seed(len(weights) + 1)
        raw = [torch.rand(full.shape, generator=gen, dtype=full.dtype) + 0.5 for _ in range(tp - 1)]
        pieces = [w / tp for w in raw]
        weights[key] = pieces + [1 - sum(pieces)] if pieces else [torch.ones_like(full)]
    return full * weights[key][r]


def _assemble(pieces: list[Any], place: Placement, tp: int, check: bool = True) -> torch.Tensor:
    if place.is_r:
        for p in pieces[1:] if check else []:
            torch.testing.assert_close(p, pieces[0], rtol=1e-9, atol=1e-9, msg="replicated output differs across ranks")
        return pieces[0]
    if place.is_s:
        return TensorShard(key="x", global_shape=(), dim=place.dim, index=0, count=tp, parts=place.parts).assemble(
            list(pieces))
    return sum(pieces[1:], pieces[0])


def _cotangent_piece(g: torch.Tensor, place: Placement, tp: int, r: int) -> torch.Tensor:
    if place.is_s:
        return TensorShard(key="x", global_shape=tuple(g.shape), dim=place.dim, index=r, count=tp,
                           parts=place.parts).slice(g)
    return g


# ------------------------------------------------------------------------------------------ running


def _values(case: Case, gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for spec in case.inputs:
        if spec.kind == "int":
            t = torch.randint(0, spec.high, spec.shape, generator=gen)
            if spec.ignore:
                t[::3] = -100
            out.append(t)
        elif spec.kind == "bool":
            out.append(torch.rand(spec.shape, generator=gen) > 0.5)
        elif spec.kind == "const":
            out.append(spec.value.clone())
        elif spec.kind == "pos":
            out.append(torch.rand(spec.shape, generator=gen, dtype=torch.float64) + 0.5)
        elif spec.kind == "f32":
            out.append(torch.randn(spec.shape, generator=gen, dtype=torch.float32))
        else:
            out.append(torch.randn(spec.shape, generator=gen, dtype=torch.float64))
    return out


def _call(case: Case, tensors: Sequence[Any]) -> Any:
    results: list[Any] = []

    def fill(a: Any) -> Any:
        if isinstance(a, I):
            return tensors[a.i]
        if isinstance(a, O):
            return results[a.k]
        if isinstance(a, (list, tuple)):
            return type(a)(fill(x) for x in a)
        return a

    for step in case.steps:
        results.append(step.target(*fill(step.args), **{k: fill(v) for k, v in step.kwargs.items()}))
    return results[-1]


def _graph(case: Case, vals: list[torch.Tensor]) -> torch.fx.GraphModule:
    """The single-device graph of the case, with ``val`` meta (inputs x0, x1, ... or parameters
    w0, w1, ...; the output is a tuple of the last step's tensors)."""
    root = nn.Module()
    g = torch.fx.Graph()
    nodes: list[torch.fx.Node] = []
    for i, (spec, v) in enumerate(zip(case.inputs, vals)):
        if spec.kind == "param":
            root.register_parameter(f"w{i}", nn.Parameter(v.clone()))
            n = g.get_attr(f"w{i}")
            n.meta["fs_param"] = f"w{i}"
        else:
            n = g.placeholder(f"x{i}")
        n.meta["val"] = torch.empty_like(v, device="meta")
        nodes.append(n)
    steps: list[torch.fx.Node] = []

    def fill(a: Any) -> Any:
        if isinstance(a, I):
            return nodes[a.i]
        if isinstance(a, O):
            return steps[a.k]
        if isinstance(a, (list, tuple)):
            return type(a)(fill(x) for x in a)
        return a

    for step in case.steps:
        node = g.call_function(step.target, fill(step.args), {k: fill(v) for k, v in step.kwargs.items()})
        ref = _call(Case(case.name, case.inputs, case.steps[:len(steps) + 1]), [v.clone() for v in vals])
        if isinstance(ref, (tuple, list)):
            node.meta["val"] = [torch.empty_like(t, device="meta") for t in ref]
        else:
            node.meta["val"] = torch.empty_like(ref, device="meta") if isinstance(ref, torch.Tensor) else ref
        steps.append(node)
    last, ref = steps[-1], _call(case, [v.clone() for v in vals])
    outs: list[Any] = []
    if isinstance(ref, (tuple, list)):
        for j, t in enumerate(ref):
            item = g.call_function(operator.getitem, (last, j))
            item.meta["val"] = torch.empty_like(t, device="meta")
            outs.append(item)
    else:
        outs.append(last)
    g.output(tuple(outs))
    gm = torch.fx.GraphModule(root, g)
    if case.functionalize:
        from passes.tp.functionalize import functionalize_inplace

        gm = functionalize_inplace(gm)
    return gm


def _io(gm: torch.fx.GraphModule) -> tuple[list[torch.fx.Node], list[Any]]:
    inputs = [n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return inputs, list(out.args[0])


def _rank_graph(gm: torch.fx.GraphModule, inputs: list[torch.fx.Node], places: tuple[Placement, ...],
                outs: list[Any], tp: int, r: int, sp: bool) -> tuple[torch.fx.GraphModule, list[Any]]:
    params = {str(n.target): p for n, p in zip(inputs, places) if n.op == "get_attr"}
    rw = Rewriter(gm, tp=tp, index=r, axis="tp", sequence_parallel=sp, seq_dim=1, params=params, styles={})
    for node in gm.graph.nodes:
        rw.cur = node
        rw.grad[node] = rw.compute_grad(node)
        if node.op in ("placeholder", "get_attr"):
            new = rw.graph.placeholder(node.name) if node.op == "placeholder" else rw.graph.get_attr(str(node.target))
            new.meta = dict(node.meta)
            place = places[inputs.index(node)]
            if place.is_s:
                rw.set_local_val(new, node, place)
        elif node.op == "call_function":
            new, place = rule_for(node.target)(rw, node)
        else:
            rw.graph.output(tuple(rw.env[o] for o in outs))
            continue
        rw.env[node], rw.place[node] = new, place
    rw.graph.lint()
    root = nn.Module()
    for n, p in zip(inputs, places):
        if n.op == "get_attr":
            full = getattr(gm, str(n.target)).detach()
            local = TensorShard(key="w", global_shape=tuple(full.shape), dim=p.dim, index=r, count=tp,
                                parts=p.parts).slice(full) if p.is_s else full
            root.register_parameter(str(n.target), nn.Parameter(local.clone()))
    return torch.fx.GraphModule(root, rw.graph), [rw.place[o] for o in outs]


def run_case(case: Case, places: tuple[Placement, ...], tp: int, *, sp: bool = False, seed: int = 0) -> Outcome:
    """Rewrite and run ``case`` with input placements ``places`` on ``tp`` simulated ranks; raise
    AssertionError on any difference from the single-device op (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    vals = _values(case, gen)
    gm = _graph(case, vals)
    inputs, outs = _io(gm)
    try:
        ranks = [_rank_graph(gm, inputs, places, outs, tp, r, sp) for r in range(tp)]
    except TPShardError as exc:
        assert str(exc), "a refusal must say why"
        return Outcome(places, refused=str(exc))
    out_places = ranks[0][1]
    assert all(rk[1] == out_places for rk in ranks), "ranks disagree on the output placement"
    # reference: forward and backward on the full tensors
    full = [v.clone().requires_grad_(v.is_floating_point() and case.grad and spec.kind != "const")
            for v, spec in zip(vals, case.inputs)]
    ref = _call(case, [f.clone() if f.requires_grad else f for f in full])  # in-place steps must not hit leaves
    ref_outs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    cot = [torch.randn(t.shape, generator=gen, dtype=t.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point()
           else None for t in ref_outs]
    diff = [(t, c) for t, c in zip(ref_outs, cot) if c is not None and t.requires_grad]
    if diff:
        torch.autograd.backward([t for t, _ in diff], [c for _, c in diff])
    # the ranks, in threads
    weights: dict[Any, list[torch.Tensor]] = {}
    leaves = [[_local(v, p, tp, r, weights).requires_grad_(v.is_floating_point() and case.grad and spec.kind != "const")
               for v, p, spec in zip(vals, places, case.inputs)] for r in range(tp)]
    results: list[Any] = [None] * tp
    errors: list[BaseException] = []
    with simulated_comm(tp) as group:

        def work(r: int) -> None:
            group.local.rank = r
            try:
                rank_gm, places_out = ranks[r]
                feed = [x.clone() if x.requires_grad else x for x, n in zip(leaves[r], inputs) if n.op != "get_attr"]
                got = rank_gm(*feed)
                pairs = [(t, _cotangent_piece(c, p, tp, r)) for t, c, p in zip(got, cot, places_out)
                         if c is not None and isinstance(t, torch.Tensor) and t.requires_grad]
                if pairs:
                    torch.autograd.backward([t for t, _ in pairs], [c for _, c in pairs])
                params = dict(rank_gm.named_parameters())
                grads = [params[str(n.target)].grad if n.op == "get_attr" else x.grad
                         for x, n in zip(leaves[r], inputs)]
                results[r] = ([t.detach() if isinstance(t, torch.Tensor) else t for t in got], grads)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                errors.append(exc)
                group.barrier.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    label = f"{case.name} {tuple(str(p) for p in places)} tp={tp}{' sp' if sp else ''}"
    for k, (t_ref, place) in enumerate(zip(ref_outs, out_places)):
        pieces = [results[r][0][k] for r in range(tp)]
        if not isinstance(t_ref, torch.Tensor) or case.compare == "none":
            continue
        if place is None:
            continue
        got = _assemble(pieces, place, tp, check=case.compare == "value")
        if case.compare == "shape":
            assert tuple(got.shape) == tuple(t_ref.shape), label
        else:
            torch.testing.assert_close(got, t_ref.detach(), rtol=case.tol, atol=case.tol * 1e-2,
                                       equal_nan=True, msg=lambda m: f"{label}: forward: {m}")
    if not diff:
        return Outcome(places, out_places=out_places)
    for i, (f, p) in enumerate(zip(full, places)):
        if f.grad is None or not f.requires_grad:
            continue
        for r in range(tp):
            g = results[r][1][i]
            want = _cotangent_piece(f.grad, p, tp, r) if p.is_s else f.grad
            if p.disjoint and g is not None:
                # a disjoint partial's gradient is the full gradient on the elements this rank owns
                # (its consumers read no other element: expert rows outside a rank's experts are zeros)
                mask = _local(torch.ones_like(f.grad), p, tp, r, {}).bool()
                g, want = g[mask], want[mask]
            if g is None:
                assert torch.count_nonzero(want) == 0, f"{label}: rank {r} got no gradient for input {i}"
                continue
            torch.testing.assert_close(g, want, rtol=case.tol, atol=case.tol * 1e-2,
                                       msg=lambda m: f"{label}: backward, input {i} on rank {r}: {m}")
    return Outcome(places, out_places=out_places)


def all_placements(case: Case, tp: int) -> list[tuple[Placement, ...]]:
    """Every combination of input placements for ``case`` (the product over its inputs), or a
    deterministic sample of ``case.limit`` of them that keeps every uniform combination."""
    combos = list(itertools.product(*(placements_for(s, tp, partial=case.partial) for s in case.inputs)))
    if case.limit and len(combos) > case.limit:
        uniform = [c for c in combos if len(set(c)) == 1]
        rest = [c for c in combos if len(set(c)) != 1]
        step = len(rest) / max(1, case.limit - len(uniform))
        combos = uniform + [rest[int(k * step)] for k in range(case.limit - len(uniform))]
    return combos




# ------------------------------------------------------------------------------------------ whole graphs


def simulate_graph(gm: torch.fx.GraphModule, rules: dict[str, str], tp: int, batch: Sequence[Any], *,
                   sequence_parallel: bool = False) -> tuple[float, dict[str, torch.Tensor]]:
    """Run ``shard_tensor_parallel_pass``'s rank graphs of a captured graph on ``tp`` simulated ranks
    (threads, collectives in memory): one forward and backward. Returns the loss (checked equal on
    every rank) and every parameter's gradient by user key, assembled from the ranks' shards."""
    import copy

    from passes.layout import META_LAYOUT
    from passes.tp.shard_tensor_parallel import shard_tensor_parallel_pass
    from planner.plan import Mesh, Plan, TensorParallel

    plan = Plan(mesh=Mesh(tp=tp), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sequence_parallel))
    ranks = [shard_tensor_parallel_pass(copy.deepcopy(gm), plan, tp_index=r, tp_size=tp) for r in range(tp)]
    losses: list[Any] = [None] * tp
    errors: list[BaseException] = []
    with simulated_comm(tp) as group:

        def work(r: int) -> None:
            group.local.rank = r
            try:
                loss = ranks[r](*batch)
                loss = loss[0] if isinstance(loss, (tuple, list)) else loss
                loss.backward()
                losses[r] = loss.item()
            except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread
                errors.append(exc)
                group.barrier.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    assert all(x == losses[0] for x in losses), f"tp ranks disagree on the loss: {losses}"
    layout = ranks[0].meta[META_LAYOUT]
    grads: dict[str, torch.Tensor] = {}
    for attr, key in layout.keys.items():
        pieces = [dict(rk.named_parameters(remove_duplicate=False)).get(attr) for rk in ranks]
        if pieces[0] is None or pieces[0].grad is None:
            continue
        g = [p.grad for p in pieces]
        grads[key] = layout.tp[key].assemble(g) if key in layout.tp else g[0]
    return losses[0], grads


def reference_graph(gm: torch.fx.GraphModule, batch: Sequence[Any]) -> tuple[float, dict[str, torch.Tensor]]:
    """The captured graph run whole: loss and gradients by user key."""
    import copy

    from passes.layout import META_LAYOUT

    one = copy.deepcopy(gm)
    loss = one(*batch)
    loss = loss[0] if isinstance(loss, (tuple, list)) else loss
    loss.backward()
    keys = {n.target: n.meta.get("fs_param") for n in one.graph.nodes if n.op == "get_attr"}
    layout = gm.meta.get(META_LAYOUT)
    grads = {}
    for attr, p in one.named_parameters(remove_duplicate=False):
        key = keys.get(attr) or (layout.keys.get(attr) if layout else None) or attr
        if p.grad is not None:
            grads[key] = p.grad
    return loss.item(), grads
