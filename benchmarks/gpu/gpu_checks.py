"""What only a GPU can check: the NCCL runtime, bf16 plans and the classic modules' CUDA paths.

    python benchmarks/gpu/gpu_checks.py --out checks.json

One NCCL rank per visible GPU through ``fairscale.launch`` (so nothing here touches CUDA before the
fork). Every check compares with the same model trained in one CPU process in fp32 (TF32 off on
the GPU for the exact ones) and prints PASS or FAIL with the largest relative difference:

* ``parallelize-fp32``: ``fairscale.parallelize(..., dtype="fp32", tf32=False, check=True)`` on the
  GPU, a Llama-style model of ours (GQA, RMSNorm, rotary): losses of 4 steps against one CPU process.
* ``llama-bf16``: the planner's default dtype on the GPU for that model: bf16, whose code upcasts to
  float32 (Hugging Face's RMSNorm, rotary), traced by the ranks in bf16 (``planner.trace_dtype``):
  its first loss against fp32 within bf16's precision, and the loss falls.
* ``gpt-bf16``: our GPT (no float32 conversions), planned by default in bf16 (bf16 parameters, fp32
  master weights): its first loss against fp32 within bf16's precision, and the loss falls.
* ``offload``: ``fairscale.experimental.nn.OffloadModel`` computing on the GPU with its slices kept
  on the CPU (with and without activation checkpointing and microbatches) against the plain model.
* ``fsdp``: ``fairscale.nn.FullyShardedDataParallel`` on the GPU (world of one) against the plain model.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import fairscale
from fairscale.testing.models import build_gpt, build_llama
from fairscale.testing.reference import train_reference

STEPS, BATCH, LR = 4, 8, 1e-2


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _check_parallelize_fp32(ref: list[float]) -> dict[str, Any]:
    case = build_llama()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               dtype="fp32", tf32=False, check=True,
                               optimizer=functools.partial(torch.optim.Adam, lr=LR))
    losses = [pm.train_step(case.make_batch(i, BATCH)) for i in range(STEPS)]
    worst = _rel(losses, ref)
    pm.close()
    return {"ok": worst <= 1e-4, "worst_rel": worst, "losses": losses, "device": str(pm.device),
            "check": str(pm.check_report)[:2000] if pm.check_report is not None else None}


def _default_dtype(build: Callable[[], Any], ref: list[float], want: str, tol: float) -> dict[str, Any]:
    case = build()
    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, BATCH), loss_fn=case.loss_fn,
                               optimizer=functools.partial(torch.optim.Adam, lr=LR))
    losses = [pm.train_step(case.make_batch(i % 2, BATCH)) for i in range(3 * STEPS)]
    first = abs(losses[0] - ref[0]) / abs(ref[0])
    dtype = pm.plan.data_parallel.param_dtype
    notes = [n for n in pm.plan.predicted.notes if n.startswith("precision")]
    pm.close()
    return {"ok": dtype == want and first <= tol and losses[-1] < losses[0], "param_dtype": dtype,
            "first_rel": first, "notes": notes, "losses": losses}


def _seq() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def _classic_losses(model: nn.Module, device: torch.device, params: Callable[[], Any] | None = None) -> list[float]:
    opt = torch.optim.Adam(params() if params else model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(500 + step)
        x, y = torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
        opt.zero_grad(set_to_none=True)
        out = model(x.to(device))
        loss = nn.functional.cross_entropy(out, y.to(out.device))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _check_offload() -> dict[str, Any]:
    from fairscale.experimental.nn import OffloadModel

    ref = _classic_losses(_seq(), torch.device("cpu"))
    cases = {}
    for ckpt in (False, True):
        for micro in (1, 2):
            model = OffloadModel(_seq(), device=torch.device("cuda"), offload_device=torch.device("cpu"),
                                 num_slices=3, checkpoint_activation=ckpt, num_microbatches=micro)
            cases[f"checkpoint={ckpt},microbatches={micro}"] = _rel(_classic_losses(model, torch.device("cuda")), ref)
    return {"ok": max(cases.values()) <= 1e-5, "worst_rel": cases}


def _check_fsdp() -> dict[str, Any]:
    from fairscale.nn import FullyShardedDataParallel

    ref = _classic_losses(_seq(), torch.device("cpu"))
    model = FullyShardedDataParallel(_seq().cuda())
    worst = _rel(_classic_losses(model, torch.device("cuda")), ref)
    return {"ok": worst <= 1e-5, "worst_rel": worst}


def _rank(rank: int, world: int) -> dict[str, Any]:
    # the CPU reference runs here, not in the parent: a Hugging Face model's forward may ask CUDA for
    # its devices, and a parent that did cannot fork ranks that use CUDA (fairscale.launch refuses)
    ref = train_reference(build_llama, steps=STEPS, global_batch=BATCH, lr=LR).losses
    gpt_ref = train_reference(build_gpt, steps=1, global_batch=BATCH, lr=LR).losses
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # exact checks: no TF32 in the plain matmuls
    torch.backends.cudnn.conv.fp32_precision = torch.backends.cudnn.rnn.fp32_precision = "ieee"
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "parallelize-fp32": lambda: _check_parallelize_fp32(ref),
        "llama-bf16": lambda: _default_dtype(build_llama, ref, "bf16", 2e-2),
        "gpt-bf16": lambda: _default_dtype(build_gpt, gpt_ref, "bf16", 2e-2),
        "offload": _check_offload, "fsdp": _check_fsdp}
    results = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception as exc:  # a failed check is reported with its traceback; the others still run
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:3000],
                             "traceback": traceback.format_exc()[-4000:]}
        print(f"{'PASS' if results[name]['ok'] else 'FAIL'} {name}: "
              f"{ {k: v for k, v in results[name].items() if k not in ('traceback', 'losses', 'check', 'notes')} }",
              flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if torch.cuda.device_count() == 0:
        print("gpu_checks needs a GPU (torch.cuda.device_count() == 0)", file=sys.stderr)
        return 2
    (results,) = fairscale.launch(_rank, devices=1)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
