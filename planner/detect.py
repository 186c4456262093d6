"""Detect the cluster this process runs on, without creating a CUDA context.

Usage::

    from planner.cluster import Cluster
    cluster = Cluster.detect()          # planner.cluster.detect_cluster, with the probes below

A CUDA context created before ranks are forked breaks every rank ("Cannot re-initialize CUDA in
forked subprocess"), and one created before ``torch.cuda.set_device`` puts every rank on ``cuda:0``.
So detection asks, in order:

1. ``torch.cuda.device_count()``: how many GPUs are visible. It asks NVML, not CUDA (PyTorch's
   own note: it does not poison fork when NVML answers; ``torch.cuda.is_available()`` does, it calls
   ``cudaGetDeviceCount``).
2. NVML through ``pynvml`` (the optional ``nvidia-ml-py`` package, ``pip install fairscale[gpu]``):
   the device name, its memory, and its active NVLink links. NVML never creates a CUDA context.
3. Without NVML: ``torch.cuda`` itself if this process already initialized CUDA (nothing left to
   protect), else a short-lived child process that asks ``torch.cuda.get_device_properties`` and
   exits, so this process stays clean. NVLink is then unknown and the model's usual fabric is
   assumed, with a warning.

The device name picks a row of :data:`planner.gpus.GPU_MODELS`; an unknown name is named as unknown
(``device="unknown: <name>"``) and planned with conservative numbers, with a warning: never
silently as another GPU. Nodes come from the launcher's ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``
(torchrun sets both): ``nodes = WORLD_SIZE / LOCAL_WORLD_SIZE``, ``devices_per_node =
LOCAL_WORLD_SIZE``; outside a launcher, one node with every visible GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from planner.gpus import GpuModel

__all__ = ["GpuInfo", "probe_gpu", "probe_nvml", "probe_torch", "node_shape", "intra_node_link", "INTER_NODE"]


@dataclass(frozen=True)
class GpuInfo:
    """What the driver says about the first visible GPU."""

    name: str
    memory_bytes: int | None = None
    """Total memory; None when it could not be read without a CUDA context."""
    nvlink_links: int | None = None
    """Active NVLink links; None when unknown (no NVML)."""
    source: str = "nvml"
    """Who answered: ``nvml``, ``torch`` (CUDA already initialized here) or ``subprocess``."""


def _first_visible_nvml_handle(pynvml: Any) -> Any:
    """NVML numbers every GPU of the machine; CUDA numbers the visible ones. Map CUDA device 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.startswith("GPU-"):
        return pynvml.nvmlDeviceGetHandleByUUID(visible)
    if visible.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(visible))
    return pynvml.nvmlDeviceGetHandleByIndex(0)


def probe_nvml() -> GpuInfo | None:
    """Name, memory and active NVLink links of the first visible GPU from NVML; None without
    ``pynvml`` or a working driver."""
    try:
        import pynvml  # nvidia-ml-py: the optional [gpu] extra
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: NVML cannot answer
        return None
    try:
        handle = _first_visible_nvml_handle(pynvml)
        name = pynvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        memory = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        links = 0
        for link in range(int(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                    links += 1
            except Exception:  # noqa: BLE001 - NotSupported past the last link, or no NVLink at all
                break
        return GpuInfo(name=name, memory_bytes=memory, nvlink_links=links, source="nvml")
    except Exception:  # noqa: BLE001 - a partial NVML (MIG, old driver): fall back
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


_CHILD = ("import json, torch; p = torch.cuda.get_device_properties(0); "
          "print(json.dumps([p.name, int(p.total_memory)]))")


def probe_torch() -> GpuInfo | None:
    """Name and memory from ``torch.cuda``: directly if this process already initialized CUDA,
    else from a child process (this one must stay free of a CUDA context)."""
    import torch  # local: the planner needs torch only to detect

    if torch.cuda.is_initialized():
        props = torch.cuda.get_device_properties(0)
        return GpuInfo(name=str(props.name), memory_bytes=int(props.total_memory), source="torch")
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True)
        name, memory = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None
    return GpuInfo(name=str(name), memory_bytes=int(memory), source="subprocess")


def probe_gpu() -> GpuInfo | None:
    """The first visible GPU (NVML, else torch as described in the module docstring); None if neither answers."""
    return probe_nvml() or probe_torch()


def node_shape(gpus: int, environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(nodes, devices per node) from the launcher's environment (see the module docstring)."""
    env = os.environ if environ is None else environ
    world = int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else None
    local = int(env["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in env else None
    if local is None:
        if world is None or world <= gpus:
            return 1, world or gpus
        local = gpus
    if world is None:
        return 1, local
    if local < 1 or world % local:
        raise ValueError(f"WORLD_SIZE={world} is not a whole number of nodes of LOCAL_WORLD_SIZE={local} ranks; "
                         "every node must run the same number of ranks")
    return world // local, local


def intra_node_link(model: GpuModel, info: GpuInfo, per_node: int) -> tuple[float, str | None]:
    """(bytes/s per GPU per direction between a node's GPUs, a note when it is assumed or
    surprising). NVLink through NVSwitch counts when NVML sees active links, or when NVML cannot
    be asked (the model's usual board); NVLink bridges count only when they join the whole node's
    group (pairs: two GPUs per node); everything else crosses PCIe."""
    pcie = model.host_bandwidth  # GPU to GPU without NVLink goes over the same PCIe link
    links = info.nvlink_links
    if model.fabric == "nvswitch":
        if links is None:
            return model.nvlink_bandwidth, (f"{info.name}: NVLink {model.nvlink_gen} through NVSwitch assumed (the "
                                            "usual board for this model); install nvidia-ml-py (pip install "
                                            "fairscale[gpu]) to check it")
        if links == 0:
            return pcie, f"{info.name}: NVML reports no active NVLink; planning with PCIe between GPUs"
        return model.nvlink_bandwidth, None
    if model.fabric == "bridge":
        if links is None:
            return pcie, (f"{info.name}: PCIe between GPUs assumed (NVLink bridges are optional on this model); "
                          "install nvidia-ml-py (pip install fairscale[gpu]) to detect them")
        if links > 0 and per_node <= model.bridge_group:
            return model.nvlink_bandwidth, None
        if links > 0:
            return pcie, (f"{info.name}: NVLink bridges join groups of {model.bridge_group} GPUs; a node of "
                          f"{per_node} is planned with PCIe between GPUs")
    return pcie, None


INTER_NODE = 50e9
"""Bytes/s per GPU per direction between nodes when nothing better is known: one 400 Gb/s NIC per
GPU (DGX H100/H200/B200: 8 ConnectX-7 NDR per node)."""
