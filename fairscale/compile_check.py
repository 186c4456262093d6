"""The plan-time compilation check: no plan that cannot run reaches a rank.

Before any rank launches, the plan is compiled the way the ranks will compile it: the model is
captured at the shape one microbatch has on one rank (what ``ParallelModule`` captures), and
``passes.compile_rank`` runs every pass and the verifier for every pipeline stage. Anything the
passes cannot execute is refused here, with the reason, the pass, the module path, the op and the
model's source line, and what to change in the plan::

    checker = checker_for(model, example_inputs, loss_fn=loss_fn)
    checker.refusal(plan)               # None, or a Refusal (.message())
    checker.check(plan)                 # raises PlanCompileError (a PlanError) with that message
    planner.search.search(..., compiles=checker)    # the search's hook: reason text or None

Which rank programs. A rank's program is fixed by its pipeline stages and its (dp, tp) indices
(the expert group is ``dp_index % ep``). All stages are compiled. The indices only choose which
slice or shard a rank keeps: every slice has the same shape (the passes refuse uneven splits for
every index alike), so one index is structurally every index: the passes use it only as slice
offsets and constants (vocabulary start, dropout seed offset), except where they fill a rank's
shard with parameter values: ZeRO buckets and FSDP units are padded to a multiple of dp, and only
the last dp rank's shard ends in padding (a member may be cut by the end of the real data, or the
shard hold padding only), while rank 0's starts at offset 0. So two index sets are compiled:
(dp 0, tp 0) and, when dp or tp is above 1, (dp - 1, tp - 1), which is also the last expert
group and the last tensor-parallel slice; middle ranks combine a mid-member start (as the last
rank) with a mid-member end (as rank 0), both already exercised. Parameters on ``meta`` have no
values, the fills are skipped for them, and what remains does not depend on the index: their
plans are compiled for (dp 0, tp 0) only, which halves the cost where it is largest.

Cost. The passes run under ``FakeTensorMode``: parameters are read for their shapes only and no
shard, bucket or slice is allocated, so a plan for a model of any size compiles in host memory
of the graph alone (a pass that needs real values would raise a fake-tensor exception; the
compile is then retried on real tensors, never for parameters on ``meta``). The whole-graph passes
run once; then one stage of each class of stages the per-stage passes treat alike is compiled
(``passes.stage_classes``: a GPT's middle stages are one class). A model on ``meta`` (planned,
not run) is traced with ``torch.fx`` and brought to ATen op by op (``passes.tp.normalize``); a
real model is captured with ``torch.export``, as its ranks will capture it. Captures are cached
per microbatch shape and verdicts per plan, in this process and in ranks forked from it. For a
model on ``meta`` the search's own capture is the check's at the batch's shape (``adopt``: the
same fx trace, brought to ATen on a copy), and splits are shared: plans whose stages hold the same
layers (``passes.split_key``; e.g. the winner and runners-up that differ in dp, microbatches or
the data-parallel kind) compile from one split, which the passes never change (a real model's
splits hold copies of its weights, so they are not kept).
Measured: ``benchmarks/planner/compile_check.py`` (its README has the table).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import traceback
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch import nn

from fairscale.capture_cache import batch_key, model_key, rank_capture, trace_dtype
from fairscale.loss_check import loss_problem
from fairscale.runtime.batch_form import microbatch_example
from passes import compile_rank, split_key, split_program
from passes.program import StagedProgram
from passes.stage_classes import stage_classes
from passes.tp.normalize import to_aten
from passes.dp.graph import DTYPES
from planner.capture import CaptureError, capture
from planner.dtype_pins import mixed_ops, mixed_problem
from planner.graph import META_MODULE, ModelGraph
from planner.plan import Plan, PlanError

__all__ = ["Refusal", "PlanCompileError", "CompileChecker", "checker_for", "rank_index_sets", "graph_refusal",
           "validate_compiles"]


@dataclass(frozen=True, kw_only=True)
class Refusal:
    """Why a plan does not compile, and where."""

    reason: str
    """The pass's own words (``TPShardError: in-place add_ would need its input converted ...``)."""
    stage: str = ""
    """Which rank program failed (``pipeline stage 1 (0-based, of 2), dp rank 3 of 4, tp rank 1 of 2``)."""
    pass_name: str = ""
    """The pass that refused (``the tensor-parallel pass``)."""
    module: str = ""
    """Module path of the node in the user's model (``layers.0.mlp``); '' when unknown."""
    op: str = ""
    """The op (``aten.add_.Tensor``)."""
    source: str = ""
    """The model's source line (``model.py:42 in forward: x += y``), from the capture's stack trace."""
    hint: str = ""
    """What to change in the plan."""
    internal: bool = False
    """The pass failed on an exception it does not declare: a fairscale bug, refused all the same."""

    def message(self) -> str:
        head = f"the plan does not compile: {self.pass_name or 'the passes'} "
        head += "failed on an internal error (a fairscale bug; please report it with this message)" \
            if self.internal else "refused it"
        lines = [head + (f" for {self.stage}" if self.stage else "") + f": {self.reason}"]
        where = []
        if self.module or self.op:
            where.append(f"module {self.module or '<model top level>'}" + (f", op {self.op}" if self.op else ""))
        if self.source:
            where.append(f"source {self.source}")
        if where:
            lines.append("at " + "; ".join(where))
        if self.hint:
            lines.append("what to do: " + self.hint)
        return "\n    ".join(lines)


class PlanCompileError(PlanError):
    """A plan the passes cannot compile; ``refusal`` says why and where."""

    def __init__(self, refusal: Refusal, *, source: str = "plan") -> None:
        self.refusal = refusal
        super().__init__([refusal.message()], source=source)


def rank_index_sets(plan: Plan, *, on_meta: bool = False) -> list[tuple[int, int]]:
    """The (dp_index, tp_index) pairs compiled for ``plan`` (module docstring: why these)."""
    dp, tp = plan.mesh.dp, plan.mesh.tp
    return [(0, 0)] if on_meta or (dp == 1 and tp == 1) else [(0, 0), (dp - 1, tp - 1)]


_FAKE_LIMITS: tuple[type[BaseException], ...] = ()
try:  # the exceptions by which a fake tensor says it would need real data
    from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                               UnsupportedFakeTensorException, UnsupportedOperatorException)
    from torch._subclasses.fake_tensor import FakeTensorMode

    _FAKE_LIMITS = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException,
                    UnsupportedOperatorException)
except ImportError:  # pragma: no cover - torch moved them; compile on real tensors then
    FakeTensorMode = None  # type: ignore[assignment,misc]


def graph_refusal(graph: ModelGraph, plan: Plan, *,
                  splits: dict[tuple[Any, ...], StagedProgram] | None = None) -> Refusal | None:
    """Compile ``plan`` on ``graph`` (captured at the microbatch shape) for every class of
    equivalent stages (``passes.stage_classes``: one stage stands for the stages the passes treat
    alike) and each of :func:`rank_index_sets`; the first failure, or None. ``splits``: programs
    already split from ``graph``, by ``passes.split_key`` (plans that differ only in what the
    split does not read, such as dp or the microbatches, share one), filled in here."""
    on_meta = _on_meta(graph)
    key = split_key(graph, plan) if splits is not None else None
    try:  # the passes never change a program they are given (compile_rank), so sharing one is safe
        program = splits[key] if splits is not None and key in splits else split_program(graph, plan)
    except Exception as exc:  # noqa: BLE001 - every failure of the passes is a refusal
        return _refusal(exc, plan, "every rank")
    if splits is not None and key is not None:
        splits[key] = program
    stages = [members[0] for members in stage_classes(program, plan)]
    for dp_index, tp_index in rank_index_sets(plan, on_meta=on_meta):
        where = f"dp rank {dp_index} of {plan.mesh.dp}, tp rank {tp_index} of {plan.mesh.tp}"
        try:
            _compile(graph, plan, stages, dp_index, tp_index, fake=FakeTensorMode is not None, program=program)
        except _FAKE_LIMITS as exc:
            if on_meta:  # no values to retry with: the check cannot vouch for the plan, so refuse it
                found = _refusal(exc, plan, where)
                return dataclasses.replace(found, reason=f"a pass needs parameter values, which a model on meta "
                                                         f"does not have ({found.reason})",
                                           hint="check the plan with the real model (parallelize or "
                                                "`fairscale validate` with a factory that builds it on CPU)")
            try:
                _compile(graph, plan, stages, dp_index, tp_index, fake=False, program=program)
            except Exception as exc:  # noqa: BLE001 - every failure of the passes is a refusal
                return _refusal(exc, plan, where)
        except Exception as exc:  # noqa: BLE001 - every failure of the passes is a refusal
            return _refusal(exc, plan, where)
    return None


def _compile(graph: ModelGraph, plan: Plan, stages: Sequence[int], dp_index: int, tp_index: int, *, fake: bool,
             program: StagedProgram) -> None:
    if fake:
        with FakeTensorMode(allow_non_fake_inputs=True):
            compile_rank(graph, plan, stages=stages, dp_index=dp_index, tp_index=tp_index, program=program)
    else:
        compile_rank(graph, plan, stages=stages, dp_index=dp_index, tp_index=tp_index, program=program)


class CompileChecker:
    """Compile checks of plans for one model and example batch; a search's ``compiles`` hook.

    Calling it returns None when the plan compiles, else the refusal's message (what
    ``planner.search.search(compiles=...)`` records in its table)."""

    def __init__(self, model: nn.Module, example_inputs: Sequence[Any], *,
                 loss_fn: Callable[..., torch.Tensor] | None = None) -> None:
        self._model = weakref.ref(model)
        self._strong: nn.Module | None = model  # dropped by checker_for: its cache must not keep models alive
        self.example_inputs = tuple(example_inputs)
        self.loss_fn = loss_fn
        self._graphs: dict[tuple[Any, ...], ModelGraph | Refusal] = {}
        self._verdicts: dict[str, Refusal | None] = {}
        self._splits: dict[int, dict[tuple[Any, ...], StagedProgram]] = {}  # id(graph) -> its programs
        self._rows: dict[Any, str | None] = {}  # rows per piece (or 'proof') -> the loss check's verdict
        self.rows_coupled: str | None = None
        """The loss check's first refusal (the loss couples the batch's rows), once one was made."""
        self._planned: ModelGraph | None = None
        self._planned_key: tuple[Any, ...] | None = None

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("the model this compile checker was made for no longer exists")
        return model

    def __call__(self, plan: Plan) -> str | None:
        found = self.refusal(plan)
        return None if found is None else found.message()

    def dtype_problem(self, dtype: str) -> str | None:
        """Why this model cannot run as a ``dtype`` (bf16 / fp16) plan runs it, or None: its trace
        in that dtype has ops whose kernels refuse their operands' mix of dtypes (``planner.dtype_pins``:
        a float32 buffer or an upcast never cast back meets a 16-bit value in a matmul, a norm, ...).
        The search falls back to fp32 on it when the dtype was its own default
        (``fairscale.api.search_graph``)."""
        traced = rank_capture(self.model, self.example_inputs, loss_fn=self.loss_fn, dtype=DTYPES[dtype])
        mixed = mixed_ops(traced.gm)
        return mixed_problem(mixed, dtype, "data_parallel.param_dtype") if mixed else None

    def check(self, plan: Plan, *, source: str = "plan") -> None:
        """Raise :class:`PlanCompileError` if ``plan`` does not compile."""
        found = self.refusal(plan)
        if found is not None:
            raise PlanCompileError(found, source=source)

    def refusal(self, plan: Plan) -> Refusal | None:
        """Why ``plan`` does not compile, or None (cached per plan)."""
        key = _plan_key(plan)
        if key not in self._verdicts:
            graph = self.graph_for(plan)
            if isinstance(graph, Refusal):
                self._verdicts[key] = graph
            else:  # a model on meta: its programs hold no weights, so they are kept for the next plans
                splits = self._splits.setdefault(id(graph), {}) if _on_meta(graph) else None
                self._verdicts[key] = graph_refusal(graph, plan, splits=splits) or self._loss_refusal(graph, plan)
        return self._verdicts[key]

    def _loss_refusal(self, graph: ModelGraph, plan: Plan) -> Refusal | None:
        """A loss the plan's pieces (dp × microbatches) cannot add up to the batch's (``fairscale.loss_check``)."""
        problem = loss_problem(self.model, self.example_inputs, self.loss_fn, graph.gm, plan, self._rows)
        self.rows_coupled = self.rows_coupled or problem
        return Refusal(reason=problem, pass_name="the loss check (fairscale.loss_check)",
                       hint="set mesh.dp to 1 and schedule.microbatches to 1, or change the loss") if problem else None

    def adopt(self, graph: ModelGraph) -> None:
        """Take ``graph``, the capture the search planned from this checker's model, batch and loss,
        as the check's capture at the batch's own shape where it is the capture :meth:`graph_for`
        would make there: a model on ``meta`` traced by ``torch.fx`` and annotated (it is brought to
        ATen on a copy; ``graph`` is left as it is), for plans of the dtype it was traced in (an fx
        trace is the same graph in every dtype, and the check traces a model on meta with fx in
        every dtype). Otherwise nothing changes."""
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in self.example_inputs]
        key = (batch_key(self.example_inputs), graph.extra.get("trace_dtype"))
        if (_on_meta(graph) and graph.tracer == "fx" and "annotate_runs" in graph.extra
                and graph.extra.get("input_shapes") == shapes and key not in self._graphs):
            self._planned, self._planned_key = graph, key

    def graph_for(self, plan: Plan) -> ModelGraph | Refusal:
        """The capture a rank of ``plan`` compiles (its microbatch shape), or why there is none."""
        rows = _batch_rows(self.example_inputs)
        gb = plan.schedule.global_batch or rows
        split = plan.mesh.dp * plan.schedule.microbatches
        if gb % split:
            return Refusal(reason=f"the global batch of {gb} does not split into dp({plan.mesh.dp}) × "
                                  f"microbatches({plan.schedule.microbatches}) = {split} equal microbatches",
                           hint="choose schedule.microbatches and mesh.dp whose product divides the global batch")
        example = microbatch_example(self.example_inputs, gb // split)
        dtype = trace_dtype(plan)
        key = (batch_key(example), dtype)
        if key not in self._graphs:
            # the search's capture, when it is the one the ranks compile (the model as it is)
            planned = self._planned if key == self._planned_key else None
            if planned is not None:  # what _capture would trace, traced already (adopt)
                graph = copy.copy(planned)
                graph.extra, graph.gm = dict(planned.extra), to_aten(planned.gm)
                self._graphs[key], self._planned = graph, None
            else:
                self._graphs[key] = self._capture(example, dtype)
        return self._graphs[key]

    def _capture(self, example: tuple[Any, ...], dtype: torch.dtype | None) -> ModelGraph | Refusal:
        # The passes rewrite ATen graphs. A real model is captured as its ranks will capture it
        # (torch.export). A model on meta is planned, not run: it is traced with torch.fx, as the
        # search traced it, and brought to ATen op by op (passes.tp.normalize, the graph the TP
        # detector checked its rules on), 5x faster than exporting 128 blocks; its ranks export
        # the real model and compile it again before building (parallelize checks every plan).
        on_meta = any(p.is_meta for p in self.model.parameters())
        try:
            if not on_meta:
                return rank_capture(self.model, example, loss_fn=self.loss_fn, dtype=dtype)  # what the ranks compile
            try:
                graph = capture(self.model, example, loss_fn=self.loss_fn, tracer="fx")
            except CaptureError:  # what torch.fx cannot trace, torch.export may
                return capture(self.model, example, loss_fn=self.loss_fn, annotate=False, tracer="export", dtype=dtype)
            graph.gm = to_aten(graph.gm)
            return graph
        except CaptureError as exc:
            return Refusal(reason=f"the model cannot be captured at the microbatch shape "
                                  f"{[tuple(t.shape) for t in example if isinstance(t, torch.Tensor)]}: {exc}",
                           pass_name="capture", hint="see the capture error; a plan with other microbatch sizes "
                                                     "(schedule.microbatches, mesh.dp) gives other shapes")


_CHECKERS: dict[tuple[Any, ...], CompileChecker] = {}


def checker_for(model: nn.Module, example_inputs: Sequence[Any], *,
                loss_fn: Callable[..., torch.Tensor] | None = None, graph: ModelGraph | None = None) -> CompileChecker:
    """The cached :class:`CompileChecker` of this model, batch shapes and loss (shared by the
    search, ``parallelize`` and ranks forked after either ran). An entry lives as long as its
    model, so a new model at a freed one's address never meets the old verdicts. ``graph``: the
    capture of the same model, batch and loss that the caller plans with (:meth:`CompileChecker.adopt`)."""
    key = model_key(model, example_inputs, loss_fn)  # a changed model is checked anew
    found = _CHECKERS.get(key)
    if found is None or found._model() is not model:
        found = _CHECKERS[key] = CompileChecker(model, example_inputs, loss_fn=loss_fn)
        found._strong = None
        weakref.finalize(model, _CHECKERS.pop, key, None)
    if graph is not None:
        found.adopt(graph)
    return found


def validate_compiles(plan: Plan, model: nn.Module, example_inputs: Sequence[Any], *,
                      loss_fn: Callable[..., torch.Tensor] | None = None, global_batch: int | None = None,
                      source: str = "plan") -> str:
    """``fairscale validate``'s compile step: raise :class:`PlanCompileError` if ``plan`` (at
    ``global_batch``, default the one it records) does not compile; else the line to print."""
    gb = global_batch or plan.schedule.global_batch
    if not gb:
        return "compile check: skipped, the plan records no global batch (give --global-batch)"
    plan = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, global_batch=gb))
    checker_for(model, example_inputs, loss_fn=loss_fn).check(plan, source=source)
    sets = rank_index_sets(plan, on_meta=any(p.is_meta for p in model.parameters()))
    return (f"compiles: {plan.mesh.pp * plan.schedule.virtual_stages} stage(s) × {len(sets)} rank index set(s) "
            "through every pass and the verifier")


def _plan_key(plan: Plan) -> str:
    data = plan.to_dict()
    for volatile in ("predicted", "model", "cluster"):
        data.pop(volatile, None)
    return json.dumps(data, sort_keys=True, default=str)


def _on_meta(graph: ModelGraph) -> bool:
    return any(p.is_meta for p in graph.gm.parameters())


def _batch_rows(batch: Sequence[Any]) -> int:
    for t in batch:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise ValueError("the example batch has no tensor with a batch dimension")


# -- turning a pass's exception into a refusal ---------------------------------------------------

_PASSES = (  # path fragment of the innermost passes/ frame -> (name, what to change)
    ("passes/split_stages", "the stage split (passes/split_stages.py)",
     "move the cut between stages (the plan's `stages`) or use fewer pipeline stages (mesh.pp)"),
    ("passes/tp/", "the tensor-parallel pass (passes/tp)",
     "drop or change the tensor_parallel rules of the modules in and around {module} (tensor_parallel.rules)"
     "{sp}, or use mesh.tp = 1"),
    ("passes/ep/", "the expert-parallel pass (passes/ep)",
     "use mesh.ep = 1, or the tensor-parallel style \"expert\" for {module}"),
    ("passes/insert_recompute", "the recompute pass (passes/insert_recompute.py)",
     "leave the layer holding {module} out of the plan's `recompute`"),
    ("passes/dp/", "the data-parallel pass (passes/dp)",
     "choose another data_parallel.kind (ddp, zero1, zero2, fsdp) or other FSDP units"),
    ("passes/verify", "the graph verifier (passes/verify.py)",
     "the passes produced an invalid graph; change the plan (stages, tensor_parallel, data_parallel) around {module}"),
)
_DECLARED = (ValueError, NotImplementedError, PlanError)
"""Exception types by which the passes refuse (SplitError, TPShardError, ExpertParallelError are
ValueErrors); anything else escaping a pass is a bug in it. VerifyError is handled by name."""
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')
_TORCH_DIR = os.path.dirname(torch.__file__)


def _refusal(exc: BaseException, plan: Plan, where: str) -> Refusal:
    frames = traceback.extract_tb(exc.__traceback__)
    stage = _stage_of(exc)
    pass_name, hint = "", "change the plan"
    for frame in reversed(frames):
        path = frame.filename.replace(os.sep, "/")
        found = next(((name, h) for frag, name, h in _PASSES if frag in path), None)
        if found is not None:
            pass_name, hint = found
            break
    # a pass that knows the remedy says it (passes.dp.graph.DtypeError), read through the chain as its node is
    hint = next((h for e in _chain(exc) if isinstance(h := getattr(e, "hint", None), str) and h), hint)
    node = _node_of(exc)
    module = _module_of(node) if node is not None else ""
    op = _op_of(node) if node is not None else ""
    internal = not isinstance(exc, _DECLARED) and type(exc).__name__ != "VerifyError"
    n_stages = plan.mesh.pp * plan.schedule.virtual_stages
    place = (f"pipeline stage {stage} (0-based, of {n_stages}), " if stage is not None else "") + where
    reason = f"{type(exc).__name__}: {exc}"
    if len(reason) > 1500:
        reason = reason[:1500] + " ..."
    return Refusal(reason=reason, stage=place, pass_name=pass_name, module=module, op=op,
                   source=_source_of(node) if node is not None else "",
                   hint=hint.format(module=module or "the module named above",
                                    sp=", turn off tensor_parallel.sequence_parallel"
                                    if plan.tensor_parallel.sequence_parallel else ""), internal=internal)


def _chain(exc: BaseException) -> list[BaseException]:
    out, seen = [], set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        out.append(cur)
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return out


def _frames(exc: BaseException) -> list[Any]:
    """Frame objects of ``exc``'s traceback, outermost first."""
    out = []
    tb = exc.__traceback__
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def _node_of(exc: BaseException) -> torch.fx.Node | None:
    """The graph node the pass was working on: the exception's own ``node`` (TPShardError sets
    it), else the innermost pass frame's local ``node`` (diagnostics only: read, never changed)."""
    for e in _chain(exc):
        node = getattr(e, "node", None)
        if isinstance(node, torch.fx.Node):
            return node
    for e in _chain(exc):
        for frame in reversed(_frames(e)):
            node = frame.f_locals.get("node")
            if isinstance(node, torch.fx.Node):
                return node
    return None


def _stage_of(exc: BaseException) -> int | None:
    """The pipeline stage ``compile_rank`` was compiling (its loop variable), if it got that far."""
    for frame in _frames(exc):
        if frame.f_code.co_name == "compile_rank" and isinstance(frame.f_locals.get("s"), int):
            return frame.f_locals["s"]
    return None


def _module_of(node: torch.fx.Node) -> str:
    path = node.meta.get(META_MODULE)
    if isinstance(path, str) and path:
        return path
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        last = list(stack.values())[-1]
        name = last[0] if isinstance(last, tuple) else str(last)
        return name[len("model."):] if name.startswith("model.") else ("" if name == "model" else name)
    return ""


def _op_of(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        target = node.target
        return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))
    if node.op == "call_method":
        return f"method .{node.target}()"
    return f"{node.op} {node.target}"


def _source_of(node: torch.fx.Node) -> str:
    """The model's own line from the capture's stack trace: its innermost frame outside torch
    (the capture wrapper is the outermost; torch.export records a trace, torch.fx does not)."""
    trace = node.meta.get("stack_trace")
    if not isinstance(trace, str) or not trace:
        return ""
    frames = _FRAME.findall(trace)
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
    if not user:
        return ""
    pick = user[-1]
    path, line, fn, code = pick
    return f"{path}:{line} in {fn}: {code.strip()}"
