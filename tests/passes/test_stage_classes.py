"""passes.stage_classes: stages the per-stage passes treat alike compile to the same program, and a
stage that differs in anything the passes read (a rule, a recompute kind, an FSDP unit, a tied
weight) is in a class of its own."""

from __future__ import annotations

import torch

from fairscale.testing.models import GPT, GPTConfig, lm_loss
from passes import compile_rank, split_program
from passes.stage_classes import stage_classes
from passes.tp.patterns import propose_tp_rules
from planner.capture import capture
from planner.graph import ModelGraph
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel

LAYERS = 8


def _graph() -> ModelGraph:
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=LAYERS, dim=32, heads=4, seq=8, vocab=64))
    ids = torch.randint(0, 64, (2, 8))
    return capture(model, (ids, ids), loss_fn=lm_loss)


def _plan(graph: ModelGraph, *, recompute: dict[str, str] | None = None, units: str = "",
          kind: str = "zero2") -> Plan:
    stages = [Stage(layers="wte, wpe, layers.0")] + [Stage(layers=f"layers.{i}") for i in range(1, LAYERS - 1)]
    stages.append(Stage(layers=f"layers.{LAYERS - 1}, ln_f, lm_head"))
    return Plan(mesh=Mesh(pp=4, dp=2, tp=2), schedule=Schedule(kind="interleaved", virtual_stages=2, microbatches=4),
                stages=stages, tensor_parallel=TensorParallel(rules=propose_tp_rules(graph.gm, tp=2).rules),
                data_parallel=DataParallel(kind=kind, units=units), recompute=recompute or {})


def _ops(gm: torch.fx.GraphModule) -> list[str]:
    return [f"{n.op}:{n.target if n.op == 'call_function' else ''}" for n in gm.graph.nodes]


def test_equivalent_stages_compile_to_the_same_program() -> None:
    graph = _graph()
    for plan in (_plan(graph), _plan(graph, kind="fsdp", units="layers.*"),
                 _plan(graph, recompute={"layers.*": "selective"})):
        program = split_program(graph, plan)
        classes = stage_classes(program, plan)
        # first stage (embeddings and a tied weight), six identical blocks, last stage (head, loss)
        assert classes == [[0], list(range(1, LAYERS - 1)), [LAYERS - 1]], classes
        _, modules = compile_rank(graph, plan, stages=range(LAYERS), dp_index=1, tp_index=1, program=program)
        for members in classes:
            first = _ops(modules[members[0]])
            assert all(_ops(modules[s]) == first for s in members[1:])


def test_a_stage_the_plan_treats_differently_is_its_own_class() -> None:
    graph = _graph()
    for plan in (_plan(graph, recompute={"layers.3": "full"}),                 # one recomputed block
                 _plan(graph, kind="fsdp", units="layers.[1-2,4-7]")):         # one block not a unit
        classes = stage_classes(split_program(graph, plan), plan)
        assert [3] in classes and [1, 2, 4, 5, 6] in classes, classes
    plan = _plan(graph)
    plan.tensor_parallel.rules = {**plan.tensor_parallel.rules, "layers.5.mlp.up_proj": "colwise_gather"}
    plan.tensor_parallel.rules = dict(sorted(plan.tensor_parallel.rules.items(), key=lambda kv: "5" not in kv[0]))
    classes = stage_classes(split_program(graph, plan), plan)
    assert [5] in classes and [1, 2, 3, 4, 6] in classes, classes
