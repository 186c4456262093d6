"""Find the tensor-parallel patterns of a captured graph and propose plan rules for them.

Usage::

    from passes.tp.patterns import propose_tp_rules
    proposal = propose_tp_rules(graph.gm, tp=4)
    proposal.rules      # {"model.layers.*.self_attn.[q_proj,k_proj,v_proj]": "colwise", ...}
    proposal.notes      # why anything was left replicated
    plan.tensor_parallel.rules = proposal.rules

Patterns (Megatron-LM, Shoeybi et al. 2019, section 3):

* **column -> row pairs**: a matmul ``B`` with a parameter weight whose input is computed only from
  the outputs of other parameter matmuls ``A`` through head-local ops (elementwise, views,
  rotary embedding, attention, activation x activation matmuls) becomes ``rowwise`` and each
  ``A`` ``colwise``. This covers attention (q/k/v -> o, GQA included), MLPs, and gated MLPs
  (SwiGLU: gate and up -> down) in one rule.
* **vocab-parallel embedding**: an embedding looked up by token ids (an integer graph input).
* **vocab-parallel loss**: a parameter matmul whose output reaches ``cross_entropy`` (or
  ``log_softmax`` + ``nll_loss``) through views and casts.
* **experts**: parameters feeding ``transformers::grouped_mm_fallback`` (MoE experts).

Every proposal is checked by running ``shard_tensor_parallel_pass`` on it (rank 0, no
communication): a rule the pass rejects for this ``tp`` (heads or KV heads that do not divide,
a tied weight used in conflicting ways) is dropped, with the pass's message in ``notes``. So what
the planner proposes is exactly what the pass can do.

node.meta keys read: ``val``, ``fs_module``, ``fs_param``. Nothing is written.
"""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from passes.graph_utils import per_graph
from passes.tp.functionalize import functionalize_inplace
from passes.tp.normalize import to_aten
from passes.tp.representative import generalize as _generalize
from passes.tp.representative import representative
from passes.tp.rewrite import TPShardError, args_of, source_of
from passes.tp.rules import ELEMENTWISE, VIEWS
from planner.graph import META_MODULE, META_PARAM, module_class
from planner.plan import Mesh, Plan, TensorParallel
from planner.selectors import parse_selector
from planner.tp_styles import TPRules, module_kind, shard_problem, split_dim

__all__ = ["TPProposal", "propose_tp_rules"]

aten = torch.ops.aten
_MATMUL_W = {aten.linear.default: 1, aten.addmm.default: 2, aten.mm.default: 1, aten.matmul.default: 1}
_HEAD_LOCAL = ELEMENTWISE | VIEWS | {
    aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.expand.default, aten.slice.Tensor,
    aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.cat.default,
    aten.scaled_dot_product_attention.default, aten.softmax.int, aten._softmax.default, aten.bmm.default,
    aten.matmul.default, aten.clone.default, aten.contiguous.default, aten.t.default}
_LOSSES = {aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_forward.default,
           aten.nll_loss_nd.default}
_TO_LOSS = VIEWS | {aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.alias.default,
                    aten.log_softmax.int, aten._log_softmax.default, aten.contiguous.default, aten.clone.default,
                    aten.flatten.using_ints}


@dataclass(kw_only=True)
class TPProposal:
    """Tensor-parallel rules the pass can apply to one graph at one tp degree."""

    rules: dict[str, str] = field(default_factory=TPRules)
    """Module selector -> style, ready for ``Plan.tensor_parallel.rules`` (a :class:`TPRules`
    carrying :meth:`reason`, which the search quotes when it refuses a tp degree)."""
    modules: dict[str, str] = field(default_factory=dict)
    """Every matched module path -> its style (before grouping into selectors), after checking."""
    attention: list[dict[str, int]] = field(default_factory=list)
    """Per attention node: ``{"heads": h, "kv_heads": k, "head_dim": d}`` as seen in the graph."""
    notes: list[str] = field(default_factory=list)
    """What was left replicated and why (``"<module>: left replicated (<style>): <op> at <source line>: ..."``)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Module path (``"*"``: the whole model) -> why it gets no tensor parallelism: the op, its
    source line and the pass's reason. What a user is told when a tp degree is refused."""

    def reason(self) -> str:
        """One line saying why the proposal is empty or partial ("" when nothing was refused)."""
        if not self.refused:
            return ""
        items = sorted(self.refused.items())
        head = "; ".join(f"module {m}: {why}" if m != "*" else why for m, why in items[:3])
        return head + (f" (and {len(items) - 3} more)" if len(items) > 3 else "")


def propose_tp_rules(gm: torch.fx.GraphModule, *, tp: int, sequence_parallel: bool = False,
                     verify: bool = True) -> TPProposal:
    """Propose ``{selector: style}`` for ``gm`` at tensor-parallel degree ``tp`` (see module doc).

    Never raises: a graph it cannot analyse, or a pass failure it cannot attribute to a module,
    gives no rules, and ``refused`` / ``notes`` say why (the op and the model's source line)."""
    out = TPProposal()
    try:
        gm = _prepared(gm)
        styles = _detect(gm, out)
        if verify and tp > 1 and not _accepted_at_multiple(gm, styles, tp, sequence_parallel):
            proposed = dict(styles)
            _verify(gm, styles, tp, sequence_parallel, out)
            if styles == proposed:
                _ACCEPTED.setdefault(gm, {}).setdefault(_styles_key(styles, sequence_parallel), set()).add(tp)
        if _drop_inapplicable(gm, styles, out) and verify and tp > 1:
            _verify(gm, styles, tp, sequence_parallel, out)  # what is left, without the dropped partners
        out.modules = dict(styles)
        out.rules = TPRules(_group(styles, _paths(gm)), reason=out.reason())
    except Exception as exc:  # noqa: BLE001 - the detector must never take the search down
        node = getattr(exc, "node", None)
        why = (f"the tensor-parallel detector could not analyse this model ({type(exc).__name__}: {exc}"
               f"{source_of(node) if isinstance(node, Node) else ''})")
        out.modules = {}
        out.refused["*"] = why
        out.rules = TPRules(reason=out.reason())
        out.notes.append(f"tensor parallelism dropped entirely: {why}")
    return out


_ACCEPTED: weakref.WeakKeyDictionary[torch.fx.GraphModule, dict[tuple[Any, ...], set[int]]] = \
    weakref.WeakKeyDictionary()
"""Prepared graph -> (proposal, sequence parallel) -> the tp degrees at which the pass accepted the
whole proposal (nothing dropped)."""


def _styles_key(styles: dict[str, str], sp: bool) -> tuple[Any, ...]:
    return (sp, tuple(sorted(styles.items())))


def _accepted_at_multiple(gm: torch.fx.GraphModule, styles: dict[str, str], tp: int, sp: bool) -> bool:
    """Whether the pass accepted this whole proposal at a multiple T of ``tp``, which the detector
    then takes for ``tp`` without running the pass again (the search asks for the largest degree
    first, so a 128-block model is rewritten once instead of once per degree). The rewrite depends
    on the degree through which dims divide by it, and what divides by T divides by ``tp``; a dim
    that divides by ``tp`` but not by T can lead the pass another way, so this is a shortcut for
    proposing, not a proof: the plan the search chooses is compiled at its own degree before it is
    returned (and again before it runs), and a refusal there rules its mesh out."""
    done = _ACCEPTED.get(gm, {}).get(_styles_key(styles, sp), set())
    return any(t % tp == 0 for t in done)


@per_graph
def _prepared(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` in ATen form with its safe in-place ops functional, as the pass sees it (once per
    captured graph: the search asks for every tp degree)."""
    return functionalize_inplace(to_aten(gm))


def _detect(gm: torch.fx.GraphModule, out: TPProposal) -> dict[str, str]:
    """Module path -> proposed style (before checking it with the pass)."""
    params = {n for n in gm.graph.nodes if n.op == "get_attr" and META_PARAM in n.meta}
    act = _activation_dependent(gm, params)
    styles: dict[str, str] = {}

    def claim(node: Node, style: str) -> None:
        path = node.meta.get(META_MODULE, "")
        if path and styles.setdefault(path, style) != style:
            out.notes.append(f"{path}: wanted both {styles[path]} and {style}; kept {styles[path]}")

    matmuls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _MATMUL_W
               and _param_weight(n, params) is not None]
    role: dict[Node, str] = {}
    for b in matmuls:  # topological order; a matmul is in at most one pair (Megatron's f ... g)
        sources = _column_sources(args_of(b)[0] if b.target != aten.addmm.default else args_of(b)[1], params, act)
        if sources and b not in role and all(role.get(a) in (None, "colwise") for a in sources):
            for a in sources:
                role[a] = "colwise"
                claim(a, "colwise")
            role[b] = "rowwise"
            claim(b, "rowwise")
    for n in matmuls:  # output heads: the last matmuls before the loss
        path = n.meta.get(META_MODULE, "")
        if path in styles or not _is_head(n, params):
            continue
        blocker = _loss_blocker(n)
        if blocker is None:
            claim(n, "vocab_loss")
        else:
            why = (f"its output reaches {_op_name(blocker)}{source_of(blocker)} before the loss; the vocab-parallel "
                   "loss needs the logits to reach cross_entropy (or log_softmax + nll_loss) through views, "
                   "flatten, casts and slices of other dims")
            out.refused[path] = why
            out.notes.append(f"{path}: left replicated (vocab_loss): {why}")
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target == aten.embedding.default and args_of(n)[0] in params:
            if _from_int_input(args_of(n)[1]):
                claim(n, "vocab_embedding")
        elif str(n.target) == "transformers.grouped_mm_fallback.default":
            claim(n, "expert")
        elif n.target == aten.scaled_dot_product_attention.default:
            out.attention.append(_heads(n))
    return styles


def _drop_inapplicable(gm: torch.fx.GraphModule, styles: dict[str, str], out: TPProposal) -> bool:
    """Drop the styles that the style table (``planner.tp_styles``) does not apply to their module's
    kind, which validation would refuse and with them the whole tp degree: a matmul is claimed by
    the module its (first) matmul runs in, and nn.MultiheadAttention's in- and out-projections run in
    the attention module itself (on its own ``in_proj_weight``), which is no Linear. Notes say the module, the op
    and the model's source line; the rest of the model (its MLPs) keeps its rules. True if any was
    dropped (after the pass's own check, whose reasons come first)."""
    owners: dict[str, tuple[str, Node]] = {}
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    for n in gm.graph.nodes:
        path = n.meta.get(META_MODULE, "")
        if n.op == "get_attr" and META_PARAM in n.meta and isinstance(n.meta.get("val"), torch.Tensor):
            owner, _, name = str(n.meta[META_PARAM]).rpartition(".")
            shapes.setdefault(owner, {})[name] = tuple(n.meta["val"].shape)
        elif n.op == "call_function" and path in styles and path not in owners and n.target in _MATMUL_W:
            owners[path] = (module_class(n), n)
    dropped = False
    for path, style in list(styles.items()):
        if path not in owners or style not in ("colwise", "rowwise", "vocab_embedding", "vocab_loss"):
            continue
        cls, node = owners[path]
        own = shapes.get(path, {})
        if split_dim(style, module_kind(cls, own)) is not None:
            continue
        why = f"{shard_problem(style, path, cls, own, 2)} (op {_op_name(node)}{source_of(node)})"
        del styles[path]
        out.refused[path] = why
        out.notes.append(f"{path}: left replicated ({style}): {why}")
        dropped = True
    return dropped


# ------------------------------------------------------------------------------------------ analysis


def _param_weight(node: Node, params: set[Node]) -> Node | None:
    pos = _MATMUL_W[node.target]  # type: ignore[index]
    w = args_of(node)[pos] if len(args_of(node)) > pos else None
    if isinstance(w, Node) and w in params and isinstance(w.meta.get("val"), torch.Tensor) and w.meta["val"].dim() == 2:
        return w
    return None


def _activation_dependent(gm: torch.fx.GraphModule, params: set[Node]) -> set[Node]:
    """Nodes whose value depends on the data: a floating-point graph input, an embedding looked up
    by ids from the graph inputs, or a parameter matmul of such values. The rest (constants,
    masks, rotary tables, learned position tables and biases indexed by positions) are the same on
    every rank and broadcast into head-local ops like constants."""
    out: set[Node] = set()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.is_floating_point():
            out.add(n)
        elif n.op == "call_function" and n.target == aten.embedding.default and _from_int_input(args_of(n)[1]):
            out.add(n)
        elif n.op == "call_function" and any(a in out for a in n.all_input_nodes):
            if "wrap_with_set_grad_enabled" not in str(n.target):
                out.add(n)
    return out


def _column_sources(x: Any, params: set[Node], act: set[Node]) -> list[Node]:
    """Parameter matmuls that ``x`` is computed from through head-local ops only, or [] if ``x``
    also depends on anything else (a norm, the residual stream, a graph input)."""
    if not isinstance(x, Node):
        return []
    found: list[Node] = []
    seen: set[Node] = set()
    stack = [x]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in act or n in params:
            continue  # constants and parameters broadcast into head-local ops
        if n.op == "call_function" and n.target in _MATMUL_W and _param_weight(n, params) is not None:
            found.append(n)
            continue
        if n.op == "call_function" and (n.target in _HEAD_LOCAL or n.target is operator.getitem):
            stack.extend(n.all_input_nodes)
            continue
        return []
    return sorted(found, key=lambda n: n.name)


def _is_head(node: Node, params: set[Node]) -> bool:
    """Whether ``node`` (a parameter matmul) is an output head: a loss is computed from its output
    without another parameter matmul in between."""
    seen: set[Node] = set()
    stack = list(node.users)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output":
            return True
        if n.op == "call_function" and n.target in _MATMUL_W and _param_weight(n, params) is not None:
            continue
        if n.op == "call_function" and n.target in _LOSSES:
            return True
        stack.extend(n.users)
    return False


def _loss_blocker(node: Node) -> Node | None:
    """None when every use of ``node``'s output reaches ``cross_entropy`` / ``nll_loss`` (as their
    input) through ops that keep the vocabulary dim whole; else the first op in the way."""
    cur = [node]
    seen: set[Node] = set()
    while cur:
        nxt = []
        for n in cur:
            for u in n.users:
                if u in seen or "_assert_tensor_metadata" in str(u.target):
                    continue
                seen.add(u)
                if u.target in _LOSSES and args_of(u)[0] is n:
                    continue
                if u.target in _TO_LOSS or (u.target == aten.slice.Tensor and _slices_other_dim(u)):
                    nxt.append(u)
                    continue
                return u
        cur = nxt
    return None


def _slices_other_dim(node: Node) -> bool:
    src = args_of(node)[0]
    v = src.meta.get("val") if isinstance(src, Node) else None
    dim = args_of(node)[1] if len(args_of(node)) > 1 else 0
    return isinstance(v, torch.Tensor) and dim % v.dim() != v.dim() - 1


def _op_name(node: Node) -> str:
    return f"{node.name} ({node.target})" if node.op != "output" else "the graph output (the logits are returned)"


def _from_int_input(ids: Any) -> bool:
    """Whether ``ids`` are integer token ids computed from the graph inputs (the ids themselves, or
    decoder ids shifted from the labels), not positions made by ``arange``."""
    v = ids.meta.get("val") if isinstance(ids, Node) else None
    if not isinstance(v, torch.Tensor) or v.is_floating_point():
        return False
    seen: set[Node] = set()
    stack = [ids]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            nv = n.meta.get("val")
            if isinstance(nv, torch.Tensor) and not nv.is_floating_point():
                return True
        stack.extend(n.all_input_nodes)
    return False


def _heads(node: Node) -> dict[str, int]:
    q, k = args_of(node)[0], args_of(node)[1]
    qv, kv = q.meta.get("val"), _kv_source(k).meta.get("val")
    return {"heads": int(qv.shape[1]), "kv_heads": int(kv.shape[1]) if kv is not None else int(qv.shape[1]),
            "head_dim": int(qv.shape[-1])}


def _kv_source(k: Node) -> Node:
    """Undo GQA's repeat (reshape <- expand <- unsqueeze) to see the KV heads."""
    cur = k
    if cur.target == aten.reshape.default and args_of(cur)[0].target == aten.expand.default:
        src = args_of(cur)[0].args[0]
        if src.target == aten.unsqueeze.default:
            return args_of(src)[0]
    return cur


# ------------------------------------------------------------------------------------------ checking


def _verify(gm: torch.fx.GraphModule, styles: dict[str, str], tp: int, sp: bool, out: TPProposal) -> None:
    """Drop rules the pass rejects at this tp (one block family at a time), noting why."""
    from passes.tp.shard_tensor_parallel import check_tensor_parallel

    paths = _paths(gm)
    small = _representative(gm)
    kept = _paths(small)
    for _ in range(len(styles) + 1):
        if not styles:
            return
        rules = _group(styles, paths)
        plan = Plan(mesh=Mesh(tp=tp), tensor_parallel=TensorParallel(rules=rules, sequence_parallel=sp))
        # a rule naming only dropped copies (not generalized): check the whole graph
        whole = any(parse_selector(text).unmatched(kept) for text in rules)
        try:
            check_tensor_parallel(gm if whole else small, plan, tp_size=tp)
            return
        except Exception as exc:  # noqa: BLE001 - whatever the pass refuses, the rules responsible are dropped
            node = getattr(exc, "node", None)
            culprit = node.meta.get(META_MODULE, "") if isinstance(node, Node) else ""
            text = str(exc) if isinstance(exc, TPShardError) else f"{type(exc).__name__}: {exc}"
            where = source_of(node) if isinstance(node, Node) else ""
            if where and where.strip() not in text:
                text = f"{text}{where}"
            general = _generalize(culprit)
            if culprit:
                dropped = [p for p in styles if _generalize(p) == general or _generalize(p).startswith(general + ".")
                           or _generalize(p.rpartition(".")[0]) == general.rpartition(".")[0]]
            else:
                dropped = [p for p, st in styles.items() if st == "vocab_loss"]
            if not dropped:
                break
            for p in sorted(dropped):
                out.notes.append(f"{p}: left replicated ({styles.pop(p)}): {text}")
                out.refused[p] = text
    if styles:  # the pass still refuses and no rule can be blamed: no tensor parallelism at all
        out.notes.append(f"tensor parallelism dropped entirely: {text}")
        out.refused["*"] = text
        styles.clear()


def _paths(gm: torch.fx.GraphModule) -> set[str]:
    return {n.meta.get(META_MODULE, "") for n in gm.graph.nodes if n.op == "call_function"}


@per_graph
def _representative(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph the proposals are checked on: ``passes.tp.representative`` (per prepared graph)."""
    return representative(gm)


def _group(styles: dict[str, str], paths: set[str] | None = None) -> dict[str, str]:
    """Module paths -> compact selectors: numbered layers become ``*`` when every module the
    pattern matches has the same style, and siblings with one style are bracketed
    (``self_attn.[q_proj,k_proj,v_proj]``)."""
    paths = set(styles) | (paths or set())
    # a selector matches a path by its trailing segments, so a path it matches ends with the same
    # last segment (the generalized last segment is '*' only for numbered modules): match within those
    by_last: dict[str, list[str]] = {}
    for p in paths:
        if p:
            by_last.setdefault(p.rpartition(".")[2], []).append(p)
    every = [p for p in paths if p]
    flat: dict[str, str] = {}
    checked: dict[tuple[str, str], bool] = {}
    for path, style in styles.items():
        general = _generalize(path)
        if (general, style) not in checked:
            sel = parse_selector(general)
            last = general.rpartition(".")[2]
            bucket = every if "*" in last else by_last.get(last, [])
            checked[(general, style)] = all(styles.get(p) == style for p in bucket if sel.matches(p))
        flat[general if checked[(general, style)] else path] = style
    grouped: dict[tuple[str, str], list[str]] = {}
    for text, style in flat.items():
        parent, _, leaf = text.rpartition(".")
        grouped.setdefault((parent, style), []).append(leaf)
    out: dict[str, str] = {}
    for (parent, style), leaves in grouped.items():
        body = leaves[0] if len(leaves) == 1 else "[" + ",".join(leaves) + "]"
        out[f"{parent}.{body}" if parent else body] = style
    return out
