"""FSDP bookkeeping that is not forward/backward: ownership, buffers, metadata, consolidation and
clipping (the optimizer state's full layout is :mod:`fairscale.nn.data_parallel.fsdp_optim`).

Naming: a *clean* key is the unwrapped module's state_dict key (FSDP/FPW wrapper levels removed);
a *raw local* key is the module tree's own key of a shard (wrapper levels kept, e.g.
``layers.0._fsdp_wrapped_module.flat_param_0``); ``local_state_dict()`` shows it cleaned
(``layers.0.flat_param_0``), as FairScale 0.4.13 did.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch
from torch import nn

import torch.distributed as dist

from fairscale.nn.misc.flatten_params_wrapper import clean_key
from passes.ops import comm
from passes.layout import FlatShard

# the wrapper class is not imported here (it imports this module); ``root`` below is an instance of
# fairscale.nn.data_parallel.FullyShardedDataParallel
FullyShardedDataParallel = Any

_DTYPES_ATTR = "_fsdp_buffer_dtypes"


# ------------------------------------------------------------------------------------------------
# process groups


def resolve_group(process_group: Any) -> tuple[Any, int, int]:
    """``(group, world_size, rank)`` for FSDP's ``process_group`` argument.

    ``None`` is the world (a single process without torch.distributed). A test double with only
    ``rank()`` and ``size()`` (``fair_dev.testing.DummyProcessGroup``) stands for a group of one:
    nothing is communicated; as a larger group it is refused (it cannot communicate).
    """
    if process_group is None:
        if dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        else:
            return None, 1, 0
    if isinstance(process_group, dist.ProcessGroup):
        return process_group, dist.get_world_size(process_group), dist.get_rank(process_group)
    if callable(getattr(process_group, "size", None)) and callable(getattr(process_group, "rank", None)):
        if process_group.size() != 1:
            raise TypeError(f"process_group={type(process_group).__name__} of size {process_group.size()} is not a "
                            "torch.distributed ProcessGroup: a stand-in group can only have size 1; pass a real group")
        return process_group, 1, 0
    raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {type(process_group).__name__}")


def check_reduce_scatter_group(process_group_reduce_scatter: Any, group: Any, world_size: int) -> None:
    """FSDP's ``process_group_reduce_scatter``: FairScale ran reduce-scatters on a second group over
    the same ranks so they could overlap the all-gathers; here they run on ``process_group`` itself.
    Any group over the same ranks (or a ``ProcessGroupName``) gives the same numbers, so it is
    accepted; a group over other ranks would reduce gradients over the wrong ranks and is refused."""
    if process_group_reduce_scatter is None or isinstance(process_group_reduce_scatter, str):
        return  # ProcessGroupName.default / .reduce_scatter (a str Enum)
    if not isinstance(process_group_reduce_scatter, dist.ProcessGroup) or not isinstance(group, dist.ProcessGroup):
        if world_size == 1 and getattr(process_group_reduce_scatter, "size", lambda: 1)() == 1:
            return
        raise TypeError(f"process_group_reduce_scatter must be a ProcessGroup over the ranks of process_group or a "
                        f"ProcessGroupName, got {type(process_group_reduce_scatter).__name__}")
    mine, theirs = dist.get_process_group_ranks(group), dist.get_process_group_ranks(process_group_reduce_scatter)
    if mine != theirs:
        raise ValueError(f"process_group_reduce_scatter covers ranks {theirs} but process_group covers {mine}: "
                         "gradients must be reduce-scattered over the ranks that share the parameters; pass a group "
                         "over the same ranks (or leave it at its default)")


# ------------------------------------------------------------------------------------------------
# ownership


def walk(module: nn.Module, fsdp_cls: type, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(dotted path, module) for ``module`` and its descendants, not entering ``fsdp_cls``
    instances (``module`` itself included: an instance wrapping an instance owns nothing of it)."""
    yield prefix, module
    if isinstance(module, fsdp_cls):
        return
    for name, child in module._modules.items():
        if child is None:
            continue
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, fsdp_cls):
            yield path, child
        else:
            yield from walk(child, fsdp_cls, path)


def direct_nested(module: nn.Module, fsdp_cls: type) -> list[Any]:
    """FSDP instances inside ``module`` that are not inside another one."""
    return [m for _, m in walk(module, fsdp_cls) if isinstance(m, fsdp_cls)]


def owned_parameters(module: nn.Module, fsdp_cls: type) -> Iterator[tuple[str, nn.Parameter]]:
    """(name, parameter) registered on ``module``'s subtree outside nested FSDP instances (with repeats)."""
    for path, m in walk(module, fsdp_cls):
        if isinstance(m, fsdp_cls):
            continue
        for name, p in m._parameters.items():
            if p is not None:
                yield clean_key(f"{path}.{name}" if path else name), p


class OriginalRefs(dict):
    """id -> weakref.ref of the original parameters an instance covers. Weak, because a nested
    instance drops its originals once flattened and a bare id would then be reused by a parameter
    created later (a fairseq model's final norm, built after its wrapped layers), which is no tie.
    Only wrapping reads it, so a pickled instance carries it empty."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return (OriginalRefs, ())


def collect_owned(module: nn.Module, fsdp_cls: type) -> tuple[list[nn.Parameter], OriginalRefs, list[str]]:
    """(distinct parameters this instance owns, the original parameters it and its nested instances
    cover, unwrapped parameter names in order). Raises on ties across instances."""
    nested = direct_nested(module, fsdp_cls)
    nested_originals = OriginalRefs()
    for m in nested:
        nested_originals.update(m._original_refs)
    owned: list[nn.Parameter] = []
    seen: set[int] = set()
    for name, p in owned_parameters(module, fsdp_cls):
        ref = nested_originals.get(id(p))
        if ref is not None and ref() is p:
            raise ValueError(f"FullyShardedDataParallel: parameter {name!r} is shared with a nested instance (tied "
                             "weights across wrapped submodules); wrap the modules that share it in the same "
                             "instance, e.g. exclude them from auto_wrap")
        if id(p) not in seen:
            seen.add(id(p))
            owned.append(p)
    nested_originals.update((id(p), weakref.ref(p)) for p in owned)
    return owned, nested_originals, original_order(module, nested, fsdp_cls)


def original_order(module: nn.Module, nested: list[Any], fsdp_cls: type) -> list[str]:
    """Clean names of the unwrapped module's parameters in its ``parameters()`` order (tied
    duplicates dropped), with nested instances' names expanded where their subtree sits."""
    owner = {id(p): m for m in nested for p in m.parameters()}
    out: list[str] = []
    done: set[int] = set()
    paths = {id(m): path for path, m in walk(module, fsdp_cls) if isinstance(m, fsdp_cls)}
    for name, p in module.named_parameters():
        m = owner.get(id(p))
        if m is None:
            out.append(clean_key(name))
        elif id(m) not in done:
            done.add(id(m))
            base = clean_key(paths[id(m)] + ".") if paths[id(m)] else ""
            out.extend(base + n for n in m._orig_names)
    return out


def prepare_buffers(module: nn.Module, fsdp_cls: type, dtype: torch.dtype | None, device: torch.device) -> None:
    """Move this instance's buffers to ``device`` and floating ones to ``dtype`` (mixed precision),
    remembering the original dtype so that state_dict() returns them unchanged."""
    for _, m in walk(module, fsdp_cls):
        if isinstance(m, fsdp_cls):
            continue
        for name, b in list(m._buffers.items()):
            if b is None:
                continue
            m.__dict__.setdefault(_DTYPES_ATTR, {}).setdefault(name, b.dtype)
            target = dtype if (dtype is not None and b.is_floating_point()) else b.dtype
            m._buffers[name] = b.to(device=device, dtype=target)


def buffer_dtypes(root: nn.Module) -> dict[str, torch.dtype]:
    """Clean buffer key -> original dtype, over ``root``'s whole tree."""
    out = {}
    for path, m in root.named_modules():
        for name, dtype in m.__dict__.get(_DTYPES_ATTR, {}).items():
            out[clean_key(f"{path}.{name}" if path else name)] = dtype
    return out


def _units_by_flat(root: FullyShardedDataParallel) -> dict[int, tuple[Any, Any, str]]:
    """id(shard parameter) -> (instance, unit, clean prefix of the instance)."""
    out = {}
    for path, m in root._instances():
        base = clean_key(path + ".") if path else ""
        for u in m._units:
            out[id(u.flat)] = (m, u, base)
    return out


# ------------------------------------------------------------------------------------------------
# local state dicts: metadata and consolidation


def _padding(layout: FlatShard) -> int:
    """Zeros at the end of this rank's shard (the flat parameter is padded to a multiple of n)."""
    s = layout.shard_numel
    lo, hi = layout.index * s, (layout.index + 1) * s
    return max(0, hi - max(layout.numel, lo))


def metadata(root: FullyShardedDataParallel) -> dict[str, Any]:
    """FairScale 0.4.13's ``local_metadata_dict()`` layout, so shards saved here consolidate with
    its ``consolidate_shard_weights`` and the other way round::

        {"param_metadata": [            # one entry per FSDP instance
            {"fsdp_path": "layers.0",   # clean path of the instance ("" for the root)
             "params": {"flat_param_0": {"names": [...], "shapes": [...], "numels": [...],
                                         "padding": zeros at the end of this rank's shard}},
             "no_broadcast_optim_state": False,
             "shared_param_info": [(source key, tied duplicate key), ...]}],
         "buffer_names": [...],         # clean keys of the (persistent) buffers
         "buffer_dtypes": {key: dtype}, # ours: the dtypes to restore (buffers may be cast)
         "world_size": n}               # ours: to check that every rank's shard was passed

    Backing parameters are named as in :meth:`local_state_dict` (``fsdp_path.flat_param_0``;
    with ``flatten_parameters=False`` each parameter under its own name). Tied-parameter keys are
    full clean keys (0.4.13 recorded them relative to the instance, which only the root reads right).
    """
    param_metadata = []
    for path, m in root._instances():
        fsdp_path = clean_key(path + ".")[:-1] if path else ""
        base = fsdp_path + "." if fsdp_path else ""
        params = {}
        for u in m._units:
            backing = u.flat_name if u.flat_name is not None else u.layout.members[0][0]
            params[backing] = {"names": [k for k, _ in u.layout.members],
                               "shapes": [torch.Size(sh) for _, sh in u.layout.members],
                               "numels": [torch.Size(sh).numel() for _, sh in u.layout.members],
                               "padding": _padding(u.layout)}
        shared = [(base + src, base + dst) for u in m._units for dst, src in u.group.aliases.items()]
        param_metadata.append({"fsdp_path": fsdp_path, "params": params,
                               "no_broadcast_optim_state": m.no_broadcast_optim_state, "shared_param_info": shared})
    dtypes = buffer_dtypes(root)
    persistent = set(root.local_state_dict())  # non-persistent buffers are in no state dict
    names = [clean_key(n) for n, _ in root.named_buffers()]
    buffer_names = [n for n in dict.fromkeys(names) if n in persistent]
    return {"param_metadata": param_metadata, "buffer_names": buffer_names,
            "buffer_dtypes": {n: dtypes[n] for n in buffer_names if n in dtypes}, "world_size": root.world_size}


def consolidate(shard_weights: list[dict[str, torch.Tensor]], shard_metadata: list[dict[str, Any]], *,
                with_module_buffers: bool, strict: bool) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's local state dict and metadata (0.4.13's format, see
    :func:`metadata`): each backing parameter's shards, padding dropped, concatenated in rank order
    and split into the named parameters; an instance with ``no_broadcast_optim_state`` (rank-local,
    e.g. MoE experts) is taken from the first shard only. Buffers come from the first shard.
    ``strict=False`` skips backing parameters and buffers missing from the first shard."""
    if not shard_weights or len(shard_weights) != len(shard_metadata):
        raise ValueError(f"consolidate_shard_weights needs one state dict and one metadata dict per rank, got "
                         f"{len(shard_weights)} and {len(shard_metadata)}")
    saved_world = shard_metadata[0].get("world_size")
    if saved_world is not None and saved_world != len(shard_weights):
        raise ValueError(f"the shards were saved by {saved_world} ranks but {len(shard_weights)} were given; pass "
                         "every rank's local_state_dict() and local_metadata_dict(), in rank order")
    out: dict[str, torch.Tensor] = {}
    for i, inst in enumerate(shard_metadata[0]["param_metadata"]):
        base = inst["fsdp_path"] + "." if inst["fsdp_path"] else ""
        for backing, info in inst["params"].items():
            key = base + backing
            if key not in shard_weights[0]:
                if strict:
                    raise KeyError(f"consolidate_shard_weights: {key!r} missing from the first state dict "
                                   "(pass strict=False to skip it)")
                continue
            ranks = range(1) if inst["no_broadcast_optim_state"] else range(len(shard_weights))
            pieces = []
            for r in ranks:
                pad = shard_metadata[r]["param_metadata"][i]["params"][backing]["padding"]
                shard = shard_weights[r][key].reshape(-1)
                pieces.append(shard[:shard.numel() - pad] if pad else shard)
            full = torch.cat(pieces)
            if full.numel() != sum(info["numels"]):
                raise ValueError(f"consolidate_shard_weights: {key!r} has {full.numel()} elements without padding "
                                 f"but its metadata lists {sum(info['numels'])}")
            for name, piece, shape in zip(info["names"], full.split(list(info["numels"])), info["shapes"]):
                out[base + name] = piece.view(shape)
        for src, dst in inst["shared_param_info"]:
            if src in out:
                out[dst] = out[src]
    if with_module_buffers:
        dtypes = shard_metadata[0].get("buffer_dtypes", {})
        for name in shard_metadata[0]["buffer_names"]:
            if name not in shard_weights[0]:
                if strict:
                    raise KeyError(f"consolidate_shard_weights: buffer {name!r} missing from the first state dict")
                continue
            value = shard_weights[0][name]
            out[name] = value.to(dtypes[name]) if name in dtypes else value
    return out


# ------------------------------------------------------------------------------------------------
# clipping


@torch.no_grad()
def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, norm_type: float, *, axis: str,
                   device: torch.device) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over gradient shards, in FairScale 0.4.13's arithmetic (to
    the bit): the norm of the per-shard float32 norms (or the max), raised to ``norm_type`` and
    summed over ``axis`` (or the max), then the coefficient ``max_norm / (norm + 1e-6)`` as a
    tensor division. Zero padding adds 0."""
    norm_type = float(norm_type)
    if not grads:
        local = torch.zeros((), device=device)
    elif norm_type == float("inf"):
        local = torch.stack([g.detach().abs().max() for g in grads]).max()
    else:
        norms = torch.stack([torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32) for g in grads])
        local = torch.linalg.vector_norm(norms, norm_type).to(grads[0].dtype)
    local = local.to(device)  # reduce where the backend can communicate (grads may be on the CPU)
    if norm_type == float("inf"):
        total = local
        comm.all_reduce_(total, axis, op=dist.ReduceOp.MAX)
    else:
        total = local ** norm_type
        comm.all_reduce_(total, axis)
        total = total ** (1.0 / norm_type)
    coef = torch.tensor(float(max_norm), dtype=total.dtype, device=total.device) / (total + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef.to(g.device))
    return total
