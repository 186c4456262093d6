"""A model whose forward writes a buffer in place (a step counter, an EMA of activations) is refused
plans that cut the batch, and the search keeps its batch whole (``planner.buffer_writes``).

One process updates such a buffer once per step from the whole batch. Under dp each rank had
updated its own copy from its slice, and under microbatches once per microbatch: after two steps
with dp=2 the counter read 5 and the EMA was off by 120% in ``pm.state_dict()`` (rank 0's copy,
which the build-time checks had also advanced), with 2 microbatches 7 and 170%, and nothing said
so. Batch norm's running statistics stay synchronized by ``passes.dp.batch_norm``, not refused.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fairscale
from fairscale.api import captured, resolve_cluster
from fairscale.testing.batch_norm_models import build_resnet
from fairscale.testing.corpus_hf import Labels
from planner.buffer_writes import find_buffer_writes
from planner.plan import Mesh, Plan, PlanError, Schedule
from planner.validate import validate_plan

BATCH = 8


class Tracker(nn.Module):
    """Counts its training calls and keeps an EMA of its hidden activations' batch mean."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        self.calls += 1
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return F.mse_loss(self.down(h), y)


def _model() -> Tracker:
    torch.manual_seed(0)
    return Tracker().double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g, dtype=torch.float64), torch.randn(BATCH, 4, generator=g,
                                                                                 dtype=torch.float64)


def _refusal(dp: int, microbatches: int) -> str:
    graph = captured(_model(), _batch(0))
    plan = Plan(mesh=Mesh(dp=dp), schedule=Schedule(kind="1f1b", microbatches=microbatches, global_batch=BATCH))
    with pytest.raises(PlanError) as info:
        validate_plan(plan, graph, resolve_cluster(dp, "a100-80gb"), devices=dp)
    return str(info.value)


def test_the_written_buffers_are_found_with_their_lines_and_batch_norm_is_not() -> None:
    writes = find_buffer_writes(captured(_model(), _batch(0)).gm)
    assert [w.buffer for w in writes] == ["calls", "ema"]
    assert writes[0].source.endswith("`self.calls += 1`"), writes[0].source
    assert writes[1].source.endswith("`self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))`"), writes[1].source
    case = build_resnet()  # num_batches_tracked += 1 and the running statistics: the batch-norm pass's
    assert find_buffer_writes(captured(case.model, case.make_batch(0, BATCH), loss_fn=case.loss_fn).gm) == []


def test_plans_that_cut_the_batch_are_refused_naming_the_buffers() -> None:
    text = _refusal(dp=2, microbatches=1)
    assert "mesh.dp: the model's forward writes the buffer(s) calls (test_buffer_writes.py:" in text, text
    assert "a plan with dp=2 ranks runs the forward on each slice of the batch" in text, text
    assert "Use mesh.dp 1 and schedule.microbatches 1" in text, text
    # module and op of each write, as every refusal names them (a VQ-VAE's EMA codebook had its lines alone)
    assert "`self.calls += 1`) at module <model top level>, op aten.add_.Tensor, ema (" in text, text
    assert "`self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))`) at module <model top level>, op aten.mul_.Tensor" \
        in text, text
    text = _refusal(dp=1, microbatches=2)
    assert "schedule.microbatches: the model's forward writes the buffer(s) calls" in text, text
    assert "a plan with 2 microbatches" in text, text


def _one_process(model: nn.Module, *, steps: int) -> list[float]:
    """Train ``model`` in place for ``steps`` SGD steps (lr 0.1) on ``_batch(step)``; its losses."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = model(*_batch(step))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _rank(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], str]:
    pm = fairscale.parallelize(_model(), example_inputs=_batch(0),
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    losses = [pm.train_step(_batch(step)) for step in range(2)]
    return losses, pm.state_dict(), f"dp={pm.plan.mesh.dp} microbatches={pm.plan.schedule.microbatches}"


def test_the_searched_plan_keeps_the_batch_whole_and_trains_exactly() -> None:
    model = _model()
    want = _one_process(model, steps=2)
    losses, state, cut = fairscale.launch(_rank, devices=2, timeout_s=600)[0]
    assert cut == "dp=1 microbatches=1"
    assert losses == pytest.approx(want, rel=1e-12)
    assert int(state["calls"]) == 2
    assert torch.allclose(state["ema"], model.ema, rtol=1e-12, atol=0)


def test_a_model_on_meta_has_no_buffer_writes_from_the_tensors_its_forward_makes() -> None:
    """HF Llama (use_cache, the default) built under ``torch.device("meta")``, as one plans a 7B
    model: its empty KV cache traced as lifted constants then ``detach_``, which had been counted as
    buffer writes, so the search kept the batch whole (Llama-2-7B on 8 H100s: tp8, no dp, of 2
    configurations)."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    assert cfg.use_cache
    with torch.device("meta"):
        model = Labels(transformers.LlamaForCausalLM(cfg))
    ids = torch.zeros(4, 8, dtype=torch.long, device="meta")
    graph = captured(model, (ids, ids))
    assert any(n.target == torch.ops.aten.detach_.default for n in graph.gm.graph.nodes)
    assert find_buffer_writes(graph.gm) == []
    found = fairscale.search(model, (ids, ids), cluster="h100-sxm-80gb", devices=4, check_runners_up=False)
    assert found.considered > 10 and found.plan.mesh.dp > 1, found.table()


class AuxLossFreeRouter(nn.Module):
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's routing bias moves against its load,
    updated in forward under ``torch.no_grad()``, which export puts in a ``wrap_with_set_grad_enabled``
    body (the search had not looked inside it, so dp and microbatches had each updated the bias from
    their own tokens, silently); and a token count kept the same way, torchtitan's."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.experts = nn.Linear(8, 4, bias=False), nn.Linear(8, 16)
        self.register_buffer("expert_bias", torch.zeros(4))
        self.register_buffer("tokens_per_expert", torch.zeros(4), persistent=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        scores = torch.sigmoid(self.gate(x))
        _, chosen = torch.topk(scores + self.expert_bias, k=1, dim=-1)
        load = F.one_hot(chosen[:, 0], 4).sum(0).to(x.dtype)
        with torch.no_grad():
            self.expert_bias.add_(0.01 * torch.sign(load.mean() - load))
            self.tokens_per_expert.add_(load)
        out = self.experts(x).view(-1, 4, 4) * scores.gather(1, chosen)[:, :, None]
        return F.mse_loss(out.sum(1), y)


def test_buffers_written_under_no_grad_are_found_and_cut_batches_refused() -> None:
    torch.manual_seed(0)
    model = AuxLossFreeRouter().double()
    writes = find_buffer_writes(captured(model, _batch(0)).gm)
    assert [w.buffer for w in writes] == ["expert_bias", "tokens_per_expert"], writes
    assert writes[0].source.endswith("`self.expert_bias.add_(0.01 * torch.sign(load.mean() - load))`"), writes[0]
    with pytest.raises(PlanError, match=r"the model.s forward writes the buffer\(s\) expert_bias \(test_buffer_writes.py:"):
        fairscale.plan(model, _batch(0), devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    plan = fairscale.plan(model, _batch(0), devices=2)
    assert (plan.mesh.dp, plan.schedule.microbatches) == (1, 1), plan


def _router_rank(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], str, bool]:
    torch.manual_seed(0)
    model = AuxLossFreeRouter().double()
    pm = fairscale.parallelize(model, example_inputs=_batch(0), optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    losses = [pm.train_step(_batch(step)) for step in range(3)]
    mesh = pm.plan.mesh
    untouched = not model.expert_bias.any() and not model.tokens_per_expert.any()
    return losses, pm.state_dict(), f"pp={mesh.pp} dp={mesh.dp} tp={mesh.tp} m={pm.plan.schedule.microbatches}", \
        untouched


def test_a_buffer_written_under_no_grad_is_updated_on_the_ranks_as_in_one_process() -> None:
    """The no_grad block returns nothing, so torch.fx's dead-code elimination had dropped it from the
    rank graphs (``planner.graph.impure``): the searched plan (the batch whole) never moved the bias
    and trained to other losses from the second step. The rank owns the buffers it writes: the
    model given to parallelize keeps its own (they had been shared, so the rank's writes reached it
    and a second module compiled from it in the process started from them)."""
    torch.manual_seed(0)
    model = AuxLossFreeRouter().double()
    want = _one_process(model, steps=3)
    losses, state, plan, untouched = fairscale.launch(_router_rank, devices=2, timeout_s=600)[0]
    assert untouched
    assert " dp=1 " in plan and plan.endswith(" m=1"), plan
    assert torch.equal(state["expert_bias"], model.expert_bias), (state["expert_bias"], model.expert_bias, plan)
    assert losses == pytest.approx(want, rel=1e-12), plan


class RowFreeWrites(nn.Module):
    """State written in forward from no row of the batch: a step counter, and a momentum teacher's
    EMA of the student's weights under ``torch.no_grad()`` (MoCo/BYOL/DINO)."""

    def __init__(self) -> None:
        super().__init__()
        self.student, self.teacher = nn.Linear(8, 4), nn.Linear(8, 4)
        self.teacher.requires_grad_(False)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        with torch.no_grad():
            target = self.teacher(x)
            for ps, pt in zip(self.student.parameters(), self.teacher.parameters()):
                pt.mul_(0.9).add_(ps.detach(), alpha=0.1)
        return F.mse_loss(self.student(x), y + target)


def _row_free() -> RowFreeWrites:
    torch.manual_seed(0)
    return RowFreeWrites().double()


def _row_free_rank(rank: int, world: int, plan: Plan) -> tuple[list[float], dict[str, torch.Tensor]]:
    pm = fairscale.parallelize(_row_free(), example_inputs=_batch(0), plan=plan,
                               optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    return [pm.train_step(_batch(step)) for step in range(3)], pm.state_dict()


def test_writes_that_no_row_feeds_keep_data_parallelism_and_train_exactly() -> None:
    """A counter or a teacher's EMA of the weights is computed alike on every dp rank, once per step
    as in one process: such a model had been refused data parallelism (a wrong refusal: every
    MoCo/BYOL-style model lost dp). Microbatches still run it per microbatch, and fsdp would write
    the teacher into a gathered copy: those stay refused, saying why."""
    writes = find_buffer_writes(captured(_row_free(), _batch(0)).gm)
    assert sorted((w.buffer, w.parameter, w.from_rows) for w in writes) == [
        ("calls", False, False), ("teacher.bias", True, False), ("teacher.weight", True, False)]
    model = _row_free()
    want = _one_process(model, steps=3)
    plan = fairscale.plan(_row_free(), _batch(0), devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    assert plan.data_parallel.kind != "fsdp" and plan.schedule.microbatches == 1, plan
    results = fairscale.launch(_row_free_rank, devices=2, args=(plan,), timeout_s=600)
    for losses, _ in results:
        assert losses == pytest.approx(want, rel=1e-12)
    state = results[0][1]  # the full state dict, on rank 0
    assert int(state["calls"]) == 3
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-12, atol=1e-12, msg=k)
    graph = captured(_row_free(), _batch(0))
    for microbatches, kind, field in [(2, "ddp", "schedule.microbatches"), (1, "fsdp", "data_parallel.kind")]:
        bad = Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=microbatches, global_batch=BATCH))
        bad.data_parallel.kind = kind
        with pytest.raises(PlanError, match=f"{field}: the model's forward writes.*no written value depends on the batch"):
            validate_plan(bad, graph, resolve_cluster(2, "a100-80gb"), devices=2)


class HiddenWrites(nn.Module):
    """In-place writes the walk had not followed: through a view of a buffer (``self.ema[:2].copy_``),
    into an ``out=`` argument, into a list of tensors (``torch._foreach_lerp_``, timm's EMA), and
    ``nn.Embedding(max_norm=...)``'s renormalization of the rows it looks up (through ``weight.detach()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.teacher = nn.Linear(8, 4), nn.Linear(8, 4)
        self.teacher.requires_grad_(False)
        self.emb = nn.Embedding(10, 4, max_norm=1.0)
        self.register_buffer("ema", torch.zeros(4))
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.ema[:2].copy_(x.detach().mean(0)[:2])
        torch.mean(x.detach()[:, :4], 0, out=self.mean)
        with torch.no_grad():
            torch._foreach_lerp_(list(self.teacher.parameters()), [p.detach() for p in self.lin.parameters()], 0.1)
        rows = (x[:, 0].abs() * 3).long().clamp(0, 9)
        return F.mse_loss(self.lin(x) + self.teacher(x) + self.emb(rows).to(x.dtype), y)


def test_writes_through_views_out_arguments_and_lists_are_found() -> None:
    """Each of these writes had gone unseen: dp2 was planned for a model whose ``self.ema[:2].copy_(x.mean(0)[:2])``
    then held rank 0's slice's mean (off by 0.78 after three steps, silently), and microbatches too."""
    torch.manual_seed(0)
    graph = captured(HiddenWrites().double(), _batch(0))
    writes = find_buffer_writes(graph.gm)
    assert sorted((w.buffer, w.parameter, w.from_rows) for w in writes) == [
        ("ema", False, True), ("emb.weight", True, True), ("mean", False, True),
        ("teacher.bias", True, False), ("teacher.weight", True, False)], writes
    assert next(w for w in writes if w.buffer == "ema").source.endswith("`self.ema[:2].copy_(x.detach().mean(0)[:2])`")
    plan = Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=1, global_batch=BATCH))
    with pytest.raises(PlanError, match="mesh.dp: the model's forward writes the buffer.s. or parameter.s. ema"):
        validate_plan(plan, graph, resolve_cluster(2, "a100-80gb"), devices=2)


class RowsSeen(nn.Module):
    """Counts the rows it has seen: ``self.seen += x.shape[0]``, a number torch.export bakes in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen += x.shape[0]
        return F.mse_loss(self.lin(x), y)


def test_a_count_of_the_rows_seen_is_refused_data_parallelism() -> None:
    """The capture holds ``add_(seen, 8)``, fed by no batch input, so 2cf198b let dp2 through: each rank's
    graph added its 4 rows and ``pm.state_dict()['seen']`` read 12 after three steps where one
    process counts 24, silently. The rank's capture is compared with the whole batch's."""
    torch.manual_seed(0)
    model = RowsSeen().double()
    assert [(w.buffer, w.from_rows) for w in find_buffer_writes(captured(model, _batch(0)).gm)] == [("seen", False)]
    with pytest.raises(Exception, match=r"writes seen \(test_buffer_writes.py:\d+ `self.seen \+= x.shape\[0\]`\) at "
                                        r"module <model top level>, op aten.add_.Tensor in place from a number the "
                                        r"batch's size gives"):
        fairscale.plan(model, _batch(0), devices=2, constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}})
    assert int(model.seen) == 0
    assert fairscale.plan(_row_free(), _batch(0), devices=2,
                          constraints={"mesh": {"pp": 1, "dp": 2, "tp": 1}}).mesh.dp == 2  # a step counter keeps dp


class ShrinksItsWeight(nn.Module):
    """Writes a weight the optimizer trains, in forward under no_grad, from no row of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.weight.mul_(0.99)
        return F.mse_loss(self.lin(x), y)


@pytest.mark.parametrize("kind", ["ddp", "zero1", "zero2"])
def test_a_trained_parameter_written_in_forward_is_refused_data_parallelism(kind: str) -> None:
    """2cf198b let dp2 through (no row feeds the write), and every rank failed at its first step:
    'Output 1 of _Bucket is a view and its base ... has been modified inplace' (ddp, zero1, zero2).
    A frozen teacher's parameters (requires_grad False) keep dp: test_writes_that_no_row_feeds_..."""
    torch.manual_seed(0)
    graph = captured(ShrinksItsWeight().double(), _batch(0))
    assert [(w.buffer, w.trainable, w.from_rows) for w in find_buffer_writes(graph.gm)] == [("lin.weight", True, False)]
    plan = Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=1, global_batch=BATCH))
    plan.data_parallel.kind = kind
    with pytest.raises(PlanError, match=r"mesh.dp: the model's forward writes the parameter\(s\) lin.weight in place "
                                        r"\(.*\), which the optimizer also trains"):
        validate_plan(plan, graph, resolve_cluster(2, "a100-80gb"), devices=2)
    assert not any(w.trainable for w in find_buffer_writes(captured(_row_free(), _batch(0)).gm))


class NoisyUnderNoGrad(nn.Module):
    """Adds noise drawn under ``torch.no_grad()`` to a buffer: export puts the draw in a higher-order op's body."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("walk", torch.zeros(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            noise = torch.randn(4, dtype=torch.float64)
        self.walk.add_(noise)
        return F.mse_loss(self.lin(x), y)


def test_a_draw_in_a_higher_order_ops_body_counts_as_varying() -> None:
    """The write's operand came out of ``wrap_with_set_grad_enabled``, whose body draws; the walk of the
    outer graph saw no draw and let dp through, where ranks seeded apart (nanoGPT's seed + rank) or
    drawing after their own slices' dropout masks keep other copies of the buffer."""
    torch.manual_seed(0)
    graph = captured(NoisyUnderNoGrad().double(), _batch(0))
    assert [(w.buffer, w.from_rows) for w in find_buffer_writes(graph.gm)] == [("walk", True)]
    plan = Plan(mesh=Mesh(dp=2), schedule=Schedule(microbatches=1, global_batch=BATCH))
    with pytest.raises(PlanError, match="mesh.dp: the model's forward writes the buffer.s. walk"):
        validate_plan(plan, graph, resolve_cluster(2, "a100-80gb"), devices=2)


class RebindsItsBuffer(nn.Module):
    """Keeps an EMA by assigning a new tensor to its buffer: ``self.ema = 0.9 * self.ema + ...``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("ema", torch.zeros(4, dtype=torch.float64))
        self.register_buffer("pe", torch.ones(8, dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.pe = self.pe.to(x.device)  # on its own device: the same tensor, not a new value
        self.ema = 0.9 * self.ema + 0.1 * x.detach().mean(0)[:4]
        return F.mse_loss(self.lin(x * self.pe), y)


def test_a_buffer_rebound_in_forward_is_refused_at_capture() -> None:
    """torch.export drops the assignment (the new value is dead code in its graph): every plan,
    dp=1 too, trained without ever updating the EMA, and pm.state_dict() had no 'ema', silently.
    torch.fx had left a Proxy in the user's module as its buffer."""
    from planner.capture import CaptureError, capture

    torch.manual_seed(0)
    model = RebindsItsBuffer()
    with pytest.raises(CaptureError, match=r"assigns a new tensor to its buffer ema: op RebindsItsBuffer.ema = at "
                                           r"module <model top level> \(RebindsItsBuffer\), source test_buffer_writes"):
        capture(model, _batch(0))
    assert type(model.ema) is torch.Tensor and torch.equal(model.ema, torch.zeros(4, dtype=torch.float64))
    capture(model, _batch(0), tracer="fx")  # (fx's trace keeps no assignment either; its Proxy is not left behind)
    assert type(model.ema) is torch.Tensor and type(model.pe) is torch.Tensor


class RebindsItsParameter(nn.Module):
    """zalandoresearch's VectorQuantizerEMA: ``self._ema_w = nn.Parameter(self._ema_w * decay + ...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.ema_w = nn.Parameter(torch.zeros(4, 8, dtype=torch.float64))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.ema_w = nn.Parameter(self.ema_w * 0.9 + 0.1 * x.detach()[:4])
        return F.mse_loss(self.lin(x) + self.ema_w.sum(), y)


def test_a_parameter_rebound_in_forward_is_refused_at_capture_naming_it() -> None:
    """torch.export dropped the assignment, and one device trained with ema_w at zeros at every step
    (losses 7.91, 1.95, 4.88 where one process gives 7.91, 16.12, 28.60), silently. In a VQ-VAE's EMA
    codebook as zalandoresearch's notebook writes it, export failed on the new nn.Parameter ('We found
    a fake tensor in the exported program constant's list') and the refusal named neither the
    assignment nor its line ('neither torch.export nor torch.fx can trace its forward ... at torch.zeros')."""
    from planner.capture import CaptureError, capture

    torch.manual_seed(0)
    model = RebindsItsParameter()
    kept = model.ema_w
    with pytest.raises(CaptureError, match=r"assigns a new tensor to its parameter ema_w: op RebindsItsParameter.ema_w "
                                           r"= at module <model top level> \(RebindsItsParameter\), source "
                                           r"test_buffer_writes.py:\d+\. .* What to do: write it in place"):
        capture(model, _batch(0))
    assert model.ema_w is kept and torch.equal(kept, torch.zeros(4, 8, dtype=torch.float64))
