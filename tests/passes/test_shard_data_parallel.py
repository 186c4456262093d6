"""shard_data_parallel_pass in one process: the structure it inserts, and numbers against the
unrewritten graph (dp_size=1, where every collective is the identity)."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx
from torch import nn

from fairscale.testing.models import build
from passes.ops import dp_ops
from passes.layout import META_LAYOUT, TensorShard, layout_of
from passes.dp.shard_data_parallel import META_DP, shard_data_parallel_pass
from planner.capture import capture
from planner.plan import DataParallel


@pytest.fixture(scope="module")
def gpt():
    case = build("gpt", layers=3)
    return case, capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, annotate=False)


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_ddp_buckets_every_trainable_parameter_once_in_reverse_use_order(gpt):
    case, graph = gpt
    gm = shard_data_parallel_pass(graph.gm, DataParallel(kind="ddp", bucket_mb=0.05), dp_index=0, dp_size=2)
    calls = _calls(gm, dp_ops.dp_bucket)
    info = gm.meta[META_DP]
    assert len(calls) == len(info.buckets) > 3
    keys = [k for b in info.buckets for k in b.keys]
    assert sorted(keys) == sorted(k for k in graph.param_shapes if k != "lm_head.weight")  # tied: one gradient
    # reverse order of first use: the final norm reduces first; the tied embedding, first used by the
    # embedding lookup, reduces last, when both of its uses have contributed
    assert keys[0].startswith("ln_f.") and keys[-1] in ("wte.weight", "lm_head.weight")
    assert info.aliases in ({"wte.weight": ["lm_head.weight"]}, {"lm_head.weight": ["wte.weight"]})
    assert "passes_ops_dp_ops_dp_bucket(" in gm.code
    # each bucket call sits before the first reader of its parameters
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for call in calls:
        readers = [u for g in call.users for u in g.users]
        assert all(order[call] < order[r] for r in readers)


def test_fsdp_gathers_each_unit_once_and_reshards_every_block(gpt):
    case, graph = gpt
    gm = shard_data_parallel_pass(graph.gm, DataParallel(kind="fsdp", units="layers.*"), dp_index=1, dp_size=4)
    info = gm.meta[META_DP]
    assert [u.name for u in info.units] == ["", "layers.0", "layers.1", "layers.2"]
    unshard, reshard = _calls(gm, dp_ops.fsdp_unshard), _calls(gm, dp_ops.fsdp_reshard)
    assert len(unshard) == 4 and len(reshard) == 3  # the root stays gathered
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    events = sorted([(order[n], "G" + str(n.args[0].target[-1])) for n in unshard]
                    + [(order[n], "F" + str(n.args[0].target[-1])) for n in reshard])
    assert " ".join(e for _, e in events) == "G0 G1 F1 G2 F2 G3 F3"
    layout = gm.meta[META_LAYOUT]
    members = [k for f in layout.flat.values() for k, _ in f.members]
    assert sorted(members) == sorted(k for k in graph.param_shapes if k != "lm_head.weight")
    for flat in layout.flat.values():
        assert flat.padded % 4 == 0 and flat.padded - flat.numel < 4 and flat.index == 1
    assert all(p.numel() == f.padded // 4 for p, f in zip([u.flat for u in info.units], layout.flat.values()))
    gm.graph.lint()


def test_reshard_without_a_selector_is_one_root_unit(gpt):
    _, graph = gpt
    gm = shard_data_parallel_pass(graph.gm, DataParallel(kind="fsdp", units=""), dp_index=0, dp_size=2)
    assert [u.name for u in gm.meta[META_DP].units] == [""]
    assert not _calls(gm, dp_ops.fsdp_reshard)


@pytest.mark.parametrize("kind,extra", [("ddp", {}), ("zero1", {}), ("zero2", {}),
                                        ("fsdp", dict(reshard_after_forward=True)),
                                        ("fsdp", dict(reshard_after_forward=False, prefetch=False)),
                                        ("fsdp", dict(offload=True)), ("zero2", dict(offload=True))])
def test_numbers_match_the_unrewritten_graph(gpt, kind, extra):
    case, graph = gpt
    before = graph.gm.code
    batch = case.make_batch(1, 2)
    ref = graph.gm(*batch)
    ref.backward()
    ref_grads = {layout_of(graph.gm).keys[n]: p.grad.clone() for n, p in graph.gm.named_parameters()}
    graph.gm.zero_grad(set_to_none=True)
    units = "layers.*" if kind == "fsdp" else ""
    gm = shard_data_parallel_pass(graph.gm, DataParallel(kind=kind, units=units, **extra), dp_index=0, dp_size=1)
    loss = gm(*batch)
    loss.backward()
    assert graph.gm.code == before  # the input graph is untouched
    assert loss.item() == ref.item()
    info = gm.meta[META_DP]
    grads = {}
    if kind == "fsdp":
        for u in info.units:
            grads.update({k: g for k, g in zip(u.keys, u.flat.grad.split([s.numel() for s in u.shapes]))})
            assert not u.is_gathered  # freed after backward
    elif kind == "ddp":
        grads = {k: p.grad for a, k in gm.meta[META_LAYOUT].keys.items() for n, p in gm.named_parameters() if n == a}
    else:
        for b in info.buckets:
            grads.update({k: g for k, g in zip(b.keys, b.shard.grad.split([s.numel() for s in b.shapes]))})
    assert set(grads) == set(ref_grads)
    for k, g in grads.items():
        torch.testing.assert_close(g.reshape(ref_grads[k].shape), ref_grads[k], rtol=0, atol=0)


class _Stage(nn.Module):
    """A pipeline-stage-like module: two inputs (an activation and a mask), a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.norm = nn.LayerNorm(8)

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for b in self.blocks:
            h = torch.relu(b(h)) * scale
        return self.norm(h), h.mean()


def _traced_stage():
    torch.manual_seed(0)
    stage = _Stage()
    h, scale = torch.randn(4, 8, requires_grad=True), torch.rand(4, 1)
    ep = torch.export.export(stage, (h, scale), strict=False)
    gm = ep.module()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            node.meta["fs_param"] = str(node.target)
    return stage, gm, h, scale


@pytest.mark.parametrize("kind", ["ddp", "zero2", "fsdp"])
def test_pipeline_stage_graph_with_tuple_output(kind):
    stage, gm, h, scale = _traced_stage()
    out_ref = stage(h, scale)
    (out_ref[0].sum() + out_ref[1]).backward()
    ref_h = h.grad.clone()
    h.grad = None
    units = "blocks.*" if kind == "fsdp" else ""
    rank_gm = shard_data_parallel_pass(gm, DataParallel(kind=kind, units=units), dp_index=0, dp_size=1)
    out = rank_gm(h, scale)
    assert isinstance(out, tuple) and len(out) == 2
    torch.testing.assert_close(out[0], out_ref[0], rtol=0, atol=0)
    (out[0].sum() + out[1]).backward()
    torch.testing.assert_close(h.grad, ref_h, rtol=0, atol=0)  # activation gradients flow through
    if kind == "fsdp":
        assert len(_calls(rank_gm, dp_ops.fsdp_reshard)) == 3  # every block (the root norm runs after them)
        assert "fsdp_unit_3" not in [n for n, _ in rank_gm.fsdp_unit_2.named_children()]  # links are not children
        repr(rank_gm)


def test_tensor_parallel_slices_are_flattened_with_their_user_keys(gpt):
    """After a TP pass, local tensors are slices; FSDP flattens them and layout.tp is carried over."""
    _, graph = gpt
    gm = torch.fx.GraphModule(graph.gm, graph.gm.graph)
    layout = gm.meta.setdefault(META_LAYOUT, None) or None
    from passes.layout import layout_of

    gm.meta.pop(META_LAYOUT, None)
    layout = layout_of(gm)
    spec = TensorShard(key="layers.0.mlp.up_proj.weight", global_shape=(512, 64), dim=0, index=0, count=2)
    layout.tp[spec.key] = spec
    rank_gm = shard_data_parallel_pass(gm, DataParallel(kind="fsdp", units="layers.*"), dp_index=0, dp_size=2)
    out = rank_gm.meta[META_LAYOUT]
    assert out.tp == {spec.key: spec}
    members = dict(m for f in out.flat.values() for m in f.members)
    assert members[spec.key] == (256, 64)  # the local (captured) shape, flattened as is


def test_mixed_precision_casts_float_inputs_and_the_loss():
    case = build("mlp")
    graph = capture(case.model, case.make_batch(0, 4), loss_fn=case.loss_fn, annotate=False)
    gm = shard_data_parallel_pass(graph.gm, DataParallel(kind="fsdp", units="layers.*", param_dtype="bf16"),
                                  dp_index=0, dp_size=1)
    casts = [n for n in gm.graph.nodes if n.op == "call_method"]
    assert [(n.target, n.args[1:]) for n in casts] == [("to", (torch.bfloat16,)), ("float", ())]
    loss = gm(*case.make_batch(0, 4))
    assert loss.dtype == torch.float32
    loss.backward()
    assert all(u.flat.grad.dtype == torch.float32 for u in gm.meta[META_DP].units)


def test_prefetch_gathers_the_next_unit_early_in_both_directions(gpt, monkeypatch):
    """Forward: unshard of unit k starts unit k+1's gather; backward: re-gathering unit k starts
    unit k-1's. Recorded as (event, unit) in execution order."""
    case, graph = gpt
    gm = shard_data_parallel_pass(graph.gm, DataParallel(kind="fsdp", units="layers.*"), dp_index=0, dp_size=1)
    events = []
    for name in ("start_gather", "gather", "free"):
        original = getattr(dp_ops.FSDPUnit, name)

        def spy(self, _original=original, _name=name):
            events.append(f"{_name[0] if _name != 'start_gather' else 'p'}{self.index}")
            return _original(self)

        monkeypatch.setattr(dp_ops.FSDPUnit, name, spy)
    gm(*case.make_batch(0, 2)).backward()
    assert " ".join(events) == ("g0 p1 g1 p2 f1 g2 p3 f2 g3 f3 "   # forward: gather k, prefetch k+1, free k
                                "g3 p2 f3 g2 p1 f2 g1 f1 f0")      # backward: re-gather k, prefetch k-1, free


def test_fx_trace_without_shape_meta():
    """capture's fx tracer without annotation leaves no ``val`` meta: liveness then keeps every
    value of unknown type, casts are decided at run time, and the numbers still match."""
    case = build("gpt", layers=2)
    graph = capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, annotate=False, tracer="fx")
    assert graph.tracer == "fx" and not any("val" in n.meta for n in graph.gm.graph.nodes)
    batch = case.make_batch(1, 2)
    ref = graph.gm(*batch)
    ref.backward()
    from passes.layout import layout_of

    ref_grad = {layout_of(graph.gm).keys[n]: p.grad.clone() for n, p in graph.gm.named_parameters()}
    gm = shard_data_parallel_pass(graph.gm, DataParallel(kind="fsdp", units="layers.*"), dp_index=0, dp_size=1)
    assert len(_calls(gm, dp_ops.fsdp_reshard)) == 2
    loss = gm(*batch)
    loss.backward()
    assert loss.item() == ref.item()
    for u in gm.meta[META_DP].units:
        for k, g in zip(u.keys, u.flat.grad.split([s.numel() for s in u.shapes])):
            torch.testing.assert_close(g.view(ref_grad[k].shape), ref_grad[k], rtol=0, atol=0)
    bf16 = shard_data_parallel_pass(graph.gm, DataParallel(kind="fsdp", units="layers.*", param_dtype="bf16"),
                                    dp_index=0, dp_size=1)
    assert bf16(*batch).dtype == torch.float32
