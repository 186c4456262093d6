"""passes.stage_blueprint: a stage read off the capture before it is built says exactly what the
built stage graph holds, the stage classes read off blueprints are those of the built graphs, and
a split on meta (or sharing the capture's tensors) builds only the stages that are used."""

from __future__ import annotations

import pytest
import torch

from fairscale.testing.corpus_hf import MODELS
from fairscale.testing.models import Case, GPT, GPTConfig, build, lm_loss
from passes.layout import META_LAYOUT
from passes.program import StagedProgram
from passes.split_stages import split_stages_pass
from passes.stage_classes import stage_classes, stage_key
from planner.capture import capture
from planner.graph import ModelGraph
from planner.plan import Mesh, Plan, Schedule, Stage

CASES = {
    "gpt": lambda: build("gpt"), "skip": lambda: build("skip"), "llama": lambda: build("llama", layers=3),
    "gpt2": lambda: build("gpt2", layers=3), "bert": lambda: build("bert"), "t5": lambda: build("t5"),
    "mixtral": lambda: build("mixtral"), "vit": lambda: build("vit"), "cnn": lambda: build("cnn"),
    "hf-bart": lambda: MODELS["hf-bart"].build(0),
}


def _capture(case: Case) -> ModelGraph:
    return capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, annotate=False)


def _cuts(graph: ModelGraph) -> list[Plan]:
    """Every layer its own stage, and pairs of layers."""
    names = [layer.name for layer in graph.layers]
    pairs = [", ".join(names[i:i + 2]) for i in range(0, len(names), 2)]
    return [Plan(mesh=Mesh(pp=len(stages)), schedule=Schedule(kind="1f1b", microbatches=len(stages)),
                 stages=[Stage(layers=s) for s in stages]) for stages in ([*names], pairs) if len(stages) > 1]


def _built_classes(program: StagedProgram) -> list[list[int]]:
    groups: dict[object, list[int]] = {}
    for st in program.stages:
        assert st.gm is not None
        key = stage_key(st.gm, rules=[], recompute={}, units=None, shared=set(program.shared_keys(st.index)))
        groups.setdefault(key, []).append(st.index)
    return list(groups.values())


@pytest.mark.parametrize("name", sorted(CASES))
def test_blueprints_say_what_the_built_stages_hold(name: str) -> None:
    graph = _capture(CASES[name]())
    for plan in _cuts(graph):
        program = split_stages_pass(graph.gm, plan, graph=graph, share_weights=True)
        assert all(st.builder is not None for st in program.stages), "nothing is built before it is used"
        classes = stage_classes(program, plan)  # from the blueprints: still nothing built
        assert all(st.builder is not None for st in program.stages)
        holders: dict[str, list[int]] = {}
        for st in program.stages:
            gm = st.gm  # built here; the build's dead-code elimination must find nothing to remove
            assert gm is not None and st.builder is None
            used = {str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}
            assert st.keys == gm.meta[META_LAYOUT].keys and set(st.keys) <= used
            assert [n.name for n in gm.graph.nodes if n.op == "placeholder"][:len(st.batch_inputs)] == \
                [graph.gm.graph.find_nodes(op="placeholder")[i].name for i in st.batch_inputs]
            for attr, p in gm.named_parameters():
                if p.requires_grad:
                    holders.setdefault(program.canonical(st.keys[attr]), []).append(st.index)
        assert program.shared == {k: v for k, v in holders.items() if len(v) > 1}
        assert classes == _built_classes(program), f"{name}, {len(plan.stages)} stages"


def test_tied_weights_are_shared_from_the_blueprints() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=4, dim=32, heads=4, seq=8, vocab=64, tied=True))
    ids = torch.randint(0, 64, (2, 8))
    graph = capture(model, (ids, ids), loss_fn=lm_loss, annotate=False)
    plan = _cuts(graph)[0]
    program = split_stages_pass(graph.gm, plan, graph=graph, share_weights=True)
    assert program.shared == {"wte.weight": [0, len(plan.stages) - 1]}
    assert program.shared_keys(len(plan.stages) - 1) == ["lm_head.weight"]


def test_the_plan_time_check_on_meta_builds_only_the_stages_it_compiles() -> None:
    from fairscale.compile_check import graph_refusal
    from passes.tp.normalize import to_aten

    with torch.device("meta"):
        model = GPT(GPTConfig(layers=12, dim=32, heads=4, seq=8, vocab=64))
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    graph = capture(model, (ids, ids), loss_fn=lm_loss)
    graph.gm = to_aten(graph.gm)  # as the compile check brings an fx capture on meta to ATen
    plan = _cuts(graph)[0]
    splits: dict[tuple[object, ...], StagedProgram] = {}
    assert graph_refusal(graph, plan, splits=splits) is None
    (program,) = splits.values()
    members = stage_classes(program, plan)
    assert len(plan.stages) == 16 and [len(m) for m in members] == [1, 1, 1, 11, 1, 1], members  # 11 blocks alike
    assert [st.index for st in program.stages if st.builder is None] == [m[0] for m in members]


def test_a_copy_of_real_weights_is_taken_at_the_split() -> None:
    """Without share_weights the stages copy the weights as they are when split, not when first used."""
    case = build("gpt")
    graph = _capture(case)
    program = split_stages_pass(graph.gm, _cuts(graph)[0], graph=graph)
    assert all(st.builder is None for st in program.stages)
    before = {k: v.clone() for k, v in program.stages[2].gm.state_dict().items()}
    with torch.no_grad():
        for p in graph.gm.parameters():
            p.add_(1.0)
    after = program.stages[2].gm.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
