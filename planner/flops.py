"""FLOP formulas that FlopCounterMode lacks, so that every matmul-like op is counted.

Stock ``FlopCounterMode`` in torch 2.13 counts 0 for the CPU flash-attention kernels and for
``aten._grouped_mm`` (Hugging Face MoE experts), and cannot see inside opaque custom ops.
:func:`flop_formulas` adds them, using flop_counter's own ``sdpa_flop_count`` /
``sdpa_backward_flop_count`` (the formulas it applies to the CUDA flash kernels; like them, causal
masking is not discounted) and 2·M·K·N per group for grouped matmuls. Pass the table as
``custom_mapping`` to compare with a real run::

    FlopCounterMode(custom_mapping=flop_formulas())
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.flop_counter as fc

__all__ = ["flop_formulas", "register_flop_formula"]

aten = torch.ops.aten


def _sdpa_cpu_fwd(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(fc.sdpa_flop_count(q, k, v))


def _sdpa_cpu_bwd(grad_out: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(fc.sdpa_backward_flop_count(grad_out, q, k, v))


def _grouped_mm(a: Any, b: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """2·M·K·N summed over groups. With 2-D ``a`` and ``b`` the groups split K (a weight gradient):
    the output is [G, M, N] but K is shared out, so the total is 2·M·N·K_total."""
    k = a[-1]
    out = 1
    for s in out_shape:
        out *= s
    if len(a) == 2 and len(b) == 2:
        out //= out_shape[0]
    return 2 * out * k


def _grouped_mm_fallback(x: Any, w: Any, offs: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """transformers' opaque MoE op: x [S, K] @ w[e] [K, N] for the S rows routed to each expert."""
    return 2 * x[0] * x[1] * w[2]


def _grouped_mm_fallback_bwd(x: Any, w: Any, offs: Any, grad: Any, *args: Any, out_shape: Any = None,
                             **kwargs: Any) -> int:
    return 2 * _grouped_mm_fallback(x, w, offs)


_EXTRA: dict[Any, Callable[..., int]] = {}


def register_flop_formula(op: Any, formula: Callable[..., int]) -> None:
    """Count ``op`` (an OpOverloadPacket, e.g. a custom op that is opaque to FlopCounterMode) with
    ``formula(*arg_shapes, out_shape=..., **kwargs) -> int``. Without one, an opaque op counts 0."""
    _EXTRA[op] = formula


def flop_formulas() -> dict[Any, Callable[..., int]]:
    """``custom_mapping`` for FlopCounterMode: the ops torch 2.13 leaves at 0 FLOPs on CPU, the
    opaque MoE op of transformers, and whatever :func:`register_flop_formula` added."""
    table: dict[Any, Callable[..., int]] = {
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_fwd,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_bwd,
    }
    if hasattr(aten, "_grouped_mm"):
        table[aten._grouped_mm] = _grouped_mm
    ns = torch.ops.transformers
    if hasattr(ns, "grouped_mm_fallback"):
        table[ns.grouped_mm_fallback] = _grouped_mm_fallback
    if hasattr(ns, "grouped_mm_fallback_backward"):
        table[ns.grouped_mm_fallback_backward] = _grouped_mm_fallback_bwd
    table.update(_EXTRA)
    return table
