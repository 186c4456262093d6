"""Which ATen ops in the graphs a bf16 plan runs refuse operands of mixed dtypes: the evidence
behind ``planner.dtype_pins.MIXED_OPS``.

    nice -n 5 python benchmarks/dtype_ops/mixed_dtype_ops.py            # capture, probe, write both files
    nice -n 5 python benchmarks/dtype_ops/mixed_dtype_ops.py --models nanogpt,resnet --no-write
    python benchmarks/dtype_ops/mixed_dtype_ops.py --device cuda      # a GPU's kernels (prints; writes nothing)
    python benchmarks/dtype_ops/mixed_dtype_ops.py --low float16      # an fp16 plan's mixes (prints; writes nothing)

1. Capture every conformance-corpus model (``fairscale.testing.corpus``, batch 2) as a bf16 plan's
   ranks trace it (``planner.capture.capture(..., dtype=torch.bfloat16)``), and the snippets of
   :data:`SNIPPETS`: calls users write whose ops the corpus does not reach (the matmul family's
   other members, group / eval batch norm, scatter, index_put, lerp, weighted losses, ...).
2. Keep one example per op and call shape (:func:`_signature`) whose call has two or more floating
   tensor operands (with one there is nothing to mix): ``op_examples.json`` (the table test,
   tests/planner/test_mixed_dtype_ops.py, replays it).
3. Run each in eager on CPU (``fairscale.testing.dtype_probe.probe``) under every assignment of
   bf16 / float32 to its floating operand slots (each alone and all-but-each beyond 7 slots),
   forward and backward, and print the ops that refuse; ``mixed_dtype_ops.md`` keeps the table,
   one row per op, beside the rule ``planner.dtype_pins.MIXED_OPS`` has for it.

Eager CPU is the reference: a CUDA kernel may accept a mix the CPU one refuses (see the notes in
``mixed_dtype_ops.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("FAIRSCALE_NO_CALIBRATE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from fairscale.testing.corpus import models  # noqa: E402
from fairscale.testing.dtype_probe import example_of, float_slots, op_of, probe, slot_names  # noqa: E402
from planner.capture import capture  # noqa: E402
from planner.dtype_pins import MIXED_OPS, op_key  # noqa: E402

HERE = Path(__file__).resolve().parent


class _Snippet(nn.Module):
    """One user call on bf16 parameters ``w`` (vector), ``m`` (matrix), ``k`` (conv kernel)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(4))
        self.m = nn.Parameter(torch.randn(4, 4))
        self.k = nn.Parameter(torch.randn(4, 4, 3))
        self.k2 = nn.Parameter(torch.randn(4, 4, 3, 3))
        self.register_buffer("stat", torch.ones(4))

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = self.fn(self, x, idx)
        return sum(o.float().sum() for o in (out if isinstance(out, tuple) else (out,)) if o.is_floating_point())


def _put(s, x, idx):
    y = x.clone()
    y[idx] = s.m[idx]  # index_put
    return y


SNIPPETS = {
    "mm": lambda s, x, idx: torch.mm(x, s.m),
    "convolution": lambda s, x, idx: torch.convolution(x.unsqueeze(0), s.k, s.w, [1], [1], [1], False, [0], 1),
    "_convolution": lambda s, x, idx: torch._convolution(x.unsqueeze(0), s.k, s.w, [1], [1], [1], False, [0], 1,
                                                         False, False, True, True),
    "conv_transpose1d_bias": lambda s, x, idx: F.conv_transpose1d(x.unsqueeze(0), s.k, s.w),
    "conv_transpose3d_bias": lambda s, x, idx: F.conv_transpose3d(x.reshape(1, 4, 1, 2, 2), s.k2.unsqueeze(2), s.w),
    "conv3d_bias": lambda s, x, idx: F.conv3d(x.reshape(1, 4, 1, 2, 2), s.k2.unsqueeze(2), s.w, padding=(0, 1, 1)),
    "conv1d_bias": lambda s, x, idx: F.conv1d(x.unsqueeze(0), s.k, s.w, padding=1),
    "batch_norm_eval_no_affine": lambda s, x, idx: F.batch_norm(x, s.stat, s.stat, training=False),
    "batch_norm_train_unsynced": lambda s, x, idx: F.batch_norm(x, None, None, s.w, s.w, training=True),
    "index_add_": lambda s, x, idx: x.clone().index_add_(0, idx, s.m[:2]),
    "index_copy_": lambda s, x, idx: x.clone().index_copy_(0, idx, s.m[:2]),
    "scatter_": lambda s, x, idx: x.clone().scatter_(0, idx.unsqueeze(1).expand(2, 4), s.m[:2]),
    "scatter_add_": lambda s, x, idx: x.clone().scatter_add_(0, idx.unsqueeze(1).expand(2, 4), s.m[:2]),
    "masked_scatter_": lambda s, x, idx: x.clone().masked_scatter_(x > 0.5, s.m),
    "lerp_": lambda s, x, idx: x.clone().lerp_(s.m, 0.5),
    "index_put_accumulate": lambda s, x, idx: x.index_put((idx,), s.m[:2], accumulate=True),
    "mv": lambda s, x, idx: torch.mv(s.m, x[0]),
    "dot": lambda s, x, idx: torch.dot(s.w, x[0]),
    "addmv": lambda s, x, idx: torch.addmv(s.w, s.m, x[0]),
    "bmm": lambda s, x, idx: torch.bmm(x.unsqueeze(0), s.m.unsqueeze(0)),
    "baddbmm": lambda s, x, idx: torch.baddbmm(s.m.unsqueeze(0), x.unsqueeze(0), s.m.unsqueeze(0)),
    "addbmm": lambda s, x, idx: torch.addbmm(s.m, x.unsqueeze(0), s.m.unsqueeze(0)),
    "addr": lambda s, x, idx: torch.addr(s.m, s.w, x[0]),
    "outer": lambda s, x, idx: torch.outer(s.w, x[0]),
    "einsum": lambda s, x, idx: torch.einsum("ij,jk->ik", x, s.m),
    "tensordot": lambda s, x, idx: torch.tensordot(x, s.m, dims=1),
    "bilinear": lambda s, x, idx: F.bilinear(x, x, s.m.unsqueeze(0)),
    "conv1d": lambda s, x, idx: F.conv1d(x.unsqueeze(0), s.k, padding=1),
    "conv3d": lambda s, x, idx: F.conv3d(x.reshape(1, 4, 1, 2, 2), s.k2.unsqueeze(2), padding=(0, 1, 1)),
    "conv_transpose1d": lambda s, x, idx: F.conv_transpose1d(x.unsqueeze(0), s.k),
    "conv_transpose2d": lambda s, x, idx: F.conv_transpose2d(x.reshape(1, 4, 2, 2), s.k2),
    "cdist": lambda s, x, idx: torch.cdist(x, s.m),
    "layer_norm": lambda s, x, idx: F.layer_norm(x, (4,), s.w, s.w),
    "rms_norm": lambda s, x, idx: F.rms_norm(x, (4,), s.w),
    "group_norm": lambda s, x, idx: F.group_norm(x, 2, s.w, s.w),
    "batch_norm_eval": lambda s, x, idx: F.batch_norm(x, s.stat, s.stat, s.w, s.w, training=False),
    "instance_norm": lambda s, x, idx: F.instance_norm(x.unsqueeze(0), weight=s.w, bias=s.w),
    "prelu": lambda s, x, idx: F.prelu(x, s.w),
    "embedding": lambda s, x, idx: F.embedding(idx, s.m),
    "embedding_bag": lambda s, x, idx: F.embedding_bag(idx.unsqueeze(0), s.m, per_sample_weights=x[0, :2].unsqueeze(0),
                                                       mode="sum"),
    "index_put": _put,
    "index_add": lambda s, x, idx: x.index_add(0, idx, s.m[:2]),
    "index_copy": lambda s, x, idx: x.index_copy(0, idx, s.m[:2]),
    "scatter": lambda s, x, idx: x.scatter(0, idx.unsqueeze(1).expand(2, 4), s.m[:2]),
    "scatter_add": lambda s, x, idx: x.scatter_add(0, idx.unsqueeze(1).expand(2, 4), s.m[:2]),
    "scatter_reduce": lambda s, x, idx: x.scatter_reduce(0, idx.unsqueeze(1).expand(2, 4), s.m[:2], "amax"),
    "masked_scatter": lambda s, x, idx: x.masked_scatter(x > 0, s.m),
    "masked_fill": lambda s, x, idx: x.masked_fill(x > 0, s.w[0]),
    "where": lambda s, x, idx: torch.where(x > 0, x, s.m),
    "copy_": lambda s, x, idx: x.clone().copy_(s.m),
    "lerp": lambda s, x, idx: torch.lerp(x, s.m, 0.5),
    "lerp_tensor": lambda s, x, idx: torch.lerp(x, s.m, s.m),
    "addcmul": lambda s, x, idx: torch.addcmul(x, s.m, s.m),
    "addcdiv": lambda s, x, idx: torch.addcdiv(x, s.m, s.m + 2),
    "clamp": lambda s, x, idx: torch.clamp(x, min=s.m, max=s.m + 1),
    "maximum": lambda s, x, idx: torch.maximum(x, s.m),
    "atan2": lambda s, x, idx: torch.atan2(x, s.m),
    "cat": lambda s, x, idx: torch.cat([x, s.m]),
    "stack": lambda s, x, idx: torch.stack([x, s.m]),
    "cross_entropy_weight": lambda s, x, idx: F.cross_entropy(x @ s.m, idx.repeat(2) * 0, weight=s.stat),
    "nll_loss_weight": lambda s, x, idx: F.nll_loss(x, idx.repeat(2) * 0, weight=s.stat),
    "bce_logits_pos_weight": lambda s, x, idx: F.binary_cross_entropy_with_logits(x, s.m.sigmoid(), pos_weight=s.stat),
    "bce": lambda s, x, idx: F.binary_cross_entropy(x.sigmoid(), s.m.sigmoid()),
    "mse_loss": lambda s, x, idx: F.mse_loss(x, s.m),
    "smooth_l1_loss": lambda s, x, idx: F.smooth_l1_loss(x, s.m),
    "kl_div": lambda s, x, idx: F.kl_div(x.log_softmax(-1), s.m.log_softmax(-1), log_target=True),
    "sdpa_mask": lambda s, x, idx: F.scaled_dot_product_attention(*(x.reshape(1, 1, 4, 4),) * 3,
                                                                  attn_mask=s.m.reshape(1, 1, 4, 4)),
    "index_fill": lambda s, x, idx: x.index_fill(0, idx, s.w[0]),
    "index_reduce": lambda s, x, idx: x.index_reduce(0, idx, s.m[:2], "amax"),
    "put": lambda s, x, idx: x.put(idx, s.w[:2]),
    "heaviside": lambda s, x, idx: torch.heaviside(x, s.m),
    "copysign": lambda s, x, idx: torch.copysign(x, s.m),
    "pow_tensor": lambda s, x, idx: torch.pow(x, s.m),
    "xlogy": lambda s, x, idx: torch.xlogy(x, s.m),
    "hypot": lambda s, x, idx: torch.hypot(x, s.m),
    "logaddexp": lambda s, x, idx: torch.logaddexp(x, s.m),
    "nextafter": lambda s, x, idx: torch.nextafter(x, s.m),
    "cross": lambda s, x, idx: torch.linalg.cross(x[:, :3], s.m[:, :3]),
    "cosine_similarity": lambda s, x, idx: F.cosine_similarity(x, s.m),
    "pairwise_distance": lambda s, x, idx: F.pairwise_distance(x, s.m),
    "searchsorted": lambda s, x, idx: torch.searchsorted(s.w.detach().sort().values, x).float(),
    "normal": lambda s, x, idx: torch.normal(x, s.m.abs()),
    "grid_sample": lambda s, x, idx: F.grid_sample(x.reshape(1, 1, 4, 4), s.m.reshape(1, 2, 4, 2), align_corners=False),
    "l1_loss": lambda s, x, idx: F.l1_loss(x, s.m),
    "huber_loss": lambda s, x, idx: F.huber_loss(x, s.m),
    "margin_ranking_loss": lambda s, x, idx: F.margin_ranking_loss(x, s.m, s.w.sign().expand(4, 4)),
    "gaussian_nll_loss": lambda s, x, idx: F.gaussian_nll_loss(x, s.m, s.m.abs() + 1),
    "multi_margin_loss_weight": lambda s, x, idx: F.multi_margin_loss(x, idx.repeat(2) * 0, weight=s.stat),
    "trapezoid": lambda s, x, idx: torch.trapezoid(x, s.m),
    "interpolate": lambda s, x, idx: F.interpolate(x.reshape(1, 1, 4, 4), scale_factor=2.0) * s.w[0],
}
"""name -> fn(module, x (4, 4), idx (2,) int64): a call whose ops the corpus may not reach."""


def _captures(names: list[str], say=print):
    for name in names:
        case = models()[name].build(0)
        try:
            yield name, capture(case.model, case.make_batch(0, 2), loss_fn=case.loss_fn, annotate=False,
                                dtype=torch.bfloat16).gm
        except Exception as e:  # noqa: BLE001 - a model the capture refuses has no graph to run
            say(f"{name}: not captured ({type(e).__name__})")
    for name, fn in SNIPPETS.items():
        batch = (torch.randn(4, 4), torch.tensor([0, 1]))
        try:
            yield f"snippet:{name}", capture(_Snippet(fn), batch, annotate=False, dtype=torch.bfloat16).gm
        except Exception as e:  # noqa: BLE001
            say(f"snippet {name}: not captured ({type(e).__name__}: {str(e).splitlines()[-1][:120]})")


def _signature(example: dict) -> str:
    """An op's call shape: its floating slots by name, which arguments are None, and the bool flags
    (``training``): two calls with the same signature differ only in sizes."""
    flags = [a if isinstance(a, bool) or a is None else type(a).__name__ for a in example["args"]]
    return json.dumps([example["op"], slot_names(example), flags, sorted(example["kwargs"])])


def collect(names: list[str], say=print) -> tuple[dict[str, dict], dict[str, list[str]]]:
    """(signature -> example with its ``"seen_in"``, op -> where seen) over every captured op."""
    examples: dict[str, dict] = {}
    seen: dict[str, list[str]] = {}
    for name, gm in _captures(names, say):
        for module in gm.modules():
            if not isinstance(module, torch.fx.GraphModule):
                continue
            for node in module.graph.nodes:
                example = example_of(node)
                if example is None:
                    continue
                seen.setdefault(example["op"], [])
                if name not in seen[example["op"]]:
                    seen[example["op"]].append(name)
                if len(float_slots(example)) >= 2:
                    examples.setdefault(_signature(example), {**example, "seen_in": []})["seen_in"].append(name)
    return examples, seen


def verdict(example: dict, device: str = "cpu", low: torch.dtype = torch.bfloat16) -> dict:
    """What eager says of ``example``: the slot names, the all-bf16 error (a kernel missing, or a
    value the probe cannot make; nothing to judge then) and each refused mix."""
    outcomes = probe(example, device=device, low=low)
    base = outcomes[0].error
    refused = [] if base else [(o.fp32, o.error) for o in outcomes if o.error]
    return {"slots": slot_names(example), "baseline": base, "refused": refused, "mixes": len(outcomes)}


NOTES = """\
Not measured here (no GPU on the machine that gathered this): CUDA kernels run their own dtype
checks. As far as known, the matmul family, the indexed writes and SDPA's query/key/value check
are the same on CUDA, and the norms' mixed path (a 16-bit input with float32 parameters) exists
there too; `aten.rms_norm` may dispatch to a fused CUDA kernel whose dtype rules were not checked.
A CUDA kernel may take a mix the CPU one refuses, or refuse one it takes: rerun this script on a
GPU machine (`--device cuda --no-write`) to know."""


def _rule_text(key: str) -> str:
    rule = MIXED_OPS.get(key)
    if rule is None:
        return "not in the table"
    text = "same dtype: " + ", ".join(rule.same)
    text += f"; {', '.join(rule.or_fp32)}: that dtype or float32" if rule.or_fp32 else ""
    return text + ("" if rule.exact else " (refuses every mix; eager only some)")


def markdown(rows: list[tuple[dict, dict]], seen: dict[str, list[str]], names: list[str]) -> str:
    """The evidence as a table, one row per op of :data:`MIXED_OPS`' keys (calls of one op with
    different operands merged), refusing ops first."""
    by: dict[str, list[tuple[dict, dict]]] = {}
    for example, v in rows:
        by.setdefault(op_key(op_of(example)), []).append((example, v))
    lines = ["| op | operands (calls) | mixes eager refuses | planner.dtype_pins.MIXED_OPS | seen in |",
             "|---|---|---|---|---|"]
    judged = {k: g for k, g in by.items() if all(not v["baseline"] for _, v in g)}
    for key in sorted(judged, key=lambda k: (not any(v["refused"] for _, v in judged[k]), k)):
        group = judged[key]
        operands = "; ".join(dict.fromkeys(", ".join(v["slots"]) for _, v in group))
        refused = "; ".join(f"{len(v['refused'])}/{v['mixes']}" for _, v in group)
        where = list(dict.fromkeys(w for e, _ in group for w in e["seen_in"]))
        shown = ", ".join(where[:3]) + (f" (+{len(where) - 3})" if len(where) > 3 else "")
        lines.append(f"| {key} | {operands} | {refused} | {_rule_text(key)} | {shown} |")
    skipped = {k: g[0][1]["baseline"] for k, g in by.items() if k not in judged}
    refusing = [k for k in judged if any(v["refused"] for _, v in judged[k])]
    head = (f"# Which ops refuse operands of mixed dtypes (eager CPU, torch {torch.__version__})\n\n"
            f"`nice -n 5 python benchmarks/dtype_ops/mixed_dtype_ops.py`: {len(names)} corpus models captured in "
            f"bf16 and {len(SNIPPETS)} snippets; {len(seen)} distinct ATen ops, {len(by)} of them called with two "
            f"or more floating operands ({len(rows)} distinct calls), each run under every bf16 / float32 mix of "
            f"those operands (each alone and all but each beyond 7), forward and backward. "
            f"{len(refusing)} ops refuse some mix; {len(judged) - len(refusing)} take every mix.\n\n")
    tail = "\n\nNot judged (the all-bf16 call fails on CPU already):\n\n" + "\n".join(
        f"- {k}: {why[:120]}" for k, why in sorted(skipped.items()))
    return head + "\n".join(lines) + tail + "\n\n" + NOTES + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="comma-separated corpus names (default: all)")
    ap.add_argument("--device", default="cpu", help="where the probe runs the ops (cuda: a GPU's kernels)")
    ap.add_argument("--low", default="bfloat16", help="the 16-bit dtype (float16: an fp16 plan's)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave op_examples.json and the .md as they are")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    names = args.models.split(",") if args.models else list(models())
    examples, seen = collect(names)
    rows = []
    for sig, example in sorted(examples.items(), key=lambda kv: kv[0]):
        v = verdict(example, args.device, getattr(torch, args.low))
        rows.append((example, v))
        mark = "BASELINE FAILS" if v["baseline"] else (f"REFUSES {len(v['refused'])}/{v['mixes']}" if v["refused"]
                                                       else "accepts")
        where = ", ".join(dict.fromkeys(example["seen_in"]))
        print(f"{example['op']:45s} {','.join(v['slots']):50s} {mark}  ({where[:60]})")
        for fp32, err in v["refused"][:64]:
            print("     fp32:", [s for s, f in zip(v["slots"], fp32) if f], "->", err[:110])
        if v["baseline"]:
            print("     ", v["baseline"][:150])
    print(f"\n{len(seen)} distinct ops in {len(names)} models and {len(SNIPPETS)} snippets; "
          f"{len(examples)} calls with two or more floating operands over {len({e['op'] for e in examples.values()})} ops")
    if not args.no_write and (args.device, args.low) == ("cpu", "bfloat16"):  # the files are the CPU bf16 evidence
        judged = [{**e, "seen_in": list(dict.fromkeys(e["seen_in"]))} for e, v in rows if not v["baseline"]]
        out = {"ops_seen": {k: seen[k] for k in sorted(seen)}, "examples": judged,
               "not_judged": {e["op"]: v["baseline"] for e, v in rows if v["baseline"]}}
        (HERE / "op_examples.json").write_text(json.dumps(out, indent=1) + "\n")
        (HERE / "mixed_dtype_ops.md").write_text(markdown(rows, seen, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
