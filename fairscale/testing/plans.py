"""Hand-written plans for tests: even pipeline cuts over a case's layers, the TP detector's rules,
checked by the plan-time compile check as ``fairscale.search`` checks its own."""

from __future__ import annotations

from fairscale.api import captured
from fairscale.compile_check import checker_for
from fairscale.testing.models import Case
from passes.tp.patterns import propose_tp_rules
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel

__all__ = ["even_plan"]


def even_plan(case: Case, batch: int, pp: int, dp: int, tp: int, kind: str = "ddp", *, microbatches: int = 1,
              schedule: str = "1f1b", virtual: int = 1) -> Plan:
    """pp × dp × tp over ``case``'s layers cut evenly into pp × ``virtual`` stages (the last takes
    the rest), FSDP units per ``layers.*`` block, a global batch of ``batch``; raises
    ``PlanCompileError`` if it does not compile."""
    graph = captured(case.model, case.make_batch(0, batch), loss_fn=case.loss_fn)
    names = [layer.name for layer in graph.layers]
    n = pp * virtual
    per = len(names) // n
    stages = [Stage(layers=", ".join(names[i * per:(i + 1) * per if i < n - 1 else None])) for i in range(n)]
    plan = Plan(mesh=Mesh(pp=pp, dp=dp, tp=tp),
                schedule=Schedule(kind=schedule, microbatches=microbatches, global_batch=batch,
                                  virtual_stages=virtual),
                stages=stages if pp > 1 else [],
                tensor_parallel=TensorParallel(rules=propose_tp_rules(graph.gm, tp=tp).rules if tp > 1 else {}),
                data_parallel=DataParallel(kind=kind, units="layers.*" if kind == "fsdp" else ""))
    checker_for(case.model, case.make_batch(0, batch), loss_fn=case.loss_fn).check(plan)
    return plan
