"""Run the conformance corpus: every (model, plan) trains exactly or is refused before launch.

API (stable; the tests, ``benchmarks/corpus/run.py`` and both corpus sources use it)::

    from fairscale.testing.corpus_run import PLANS, run_cases, table
    results = run_cases(["hf-llama", "hf-gpt2"], ["searched", "pp2xtp2", "dp4x2mb"], devices=4)
    for r in results:            # Result: model, plan, outcome, detail, loss_error, grad_error, ...
        assert r.ok, r.describe()
    print(table(results))        # markdown: model x plan -> exact (errors) / refused: reason

``names`` are keys of :func:`fairscale.testing.corpus.models` (default: all); ``plans`` are keys of
:data:`PLANS`. Outcomes (:data:`OUTCOMES`):

* ``exact``: trained :data:`STEPS` steps on launched gloo ranks and matched one process: the
  losses of every step and the first step's full gradients (``pm.full_grads()``) within the float
  tolerance of :mod:`fairscale.numerics` (``reference.grad_comparison``). Where only gradients
  fall outside it, the model's measured float32 floor is taken into account
  (``numerics.precision_floor``: how far the one-process float32 gradients are from float64; see
  :mod:`fairscale.numerics`, "Ill-conditioned models") and reported with the result.
* ``refused``: the public API raised ``PlanError`` (a refusal, or a plan the passes cannot
  compile) or ``CaptureError`` (a model it cannot trace) in the parent, before any rank started. The refusal must say where and what to do:
  :func:`refusal_gaps` lists what its message lacks (module, op, source line, remedy), and a
  refusal with gaps is not ``ok``.
* ``DIFFERS``: trained, but the losses or gradients differ from one process: a silent wrong result.
* ``CRASH``: anything else: an exception while planning that is not a ``PlanError``, or a failure
  on a rank after launch.

How. Everything is planned in this process, through the public API: ``"searched"`` is the plan
``fairscale.parallelize`` searches for when given no plan (``fairscale.api.search_graph`` with
the compile check, every launched device used), the other kinds are ``fairscale.search`` with
constraints. Then one launch of ``devices`` gloo ranks (fork) runs every planned case in a row:
each rank builds ``fairscale.parallelize(model, example_inputs=..., plan=plan)`` (which validates
and compiles the plan again, from the parent's cache) and trains with SGD. Rank 0 writes each
case's losses and gradients to a scratch directory as it finishes, so a case that crashes the
ranks loses only itself: it is recorded as ``CRASH`` with the ranks' tracebacks and the remaining
cases run in a new launch. The reference (one process, :func:`train_reference`) runs here.

Why SGD (``lr`` :data:`LR`): Adam's update ``m/√v`` is scale-free, so an entry whose true gradient
is ~0 (a key bias, q/k at init) takes an lr-sized step in the direction of its rounding noise,
and after it the losses of float32 runs differ by more than rounding (:mod:`fairscale.numerics`).
SGD moves every parameter by lr x its gradient, so later losses stay within float tolerance
exactly when the gradients do; the first step's gradients are compared in full.
"""

from __future__ import annotations

import functools
import os
import pickle
import re
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from fairscale import numerics
from fairscale.check_step import reference_step
from fairscale.testing.corpus import CorpusModel, models
from fairscale.testing.models import Case
from fairscale.testing.reference import Trajectory, grad_comparison, train_reference, start_again
from planner.capture import CaptureError
from planner.plan import Plan, PlanError

__all__ = ["PLANS", "OUTCOMES", "STEPS", "GLOBAL_BATCH", "LR", "Result", "run_cases", "plan_case", "refusal_gaps",
           "table", "to_json", "from_json"]

STEPS = 3
GLOBAL_BATCH = 8
LR = 0.1
SEED = 0

PLANS: dict[str, dict[str, Any] | None] = {
    "searched": None,
    "pp2xtp2": {"mesh": {"pp": 2, "dp": 1, "tp": 2}},
    "dp4x2mb": {"mesh": {"pp": 1, "dp": 4, "tp": 1}, "schedule": {"microbatches": 2}},
}
"""Plan kinds: ``None`` is the searched plan; otherwise the constraints given to ``fairscale.search``
(pp2xtp2 for 4 devices; dp4x2mb: data parallel over 4 ranks, each step in 2 microbatches)."""

OUTCOMES = ("exact", "refused", "DIFFERS", "CRASH")

_GAPS = (
    ("module", re.compile(r"\bmodule\b")),
    ("op", re.compile(r"\bop\b|aten\.")),
    ("source line", re.compile(r"\.py:\d+")),
    ("what to do", re.compile(r"what to do|\buse\b|\bset\b|\bchoose\b|\bdrop\b|\bremove\b|\bpass\b", re.I)),
)


def refusal_gaps(message: str) -> list[str]:
    """What a refusal's message lacks of: the module, the op, the model's source line (``file.py:N``)
    and what to do; ``[]`` when it has all four."""
    return [what for what, pattern in _GAPS if not pattern.search(message)]


@dataclass
class Result:
    """One (model, plan) of the corpus."""

    model: str
    plan: str
    outcome: str
    """One of :data:`OUTCOMES`."""
    detail: str = ""
    """The refusal's message, the comparison's report (``DIFFERS``), or the traceback (``CRASH``)."""
    mesh: str = ""
    """The plan that ran, in short (``pp2 dp1 tp2, 1f1b x2, ddp``); '' when refused."""
    loss_error: float | None = None
    """Largest relative loss error over the steps (exact / DIFFERS)."""
    grad_error: float | None = None
    """Largest gradient error (relative to the tensor's scale, :mod:`fairscale.numerics`)."""
    seconds: float = 0.0
    """Planning plus this case's share of the launch (its own training time on rank 0)."""
    gaps: list[str] = field(default_factory=list)
    """For a refusal: what its message lacks (:func:`refusal_gaps`)."""
    floor: float | None = None
    """The model's measured float32 floor, when the gradients were judged with it."""

    @property
    def ok(self) -> bool:
        """Exact, or refused with a message that names module, op, source line and remedy."""
        return self.outcome == "exact" or (self.outcome == "refused" and not self.gaps)

    def reason(self) -> str:
        """The refusal's first problem, without the error's boilerplate ("plan has 1 problem:")."""
        lines = [ln.strip() for ln in self.detail.strip().splitlines()]
        lines = [ln for ln in lines if ln and not re.fullmatch(r".* has \d+ problems?:", ln)]
        text = re.sub(r"^- ", "", lines[0]) if lines else ""
        return re.sub(r"^.*?the plan does not compile: ", "", text)

    def summary(self, *, width: int | None = None) -> str:
        """One line; ``width`` cuts a refusal's reason to about that many characters (the README's
        table; ``results.md`` keeps the whole message)."""
        if self.outcome in ("exact", "DIFFERS"):
            floor = f", float32 floor {self.floor:.1e}" if self.floor is not None else ""
            return f"{self.outcome} ({self.mesh}; loss {self.loss_error:.1e}, grad {self.grad_error:.1e}{floor})"
        if self.outcome == "refused":
            reason = self.reason()
            if width is not None and len(reason) > width:
                reason = reason[:width].rsplit(" ", 1)[0] + " …"
            return f"refused: {reason}" + (f" [message lacks: {', '.join(self.gaps)}]" if self.gaps else "")
        return f"CRASH: {self.detail.strip().splitlines()[-1] if self.detail.strip() else ''}"

    def describe(self) -> str:
        return f"{self.model} x {self.plan}: {self.summary()}\n{self.detail}"


def _mesh(plan: Plan) -> str:
    m, s = plan.mesh, plan.schedule
    text = f"pp{m.pp} dp{m.dp} tp{m.tp}" + (f" ep{m.ep}" if m.ep > 1 else "")
    text += f", {s.kind} x{s.microbatches}" if m.pp > 1 or s.microbatches > 1 else ""
    text += f", {plan.data_parallel.kind}" if m.dp > 1 else ""
    return text + (", sp" if m.tp > 1 and plan.tensor_parallel.sequence_parallel else "")


def plan_case(case: Case, kind: str, *, devices: int = 4) -> Plan:
    """The plan of ``kind`` for ``case`` through the public API (raises ``PlanError`` to refuse)."""
    import fairscale
    from fairscale.api import captured, resolve_cluster, search_graph
    from fairscale.arguments import check_all
    from fairscale.compile_check import checker_for

    batch = case.make_batch(0, GLOBAL_BATCH)
    if PLANS[kind] is None:  # what parallelize(model, devices=N) searches when given no plan, in its steps
        batch, _ = check_all(case.model, batch, loss_fn=case.loss_fn, devices=devices)
        graph = captured(case.model, batch, loss_fn=case.loss_fn)
        return search_graph(graph, resolve_cluster(devices, device=torch.device("cpu")), use_all_devices=True,
                            compiles=checker_for(case.model, batch, loss_fn=case.loss_fn)).plan
    return fairscale.plan(case.model, batch, devices=devices, loss_fn=case.loss_fn, constraints=PLANS[kind])


@dataclass
class _Job:
    index: int
    model: str
    plan_kind: str
    case: Case
    plan: Plan


def _rank(rank: int, world: int, jobs: list[_Job], scratch: str, say: Callable[[str], None]) -> None:
    import fairscale

    for job in jobs:
        start = time.perf_counter()
        case = job.case
        start_again(case.model)  # each plan from the model's initial weights
        pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, GLOBAL_BATCH), loss_fn=case.loss_fn,
                                   plan=job.plan, optimizer=functools.partial(torch.optim.SGD, lr=LR))
        losses, grads = [], {}
        for step in range(STEPS):
            losses.append(pm.train_step(case.make_batch(step, GLOBAL_BATCH)))
            if step == 0:
                grads = {k: v.numpy() for k, v in pm.full_grads().items()}
        del pm
        if rank == 0:
            out = dict(losses=losses, grads=grads, seconds=time.perf_counter() - start)
            with open(os.path.join(scratch, f"{job.index}.tmp"), "wb") as f:
                pickle.dump(out, f)
            os.replace(os.path.join(scratch, f"{job.index}.tmp"), os.path.join(scratch, f"{job.index}.pkl"))
            say(f"  trained {job.model} x {job.plan_kind} on {world} ranks ({out['seconds']:.1f} s)")


def _launch_all(jobs: list[_Job], devices: int, progress: Callable[[str], None]) -> dict[int, Any]:
    """Run ``jobs`` on ``devices`` ranks; per job index, rank 0's record or the crash text."""
    from fairscale.runtime.launch import RankFailedError, launch

    out: dict[int, Any] = {}
    pending = list(jobs)
    with tempfile.TemporaryDirectory(prefix="fairscale-corpus-") as scratch:
        while pending:
            try:
                # generous: a rank's capture of a large model on a loaded CI machine (the first
                # collective waits for the slowest) took over 60 s; a stuck rank still ends the launch
                launch(_rank, devices=devices, args=(pending, scratch, progress), collective_timeout_s=300.0)
                failure = None
            except RankFailedError as e:
                failure = str(e)
            for job in pending:
                path = os.path.join(scratch, f"{job.index}.pkl")
                if os.path.exists(path):
                    with open(path, "rb") as f:
                        out[job.index] = pickle.load(f)
            if failure is None:
                break
            crashed = next(j for j in pending if j.index not in out)
            out[crashed.index] = failure
            progress(f"  {crashed.model} x {crashed.plan_kind}: CRASH after launch; relaunching for the rest")
            pending = [j for j in pending if j.index not in out]
    return out


def _float32_floor(entry: CorpusModel) -> float | None:
    """The model's float32 floor (``numerics.precision_floor``): its first step's gradients in
    float32 against the same step in float64, in one process; None if it has no float64 kernels."""
    grads = {}
    for dtype in (torch.float32, torch.float64):
        case = entry.build(SEED)
        case.model.to(dtype)
        batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in case.make_batch(0, GLOBAL_BATCH))
        try:
            grads[dtype] = reference_step(case.model, batch, case.loss_fn)[1]
        except RuntimeError:
            return None
    return numerics.precision_floor(grads[torch.float32], grads[torch.float64])


def _judge(job: _Job, entry: CorpusModel, ref: Trajectory, record: Any, plan_s: float) -> Result:
    base = dict(model=job.model, plan=job.plan_kind, mesh=_mesh(job.plan))
    if isinstance(record, str):
        return Result(**base, outcome="CRASH", detail=record, seconds=plan_s)
    got = Trajectory(losses=list(record["losses"]), grads={k: torch.from_numpy(np.asarray(v))
                                                           for k, v in record["grads"].items()})
    cmp, floor = grad_comparison(ref, got), None
    if not cmp.ok and all(d.ok for d in cmp.losses):  # gradients only: is it the model's float32 floor?
        floor = _float32_floor(entry)
        if floor is not None:
            cmp = grad_comparison(ref, got, floor=floor)
    return Result(**base, outcome="exact" if cmp.ok else "DIFFERS", detail="" if cmp.ok else cmp.describe(),
                  loss_error=max((d.error for d in cmp.losses), default=0.0),
                  grad_error=max((d.error for d in cmp.grads), default=0.0), seconds=plan_s + record["seconds"],
                  floor=floor)


def run_cases(names: Iterable[str] | None = None, plans: Sequence[str] = tuple(PLANS), *, devices: int = 4,
              progress: Callable[[str], None] | None = print) -> list[Result]:
    """Plan, train and judge every (model, plan) of ``names`` x ``plans``, in that order (module
    docstring). ``progress`` gets one line per case as it is decided (``None``: quiet)."""
    say = progress or (lambda _line: None)
    registry = models()
    chosen: list[CorpusModel] = [registry[n] for n in (names if names is not None else registry)]
    unknown = [p for p in plans if p not in PLANS]
    if unknown:
        raise ValueError(f"unknown plan kinds {unknown}; choose from {list(PLANS)}")
    results: dict[int, Result] = {}
    jobs: list[_Job] = []
    refs: dict[str, Trajectory] = {}
    plan_seconds: dict[int, float] = {}
    index = 0
    for entry in chosen:
        case = entry.build(SEED)  # one model per entry, shared by its plans: the parallel runs never modify it
        for kind in plans:
            start = time.perf_counter()
            try:
                plan = plan_case(case, kind, devices=devices)
            except (PlanError, CaptureError) as e:
                msg = str(e)
                results[index] = Result(entry.name, kind, "refused", detail=msg, gaps=refusal_gaps(msg),
                                        seconds=time.perf_counter() - start)
                say(f"{entry.name} x {kind}: {results[index].summary()}")
            except Exception:  # noqa: BLE001 - a failure of the public API itself is a crash, reported
                results[index] = Result(entry.name, kind, "CRASH", detail=traceback.format_exc(),
                                        seconds=time.perf_counter() - start)
                say(f"{entry.name} x {kind}: CRASH while planning: {results[index].summary()}")
            else:
                plan_seconds[index] = time.perf_counter() - start
                jobs.append(_Job(index, entry.name, kind, case, plan))
                say(f"{entry.name} x {kind}: planned {_mesh(plan)} ({plan_seconds[index]:.1f} s)")
                if entry.name not in refs:
                    refs[entry.name] = train_reference(
                        lambda e=entry: e.build(SEED), steps=STEPS, global_batch=GLOBAL_BATCH,
                        optimizer=lambda params: torch.optim.SGD(params, lr=LR))
            index += 1
    for size in sorted({j.plan.mesh.size for j in jobs}):
        group = [j for j in jobs if j.plan.mesh.size == size]
        records = _launch_all(group, size, say)
        for job in group:
            results[job.index] = _judge(job, registry[job.model], refs[job.model], records[job.index],
                                        plan_seconds[job.index])
            say(f"{job.model} x {job.plan_kind}: {results[job.index].summary()}")
    return [results[i] for i in sorted(results)]


def table(results: Sequence[Result], plans: Sequence[str] | None = None, *, width: int | None = None) -> str:
    """A markdown table: one row per model, one column per plan kind (``width``: see ``Result.summary``)."""
    kinds = list(plans or dict.fromkeys(r.plan for r in results))
    by = {(r.model, r.plan): r for r in results}
    rows = list(dict.fromkeys(r.model for r in results))
    lines = ["| model | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for name in rows:
        cells = [by[(name, k)].summary(width=width).replace("|", "/") if (name, k) in by else "" for k in kinds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def from_json(records: Sequence[dict[str, Any]]) -> list[Result]:
    """:func:`to_json`'s records back as results (to re-render a table)."""
    return [Result(model=r["model"], plan=r["plan"], outcome=r["outcome"], detail=r["detail"], mesh=r["mesh"],
                   loss_error=r["loss_error"], grad_error=r["grad_error"], seconds=r["seconds"], gaps=r["gaps"],
                   floor=r.get("float32_floor")) for r in records]


def to_json(results: Sequence[Result]) -> list[dict[str, Any]]:
    """The results as JSON-able records (every field, plus ``ok``)."""
    return [dict(model=r.model, plan=r.plan, outcome=r.outcome, ok=r.ok, mesh=r.mesh, loss_error=r.loss_error,
                 grad_error=r.grad_error, float32_floor=r.floor, seconds=round(r.seconds, 2), gaps=r.gaps,
                 detail=r.detail) for r in results]
