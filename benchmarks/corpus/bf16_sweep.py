"""Sweep the conformance corpus under bf16 plans: every model x plan -> exact / refused / DIFFERS / CRASH.

    nice -n 5 python benchmarks/corpus/bf16_sweep.py                       # every model, every plan
    nice -n 5 python benchmarks/corpus/bf16_sweep.py --models hf-llama,resnet --plans one,ddp2
    python benchmarks/corpus/bf16_sweep.py --table benchmarks/corpus/bf16_results.jsonl   # re-render

Each plan is an explicit :class:`Plan` with ``data_parallel.param_dtype="bf16"`` (the GPU default),
checked through the public compile check before launch; ranks are gloo CPU processes
(``fairscale.testing.corpus_run``'s launcher: a case that crashes the ranks is recorded and the
rest run on). Plans: ``one`` (one rank), ``ddp2`` / ``fsdp2`` (dp2), ``pp2`` (two stages, one
microbatch, layers split in halves), ``tp2`` (the TP detector's rules; absent when it proposes none).

The reference is eager bf16 with fp32 masters, as a user trains in bf16: bf16 copies of the
parameters (buffers as they are), forward and backward on the batch with its floating tensors in
bf16, the loss read in fp32; the copies' gradients step SGD (lr ``corpus_run.LR``) on the fp32
masters. SGD, not Adam: Adam's scale-free update turns rounding noise in ~0 gradients into
lr-sized steps (``corpus_run``'s docstring), which bf16's noise makes worse.

Tolerance: every step's loss within :data:`TOL` relative of the reference. A dp2 loss is the mean
of two half-batch bf16 losses, each rounded apart (one bf16 ulp, 2^-8..2^-7 relative, from the
full-batch bf16 loss, itself rounded: together up to one ulp, 2^-7 relative), the halves' sums
round differently inside, tp splits the matmuls' sums, and later steps start from weights that
differ by the rounding of the gradients' parts. So the tolerance is two bf16 epsilons, 2^-6
(measured on nanogpt: one rank and pp2 0, dp2 and tp2 6.9e-3); the first step's gradients
(relative L2 error over all parameters) are reported beside it, and a gradient error above
:data:`GRAD_TOL`, or above twice the model's bf16 floor where that is larger, is DIFFERS too. The
bf16 floor is how far the reference's own first-step gradients are from the float32 ones (the
same model in float32, one process): BatchNorm models reach 6e-2 (vgg-bn) to 1e-1 (resnet) there,
the conv biases before each norm having a true gradient of ~0; two bf16 computations each that far
from float32 can be up to twice that far from each other (measured on vgg-bn at one rank: plan
6.3e-2 and eager 6.0e-2 from float32, 6.5e-2 from each other).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("FAIRSCALE_NO_CALIBRATE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from fairscale.api import captured  # noqa: E402
from fairscale.check_step import reference_step  # noqa: E402
from fairscale.compile_check import checker_for  # noqa: E402
from fairscale.testing import corpus_run  # noqa: E402
from fairscale.testing.corpus import models  # noqa: E402
from passes.tp.patterns import propose_tp_rules  # noqa: E402
from planner.capture import CaptureError, LossModule  # noqa: E402
from planner.plan import DataParallel, Mesh, Plan, PlanError, Schedule, Stage, TensorParallel  # noqa: E402

HERE = Path(__file__).resolve().parent
PLANS = {"one": (1, 1, 1, "ddp"), "ddp2": (1, 2, 1, "ddp"), "fsdp2": (1, 2, 1, "fsdp"), "pp2": (2, 1, 1, "ddp"),
         "tp2": (1, 1, 2, "ddp")}
"""name -> (pp, dp, tp, data_parallel.kind)."""
TOL = 2.0 ** -6
GRAD_TOL = 5e-2
STEPS, BATCH, SEED = corpus_run.STEPS, corpus_run.GLOBAL_BATCH, corpus_run.SEED


def eager_bf16(entry, steps: int = STEPS, *, buffers: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses of eager bf16 with fp32 masters (module docstring), and the first step's
    gradients of the masters (fp32, by ``named_parameters`` name). The model's own parameters
    hold the bf16 copies (no deepcopy: a model may reach its modules through closures, minGPT's
    ``mlpf`` lambda, which a copy would leave pointing at the original). ``buffers``: floating
    buffers in bf16 too (``model.to(torch.bfloat16)``'s buffers), for models whose eager kernels
    refuse bf16 parameters beside fp32 buffers (BatchNorm's running statistics on CPU); a
    training-mode forward never reads running statistics, so the losses are the same function."""
    case = entry.build(SEED)
    if buffers:
        for module in case.model.modules():
            for key, b in module._buffers.items():
                if b is not None and b.is_floating_point():
                    module._buffers[key] = b.to(torch.bfloat16)
    params = {k: p for k, p in case.model.named_parameters() if p.is_floating_point()}
    master = {k: torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for k, p in params.items()}
    opt = torch.optim.SGD([m for m in master.values() if m.requires_grad], lr=corpus_run.LR)
    wrapped = LossModule(case.model, case.loss_fn, fp32_loss=True)
    losses, grads = [], {}
    for step in range(steps):
        for k, p in params.items():
            p.data = master[k].detach().to(torch.bfloat16)
            p.grad = None
        batch = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in case.make_batch(step, BATCH))
        loss = wrapped(*batch)
        loss.backward()
        for k, m in master.items():
            m.grad = None if params[k].grad is None else params[k].grad.float()
        if step == 0:
            grads = {k: m.grad.clone() for k, m in master.items() if m.grad is not None}
        opt.step()
        losses.append(float(loss.detach()))
    return losses, grads


def bf16_plan(case, kind: str) -> Plan | None:
    """The plan ``kind`` of :data:`PLANS` in bf16, compile-checked (raises PlanError / CaptureError
    to refuse); None for tp2 when the detector proposes no rules."""
    pp, dp, tp, dp_kind = PLANS[kind]
    batch = case.make_batch(0, BATCH)
    graph = captured(case.model, batch, loss_fn=case.loss_fn)
    rules = {}
    if tp > 1:
        rules = propose_tp_rules(graph.gm, tp=tp).rules
        if not rules:
            return None
    names = [layer.name for layer in graph.layers]
    per = max(1, len(names) // pp)
    stages = [Stage(layers=", ".join(names[i * per:(i + 1) * per if i < pp - 1 else None])) for i in range(pp)]
    plan = Plan(mesh=Mesh(pp=pp, dp=dp, tp=tp), schedule=Schedule(kind="gpipe", microbatches=1, global_batch=BATCH),
                stages=stages if pp > 1 else [], tensor_parallel=TensorParallel(rules=rules),
                data_parallel=DataParallel(kind=dp_kind, param_dtype="bf16"))
    checker_for(case.model, batch, loss_fn=case.loss_fn).check(plan)
    return plan


def _grad_error(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    """Relative L2 error of ``got`` over all of ``ref``'s tensors (inf if one is missing)."""
    num = sum(float((got[k].float() - v).pow(2).sum()) for k, v in ref.items() if k in got)
    den = sum(float(v.pow(2).sum()) for v in ref.values())
    missing = [k for k in ref if k not in got]
    return float("inf") if missing else (num / max(den, 1e-30)) ** 0.5


def sweep_model(name: str, plans: list[str], say=print) -> list[dict]:
    entry = models()[name]
    case = entry.build(SEED)
    rows, jobs = {}, []
    for i, kind in enumerate(plans):
        start = time.perf_counter()
        try:
            plan = bf16_plan(case, kind)
        except (PlanError, CaptureError) as e:
            rows[i] = dict(model=name, plan=kind, outcome="refused", detail=str(e))
        except Exception:  # noqa: BLE001 - the public API failing is a crash
            rows[i] = dict(model=name, plan=kind, outcome="CRASH", detail="while planning:\n" + traceback.format_exc())
        else:
            if plan is None:
                rows[i] = dict(model=name, plan=kind, outcome="n/a", detail="the TP detector proposes no rules")
            else:
                jobs.append(corpus_run._Job(i, name, kind, case, plan))
        if i in rows:
            rows[i]["seconds"] = round(time.perf_counter() - start, 1)
            say(f"{name} x {kind}: {rows[i]['outcome']}")
    if jobs:
        ref_losses, ref_grads, note = None, None, ""
        for buffers in (False, True):
            try:
                ref_losses, ref_grads = eager_bf16(entry, buffers=buffers)
                note = " (reference with bf16 buffers)" if buffers else ""
                break
            except Exception:  # noqa: BLE001 - the reference itself failed: the runs are reported, not judged
                no_ref = "the eager bf16 reference failed:\n" + traceback.format_exc()
        if ref_losses is None:
            say(f"{name}: no reference: {no_ref.strip().splitlines()[-1]}")
        else:
            fp32 = entry.build(SEED)
            floor = _grad_error(reference_step(fp32.model, fp32.make_batch(0, BATCH), fp32.loss_fn)[1], ref_grads)
        for size in sorted({j.plan.mesh.size for j in jobs}):
            group = [j for j in jobs if j.plan.mesh.size == size]
            records = corpus_run._launch_all(group, size, say)
            for job in group:
                rec = records[job.index]
                if isinstance(rec, str):
                    rows[job.index] = dict(model=name, plan=job.plan_kind, outcome="CRASH", detail=rec)
                    continue
                got = [float(x) for x in rec["losses"]]
                if ref_losses is None:
                    rows[job.index] = dict(model=name, plan=job.plan_kind, outcome="no reference",
                                           detail=f"trained: losses {got}\n{no_ref}")
                    say(f"{name} x {job.plan_kind}: trained {got}, no reference")
                    continue
                err = max(abs(a - b) / abs(b) for a, b in zip(got, ref_losses))
                gerr = _grad_error(ref_grads, {k: torch.as_tensor(v) for k, v in rec["grads"].items()})
                ok = err <= TOL and gerr <= max(GRAD_TOL, 2 * floor)
                rows[job.index] = dict(model=name, plan=job.plan_kind, outcome="exact" if ok else "DIFFERS",
                                       loss_error=err, grad_error=gerr, seconds=round(rec["seconds"], 1), note=note,
                                       bf16_floor=floor,
                                       detail=f"losses {got} vs eager bf16 {ref_losses}{note}")
                say(f"{name} x {job.plan_kind}: {rows[job.index]['outcome']} (loss {err:.1e}, grad {gerr:.1e})")
    return [rows[i] for i in sorted(rows)]


def cell(row: dict) -> str:
    out = row["outcome"]
    if out in ("exact", "DIFFERS"):
        floor = f", bf16 floor {row['bf16_floor']:.1e}" if row.get("bf16_floor", 0) > GRAD_TOL / 2 else ""
        return f"{out} (loss {row['loss_error']:.1e}, grad {row['grad_error']:.1e}{floor}){row.get('note', '')}"
    lines = [ln.strip() for ln in row["detail"].strip().splitlines() if ln.strip()]
    if out == "refused":  # the reason, without the boilerplate of where the compile check was
        text = corpus_run.Result(row["model"], row["plan"], "refused", detail=row["detail"]).reason()
        text = re.sub(r"^the .*? refused it for .*?: \w+Error: ", "", text)
        return "refused: " + text[:200].replace("|", "/")
    if out == "CRASH":
        return "CRASH: " + (lines[-1][:160].replace("|", "/") if lines else "")
    return out


def table(rows: list[dict]) -> str:
    kinds = list(dict.fromkeys(r["plan"] for r in rows))
    by = {(r["model"], r["plan"]): r for r in rows}
    out = ["| model | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    for name in dict.fromkeys(r["model"] for r in rows):
        out.append(f"| {name} | " + " | ".join(cell(by[(name, k)]) if (name, k) in by else "" for k in kinds) + " |")
    counts = {}
    for r in rows:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return "\n".join(out) + "\n\n" + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="comma-separated corpus names (default: all)")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--out", default=str(HERE / "bf16_results.jsonl"), help="JSON lines, appended per model")
    ap.add_argument("--table", help="only print the table of this JSON-lines file")
    args = ap.parse_args(argv)
    if args.table:
        rows = [json.loads(line) for line in Path(args.table).read_text().splitlines() if line.strip()]
        print(table(rows))
        return 0
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    names = args.models.split(",") if args.models else list(models())
    rows = []
    for name in names:
        got = sweep_model(name, args.plans.split(","))
        with open(args.out, "a") as f:
            for r in got:
                f.write(json.dumps(r) + "\n")
        rows += got
    print(table(rows))
    return 1 if any(r["outcome"] in ("DIFFERS", "CRASH") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
