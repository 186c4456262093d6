"""An analytic Megatron-GPT :class:`ModelGraph` for planner tests and benchmarks (no tracing).

It has the layer names of ``fairscale.testing.models.GPT`` (``wte``, ``wpe``, ``layers.N`` with
``attn.{q,k,v,o}_proj`` and ``mlp.{up,down}_proj``, ``ln_f``, ``lm_head`` tied to ``wte``) and the
per-layer facts that capture would annotate, written from closed forms:

* FLOPs (Narayanan et al. 2021, §5.1 / Appendix): a block's forward is ``24·b·s·h² + 4·b·s²·h``,
  the LM head's ``2·b·s·h·V``; backward is twice the forward. With full recompute this gives the
  paper's ``F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` per step (:func:`megatron_flops`).
* Saved activations (Korthikanti et al. 2022, Eq. 1, fp16 bytes, no tensor parallelism): a block
  saves ``s·b·h·34 + 5·a·s²·b``; the head keeps its input and the logits.
* Selective recompute caches the outputs of the block's matmuls and attention
  (``planner.cost_memory.selective_output_bytes``): q, k, v, o (4·sbh elements), MLP up (4·sbh)
  and down (sbh), attention output (sbh): 10·sbh elements, plus the attention log-sum-exp
  (a·s·b fp32). Written to ``extra["selective_bytes"]`` since the graph module is empty.

Byte facts are in fp32 (``itemsize`` 4), like a capture of an fp32 model on ``meta``; the cost
model rescales them to the compute dtype. The graph module is empty: this object only feeds the
planner, never the passes.
"""

from __future__ import annotations

import torch
import torch.fx

from planner.graph import Layer, ModelGraph

__all__ = ["gpt_graph", "megatron_flops"]

_FP32 = 4


def megatron_flops(*, batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs per step as Narayanan et al. 2021 count them (full recompute included):
    ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))``."""
    return 96.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def gpt_graph(*, layers: int, hidden: int, heads: int, seq: int, vocab: int, batch: int = 1) -> ModelGraph:
    """A GPT with tied embeddings and the given shape, captured (analytically) at ``batch`` samples."""
    b, s, h, a, v = batch, seq, hidden, heads, vocab
    sbh = s * b * h
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (v, h), "wpe.weight": (s, h)}
    modules: dict[str, str] = {"": "GPT", "wte": "Embedding", "wpe": "Embedding", "layers": "ModuleList",
                               "ln_f": "LayerNorm", "lm_head": "Linear"}
    out: list[Layer] = [
        Layer(name="wte", index=0, params=["wte.weight"], param_count=v * h, param_bytes=v * h * _FP32,
              saved_bytes=s * b * 8, input_bytes=s * b * 8, output_bytes=sbh * _FP32),
        Layer(name="wpe", index=1, params=["wpe.weight"], param_count=s * h, param_bytes=s * h * _FP32,
              saved_bytes=0, input_bytes=sbh * _FP32, output_bytes=sbh * _FP32),
    ]
    block_params = 12 * h * h + 13 * h
    for i in range(layers):
        p = f"layers.{i}"
        modules.update({p: "Block", f"{p}.ln_1": "LayerNorm", f"{p}.attn": "Attention", f"{p}.ln_2": "LayerNorm",
                        f"{p}.mlp": "MLP"})
        names = []
        for sub, shape in (("attn.q_proj", (h, h)), ("attn.k_proj", (h, h)), ("attn.v_proj", (h, h)),
                           ("attn.o_proj", (h, h)), ("mlp.up_proj", (4 * h, h)), ("mlp.down_proj", (h, 4 * h))):
            modules[f"{p}.{sub}"] = "Linear"
            shapes[f"{p}.{sub}.weight"] = shape
            shapes[f"{p}.{sub}.bias"] = (shape[0],)
            names += [f"{p}.{sub}.weight", f"{p}.{sub}.bias"]
        for ln in ("ln_1", "ln_2"):
            shapes[f"{p}.{ln}.weight"] = (h,)
            shapes[f"{p}.{ln}.bias"] = (h,)
            names += [f"{p}.{ln}.weight", f"{p}.{ln}.bias"]
        fwd = 24 * b * s * h * h + 4 * b * s * s * h
        out.append(Layer(name=p, index=len(out), block="layers.*", params=names, param_count=block_params,
                         param_bytes=block_params * _FP32, flops_fwd=fwd, flops_bwd=2 * fwd,
                         saved_bytes=2 * (34 * sbh + 5 * a * s * s * b), input_bytes=sbh * _FP32,
                         output_bytes=sbh * _FP32, attention={"heads": a, "kv_heads": a, "head_dim": h // a}))
    shapes["ln_f.weight"] = (h,)
    shapes["ln_f.bias"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    out.append(Layer(name="ln_f", index=len(out), params=["ln_f.weight", "ln_f.bias"], param_count=2 * h,
                     param_bytes=2 * h * _FP32, saved_bytes=sbh * _FP32, input_bytes=sbh * _FP32,
                     output_bytes=sbh * _FP32))
    head = 2 * b * s * h * v
    out.append(Layer(name="lm_head", index=len(out), params=["wte.weight"], param_count=0, param_bytes=0,
                     flops_fwd=head, flops_bwd=2 * head, saved_bytes=(sbh + s * b * v) * _FP32,
                     input_bytes=sbh * _FP32, output_bytes=_FP32))
    blocks = {"layers.*": [f"layers.{i}" for i in range(layers)]}
    selective = {f"layers.{i}": 10 * sbh * _FP32 + a * s * b * 4 for i in range(layers)}
    selective["lm_head"] = s * b * v * _FP32
    num = v * h + s * h + layers * block_params + 2 * h
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    return ModelGraph(gm=gm, layers=out, model_class="GPT", fingerprint=f"gpt-analytic-{layers}x{hidden}x{heads}",
                      num_parameters=num, param_shapes=shapes, param_dtypes={k: "float32" for k in shapes},
                      modules=modules, blocks=blocks, tied=[["wte.weight", "lm_head.weight"]], batch_size=batch,
                      tracer="analytic", extra={"seq": seq, "vocab": vocab, "selective_bytes": selective})
