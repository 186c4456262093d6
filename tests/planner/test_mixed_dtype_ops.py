"""planner.dtype_pins.MIXED_OPS against eager PyTorch: every call with two or more floating
operands that the corpus captures (and benchmarks/dtype_ops' snippets) hold, run on CPU under
every bf16 (and fp16) / float32 mix of its operands (benchmarks/dtype_ops/op_examples.json, gathered by
benchmarks/dtype_ops/mixed_dtype_ops.py): eager refuses a mix exactly when the table says so, so
the table cannot drift from torch; an op that takes every mix by type promotion is not in it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from fairscale.testing.dtype_probe import op_of, probe, slot_names
from planner.capture import capture
from planner.dtype_pins import MIXED_OPS, mix_refused, mixed_ops, op_key
from planner.graph import META_MODULE

DATA = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/dtype_ops/op_examples.json").read_text())
EXAMPLES = DATA["examples"]


def _dtypes(example: dict, fp32: tuple[bool, ...], low: torch.dtype) -> dict[str, list[torch.dtype]]:
    out: dict[str, list[torch.dtype]] = {}
    for name, wide in zip(slot_names(example), fp32):
        out.setdefault(re.sub(r"\[\d+\]$", "", name), []).append(torch.float32 if wide else low)
    return out


def _id(example: dict) -> str:
    return f"{example['op']}({','.join(slot_names(example))})"


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("example", EXAMPLES, ids=[_id(e) for e in EXAMPLES])
def test_eager_refuses_a_mix_exactly_when_the_table_says_so(example, low):
    key = op_key(op_of(example))
    rule = MIXED_OPS.get(key)
    outcomes = probe(example, low=low)
    assert outcomes[0].error is None, outcomes[0]  # all 16-bit runs: what is judged is the mix alone
    wrong = [(o.fp32, o.error) for o in outcomes if mix_refused(key, _dtypes(example, o.fp32, low)) != bool(o.error)]
    if rule is not None and not rule.exact:  # refuses every mix: more than eager, never less
        assert all(error is None for _, error in wrong), wrong
        assert wrong, f"{key}: eager refuses exactly the mixes the rule does: make it exact"
    else:
        assert not wrong, (key, rule, [(slot_names(example), w) for w in wrong])


def test_every_op_of_the_table_is_checked_and_refuses_some_mix():
    checked = {op_key(op_of(e)) for e in EXAMPLES}
    assert set(MIXED_OPS) <= checked, sorted(set(MIXED_OPS) - checked)
    assert len(MIXED_OPS) >= 40  # the matmul family, convolutions, attention, norms, indexed writes, losses


def test_ops_that_promote_are_not_in_the_table():
    promoting = {"aten.add", "aten.mul", "aten.div", "aten.sub", "aten.where", "aten.cat", "aten.copy",
                 "aten.addcmul", "aten.masked_fill", "aten.rms_norm", "aten.mse_loss", "aten.type_as"}
    assert promoting <= {op_key(op_of(e)) for e in EXAMPLES}
    assert not promoting & set(MIXED_OPS)


def _net_capture(net: nn.Module):
    return capture(net, (torch.randn(2, 3, 4, 4),), loss_fn=lambda out: out.float().mean(), annotate=False,
                   dtype=torch.bfloat16).gm


def test_a_training_batch_norm_is_the_batch_norm_pass_s_and_an_eval_one_is_refused():
    """Both read float32 running statistics beside bf16 weights, which aten.batch_norm refuses; in
    training mode the batch-norm pass replaces it with a kernel of its own (``passes.ops.bn_ops``:
    vgg-bn and resnet train in bf16), in eval mode the ranks run it as it is."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    assert mixed_ops(_net_capture(net)) == []
    net[1].eval()
    assert [(str(n.target), n.meta[META_MODULE]) for n in mixed_ops(_net_capture(net))] == \
        [("aten.batch_norm.default", "1")]
