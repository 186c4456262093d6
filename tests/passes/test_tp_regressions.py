"""Tensor-parallel failures found on models as users write them (issue 12, 13), each checked end to
end: the pattern detector proposes rules, ``shard_tensor_parallel_pass`` rewrites every rank, and
the ranks run in one process (``tp_sim.simulate_graph``: threads, collectives in memory) against
the captured graph run whole, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from passes.tp.patterns import propose_tp_rules
from passes.tp.shard_tensor_parallel import collective_counts, shard_tensor_parallel_pass
from planner.capture import capture
from planner.plan import Mesh, Plan, PlanError, TensorParallel
from planner.validate import validate_plan
from tp_sim import reference_graph, simulate_graph

V, D, T, B = 32, 16, 8, 4


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, T), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _exact(model: nn.Module, loss_fn=None, tp: int = 2, *, expect: set[str] | None = None, sp: bool = False):
    """Detector rules for ``model`` at ``tp``; the simulated ranks match the whole graph (loss and
    every gradient). Returns (rules, proposal)."""
    model = model.double()
    batch = _batch()
    graph = capture(model, batch, loss_fn=loss_fn)
    proposal = propose_tp_rules(graph.gm, tp=tp, sequence_parallel=sp)
    if expect is not None:
        assert expect <= set(proposal.modules.items()), (proposal.modules, proposal.notes)
    loss, grads = simulate_graph(graph.gm, proposal.rules, tp, batch, sequence_parallel=sp)
    ref_loss, ref_grads = reference_graph(graph.gm, batch)
    assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss), (loss, ref_loss)
    assert set(grads) == set(ref_grads)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=lambda m: f"{k}: {m}")
    return proposal.rules, proposal, graph


# ------------------------------------------------------------------------------------------ models


class XXNorm(nn.Module):
    """RMSNorm written ``x * x`` (as several LLM codebases do)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * self.weight


class MLP(nn.Module):
    def __init__(self, *, inplace_residual: bool = False, norm_after: bool = False) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D, bias=False)  # no bias: the output stays a partial sum
        self.act = nn.ReLU(inplace=True)
        self.norm = XXNorm(D) if norm_after else None
        self.inplace_residual = inplace_residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down(self.act(self.up(x)))
        if self.norm is not None:  # the norm reads the row-parallel output before any residual: a partial sum
            return x + self.norm(out)
        if self.inplace_residual:
            out += x  # ResNet style: an in-place add on the row-parallel (partial-sum) output
            return out
        return x + out


class LM(nn.Module):
    def __init__(self, **block: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(MLP(**block) for _ in range(2))
        self.norm = XXNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.norm(x))


def flat_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


PAIRS = {("blocks.0.up", "colwise"), ("blocks.0.down", "rowwise")}


def test_x_times_x_norm_on_a_partial_sum_is_exact() -> None:
    """Issue 12.1: ``x * x`` on a row-parallel output was treated as linear (sum_r x_r^2)."""
    _exact(LM(norm_after=True), flat_loss, expect=PAIRS)
    _exact(LM(norm_after=True), flat_loss, expect=PAIRS, sp=True)


def test_inplace_residual_on_a_partial_sum() -> None:
    """Issue 12.8: ``out += x`` on a row-parallel output was refused by the pass after the search
    proposed it (under sequence parallelism, where the residual is a sequence shard); it now runs out
    of place, exactly."""
    _exact(LM(inplace_residual=True), flat_loss, expect=PAIRS)
    _exact(LM(inplace_residual=True), flat_loss, expect=PAIRS, sp=True)


def test_flatten_loss_gets_a_vocab_parallel_head() -> None:
    """Issue 12.6 / 13.4: ``cross_entropy(out.flatten(0, 1), y.flatten())``: flatten was fed a shape
    list by the view rule; now the untied head is vocab-parallel and the loss too."""
    rules, proposal, graph = _exact(LM(), flat_loss, expect={("lm_head", "vocab_loss"), ("embed", "vocab_embedding")})
    gm = shard_tensor_parallel_pass(graph.gm, Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=rules)),
                                    tp_index=0, tp_size=2)
    assert collective_counts(gm).get("vocab_parallel_cross_entropy") == 1


def test_hf_style_shifted_loss_with_label_smoothing() -> None:
    """Hugging Face's causal-LM loss shape: logits.float(), labels padded with -100 and shifted,
    view(-1, V), ignore_index; with label smoothing (exact in the vocab-parallel loss too)."""
    def hf_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float = 0.1) -> torch.Tensor:
        logits = logits.float() if logits.dtype != torch.float64 else logits
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
        return F.cross_entropy(logits.view(-1, V), labels.view(-1), ignore_index=-100, label_smoothing=smoothing)

    _exact(LM(), hf_loss, expect={("lm_head", "vocab_loss")})

    def logit_shift(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # the older HF form
        return F.cross_entropy(logits[:, :-1, :].contiguous().view(-1, V), labels[:, 1:].reshape(-1))

    _exact(LM(), logit_shift, expect={("lm_head", "vocab_loss")})


def test_unrecognised_loss_keeps_the_head_replicated_and_says_why() -> None:
    def z_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return flat_loss(logits, y) + 1e-4 * torch.logsumexp(logits, -1).pow(2).mean()

    _, proposal, _ = _exact(LM(), z_loss)
    assert "lm_head" not in proposal.modules
    assert "logsumexp" in proposal.refused["lm_head"] and "in the loss function" in proposal.refused["lm_head"]

    def weighted(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), weight=torch.linspace(0.5, 1.5, V,
                                                                                        dtype=logits.dtype))

    _, proposal, _ = _exact(LM(), weighted)
    assert "lm_head" not in proposal.modules and "class weights" in proposal.refused["lm_head"]


# ------------------------------------------------------------------------------------------ the detector


class CumsumUp(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.weight.cumsum(0).sum()


class Refused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = CumsumUp(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).sum()


def test_detector_never_crashes_and_keeps_its_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 12.5 / 13.2: a rule that breaks took the whole search down; now the module gets no
    tensor parallelism, and the reason names the op and the model's source line."""
    from passes.tp import model_rules

    graph = capture(LM().double(), _batch(), loss_fn=flat_loss)

    def broken(rw, node):  # noqa: ANN001, ANN202 - a rule with a bug on sharded inputs
        if not rw.p(node.args[0]).is_r:
            raise IndexError("list index out of range")
        return model_rules.fallback(rw, node)

    monkeypatch.setitem(model_rules.RULES, torch.ops.aten.relu_.default, broken)
    monkeypatch.setitem(model_rules.RULES, torch.ops.aten.relu.default, broken)
    proposal = propose_tp_rules(graph.gm, tp=2)
    assert "blocks.0.up" not in proposal.modules and ("lm_head", "vocab_loss") in proposal.modules.items()
    why = proposal.refused["blocks.0.up"]
    assert "aten.relu" in why and "IndexError: list index out of range" in why and "test_tp_regressions.py:" in why


def test_search_says_why_tp_is_refused() -> None:
    """The refusal quoted divisibility ("allowed degrees are [1]"); it now quotes the detector."""
    from planner.cluster import Cluster
    from planner.search import search

    graph = capture(Refused().double(), (torch.randn(B, D, dtype=torch.float64),))
    rules = propose_tp_rules(graph.gm, tp=2).rules
    assert rules == {} and "aten.cumsum" in rules.reason
    with pytest.raises(PlanError, match=r"tp=2 is not possible here; allowed degrees are \[1\] \(no tensor-parallel "
                                        r"rules at tp=2: .*no sharding rule for aten.cumsum.default.*"
                                        r"test_tp_regressions.py:\d+"):
        search(graph, Cluster.cpu(2, memory_bytes=2**30), global_batch=B, constraints={"tp": 2},
               tp_rules=lambda tp: propose_tp_rules(graph.gm, tp=tp).rules)


def test_default_hf_llama_does_not_crash_the_detector() -> None:
    """Issue 12.5: ``use_cache=True`` (the default) puts ``cat([empty_cache, k], -2)`` in the graph;
    the cat rule indexed the empty tensor's missing dims."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=D * 4, intermediate_size=D * 8, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T)
    assert cfg.use_cache
    ids, y = _batch()
    graph = capture(LlamaForCausalLM(cfg), (ids, y), loss_fn=lambda out, y: flat_loss(out.logits, y))
    proposal = propose_tp_rules(graph.gm, tp=2)
    assert proposal.notes == [] and proposal.modules["model.layers.0.self_attn.q_proj"] == "colwise"
    assert proposal.modules["lm_head"] == "vocab_loss"
    assert propose_tp_rules(graph.gm, tp=1).rules  # tp=1 never checks, never crashes


def test_meta_models_get_tensor_parallel_rules() -> None:
    """Issue 13.2: models on ``meta`` are captured with torch.fx (``call_method`` nodes, an opaque
    loss function); the detector now reads them in ATen form and proposes the same rules as for
    the export-captured model."""
    from fairscale.testing.models import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(layers=2, dim=64, heads=4, seq=16, vocab=64)
    with torch.device("meta"):
        meta_model = GPT(cfg)
    ids = torch.zeros(2, 16, dtype=torch.long)
    meta = capture(meta_model, (ids.to("meta"), ids.to("meta")), loss_fn=lm_loss)
    assert meta.tracer == "fx"
    torch.manual_seed(0)
    real = capture(GPT(cfg), (ids, ids), loss_fn=lm_loss)
    assert real.tracer == "export"
    for tp in (2, 4):
        got, want = propose_tp_rules(meta.gm, tp=tp), propose_tp_rules(real.gm, tp=tp)
        assert got.rules == want.rules and got.notes == [], (got.rules, got.notes)
        assert {"colwise", "rowwise", "vocab_embedding", "vocab_loss"} <= set(got.rules.values())


@pytest.mark.slow
def test_one_trillion_parameter_gpt_on_meta_gets_rules() -> None:
    """The 1T GPT of benchmarks/planner/speed.py (Megatron 2021 Table 1's last row)."""
    from fairscale.testing.models import GPT, GPTConfig, lm_loss

    with torch.device("meta"):
        model = GPT(GPTConfig(layers=128, dim=25600, heads=160, seq=2048, vocab=51200))
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    graph = capture(model, (ids, ids), loss_fn=lm_loss)
    rules = propose_tp_rules(graph.gm, tp=8).rules
    assert rules == {"layers.*.attn.[q_proj,k_proj,v_proj]": "colwise", "layers.*.attn.o_proj": "rowwise",
                     "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
                     "lm_head": "vocab_loss", "wte": "vocab_embedding"}


# ------------------------------------------------------------------------------------------ tied weights


def test_tied_weights_need_one_layout_in_validation() -> None:
    """Issue 12.7: an embedding split on its vocabulary with its tied LM head left whole passed
    validation and aborted gloo in the pipeline's tied-gradient sum (buffers of different sizes)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=D * 4, n_layer=2, n_head=4))
    ids, y = _batch()
    graph = capture(model, (ids, y), loss_fn=lambda out, y: flat_loss(out.logits, y))
    rules = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise",
             "transformer.wte": "vocab_embedding"}
    plan = Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=rules))
    with pytest.raises(PlanError, match=r"tensor_parallel.rules: the tied weights \['transformer.wte.weight', "
                                        r"'lm_head.weight'\] must have one layout, but transformer.wte.weight is "
                                        r"split on dim 0 \(rule tensor_parallel.rules\[\"transformer.wte\"\]\); "
                                        r"lm_head.weight is kept whole \(no rule\)"):
        validate_plan(plan, graph, devices=2)
    validate_plan(Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules={**rules, "lm_head": "vocab_loss"})),
                  graph, devices=2)
    # the detector proposes the consistent pair, and the pass refuses the inconsistent one
    assert {("transformer.wte", "vocab_embedding"), ("lm_head", "vocab_loss")} <= set(
        propose_tp_rules(graph.gm, tp=2).modules.items())
    from passes.tp.rewrite import TPShardError

    with pytest.raises(TPShardError, match="a tied weight needs one layout"):
        shard_tensor_parallel_pass(graph.gm, Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=rules)),
                                   tp_index=0, tp_size=2)


def test_a_tied_key_the_graph_never_reads_has_no_layout_and_the_search_drops_conflicting_rules() -> None:
    """Hugging Face BERT ties ``cls.predictions.bias`` to ``cls.predictions.decoder.bias``: the graph
    reads the tensor through the decoder only. Validation gave the owner key a layout of its own
    ("kept whole") and refused the detector's vocab-parallel head, after the search had returned it:
    the ranks raised after launch. Only keys the graph reads count now; and where the proposed
    rules do give a tied tensor two layouts, the search drops them instead of returning the plan."""
    from fairscale.testing.corpus_hf import MODELS
    from planner.search.core import one_layout_per_tied

    case = MODELS["hf-bert"].build(0)
    graph = capture(case.model, case.make_batch(0, 2))
    assert ["inner.cls.predictions.bias", "inner.cls.predictions.decoder.bias"] in graph.tied
    rules = dict(propose_tp_rules(graph.gm, tp=2).rules)
    assert rules.get("inner.cls.predictions.decoder") == "vocab_loss"
    validate_plan(Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=rules)), graph, devices=2)
    assert one_layout_per_tied(graph, rules) is rules
    half = {k: v for k, v in rules.items() if k != "inner.cls.predictions.decoder"}  # embedding split, head whole
    with pytest.raises(PlanError, match="must have one layout"):
        validate_plan(Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=half)), graph, devices=2)
    kept = one_layout_per_tied(graph, half)
    assert "inner.bert.embeddings.word_embeddings" not in kept and "tied weight two layouts" in kept.reason
    validate_plan(Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=kept)), graph, devices=2)


class TorchEncoder(nn.Module):
    """A projection into nn.TransformerEncoder: the attention's in-projection runs inside
    nn.MultiheadAttention (on its own in_proj_weight), so the detector paired proj (colwise) with the
    attention module itself (rowwise), which no style applies to; validation then refused the rule
    and with it every tp > 1 (also for the MLPs)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.proj = nn.Linear(D, D)
        layer = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.proj(self.emb(ids))))


def test_multihead_attention_stays_replicated_and_its_mlp_is_split() -> None:
    _, proposal, graph = _exact(TorchEncoder(), flat_loss, expect={("encoder.layers.0.linear1", "colwise"),
                                                                   ("encoder.layers.0.linear2", "rowwise")})
    why = proposal.refused["encoder.layers.0.self_attn"]
    assert why.startswith("rowwise applies to Conv1D / Embedding / Linear modules, but encoder.layers.0.self_attn is "
                          "MultiheadAttention (op linear"), why
    assert "aten.linear.default" in why and "test_tp_regressions.py:" in why
    assert "encoder.layers.0.self_attn" not in proposal.modules
    assert not validate_plan(Plan(mesh=Mesh(tp=2), tensor_parallel=TensorParallel(rules=proposal.rules)), graph, 2)


class Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.body = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(torch.relu(self.stem(x))).mean()


def test_a_forced_tp_on_a_model_without_linear_layers_names_its_op_and_what_to_do() -> None:
    """Was: 'tp > 1 needs tensor_parallel rules, and none were given or found' (no module, op, line
    or remedy)."""
    from planner.cluster import Cluster
    from planner.search import search

    graph = capture(Convs().double(), (torch.randn(B, 3, 8, 8, dtype=torch.float64),))
    with pytest.raises(PlanError, match=r"none were given or found: no Linear, Conv1D or Embedding module of the "
                                        r"model pairs up for tensor parallelism; its largest op is "
                                        r"aten.conv2d.default in module body \(Conv2d\) at "
                                        r"test_tp_regressions.py:\d+. Use tp=1 \(leave mesh.tp out of the "
                                        r"constraints\), or give tensor_parallel rules"):
        search(graph, Cluster.cpu(2, memory_bytes=2**30), global_batch=B, constraints={"tp": 2},
               tp_rules=lambda tp: propose_tp_rules(graph.gm, tp=tp).rules)


class RoutedLM(nn.Module):
    """mistral-src's MoE: top-2 of a gate, the tokens of each expert found with torch.where (a size
    from the data), results[idx] += weight * expert(x[idx])."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.gate = nn.Linear(D, 4, bias=False)
        self.up = nn.ModuleList(nn.Linear(D, 2 * D, bias=False) for _ in range(4))
        self.down = nn.ModuleList(nn.Linear(2 * D, D, bias=False) for _ in range(4))
        self.head = nn.Linear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids).view(-1, D)
        weights, chosen = torch.topk(self.gate(x), 2)
        weights = F.softmax(weights, dim=1)
        out = torch.zeros_like(x)
        for i, (up, down) in enumerate(zip(self.up, self.down)):
            rows, nth = torch.where(chosen == i)
            out[rows] += weights[rows, nth, None] * down(F.silu(up(x[rows])))
        return self.head(out.view(B, T, D))


def test_data_dependent_moe_routing_splits_its_experts_exactly() -> None:
    """Sizes from the data are symbolic in the graph the ranks capture (annotate=False: export's
    values); the pass read every size as an int and refused every plan, tp=1 included."""
    rules, _, _ = _exact(RoutedLM(), flat_loss, expect={("up.0", "colwise"), ("down.0", "rowwise")})
    model, batch = RoutedLM().double(), _batch()
    graph = capture(model, batch, loss_fn=flat_loss, annotate=False)
    assert any(not isinstance(d, int) for n in graph.gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
               for d in n.meta["val"].shape)
    loss, grads = simulate_graph(graph.gm, rules, 2, batch)
    ref_loss, ref_grads = reference_graph(graph.gm, batch)
    assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=lambda m: f"{k}: {m}")


class CenterLoss(nn.Module):
    """KaiyangZhou's center loss beside a classifier: ``torch.addmm(distmat, f, centers.t(), beta=1,
    alpha=-2)`` (the squared distances of features to a parameter), and open-reid's batch-hard
    triplet distances, ``dist.addmm_(1, -2, x, x.t())``'s functional form, on activations alone."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.centers = nn.Parameter(torch.randn(5, D))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        f = self.down(F.relu(self.up(self.embed(ids).mean(1))))
        n = f.size(0)
        distmat = f.pow(2).sum(1, keepdim=True).expand(n, 5) + self.centers.pow(2).sum(1, keepdim=True).expand(5, n).t()
        distmat = torch.addmm(distmat, f, self.centers.t(), beta=1, alpha=-2)
        dist = f.pow(2).sum(1, keepdim=True).expand(n, n)
        dist = torch.addmm(dist + dist.t(), f, f.t(), beta=1, alpha=-2)
        return distmat.clamp(min=1e-12).mean() + dist.clamp(min=1e-12).mean()


def test_addmm_with_beta_and_alpha_runs_on_whole_operands() -> None:
    """The tensor-parallel pass refused addmm with beta/alpha at any tp, tp=1 included (its rewrite
    runs on every plan), so every plan of a center loss or a triplet loss's distances was refused,
    'the tensor-parallel pass refused it ... tp rank 0 of 1'. It now runs on whole operands."""
    rules, _, graph = _exact(CenterLoss(), lambda loss, _y: loss, expect={("up", "colwise"), ("down", "rowwise")})
    shard_tensor_parallel_pass(graph.gm, Plan(), tp_index=0, tp_size=1)  # raised


class HeadlessAttention(nn.Module):
    """Attention without heads: ``scaled_dot_product_attention`` on ``[b, t, d]`` (a fuzzer's model)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.head = nn.Linear(D, V)
        self.causal = causal

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + F.scaled_dot_product_attention(self.q(h), self.k(h), self.v(h), is_causal=self.causal)
        return self.head(h)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rules", [{"q": "rowwise"}, {"v": "rowwise"}, {"q": "colwise", "k": "colwise", "v": "colwise"}])
def test_attention_without_heads_under_sequence_parallelism_attends_to_every_key(causal: bool,
                                                                                  rules: dict[str, str]) -> None:
    """The sdpa rule read a shard of dim 1 as a shard of the heads, which it is only of
    ``[b, h, t, d]``: of ``[b, t, d]`` it is the sequence that sequence parallelism shards, and each
    rank attended to its own half of the keys (tp2 with sp trained 10% off from step 0, silently)."""
    model, batch = HeadlessAttention(causal).double(), _batch()
    graph = capture(model, batch, loss_fn=flat_loss)
    loss, grads = simulate_graph(graph.gm, rules, 2, batch, sequence_parallel=True)
    ref_loss, ref_grads = reference_graph(graph.gm, batch)
    assert abs(loss - ref_loss) <= 1e-10 * abs(ref_loss), (loss, ref_loss)
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-9, atol=1e-11, msg=lambda m: f"{k}: {m}")
