"""An analytic Megatron-GPT :class:`ModelGraph` for planner tests and benchmarks (no tracing).

It has the layer names of ``fairscale.testing.models.GPT`` (``wte``, ``wpe``, ``layers.N`` with
``attn.{q,k,v,o}_proj`` and ``mlp.{up,down}_proj``, ``ln_f``, ``lm_head`` tied to ``wte``) and the
per-layer facts that capture would annotate, written from closed forms:

* FLOPs (Narayanan et al. 2021, §5.1 / Appendix): a block's forward is ``24·b·s·h² + 4·b·s²·h``,
  the LM head's ``2·b·s·h·V``; backward is twice the forward. With full recompute this gives the
  paper's ``F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` per step (:func:`megatron_flops`).
* Saved activations (Korthikanti et al. 2022, Eq. 1, fp16 bytes, no tensor parallelism): a block
  saves ``s·b·h·34 + 5·a·s²·b``; the head keeps its input and the logits.
* Attention is unfused, as in Megatron-LM 2021: the scores ``QKᵀ`` and ``PV`` are batched matmuls
  of ``4·b·s²·h`` FLOPs forward that read Q, K, V and write the output (``4·s·b·h`` values) and
  write then read the ``a·s²·b`` scores (``extra["attention_bmm"]``: FLOPs, fp32 bytes).
* Selective recompute caches the outputs of the block's matmuls and attention
  (``planner.cost_memory.selective_output_bytes``): q, k, v, o (4·sbh elements), MLP up (4·sbh)
  and down (sbh), attention output (sbh): 10·sbh elements, plus the attention log-sum-exp
  (a·s·b fp32). Written to ``extra["selective_bytes"]`` since the graph module is empty.

Byte facts are in fp32 (``itemsize`` 4), like a capture of an fp32 model on ``meta``; the cost
model rescales them to the compute dtype. The graph module is empty: this object only feeds the
planner, never the passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from planner.graph import Layer, ModelGraph
from planner.plan import DataParallel, Mesh, Plan, Schedule, Stage, TensorParallel
from planner.selectors import format_layers

__all__ = ["gpt_graph", "megatron_flops", "MegatronRun", "TABLE1", "megatron_plan"]

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
    bmm = {f"layers.{i}": (4 * b * s * s * h, (4 * sbh + 2 * a * s * s * b) * _FP32) for i in range(layers)}
    selective["lm_head"] = s * b * v * _FP32
    num = v * h + s * h + layers * block_params + 2 * h
    gm = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    return ModelGraph(gm=gm, layers=out, model_class="GPT", fingerprint=f"gpt-analytic-{layers}x{hidden}x{heads}",
                      num_parameters=num, param_shapes=shapes, param_dtypes={k: "float32" for k in shapes},
                      modules=modules, blocks=blocks, tied=[["wte.weight", "lm_head.weight"]], batch_size=batch,
                      tracer="analytic", extra={"seq": seq, "vocab": vocab, "selective_bytes": selective,
                                                "attention_bmm": bmm})


# --- Narayanan et al. 2021, Table 1, with the settings each run used ----------------------------


@dataclass(frozen=True, kw_only=True)
class MegatronRun:
    """One row of Table 1 of Narayanan et al. 2021 (GPT, sequence 2048, vocabulary 51200, A100-80GB,
    fp16 with loss scaling, full activation recompute) and the settings its script passed to
    Megatron-LM: ``examples/sc21/run_table_1.sh`` and ``CONFIG.sh`` in NVIDIA/Megatron-LM (the paper's
    own scripts; ``--micro-batch-size``, ``--num-layers-per-virtual-pipeline-stage``, ``--DDP-impl``,
    ``--fp16``, ``--recompute-method uniform``)."""

    name: str
    """Model size as the table prints it (billions of parameters)."""
    layers: int
    hidden: int
    heads: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    published_tflops: float
    """Achieved teraFLOP/s per GPU, counted with :func:`megatron_flops`."""
    micro_batch: int
    """Samples per microbatch (``--micro-batch-size``)."""
    layers_per_chunk: int = 0
    """``--num-layers-per-virtual-pipeline-stage`` (0: no interleaving, plain 1F1B)."""
    torch_ddp: bool = False
    """``--DDP-impl torch`` (bucketed all-reduce during the backward) rather than ``local`` (one
    all-reduce of the gradient buffer after the rank's last backward)."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (virtual stages)."""
        return self.layers // (self.pp * self.layers_per_chunk) if self.layers_per_chunk else 1

    def published_step_s(self, *, seq: int = 2048, vocab: int = 51200) -> float:
        """The step time the published TFLOP/s imply: ``F / (TFLOP/s · GPUs)`` (eq. 3)."""
        flops = megatron_flops(batch=self.global_batch, seq=seq, layers=self.layers, hidden=self.hidden, vocab=vocab)
        return flops / (self.published_tflops * 1e12 * self.gpus)

    def graph(self, *, seq: int = 2048, vocab: int = 51200) -> ModelGraph:
        return gpt_graph(layers=self.layers, hidden=self.hidden, heads=self.heads, seq=seq, vocab=vocab)


TABLE1 = (
    MegatronRun(name="1.7", layers=24, hidden=2304, heads=24, tp=1, pp=1, gpus=32, global_batch=512,
                published_tflops=137, micro_batch=16, torch_ddp=True),
    MegatronRun(name="3.6", layers=30, hidden=3072, heads=32, tp=2, pp=1, gpus=64, global_batch=512,
                published_tflops=138, micro_batch=16, torch_ddp=True),
    MegatronRun(name="7.5", layers=36, hidden=4096, heads=32, tp=4, pp=1, gpus=128, global_batch=512,
                published_tflops=142, micro_batch=16, torch_ddp=True),
    MegatronRun(name="18.4", layers=40, hidden=6144, heads=48, tp=8, pp=1, gpus=256, global_batch=1024,
                published_tflops=135, micro_batch=8, torch_ddp=True),
    MegatronRun(name="39.1", layers=48, hidden=8192, heads=64, tp=8, pp=2, gpus=512, global_batch=1536,
                published_tflops=138, micro_batch=4),
    MegatronRun(name="76.1", layers=60, hidden=10240, heads=80, tp=8, pp=4, gpus=1024, global_batch=1792,
                published_tflops=140, micro_batch=2, layers_per_chunk=5),
    MegatronRun(name="145.6", layers=80, hidden=12288, heads=96, tp=8, pp=8, gpus=1536, global_batch=2304,
                published_tflops=148, micro_batch=2, layers_per_chunk=5),
    MegatronRun(name="310.1", layers=96, hidden=16384, heads=128, tp=8, pp=16, gpus=1920, global_batch=2160,
                published_tflops=155, micro_batch=1, layers_per_chunk=3),
    MegatronRun(name="529.6", layers=105, hidden=20480, heads=128, tp=8, pp=35, gpus=2520, global_batch=2520,
                published_tflops=163, micro_batch=1, layers_per_chunk=1),
    MegatronRun(name="1008.0", layers=128, hidden=25600, heads=160, tp=8, pp=64, gpus=3072, global_batch=3072,
                published_tflops=163, micro_batch=1),
)
"""The ten rows, in the table's order."""


def megatron_plan(run: MegatronRun, graph: ModelGraph, tp_rules: dict[str, str]) -> Plan:
    """The plan ``run`` trained with, spelled as a fairscale plan: its mesh, 1F1B or interleaved
    with its chunks, its microbatches, ``layers_per_chunk`` blocks per stage with the embeddings on
    the first stage and the final norm and head on the last (Megatron-LM's layout), every block
    recomputed, fp16 DDP (one gradient buffer for ``local``, 25 MiB buckets for ``torch``)."""
    stages, per = run.pp * run.chunks, run.layers // (run.pp * run.chunks)
    names = [layer.name for layer in graph.layers]
    first = names.index("layers.0")
    cuts = [0] + [first + per * k for k in range(1, stages)] + [len(names)]
    return Plan(mesh=Mesh(pp=run.pp, dp=run.dp, tp=run.tp),
                schedule=Schedule(kind="interleaved" if run.chunks > 1 else "1f1b", microbatches=run.microbatches,
                                  virtual_stages=run.chunks, global_batch=run.global_batch),
                stages=[Stage(layers=format_layers(names[a:b])) for a, b in zip(cuts, cuts[1:])] if stages > 1 else [],
                tensor_parallel=TensorParallel(rules=dict(tp_rules) if run.tp > 1 else {}),
                data_parallel=DataParallel(kind="ddp", param_dtype="fp16", reduce_dtype="fp16",
                                           bucket_mb=25.0 if run.torch_ddp else float(2**20)),
                recompute={"layers.*": "full"})
