"""A Llama-shaped Hugging Face model in bf16 on this machine's GPU: predicted against measured.

    python -m fairscale calibrate                      # the GPU's rates, cached (first plan does it too)
    python benchmarks/gpu/bench_llama.py --width 2048 --layers 16 --out llama.json

Everything goes through the public entry points: ``fairscale.launch`` (NCCL, one rank per GPU),
``fairscale.parallelize(..., calibrate=K)`` (capture, the planner's default dtype for the detected
GPU, the closed loop that times K steps by term, refits and may switch the plan), then plain
``pm.train_step`` calls timed with the device synchronized, and ``pm.memory_report()`` after a step
run with ``measure_memory=True`` (the allocator's peak against the predicted total). In the same
rank, after ``pm.close()``, the same model in native PyTorch (``torch.autocast`` bf16, the fp32
model on the GPU, ``torch.optim.Adam``) gives the baseline step time. The model is
``transformers.LlamaForCausalLM`` with its default config apart from the sizes named here.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import fairscale
from fairscale.testing.corpus_hf import Labels
from fairscale.testing.models import Case, build_gpt
from planner.capture import LossModule

VOCAB = 32000


def build(args: argparse.Namespace) -> Case:
    """``--model llama``: ``transformers.LlamaForCausalLM``, its default config apart from the sizes;
    ``--model gpt``: our nanoGPT-shaped decoder (``fairscale.testing.models.GPT``) at the same sizes."""
    torch.manual_seed(0)
    if args.model == "gpt":
        return build_gpt(vocab=VOCAB, seq=args.seq, layers=args.layers, heads=args.width // 128, dim=args.width)
    from transformers import LlamaConfig, LlamaForCausalLM

    width = args.width
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=int(width * 8 / 3 / 256 + 0.999) * 256,
                      num_hidden_layers=args.layers, num_attention_heads=width // 128,
                      num_key_value_heads=width // 128, max_position_embeddings=args.seq)

    def tokens(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, VOCAB, (n, args.seq), generator=g)
        return ids, ids.clone()

    return Case("hf-llama", Labels(LlamaForCausalLM(cfg)), tokens, None)


def _timed_steps(step_fn: Any, steps: int, device: torch.device) -> list[float]:
    times = []
    for i in range(steps):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step_fn(i)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def train(rank: int, world: int, case: Case, args: argparse.Namespace) -> dict[str, Any]:
    result = parallel(case, args)  # its module is gone when it returns: the baseline gets the whole GPU
    gc.collect()
    torch.cuda.empty_cache()
    bf16 = result["plan"]["data_parallel"]["param_dtype"] == "bf16"
    result["native"] = native(case, args, torch.device("cuda", torch.cuda.current_device()), bf16=bf16)
    return result


def parallel(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    model, batch = case.model, (lambda step, n, _seq: case.make_batch(step, n))
    example = batch(0, args.batch, args.seq)
    t0 = time.perf_counter()
    pm = fairscale.parallelize(model, example_inputs=example, loss_fn=case.loss_fn, calibrate=args.calibrate_steps)
    build_s = time.perf_counter() - t0
    device = pm.device
    losses: list[float] = []
    for i in range(args.calibrate_steps + 1):  # the closed loop's warm-up and timed steps
        losses.append(pm.train_step(batch(i, args.batch, args.seq)))
    start = len(losses)
    times = _timed_steps(lambda i: losses.append(pm.train_step(batch(start + i, args.batch, args.seq))),
                         args.steps, device)
    torch.cuda.reset_peak_memory_stats(device)
    losses.append(pm.train_step(batch(len(losses), args.batch, args.seq), measure_memory=True))
    memory = pm.memory_report()
    plan = pm.plan
    loop = pm.closed_loop_report
    result = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
        "model": {"name": case.name, "width": args.width, "layers": args.layers, "seq": args.seq, "batch": args.batch,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "plan": plan.to_dict(), "build_s": build_s, "notes": list(plan.predicted.notes),
        "predicted_step_s": plan.predicted.step_time_s, "measured_step_s": statistics.median(times),
        "step_times_s": times, "losses": losses,
        "memory_table": memory.table(), "device_peak_bytes": memory.device_peak,
        "predicted_memory_bytes": memory.predicted_total,
        "closed_loop": loop.text() if loop is not None else None,
    }
    pm.close()
    return result


def native(case: Case, args: argparse.Namespace, device: torch.device, *, bf16: bool) -> dict[str, Any]:
    """The same model in plain PyTorch: fp32 weights and Adam on the GPU; bf16 autocast where the
    plan computes in bf16, else fp32 with TF32 (as the plan's runtime sets it)."""
    net = LossModule(case.model, case.loss_fn).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)

    def step(i: int) -> None:
        inputs = [t.to(device, non_blocking=True) for t in case.make_batch(i, args.batch)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = net(*inputs)
        loss.backward()
        opt.step()

    _timed_steps(step, 2, device)
    torch.cuda.reset_peak_memory_stats(device)
    times = _timed_steps(step, args.steps, device)
    return {"step_s": statistics.median(times), "step_times_s": times, "autocast_bf16": bf16,
            "peak_bytes": torch.cuda.max_memory_allocated(device)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("llama", "gpt"), default="llama")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the closed loop's")
    parser.add_argument("--calibrate-steps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if torch.cuda.device_count() == 0:
        print("bench_llama needs a GPU (torch.cuda.device_count() == 0)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    case = build(args)
    print(f"built the model in {time.perf_counter() - t0:.1f} s", flush=True)
    (result,) = fairscale.launch(train, devices=1, args=(case, args))
    ours, base = result["measured_step_s"], result["native"]["step_s"]
    print(result["closed_loop"] or "(no closed-loop report)")
    print(result["memory_table"])
    print("\n".join(result["notes"]))
    print(f"{result['device']}: {case.name} {args.width}x{args.layers} ({result['model']['parameters'] / 1e9:.2f} B "
          f"parameters), batch {args.batch}x{args.seq}, plan {result['plan']['data_parallel']['param_dtype']}")
    print(f"  step: predicted {result['predicted_step_s'] * 1e3:.1f} ms, measured {ours * 1e3:.1f} ms "
          f"({(result['predicted_step_s'] - ours) / ours:+.0%}); native PyTorch {base * 1e3:.1f} ms "
          f"(fairscale / native {ours / base:.2f})")
    peak, pred = result["device_peak_bytes"], result["predicted_memory_bytes"]
    if peak:
        print(f"  peak memory: predicted {pred / 2**30:.2f} GiB, measured {peak / 2**30:.2f} GiB "
              f"({(pred - peak) / peak:+.0%}); native {result['native']['peak_bytes'] / 2**30:.2f} GiB")
    print(f"  losses {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}; build {result['build_s']:.1f} s")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
