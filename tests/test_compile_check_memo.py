"""What the plan-time compile check shares between the plans it checks, and that sharing changes
no verdict: one split per set of stages (``passes.split_key``), and the search's own capture
taken as the check's capture where it is the same (``CompileChecker.adopt``)."""

from __future__ import annotations

import copy
from typing import Any

import torch

import fairscale
import passes
from fairscale import cli
from fairscale.api import captured
from fairscale.compile_check import CompileChecker, Refusal, graph_refusal
from passes.graph_utils import local_fake
from planner.capture import capture
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel

RULES = {"layers.*.attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.attn.o_proj": "rowwise",
         "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
FOUR = [Stage(layers="wte, wpe, layers.0"), Stage(layers="layers.1"), Stage(layers="layers.2"),
        Stage(layers="layers.3, ln_f, lm_head")]
TWO = [Stage(layers="wte, wpe, layers.[0-1]"), Stage(layers="layers.[2-3], ln_f, lm_head")]


def meta_gpt() -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor], Any]:
    import meta_factories

    return meta_factories.gpt_meta()


def plans() -> list[Plan]:
    """Plans that share stages (pp 4 × v 1 and pp 2 × v 2: the same four stages) and differ in dp,
    microbatches and data-parallel kind; others with other stages; two the passes refuse."""
    out = []
    for pp, v, stages in ((4, 1, FOUR), (2, 2, FOUR), (2, 1, TWO)):
        for dp, m, kind in ((2, 4, "zero1"), (4, 2, "zero1"), (2, 2, "fsdp"), (1, 8, "ddp")):
            out.append(Plan(mesh=Mesh(pp=pp, dp=dp, tp=2), schedule=Schedule(
                kind="interleaved" if v > 1 else "1f1b", microbatches=m, virtual_stages=v, global_batch=8),
                stages=copy.deepcopy(stages), tensor_parallel=TensorParallel(rules=dict(RULES), sequence_parallel=True),
                data_parallel=DataParallel(kind=kind)))
    out.append(Plan(mesh=Mesh(pp=4, dp=2, tp=3), schedule=Schedule(microbatches=4, global_batch=8),  # 4 heads
                    stages=copy.deepcopy(FOUR), tensor_parallel=TensorParallel(rules=dict(RULES))))
    out.append(Plan(mesh=Mesh(pp=4, dp=2, tp=2), schedule=Schedule(microbatches=4, global_batch=8),
                    stages=[Stage(layers="wte, wpe"), *copy.deepcopy(FOUR[1:])],
                    tensor_parallel=TensorParallel(rules=dict(RULES))))
    return out


def test_shared_splits_give_the_verdicts_of_separate_ones(monkeypatch: Any) -> None:
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    model, batch, loss_fn = meta_gpt()
    memo = CompileChecker(model, batch, loss_fn=loss_fn)
    splits: list[Plan] = []
    real_split = passes.split_program

    def counted(graph: Any, plan: Plan, **kw: Any) -> Any:
        splits.append(plan)
        return real_split(graph, plan, **kw)

    monkeypatch.setattr("fairscale.compile_check.split_program", counted)
    shared = [memo.refusal(p) for p in plans()]
    monkeypatch.setattr("fairscale.compile_check.split_program", real_split)
    separate = [graph_refusal(memo.graph_for(p), p) for p in plans()]  # no memo: one split per plan
    assert [r is None for r in shared] == [r is None for r in separate]
    assert [r.message() if r else None for r in shared] == [r.message() if r else None for r in separate]
    assert [r is None for r in shared].count(False) == 2, [r.message() for r in shared if r]
    # 12 good plans on two sets of stages at two microbatch shapes (1: dp × m = 8; 2: fsdp's dp 2 ×
    # m 2), and tp = 3 (refused) on the first: 4 splits, then the refused stages (no key: the split
    # raises, from that plan's own fields)
    assert len(splits) == 5 and splits[-1].stages[0].layers == "wte, wpe"


def test_split_key_reads_what_the_split_reads() -> None:
    from fairscale.testing.models import GPT, GPTConfig, lm_loss

    with torch.device("meta"):
        model = GPT(GPTConfig(layers=4, dim=64, heads=4, seq=16, vocab=128))
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    graph = capture(model, (ids, ids), loss_fn=lm_loss)
    a, b, c, d, e = plans()[0], plans()[1], plans()[4], plans()[8], plans()[-1]
    assert passes.split_key(graph, a) == passes.split_key(graph, b) == passes.split_key(graph, c)  # pp4 = pp2 × v2
    assert passes.split_key(graph, a) != passes.split_key(graph, d)  # two stages
    assert passes.split_key(graph, e) is None  # layers.0 in no stage
    assert passes.split_key(graph, dataclass_replace(a, batch_norm="local")) != passes.split_key(graph, a)


def dataclass_replace(plan: Plan, **kw: Any) -> Plan:
    import dataclasses

    return dataclasses.replace(plan, **kw)


def test_a_model_with_batch_norm_keys_its_split_on_dp_and_microbatches() -> None:
    from fairscale.testing.batch_norm_models import build_tabular

    case = build_tabular()
    graph = capture(case.model, case.make_batch(0, 8), loss_fn=case.loss_fn)
    assert passes.has_batch_norm(graph.gm)
    one = Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=1, global_batch=8))
    two = Plan(mesh=Mesh(dp=4), schedule=Schedule(microbatches=1, global_batch=8))
    assert passes.split_key(graph, one) != passes.split_key(graph, two)


def test_the_search_capture_is_the_check_capture(monkeypatch: Any) -> None:
    """A model on meta: the check's capture at the batch's shape is the search's, brought to ATen
    on a copy, and it is what a capture of its own would be."""
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    model, batch, loss_fn = meta_gpt()
    graph = captured(model, batch, loss_fn=loss_fn)
    before = graph.gm.code
    adopted = CompileChecker(model, batch, loss_fn=loss_fn)
    adopted.adopt(graph)
    own = CompileChecker(model, batch, loss_fn=loss_fn)
    p = plans()[0]
    p.schedule = Schedule(microbatches=1, global_batch=2)
    p.mesh = Mesh(pp=4, dp=2, tp=2)
    mine, theirs = adopted.graph_for(p), own.graph_for(p)
    assert mine.gm is not graph.gm and graph.gm.code == before  # the search's graph is left as it is
    assert mine.gm.code == theirs.gm.code
    assert [n.meta.keys() for n in mine.gm.graph.nodes] == [n.meta.keys() for n in theirs.gm.graph.nodes]
    assert [layer.name for layer in mine.layers] == [layer.name for layer in theirs.layers]
    assert adopted.refusal(p) == own.refusal(p) is None
    # another microbatch shape: captured as before
    q = copy.deepcopy(p)
    q.schedule = Schedule(microbatches=1, global_batch=4)
    other = adopted.graph_for(q)
    assert not isinstance(other, Refusal) and other.gm is not mine.gm and other.batch_size == 2


def test_a_real_model_capture_is_not_adopted() -> None:
    from fairscale.testing.models import build

    case = build("gpt", layers=2, dim=32, heads=2, seq=8, vocab=64)
    batch = case.make_batch(0, 4)
    graph = captured(case.model, batch, loss_fn=case.loss_fn)
    checker = CompileChecker(case.model, batch, loss_fn=case.loss_fn)
    checker.adopt(graph)  # exported for its ranks, not traced by fx: the check captures it itself
    assert checker._planned is None


def test_the_cli_and_the_api_return_the_same_plan_for_a_model_on_meta(monkeypatch: Any, capsys: Any) -> None:
    """With tensor parallelism (rules from the detector; tp fixed, as a tiny model would not choose
    it) and the compile check on (which may take the search's capture for its own)."""
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    code = cli.main(["plan", "meta_factories:gpt_meta", "--cluster", "a100-80gb", "--devices", "16",
                     "--global-batch", "32", "--constraints", '{"mesh": {"tp": 2}}'])
    out, err = capsys.readouterr()
    assert code == 0, err
    from_cli = Plan.from_json(out)
    assert from_cli.mesh.tp > 1 and from_cli.tensor_parallel.rules, from_cli.to_json()
    model, batch, loss_fn = meta_gpt()
    from_api = fairscale.plan(model, batch, loss_fn=loss_fn, cluster="a100-80gb", devices=16, global_batch=32,
                               constraints={"mesh": {"tp": 2}})
    from_cli.model.factory = ""
    assert from_cli.to_json() == from_api.to_json()


def test_local_fake_is_what_the_fake_mode_makes() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        v = torch.empty(4, 6, 8, dtype=torch.bfloat16)
        made = torch.empty(4, 3, 8, dtype=torch.bfloat16)
    fast = local_fake(v, (4, 3, 8))
    assert isinstance(fast, FakeTensor) and fast.fake_mode is mode
    assert (fast.shape, fast.stride(), fast.dtype, fast.device, fast.requires_grad) == \
        (made.shape, made.stride(), made.dtype, made.device, made.requires_grad)
    assert local_fake(v, (4, 6, 8)) is v
