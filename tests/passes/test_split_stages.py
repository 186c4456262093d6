"""The stage split pass in one process: chained stages compute the original loss and gradients,
and the structure (what crosses each cut, what is recomputed, who holds tied copies) is as planned."""

from __future__ import annotations

import re

import pytest
import torch

from fairscale.testing.models import Case, build
from passes.layout import META_LAYOUT
from passes.split_stages import META_STAGE, META_STAGES, StagedProgram, split_stages_pass
from planner.capture import capture
from planner.graph import ModelGraph
from planner.plan import Mesh, Plan, PlanError, Schedule, Stage
from planner.schedule import ScheduleError, build_schedule, simulate


def _capture(case: Case, batch: int = 2) -> tuple[ModelGraph, tuple[torch.Tensor, ...]]:
    b = case.make_batch(0, batch)
    return capture(case.model, b, loss_fn=case.loss_fn, annotate=False), b


@pytest.fixture(scope="module")
def gpt() -> tuple[ModelGraph, tuple[torch.Tensor, ...]]:
    return _capture(build("gpt"))


@pytest.fixture(scope="module")
def skip() -> tuple[ModelGraph, tuple[torch.Tensor, ...]]:
    return _capture(build("skip"))


@pytest.fixture(scope="module")
def llama() -> tuple[ModelGraph, tuple[torch.Tensor, ...]]:
    return _capture(build("llama", layers=3))


def _plan(*stages: str, v: int = 1) -> Plan:
    kind = "interleaved" if v > 1 else "1f1b"
    return Plan(mesh=Mesh(pp=len(stages) // v), schedule=Schedule(kind=kind, microbatches=2, virtual_stages=v),
                stages=[Stage(layers=s) for s in stages])


def _chain(program: StagedProgram, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    vals: tuple[torch.Tensor, ...] = ()
    for st in program.stages:
        vals = st.gm(*[batch[i] for i in st.batch_inputs], *vals)
    return vals[0]


def _grads_match(graph: ModelGraph, program: StagedProgram, batch: tuple[torch.Tensor, ...]) -> None:
    """Backward through the chained stages gives the original gradients (tied copies summed)."""
    graph.gm.zero_grad(set_to_none=True)
    graph.gm(*batch).backward()
    want = {}
    for node in graph.gm.graph.nodes:
        if node.op == "get_attr" and "fs_param" in node.meta:
            p = graph.gm.get_parameter(str(node.target)) if str(node.target) in dict(graph.gm.named_parameters()) \
                else None
            if p is not None and p.grad is not None:
                want[program.canonical(node.meta["fs_param"])] = p.grad.clone()
    _chain(program, batch).backward()
    got: dict[str, torch.Tensor] = {}
    for st in program.stages:
        for attr, key in st.param_keys().items():
            p = dict(st.gm.named_parameters()).get(attr)
            if p is not None and p.grad is not None:
                k = program.canonical(key)
                got[k] = got[k] + p.grad if k in got else p.grad.clone()
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")


def test_gpt_two_stages_numbers_and_structure(gpt: tuple[ModelGraph, tuple[torch.Tensor, ...]]) -> None:
    graph, batch = gpt
    program = split_stages_pass(graph.gm, _plan("wte, wpe, layers.[0-1]", "layers.[2-3], ln_f, lm_head"),
                                graph=graph)
    assert torch.equal(_chain(program, batch), graph.gm(*batch))
    _grads_match(graph, program, batch)
    s0, s1 = program.stages
    assert s0.batch_inputs == [0] and s1.batch_inputs == [1]          # labels go straight to the last stage
    assert [(v.shape, v.grad) for v in s0.outputs] == [((2, 32, 64), True)]
    assert s1.inputs == s0.outputs and s1.outputs[0].shape == ()
    assert program.shared == {"wte.weight": [0, 1]}                    # tied wte / lm_head: a copy on each
    assert "wte.weight" in s0.param_keys().values() and "lm_head.weight" in s1.param_keys().values()
    assert not any(k.startswith("layers.2") for k in s0.param_keys().values())
    assert s0.gm.meta[META_LAYOUT].keys == s0.param_keys()
    # stage ownership is recorded on the input graph and on the stage graphs
    owner = {n.name: n.meta.get(META_STAGE) for n in graph.gm.graph.nodes}
    assert owner["embedding"] == 0 and owner["cross_entropy_loss"] == 1
    assert all(n.meta[META_STAGE] == 1 for n in s1.gm.graph.nodes if n.op == "call_function")
    labels = next(n for n in graph.gm.graph.nodes if n.op == "placeholder" and n.name == "batch_1")
    assert labels.meta[META_STAGES] == [1]
    # the copies are independent tensors: stepping one stage leaves the original and the other alone
    p0 = dict(s0.gm.named_parameters())
    assert all(p.data_ptr() != q.data_ptr() for p in p0.values() for q in graph.gm.parameters())
    send, recv = program.boundary_specs()
    simulate(build_schedule("1f1b", pp=2, microbatches=2), send_specs=send, recv_specs=recv)


@pytest.mark.parametrize("cut", range(1, 8))
def test_every_cut_of_gpt_computes_the_same_loss(gpt: tuple[ModelGraph, tuple[torch.Tensor, ...]], cut: int) -> None:
    graph, batch = gpt
    names = [layer.name for layer in graph.layers]
    program = split_stages_pass(graph.gm, _plan(", ".join(names[:cut]), ", ".join(names[cut:])), graph=graph)
    assert torch.equal(_chain(program, batch), graph.gm(*batch))


def test_skip_connection_is_relayed_and_mask_recomputed(skip: tuple[ModelGraph, tuple[torch.Tensor, ...]]) -> None:
    graph, batch = skip
    program = split_stages_pass(graph.gm, _plan("embed, blocks.0", "blocks.[1-2]", "blocks.[3-4]",
                                                "blocks.5, head"), graph=graph)
    assert torch.equal(_chain(program, batch), graph.gm(*batch))
    _grads_match(graph, program, batch)
    # the embedding output (node "linear") skips to the head: stages 1 and 2 receive it and pass it on
    for st in program.stages[1:3]:
        assert "linear" in [v.name for v in st.inputs] and "linear" in [v.name for v in st.outputs]
        # and their graphs return that placeholder unchanged
        out = next(n for n in st.gm.graph.nodes if n.op == "output")
        assert any(a.op == "placeholder" and a.name == "linear" for a in out.args[0])
    # the mask depends only on the batch: every stage recomputes it, none sends it
    mask = next(n for n in graph.gm.graph.nodes if n.op == "call_function" and "gt" == n.name)
    assert mask.meta[META_STAGES] == [0, 1, 2, 3]
    assert all(v.name not in ("gt", "to") for st in program.stages for v in st.inputs)
    assert all(st.batch_inputs[0] == 0 for st in program.stages)      # x reaches every stage
    assert program.shared == {}


def test_llama_rotary_tables_are_recomputed_not_sent(llama: tuple[ModelGraph, tuple[torch.Tensor, ...]]) -> None:
    graph, batch = llama
    names = [layer.name for layer in graph.layers]
    program = split_stages_pass(graph.gm, _plan(*[", ".join(names[i:i + 2]) for i in range(0, 6, 2)]), graph=graph)
    assert torch.equal(_chain(program, batch), graph.gm(*batch))
    _grads_match(graph, program, batch)
    for st in program.stages[:-1]:
        assert len(st.outputs) == 1 and st.outputs[0].shape == (2, 16, 64)   # only the hidden state crosses


def test_interleaved_stages_and_pass_through_stage(gpt: tuple[ModelGraph, tuple[torch.Tensor, ...]]) -> None:
    graph, batch = gpt
    names = [layer.name for layer in graph.layers]
    program = split_stages_pass(graph.gm, _plan(*names, v=2), graph=graph)   # 8 stages of one layer
    assert len(program.stages) == 8 and torch.equal(_chain(program, batch), graph.gm(*batch))
    assert program.shared == {"wte.weight": [0, 7]}


def test_plan_problems_are_all_reported(gpt: tuple[ModelGraph, tuple[torch.Tensor, ...]]) -> None:
    graph, _ = gpt
    with pytest.raises(PlanError) as info:
        split_stages_pass(graph.gm, _plan("wte, wpe, layers.[0-2]", "layers.[2-3], ln_g"), graph=graph)
    assert info.value.problems == [
        "stages[1].layers: 'ln_g' matches no layer",
        "stages[1].layers: layers.2 is already in stages[0]",
        "stages: layers ln_f, lm_head are in no stage",
    ]
    with pytest.raises(PlanError, match=re.escape("stages: 2 given, but pp (3) × virtual_stages (1) = 3")):
        split_stages_pass(graph.gm, Plan(mesh=Mesh(pp=3), stages=[Stage(layers="wte, wpe, layers.*"),
                                                                    Stage(layers="ln_f, lm_head")]), graph=graph)
    with pytest.raises(PlanError, match=re.escape("stages[1].layers: wte runs before lm_head of stages[0]; stages "
                                                  "must be contiguous runs of layers in execution order")):
        split_stages_pass(graph.gm, _plan("layers.*, ln_f, lm_head", "wte, wpe"), graph=graph)
    with pytest.raises(PlanError, match=re.escape("stages: empty, but pp (2) × virtual_stages (1) = 2 stages")):
        split_stages_pass(graph.gm, Plan(mesh=Mesh(pp=2)), graph=graph)
    one = split_stages_pass(graph.gm, Plan(), graph=graph)
    assert len(one.stages) == 1 and one.stages[0].batch_inputs == [0, 1]


def test_boundary_shape_disagreement_is_caught_by_the_simulator(
        gpt: tuple[ModelGraph, tuple[torch.Tensor, ...]]) -> None:
    graph, _ = gpt
    other, _ = _capture(build("gpt"), batch=4)
    plan = _plan("wte, wpe, layers.[0-1]", "layers.[2-3], ln_f, lm_head")
    a, b = split_stages_pass(graph.gm, plan, graph=graph), split_stages_pass(other.gm, plan, graph=other)
    with pytest.raises(ScheduleError, match=re.escape("stage 0 sends [((2, 32, 64), torch.float32)] but stage 1 "
                                                      "expects [((4, 32, 64), torch.float32)]")):
        simulate(build_schedule("gpipe", pp=2, microbatches=2), send_specs=a.boundary_specs()[0],
                 recv_specs=b.boundary_specs()[1])


def test_a_recomputed_value_replays_the_in_place_writes_into_its_views() -> None:
    """Hugging Face BART (and Whisper) build the decoder's inputs with ``shift_tokens_right``:
    ``new_zeros``, ``copy_`` into a slice of it, ``fill_`` of its first column, ``masked_fill_``.
    A stage that recomputed the value (it depends on the labels only) copied ``new_zeros`` and
    ``masked_fill_`` but not the writes through the views, so its decoder read zeros: the losses of
    pp2 plans with the decoder embedding on a later stage than the shift differed by 5e-3, silently."""
    from fairscale.testing.corpus_hf import MODELS

    case = MODELS["hf-bart"].build(0)
    graph, batch = _capture(case)
    program = split_stages_pass(graph.gm, _plan(
        "inner.model.encoder.embed_tokens, inner.model.encoder.embed_positions, "
        "inner.model.encoder.layernorm_embedding, inner.model.encoder.layers.0",
        "inner.model.encoder.layers.1, inner.model.decoder.embed_tokens, inner.model.decoder.embed_positions, "
        "inner.model.decoder.layernorm_embedding",
        "inner.model.decoder.layers.0", "inner.model.decoder.layers.1, inner.lm_head", v=2), graph=graph)
    assert float(_chain(program, batch)) == float(graph.gm(*batch))
    shift = [n for n in program.stages[1].gm.graph.nodes if n.op == "call_function"
             and n.target in (torch.ops.aten.copy_.default, torch.ops.aten.fill_.Tensor)]
    assert len(shift) == 2, "the stage that recomputes the shifted labels replays both writes"


class _Block(torch.nn.Module):
    """torchvision's BasicBlock: conv1, bn1, conv2, bn2 (the stem's names), a downsample after them."""

    def __init__(self, downsample: bool = False) -> None:
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.conv2, self.bn2 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.downsample = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4)) if downsample \
            else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        identity = self.downsample(x) if self.downsample is not None else x
        return torch.relu(out + identity)


class _ResNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.layer1, self.layer2 = torch.nn.Sequential(_Block()), torch.nn.Sequential(_Block(downsample=True))
        self.fc = torch.nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(torch.relu(self.bn1(self.conv1(x)))))
        return self.fc(x.mean((2, 3)))


def test_a_layer_named_in_full_is_its_stages_though_a_top_level_name_ends_it() -> None:
    """The search's stages of torchvision's ResNet name the stem "conv1, bn1", which also match
    layer2.0.conv1 and layer2.0.bn1 by suffix: every pp plan of it had been refused ("stages[1].layers:
    layer2.0.conv1 is already in stages[0]"). A layer another stage names in full is that stage's."""
    torch.manual_seed(0)
    model = _ResNet()
    batch = (torch.randn(2, 3, 6, 6), torch.tensor([1, 3]))
    graph = capture(model, batch, loss_fn=torch.nn.functional.cross_entropy, annotate=False)
    names = [layer.name for layer in graph.layers]
    cut = names.index("layer2.0.conv1")
    program = split_stages_pass(graph.gm, _plan(", ".join(names[:cut]), ", ".join(names[cut:])), graph=graph)
    assert [st.layers for st in program.stages] == [names[:cut], names[cut:]]
    assert torch.equal(_chain(program, batch), graph.gm(*batch))
    with pytest.raises(PlanError, match=re.escape("stages[1].layers: layer2.0.conv1 is already in stages[0]")):
        split_stages_pass(graph.gm, _plan("conv1, bn1, layer1, layer2.0.conv1", "layer2.0.conv1, layer2.0.bn1, "
                                          "layer2.0.conv2, layer2.0.bn2, fc"), graph=graph)


class _InPlaceBlock(torch.nn.Module):
    """torchvision's BasicBlock as written: ``out += identity`` then an in-place ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.conv2, self.bn2 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.downsample = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.BatchNorm2d(4))
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        out += self.downsample(x)
        return self.relu(out)


def test_a_received_value_written_in_place_is_named_among_the_stages_received_values() -> None:
    """Cut after bn2, stage 1 receives bn2's output and adds the identity into it in place, so the
    split copies it first; the stage recorded the copy's op (aten.clone.default) as that received
    value's name, the tensor-parallel pass then recorded one received value of two, and the search's
    pp2 x tp2 plan of torchvision's ResNet crashed after launch on every rank ("the tensor-parallel
    stage graph records 1 received values but the stage boundary has 2")."""
    from passes import compile_rank
    from passes.split_stages import stage_io
    from passes.tp.summary import tp_summary
    from planner.plan import TensorParallel

    torch.manual_seed(0)
    model = _ResNet()
    model.layer2 = torch.nn.Sequential(_InPlaceBlock())
    batch = (torch.randn(2, 3, 6, 6), torch.tensor([1, 3]))
    graph = capture(model, batch, loss_fn=torch.nn.functional.cross_entropy, annotate=False)
    names = [layer.name for layer in graph.layers]
    cut = names.index("layer2.0.downsample.0")
    plan = _plan(", ".join(names[:cut]), ", ".join(names[cut:]))
    program = split_stages_pass(graph.gm, plan, graph=graph)
    gm = program.stages[1].gm
    received = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"][-len(program.stages[1].inputs):]
    assert len(received) == 2 and list(stage_io(gm).received) == received
    assert torch.equal(_chain(program, batch), graph.gm(*batch))
    tp_plan = Plan(mesh=Mesh(pp=2, tp=2), schedule=Schedule(kind="gpipe", microbatches=1), stages=plan.stages,
                   tensor_parallel=TensorParallel(rules={"fc": "rowwise"}))
    _, rank = compile_rank(graph, tp_plan, stages=[1], dp_index=0, tp_index=0)
    assert len((tp_summary(rank[1]) or {})["received"]) == 2


class _SliceWrite(torch.nn.Module):
    """Two values cross the cut after ``c``; the next stage adds into a slice of one in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
        self.c, self.d = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.c(self.a(x)), self.b(x)
        h[:, :4] += g[:, :4]
        return self.d(torch.nn.functional.gelu(h))


def test_a_received_value_written_through_a_view_is_copied_first_and_the_copy_is_the_stages() -> None:
    """``h[:, :4] += g[:, :4]`` on a received ``h`` (a slice, then ``add_`` on it) crashed after launch
    on stage 1's ranks at the first train_step, 'a view of a leaf Variable that requires grad is being
    used in an in-place operation': the split copied a received value written in place by its own op
    only. And the copy carried the sender's module, so the search's pp2 x tp2 plan (rule 'c': rowwise,
    c in stage 0) was refused for stage 1: "rule 'c' (rowwise) matches module 'c', which has no
    linear/embedding/expert parameter to shard (first node: clone_default ...)"."""
    from passes import compile_rank
    from planner.plan import TensorParallel

    torch.manual_seed(0)
    batch = (torch.randn(4, 8), torch.tensor([1, 3, 0, 2]))
    graph = capture(_SliceWrite(), batch, loss_fn=torch.nn.functional.cross_entropy, annotate=False)
    plan = _plan("a, b, c", "d")
    program = split_stages_pass(graph.gm, plan, graph=graph)
    first, second = program.stages
    sent = first.gm(*[batch[i] for i in first.batch_inputs])
    received = [v.detach().requires_grad_() for v in sent]  # leaves, as the runtime receives them
    loss = second.gm(*[batch[i] for i in second.batch_inputs], *received)[0]
    loss.backward()
    assert torch.equal(loss, graph.gm(*batch)) and all(v.grad is not None for v in received)
    tp_plan = Plan(mesh=Mesh(pp=2, tp=2), schedule=Schedule(kind="gpipe", microbatches=1), stages=plan.stages,
                   tensor_parallel=TensorParallel(rules={"[a,b]": "colwise", "c": "rowwise"}))
    compile_rank(graph, tp_plan, stages=[1], dp_index=0, tp_index=0)
