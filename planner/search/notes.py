"""What a plan's reader should know, in words: the precision it trains in, the devices it leaves
idle and why, a pipeline with fewer microbatches than stages and why. They go to
``Breakdown.notes`` and ``Plan.predicted.notes``; the report prints them."""

from __future__ import annotations

from planner.search.config import Breakdown, Context

__all__ = ["plan_notes", "precision_note"]


def precision_note(param_dtype: str, reduce_dtype: str) -> str:
    """One line on the training precision of a plan."""
    if param_dtype == "fp32":
        return f"precision: fp32 throughout (parameters, activations, Adam states), gradients reduced in {reduce_dtype}"
    scaling = " (needs loss scaling: fp16 gradients underflow without it)" if param_dtype == "fp16" else ""
    return (f"precision: mixed, {param_dtype} compute{scaling}: {param_dtype} parameters and activations, fp32 master "
            f"weights and Adam states, gradients reduced in {reduce_dtype}")


def plan_notes(ctx: Context, b: Breakdown, *, idle_reason: str = "") -> list[str]:
    """The notes of a costed configuration (see the module docstring)."""
    cfg = b.config
    assert cfg is not None
    out = [precision_note(cfg.param_dtype, cfg.reduce_dtype)]
    n = ctx.cluster.devices
    if b.devices < n:
        out.append(f"using {b.devices} of {n} devices; more would be slower: {idle_reason}")
    if cfg.pp > 1 and cfg.microbatches < cfg.pp:
        per = ctx.global_batch // cfg.dp
        out.append(f"{cfg.microbatches} microbatch{'es' if cfg.microbatches > 1 else ''} for pp={cfg.pp} stages: "
                   f"the pipeline is never full (GPipe); no plan with at least as many microbatches as stages "
                   f"was found: none fits, or the batch gives each replica too few samples (here {per} of the "
                   f"global batch {ctx.global_batch})")
    return out
