"""Which device a rank computes on, chosen before anything touches CUDA.

Usage (``fairscale.parallelize`` does this on every rank)::

    device = resolve_device(None)        # cuda:LOCAL_RANK under NCCL / when CUDA is present, else cpu
    use_device(device)                   # torch.cuda.set_device, before any CUDA context exists
    enable_tf32(device)                  # fp32 matmuls and convolutions in TF32 on NVIDIA GPUs

Rules (each error names the ``device=`` argument and what to do):

* ``device=None`` follows the process group: NCCL means ``cuda:LOCAL_RANK``; gloo means ``cpu``.
  Without a process group (planning in one process) it is ``cuda:LOCAL_RANK`` when a GPU is
  visible, else ``cpu``. ``LOCAL_RANK`` (set by torchrun and by ``fairscale.launch``) picks the
  GPU, never the global rank: rank 9 of a 2 × 8 job is ``cuda:1`` on its node.
* ``device="cpu"`` with NCCL is refused (NCCL moves CUDA tensors only); ``device="cuda..."``
  without a visible GPU is refused; so is a CUDA device with gloo, which lacks CUDA
  reduce-scatter and all-to-all (launch with NCCL instead).
* Nothing here initializes CUDA: GPUs are counted with ``torch.cuda.device_count()``, which asks
  NVML and leaves no CUDA context (unlike ``torch.cuda.is_available()``, which calls
  ``cudaGetDeviceCount`` and so ``cuInit``: a process that did that cannot fork working ranks).

TF32 (``enable_tf32``): on Ampere and later GPUs, fp32 matmuls and convolutions run on tensor
cores with a 10-bit mantissa (NVIDIA, "TensorFloat-32 in the A100 GPU", 2020; PyTorch's CUDA
semantics notes), ~8x the IEEE fp32 rate. It is what the cost model's ``tf32`` peak assumes for
fp32 plans. It changes fp32 results at the 1e-3 relative level, so ``parallelize(..., tf32=False)``
keeps IEEE fp32 (compare against an eager run with the same setting). An explicit user choice
(``torch.backends.cuda.matmul.fp32_precision = "ieee"``) is never overridden.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["resolve_device", "use_device", "enable_tf32", "local_rank", "cuda_count", "to_device", "collective_device",
           "resolve_device_for_backend"]


def cuda_count() -> int:
    """Visible CUDA devices, counted without creating a CUDA context (NVML when it answers)."""
    return torch.cuda.device_count()


def local_rank() -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (torchrun, ``fairscale.launch``), else 0."""
    value = os.environ.get("LOCAL_RANK", "0")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={value!r} is not an integer; it is set by torchrun or fairscale.launch") from None


def _backend() -> str | None:
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def resolve_device(device: str | torch.device | int | None = None) -> torch.device:
    """The device this rank computes on (see the module docstring for the rules). Raises
    ``ValueError`` naming ``device=`` for a device the process group or the machine cannot use."""
    backend = _backend()
    count = cuda_count()
    if device is None:
        want_cuda = backend == "nccl" or (backend is None and count > 0)
        if not want_cuda:
            return torch.device("cpu")
        if count == 0:
            raise ValueError("the process group uses NCCL but no CUDA device is visible; launch with "
                             "backend='gloo' for CPU ranks, or pass device= explicitly")
        return _cuda(local_rank(), count, "LOCAL_RANK")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device; pass 'cpu', 'cuda' or 'cuda:N'") from exc
    if dev.type == "cpu":
        if backend == "nccl":
            raise ValueError(f"device={device!r} but the process group uses NCCL, which only moves CUDA tensors; "
                             "pass device='cuda' (cuda:LOCAL_RANK) or launch with backend='gloo'")
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device={device!r}: the runtime runs on 'cpu' or 'cuda[:N]', not {dev.type!r}")
    if count == 0:
        raise ValueError(f"device={device!r} but no CUDA device is visible (torch.cuda.device_count() == 0); "
                         "pass device='cpu' or leave device unset")
    if backend == "gloo":
        raise ValueError(f"device={device!r} with the gloo backend: gloo has no CUDA reduce-scatter or "
                         "all-to-all; launch with backend='nccl' (the default when CUDA is present) or pass "
                         "device='cpu'")
    if dev.index is None:
        return _cuda(local_rank(), count, "LOCAL_RANK")
    return _cuda(dev.index, count, f"device={device!r}")


def _cuda(index: int, count: int, what: str) -> torch.device:
    if not 0 <= index < count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise ValueError(f"{what} asks for cuda:{index}, but this node has {count} visible CUDA device(s){seen}; "
                         f"launch at most {count} ranks per node (torchrun --nproc_per_node {count}) or pass device=")
    return torch.device("cuda", index)


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (no-op on CPU). Call it before anything
    creates a CUDA context, so the context and NCCL's buffers land on this rank's own GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def enable_tf32(device: torch.device) -> bool:
    """Run fp32 matmuls and convolutions in TF32 on ``device`` if it is a CUDA device and the user
    has not chosen a precision; returns whether TF32 is on. CPU devices are left alone."""
    if device.type != "cuda":
        return False
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    try:
        if matmul.fp32_precision == "none":  # "none": nobody chose; "ieee"/"tf32": a choice we keep
            matmul.fp32_precision = "tf32"
        if conv.fp32_precision == "none":
            conv.fp32_precision = "tf32"
        return matmul.fp32_precision == "tf32"
    except RuntimeError:  # the user set the legacy allow_tf32 flags: theirs is the choice
        return bool(torch.backends.cuda.matmul.allow_tf32)


def to_device(batch: tuple[object, ...], device: torch.device) -> tuple[object, ...]:
    """Every tensor of ``batch`` on ``device``, copied without blocking the host (an asynchronous
    copy from pinned memory; from pageable memory the copy is staged, still in stream order)."""
    return tuple(t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) and t.device != device else t
                 for t in batch)


def collective_device() -> torch.device:
    """Where the default process group's collectives take their tensors: this process's current
    GPU under NCCL, else the CPU."""
    if _backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device_for_backend(backend: str) -> torch.device:
    """The device a process about to create a ``backend`` process group should make current:
    ``cuda:LOCAL_RANK`` for NCCL (checked against the visible GPUs), ``cpu`` otherwise."""
    if backend != "nccl":
        return torch.device("cpu")
    count = cuda_count()
    if count == 0:
        raise ValueError("backend='nccl' but no CUDA device is visible; launch with backend='gloo' for CPU ranks")
    return _cuda(local_rank(), count, "LOCAL_RANK")
