"""capture() on every model family: the graph runs, FLOPs and saved bytes match a real run, layers,
blocks, tied parameters and attention shapes are what a planner needs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from fairscale.testing.models import FAMILIES, build
from planner.annotate import flop_formulas
from planner.capture import capture
from planner.graph import META_FLOPS_BWD, META_FLOPS_FWD, META_LAYER, META_PARAM, META_SAVED_BYTES, META_VAL

B = 2

LAYERS = {
    "gpt": ["wte", "wpe", "layers.0", "layers.1", "layers.2", "layers.3", "ln_f", "lm_head"],
    "mlp": ["layers.0", "layers.1", "layers.2", "layers.3"],
    "cnn": ["features.0", "features.1", "head"],
    "encoder": ["embed", "encoder.layers.0", "encoder.layers.1", "head"],
    "skip": ["embed"] + [f"blocks.{i}" for i in range(6)] + ["head"],
    "llama": ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"],
    "gpt2": ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f",
             "lm_head"],
    "bert": ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1", "cls"],
    "t5": ["inner.encoder.embed_tokens", "inner.encoder.block.0", "inner.encoder.block.1",
           "inner.encoder.final_layer_norm", "inner.decoder.embed_tokens", "inner.decoder.block.0",
           "inner.decoder.block.1", "inner.decoder.final_layer_norm", "inner.lm_head"],
    "mixtral": ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"],
    "vit": ["vit.embeddings", "vit.layers.0", "vit.layers.1", "vit.layernorm", "classifier"],
}

MIN_NODES = {"gpt": 120, "mlp": 15, "cnn": 15, "encoder": 80, "skip": 30, "llama": 150, "gpt2": 120, "bert": 100,
             "t5": 300, "mixtral": 200, "vit": 100}

BLOCKS = {
    "gpt": {"layers.*": ["layers.0", "layers.1", "layers.2", "layers.3"]},
    "mlp": {"layers.[0-2]": ["layers.0", "layers.1", "layers.2"]},
    "cnn": {"features.*": ["features.0", "features.1"]},
    "encoder": {"encoder.layers.*": ["encoder.layers.0", "encoder.layers.1"]},
    "skip": {"blocks.*": [f"blocks.{i}" for i in range(6)]},
    "llama": {"model.layers.*": ["model.layers.0", "model.layers.1"]},
    "gpt2": {"transformer.h.*": ["transformer.h.0", "transformer.h.1"]},
    "bert": {"bert.encoder.layer.*": ["bert.encoder.layer.0", "bert.encoder.layer.1"]},
    "t5": {"inner.encoder.block.*": ["inner.encoder.block.0", "inner.encoder.block.1"],
           "inner.decoder.block.*": ["inner.decoder.block.0", "inner.decoder.block.1"]},
    "mixtral": {"model.layers.*": ["model.layers.0", "model.layers.1"]},
    "vit": {"vit.layers.*": ["vit.layers.0", "vit.layers.1"]},
}

ATTENTION = {"gpt": (4, 4, 16), "encoder": (4, 4, 8), "llama": (4, 2, 16), "gpt2": (4, 4, 16), "bert": (4, 4, 16),
             "t5": (4, 4, 16), "mixtral": (4, 2, 16), "vit": (4, 4, 16)}


def _loss(case, batch):
    return case.loss_fn(case.model(batch[0]), *batch[1:]) if case.loss_fn else case.model(*batch)


@pytest.fixture(scope="module")
def captured():
    """Every family captured once (export, annotated), with a real fwd+bwd FLOP count."""
    out = {}
    for name in FAMILIES:
        case = build(name)
        batch = case.make_batch(0, B)
        graph = capture(case.model, batch, loss_fn=case.loss_fn)
        with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as fwd:
            loss = _loss(case, batch)
        with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as bwd:
            loss.backward()
        out[name] = (case, batch, graph, loss.detach(), fwd.get_total_flops(), bwd.get_total_flops())
    return out


@pytest.mark.parametrize("name", list(FAMILIES))
def test_graph_computes_the_model_loss(captured, name):
    case, batch, graph, loss, _, _ = captured[name]
    torch.testing.assert_close(graph.gm(*batch), loss, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_flops_match_flop_counter_on_real_forward_backward(captured, name):
    _, _, graph, _, fwd, bwd = captured[name]
    assert fwd > 0 and bwd > 0
    assert sum(layer.flops_fwd for layer in graph.layers) == fwd
    assert sum(layer.flops_bwd for layer in graph.layers) == bwd
    assert graph.flops_per_step == fwd + bwd


@pytest.mark.parametrize("name", list(FAMILIES))
def test_saved_bytes_match_saved_tensor_hooks_on_real_run(captured, name):
    """Distinct non-parameter storages autograd saves when the captured graph runs for real."""
    _, batch, graph, _, _, _ = captured[name]
    params = {t.untyped_storage()._cdata for t in [*graph.gm.parameters(), *graph.gm.buffers()]}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage()._cdata
        if key not in params:
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        graph.gm(*batch)
    assert sum(layer.saved_bytes for layer in graph.layers) == sum(saved.values()) > 0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_layer_names_and_node_counts(captured, name):
    _, _, graph, _, _, _ = captured[name]
    assert [layer.name for layer in graph.layers] == LAYERS[name]
    assert [layer.index for layer in graph.layers] == list(range(len(LAYERS[name])))
    assert len(graph.gm.graph.nodes) > MIN_NODES[name]
    for node in graph.gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            assert node.meta[META_LAYER] in LAYERS[name], node.format_node()
            assert META_VAL in node.meta and META_FLOPS_FWD in node.meta and META_FLOPS_BWD in node.meta
    # layers are contiguous in execution order
    seen = [n.meta[META_LAYER] for n in graph.gm.graph.nodes if META_LAYER in n.meta and n.op != "get_attr"]
    runs = [x for i, x in enumerate(seen) if i == 0 or seen[i - 1] != x]
    assert runs == LAYERS[name]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_blocks_batch_and_parameters(captured, name):
    case, _, graph, _, _, _ = captured[name]
    assert graph.blocks == BLOCKS[name]
    for layer in graph.layers:
        expected = next((k for k, v in BLOCKS[name].items() if layer.name in v), None)
        assert layer.block == expected
    assert graph.batch_size == B
    assert sum(layer.param_count for layer in graph.layers) == graph.num_parameters == sum(
        p.numel() for p in case.model.parameters())
    used = {k for layer in graph.layers for k in layer.params}
    keys = set(dict(case.model.named_parameters(remove_duplicate=False)))
    assert used <= keys
    # a key no layer names is an alias of a tied tensor that is read under another key
    # (t5's ``shared.weight`` runs as ``encoder.embed_tokens``; bert's ``cls.predictions.bias``)
    for key in keys - used:
        group = next(g for g in graph.tied if key in g)
        assert set(group) & used


@pytest.mark.parametrize("name", list(FAMILIES))
def test_attention_shapes(captured, name):
    _, _, graph, _, _, _ = captured[name]
    found = {layer.name: layer.attention for layer in graph.layers if layer.attention}
    if name not in ATTENTION:
        assert found == {}
        return
    heads, kv, dim = ATTENTION[name]
    assert set(found) == set(next(iter(BLOCKS[name].values()))) | set(
        sum(BLOCKS[name].values(), [])), found
    assert all(a == {"heads": heads, "kv_heads": kv, "head_dim": dim} for a in found.values())


def test_tied_embedding_is_listed_by_every_user(captured):
    """ep.module() reads gpt's tied tensor through one get_attr (model.lm_head.weight) for both the
    embedding and the head; capture gives each user the key of its own module."""
    _, _, graph, _, _, _ = captured["gpt"]
    assert graph.tied == [["wte.weight", "lm_head.weight"]]
    assert graph.layer("wte").params == ["wte.weight"]
    assert graph.layer("lm_head").params == ["lm_head.weight"]
    assert graph.layer("wte").param_count == 256 * 64 and graph.layer("lm_head").param_count == 0
    keys = {n.meta[META_PARAM]: n for n in graph.gm.graph.nodes if n.op == "get_attr"}
    assert [u.target for u in keys["wte.weight"].users] == [torch.ops.aten.embedding.default]
    assert [u.target for u in keys["lm_head.weight"].users] == [torch.ops.aten.linear.default]
    _, _, t5, _, _, _ = captured["t5"]
    assert t5.tied == [["inner.shared.weight", "inner.encoder.embed_tokens.weight",
                        "inner.decoder.embed_tokens.weight", "inner.lm_head.weight"]]
    assert t5.layer("inner.decoder.embed_tokens").params == ["inner.decoder.embed_tokens.weight"]
    _, _, gpt2, _, _, _ = captured["gpt2"]
    assert gpt2.layer("lm_head").params == ["lm_head.weight"]
    assert gpt2.layer("transformer.wte").params == ["transformer.wte.weight"]


def test_saved_bytes_are_deduplicated_and_first_layer_has_no_grad_input(captured):
    _, _, graph, _, _, _ = captured["gpt"]
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    layer = graph.layer("layers.1")
    linears = [nodes[n] for n in layer.nodes if nodes[n].target == torch.ops.aten.linear.default]
    q, k, v = linears[:3]
    act = B * 32 * 64 * 4  # the ln_1 output that q, k and v all save
    assert q.meta[META_SAVED_BYTES] == act and k.meta[META_SAVED_BYTES] == 0 and v.meta[META_SAVED_BYTES] == 0
    assert q.meta[META_FLOPS_FWD] == 2 * B * 32 * 64 * 64 and q.meta[META_FLOPS_BWD] == 2 * q.meta[META_FLOPS_FWD]
    _, _, mlp, _, _, _ = captured["mlp"]
    first = next(n for n in mlp.gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    # the input batch needs no gradient: only the weight gradient is computed
    assert first.meta[META_FLOPS_FWD] == 2 * B * 32 * 64 and first.meta[META_FLOPS_BWD] == 2 * B * 32 * 64


def test_layer_boundary_bytes(captured):
    _, _, graph, _, _, _ = captured["gpt"]
    hidden = B * 32 * 64 * 4
    for name in ("layers.1", "layers.2"):
        assert graph.layer(name).input_bytes == hidden and graph.layer(name).output_bytes == hidden
    assert graph.layer("lm_head").output_bytes == 0
    assert graph.layer("lm_head").input_bytes == hidden + B * 32 * 8  # ln_f output and the labels


@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn"])
def test_fx_gives_the_same_facts_as_export(captured, name):
    case, batch, graph, loss, _, _ = captured[name]
    fx = capture(case.model, batch, loss_fn=case.loss_fn, tracer="fx")
    assert fx.tracer == "fx" and graph.tracer == "export"
    torch.testing.assert_close(fx.gm(*batch), loss, rtol=1e-6, atol=1e-6)
    facts = ("name", "params", "param_count", "param_bytes", "flops_fwd", "flops_bwd", "saved_bytes",
             "output_bytes", "input_bytes", "attention", "block")
    assert [[getattr(x, f) for f in facts] for x in fx.layers] == [[getattr(x, f) for f in facts] for x in graph.layers]
    assert fx.blocks == graph.blocks and fx.tied == graph.tied


def test_fx_keeps_transformer_encoder_as_a_leaf(captured):
    """Default fx leaves nn.TransformerEncoder opaque; our tracer retries with it as a leaf after
    its fast-path checks fail, and still counts its FLOPs and saved bytes."""
    case, batch, graph, loss, fwd, bwd = captured["encoder"]
    fx = capture(case.model, batch, loss_fn=case.loss_fn, tracer="fx")
    assert [layer.name for layer in fx.layers] == ["embed", "encoder", "head"]
    assert [n.target for n in fx.gm.graph.nodes if n.op == "call_module"] == ["model.encoder"]
    assert fx.flops_per_step == fwd + bwd
    assert sum(x.saved_bytes for x in fx.layers) == sum(x.saved_bytes for x in graph.layers)
    torch.testing.assert_close(fx.gm(*batch), loss, rtol=1e-6, atol=1e-6)


def test_meta_model_costs_nothing_and_gives_the_facts_of_the_real_one(captured):
    case, batch, graph, _, _, _ = captured["gpt"]
    with torch.device("meta"):
        meta = build("gpt").model
    meta_batch = tuple(x.to("meta") for x in batch)
    for tracer in ("auto", "export"):
        got = capture(meta, meta_batch, loss_fn=case.loss_fn, tracer=tracer)
        assert got.tracer == ("fx" if tracer == "auto" else "export")
        assert [(x.name, x.flops_fwd, x.flops_bwd, x.saved_bytes, x.output_bytes, x.param_count) for x in got.layers] \
            == [(x.name, x.flops_fwd, x.flops_bwd, x.saved_bytes, x.output_bytes, x.param_count) for x in graph.layers]


def test_the_runtimes_capture_skips_the_annotation():
    """The runtime re-captures per microbatch shape without annotating (its speed is a benchmark,
    ``benchmarks/capture/bench_capture.py``, not a timed test): same layers, no FLOP facts."""
    case = build("gpt")
    batch = case.make_batch(0, B)
    graph = capture(case.model, batch, loss_fn=case.loss_fn, annotate=False)
    annotated = capture(case.model, batch, loss_fn=case.loss_fn)
    assert [layer.name for layer in graph.layers] == [layer.name for layer in annotated.layers] == LAYERS["gpt"]
    assert all(layer.flops_fwd == 0 for layer in graph.layers)
    assert any(layer.flops_fwd > 0 for layer in annotated.layers)


def test_bad_tracer_options_say_what_is_allowed():
    case = build("mlp")
    batch = case.make_batch(0, B)
    with pytest.raises(ValueError, match=r"tracer='jit': choose 'auto', 'export' or 'fx'"):
        capture(case.model, batch, loss_fn=case.loss_fn, tracer="jit")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"leaf_modules= and concrete_args= are torch.fx options"):
        capture(case.model, batch, loss_fn=case.loss_fn, tracer="export", leaf_modules=(torch.nn.ReLU,))


def test_glue_joins_the_next_layer(captured):
    """Llama's mask code (module path ``model``) and rotary_emb (no parameters) run before block 0
    and join it; block 1 holds only its own nodes."""
    _, _, graph, _, _, _ = captured["llama"]
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    outside = lambda layer: {nodes[n].meta["fs_module"] for n in graph.layer(layer).nodes  # noqa: E731
                             if not nodes[n].meta["fs_module"].startswith(layer)}
    assert outside("model.layers.0") == {"model", "model.rotary_emb"}
    assert outside("model.layers.1") == set()
    assert graph.layer("model.layers.0").buffers == ["model.rotary_emb.inv_freq"]


def test_opaque_moe_op_stays_in_its_block_and_is_counted(captured):
    """transformers runs Mixtral's experts through an opaque custom op (fake kernel only); it stays
    in its block and planner.flops counts it as x[S,K] @ w[e][K,N] per routed row."""
    _, _, graph, _, _, _ = captured["mixtral"]
    ops = [n for n in graph.gm.graph.nodes if str(n.target) == "transformers.grouped_mm_fallback.default"]
    assert [n.meta[META_LAYER] for n in ops] == ["model.layers.0"] * 2 + ["model.layers.1"] * 2
    rows = B * 16 * 2  # tokens x top-2
    assert [n.meta[META_FLOPS_FWD] for n in ops[:2]] == [2 * rows * 64 * 256, 2 * rows * 128 * 64]
    assert all(n.meta[META_FLOPS_BWD] == 2 * n.meta[META_FLOPS_FWD] for n in ops)


def test_hugging_face_model_on_meta_falls_back_to_export_with_the_real_facts(captured):
    """fx cannot trace Llama (mask code branches on shapes), so auto falls back to export; the
    graph traced on meta is annotated as CPU fakes and gives exactly the real model's facts."""
    case, batch, graph, _, _, _ = captured["llama"]
    with torch.device("meta"):
        meta = build("llama").model
    got = capture(meta, tuple(x.to("meta") for x in batch), loss_fn=case.loss_fn)
    assert got.tracer == "export" and got.extra["annotate_device"] == "cpu"
    assert got.extra["fallback_from"][0].startswith("  torch.fx failed at ")
    facts = lambda g: [(x.name, x.flops_fwd, x.flops_bwd, x.saved_bytes, x.param_count, x.attention)  # noqa: E731
                       for x in g.layers]
    assert facts(got) == facts(graph)


def test_meta_trace_with_device_specific_branches_is_counted_on_meta(captured):
    """Mixtral traced on meta takes a non-CPU branch (int32 histc) that CPU kernels reject, so its
    facts are counted on meta; attention then runs the math path and backward FLOPs differ a little."""
    case, batch, graph, _, fwd, bwd = captured["mixtral"]
    with torch.device("meta"):
        meta = build("mixtral").model
    got = capture(meta, tuple(x.to("meta") for x in batch), loss_fn=case.loss_fn)
    assert got.extra["annotate_device"] == "meta"
    assert sum(x.flops_fwd for x in got.layers) == fwd
    assert abs(sum(x.flops_bwd for x in got.layers) / bwd - 1) < 0.02
