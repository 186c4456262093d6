"""Memory per rank: model states (parameters, gradients, Adam), activations, FSDP unshard buffers.

Units: bytes. ``params`` is a count of parameter elements held by the rank before data-parallel
sharding (tensor parallelism already applied).

Source for model states: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", §3.1 (mixed-precision Adam holds 2Ψ fp16 parameters + 2Ψ fp16
gradients + KΨ optimizer states with K = 12: fp32 master copy, momentum, variance) and §5.1-5.3
(stage 1 shards the K part over the data-parallel degree, stage 2 also the gradients, stage 3 =
FSDP also the parameters).
"""

from __future__ import annotations

__all__ = ["DTYPE_BYTES", "model_state_bytes", "activation_bytes", "unshard_buffer_bytes"]

DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "float32": 4, "bfloat16": 2, "float16": 2}


def model_state_bytes(params: float, *, dp_kind: str, dp: int, param_dtype: str = "fp32",
                      optimizer: str = "adam") -> float:
    """Bytes of parameters + gradients + optimizer states one rank keeps between steps.

    Per parameter element (ZeRO §3.1): parameters ``P`` = bytes of ``param_dtype``, gradients
    ``G`` = the same, optimizer ``K`` = 8 for Adam in fp32 (momentum + variance; the parameter is
    its own master copy) or 12 with a lower-precision ``param_dtype`` (fp32 master + momentum +
    variance); SGD with momentum has K = 4 (+4 master). Sharding over ``dp`` (ZeRO §5):
    ddp ``P+G+K``, zero1 ``P+G+K/dp``, zero2 ``P+(G+K)/dp``, fsdp ``(P+G+K)/dp``.
    Example: 1e9 parameters, bf16, ddp: 1e9·(2+2+12) = 16e9 bytes.
    """
    p = DTYPE_BYTES[param_dtype]
    g = p
    if optimizer == "adam":
        k = 8 if p == 4 else 12
    elif optimizer == "sgd":
        k = 4 if p == 4 else 8
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; the cost model knows adam and sgd")
    per: float
    if dp_kind == "ddp":
        per = p + g + k
    elif dp_kind == "zero1":
        per = p + g + k / dp
    elif dp_kind == "zero2":
        per = p + (g + k) / dp
    elif dp_kind == "fsdp":
        per = (p + g + k) / dp
    else:
        raise ValueError(f"unknown data-parallel kind {dp_kind!r}; use ddp, zero1, zero2 or fsdp")
    return params * per


def activation_bytes(saved_per_microbatch: float, in_flight: float) -> float:
    """Activations held at the peak: bytes saved for backward by one microbatch × microbatches in
    flight for the schedule (``planner.schedule_cost.in_flight``)."""
    return saved_per_microbatch * in_flight


def unshard_buffer_bytes(unit_params: list[float], *, param_dtype: str, reshard_after_forward: bool,
                         prefetch: bool) -> float:
    """Peak bytes of gathered (unsharded) FSDP parameters plus their unsharded gradients.

    With ``reshard_after_forward`` a unit's full parameters live only while it runs: the peak is
    the largest unit, plus the next one when prefetching, plus one unit of full gradients waiting
    for its reduce-scatter (FSDP paper, Zhao et al. 2023, §3.2-3.3). Without it every unit stays
    gathered from its forward to its backward, so the peak is all units' parameters plus one
    unit's gradients. ``unit_params`` are element counts; result in bytes of ``param_dtype``.
    """
    if not unit_params:
        return 0.0
    b = DTYPE_BYTES[param_dtype]
    largest = sorted(unit_params, reverse=True)
    if reshard_after_forward:
        gathered = largest[0] + (largest[1] if prefetch and len(largest) > 1 else 0.0)
    else:
        gathered = sum(unit_params)
    return (gathered + largest[0]) * b
