"""MoE plans: the expert-parallel degree the search chooses for two published MoE shapes.

Hugging Face ``Qwen2MoeForCausalLM`` and ``MixtralForCausalLM`` with their DEFAULT configs (which
are Qwen1.5-MoE-A2.7B, 60 experts top-4, and Mixtral-8x7B, 8 experts top-2), built on ``meta``,
planned through ``fairscale.search`` for 64 H100-SXM-80GB: free, then with ``mesh.ep`` fixed to 1
and to 4 (constraints), so the table says what expert parallelism buys under the cost model::

    python benchmarks/planner/moe_plans.py            # both models
    python benchmarks/planner/moe_plans.py --only qwen

Qwen at one 1024-token sample per GPU is where expert weight reads dominate (few tokens per
expert); Mixtral at four 4096-token samples per GPU is compute-bound in its experts.
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import fairscale
from fairscale.testing.corpus_hf import Labels

GPUS = 64
CLUSTER = "h100-sxm-80gb"
CASES = {  # name: (config class, model class, tokens per sample, samples per GPU)
    "qwen": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", 1024, 1),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", 4096, 4),
}


def build(config: str, model: str, seq: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    cfg = getattr(transformers, config)()  # the default config: the published shape
    with torch.device("meta"):
        net = Labels(getattr(transformers, model)(cfg), "input_ids")
    ids = torch.zeros(1, seq, dtype=torch.long, device="meta")
    return net, (ids, ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=sorted(CASES), help="plan one of the models")
    args = ap.parse_args()
    for name, (config, model_cls, seq, per_gpu) in CASES.items():
        if args.only and name != args.only:
            continue
        start = time.perf_counter()
        model, batch = build(config, model_cls, seq)
        found = {}
        for label, constraints in (("searched", None), ("ep=1", {"mesh": {"ep": 1}}), ("ep=4", {"mesh": {"ep": 4}})):
            result = fairscale.search(model, batch, cluster=CLUSTER, devices=GPUS, global_batch=GPUS * per_gpu,
                                      constraints=constraints, check_runners_up=False)
            found[label] = result.best
        took = time.perf_counter() - start
        print(f"{model_cls} (default {config}), {per_gpu} × {seq} tokens per GPU, {GPUS} × {CLUSTER} "
              f"({took:.1f} s to build, capture and plan the three):")
        for label, best in found.items():
            print(f"  {label:>8}: {best.summary()}")
        best = found["searched"].breakdown.step_time_s
        print("  step time against the searched plan: " + ", ".join(
            f"{label} {c.breakdown.step_time_s / best:.3f}×" for label, c in found.items() if label != "searched"))


if __name__ == "__main__":
    main()
