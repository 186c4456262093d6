"""FlattenParamsWrapper: a module's parameters stored as one (or a few) flat parameters.

    from fairscale.nn.misc import FlattenParamsWrapper

    model = FlattenParamsWrapper(model)             # every parameter into ``flat_param_0``
    opt = torch.optim.Adam(model.parameters())      # one tensor to update
    model.state_dict().keys()                       # the original keys, e.g. "0.weight"

``param_list`` picks what to flatten: ``None`` (all parameters), a list of parameters (one flat
parameter), or a list of lists (one flat parameter per inner list). Parameters left out stay where
they are. A flat parameter holds its members once each, in the given order; a parameter shared by
several modules (tied weights) is stored once and bound into each of them.

How the original names keep working: the originals are removed from their modules; before each
forward, views of the flat parameter are written into the modules' instance ``__dict__`` under the
original names, so ``self.weight`` in the user's forward finds them, and autograd routes their
gradients into the flat parameter. ``state_dict`` temporarily registers those views as parameters
under their own names, so keys are exactly those of the unwrapped module.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

__all__ = ["FlattenParamsWrapper"]

_MARKERS = ("_fsdp_wrapped_module.", "_fpw_module.")


def clean_key(key: str) -> str:
    """A state_dict key with FSDP/FPW wrapper levels removed: the unwrapped module's key."""
    for marker in _MARKERS:
        key = key.replace(marker, "")
    return key


@dataclass
class FlatGroup:
    """What one flat parameter holds."""

    members: list[tuple[str, torch.Size]] = field(default_factory=list)
    """(clean name relative to the wrapped module, shape) of each distinct parameter, in flat order."""
    slots: list[list[tuple[nn.Module, str]]] = field(default_factory=list)
    """For member i, every (module, attribute) it is registered under (several when tied)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Clean name of a tied duplicate -> clean name of the member that stores it."""
    requires_grad: bool = True
    dtype: torch.dtype = torch.float32

    @property
    def numel(self) -> int:
        return sum(s.numel() for _, s in self.members)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, start = [], 0
        for _, shape in self.members:
            n = shape.numel()
            out.append(flat[start:start + n].view(shape))
            start += n
        return out


def _occurrences(module: nn.Module, skip: tuple[type, ...] = ()) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(param) -> every (owner module, attribute, full name) it is registered under, in
    ``named_parameters`` order; subtrees of ``skip`` types are not entered."""
    out: dict[int, list[tuple[nn.Module, str, str]]] = {}

    def visit(mod: nn.Module, prefix: str) -> None:
        for name, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((mod, name, prefix + name))
        for cname, child in mod._modules.items():
            if child is not None and not isinstance(child, skip):
                visit(child, f"{prefix}{cname}.")

    visit(module, "")
    return out


def build_groups(module: nn.Module, groups: Sequence[Sequence[nn.Parameter]],
                 skip: tuple[type, ...] = ()) -> list[FlatGroup]:
    """Describe each requested group (distinct parameters, their slots and aliases)."""
    occ = _occurrences(module, skip)
    seen: set[int] = set()
    out = []
    for params in groups:
        g = FlatGroup()
        flags = {bool(p.requires_grad) for p in params}
        dtypes = {p.dtype for p in params}
        if len(flags) > 1:
            raise ValueError("FlattenParamsWrapper: a flat parameter cannot mix parameters that require grad with "
                             "frozen ones; pass them as separate inner lists of param_list")
        if len(dtypes) > 1:
            raise ValueError(f"FlattenParamsWrapper: a flat parameter needs one dtype, got {sorted(map(str, dtypes))}; "
                             "cast the module first or pass separate inner lists of param_list")
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            where = occ.get(id(p))
            if not where:
                raise ValueError(f"FlattenParamsWrapper: a parameter of shape {tuple(p.shape)} in param_list is not "
                                 "a parameter of the wrapped module")
            g.members.append((clean_key(where[0][2]), p.shape))
            g.slots.append([(m, n) for m, n, _ in where])
            for _, _, alias in where[1:]:
                g.aliases[clean_key(alias)] = clean_key(where[0][2])
        if params:
            g.requires_grad = flags.pop()
            g.dtype = dtypes.pop()
        out.append(g)
    return out


def bind_views(group: FlatGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Make each slot's attribute read the given tensor (shadowing, not replacing, registration)."""
    for slots, t in zip(group.slots, tensors):
        for mod, name in slots:
            mod.__dict__[name] = t


def unbind_views(group: FlatGroup) -> None:
    for slots in group.slots:
        for mod, name in slots:
            mod.__dict__.pop(name, None)


class FlattenParamsWrapper(nn.Module):
    """Flatten ``module``'s parameters (all, or ``param_list``) into ``flat_param_<i>`` parameters.

    Args:
        module: the module to wrap; reachable as ``wrapper._fpw_module`` and through attribute
            forwarding (``wrapper.layer`` is ``module.layer``).
        param_list: ``None``, a list of parameters, or a list of lists of parameters.
    """

    def __init__(self, module: nn.Module, param_list: Sequence[Any] | None = None) -> None:
        super().__init__()
        self._fpw_module = module
        if param_list is None:
            param_list = [list(module.parameters())]
        elif len(param_list) and isinstance(param_list[0], nn.Parameter):
            param_list = [list(param_list)]
        groups = [list(g) for g in param_list if len(g)]
        self._groups = build_groups(module, groups)
        self._flat_names: list[str] = []
        for i, (g, params) in enumerate(zip(self._groups, groups)):
            distinct = list({id(p): p for p in params}.values())
            with torch.no_grad():
                data = torch.cat([p.detach().reshape(-1) for p in distinct]) if distinct else torch.empty(0)
            flat = nn.Parameter(data, requires_grad=g.requires_grad)
            for slots in g.slots:
                for mod, name in slots:
                    del mod._parameters[name]
            name = f"flat_param_{i}"
            self.register_parameter(name, flat)
            self._flat_names.append(name)
        self._unflat_state_dict = True
        """False when an FSDP instance owns this wrapper: FSDP then decides what state_dict shows."""
        self.bind(self.flat_params)  # the original attributes read the flat storage from now on

    # ---------------------------------------------------------------------------------------------
    @property
    def flat_params(self) -> list[nn.Parameter]:
        return [self._parameters[n] for n in self._flat_names]  # type: ignore[misc]

    @property
    def flat_param(self) -> nn.Parameter:
        """The first (usually the only) flat parameter."""
        if not self._flat_names:
            raise AttributeError("FlattenParamsWrapper has no flat parameter (param_list was empty)")
        return self.flat_params[0]

    @property
    def module(self) -> nn.Module:
        return self._fpw_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fpw_module, name)

    def bind(self, flats: Sequence[torch.Tensor]) -> None:
        """Bind views of ``flats`` (one full flat tensor per group) under the original names."""
        for g, flat in zip(self._groups, flats):
            bind_views(g, g.views(flat))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.bind(self.flat_params)
        return self._fpw_module(*args, **kwargs)

    # ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def unflattened(self, flats: Sequence[torch.Tensor] | None = None) -> Iterator[None]:
        """Temporarily register the original parameters (views of ``flats``, default the flat
        parameters' data) under their own names, and hide the flat parameters."""
        flats = [p.detach() for p in self.flat_params] if flats is None else list(flats)
        saved: dict[str, Any] = {n: self._parameters.pop(n) for n in self._flat_names}
        try:
            for g, flat, name in zip(self._groups, flats, self._flat_names):
                unbind_views(g)
                for slots, view in zip(g.slots, g.views(flat)):
                    p = nn.Parameter(view, requires_grad=saved[name].requires_grad)  # one object per member: tied
                    for mod, attr in slots:
                        mod._parameters[attr] = p
            yield
        finally:
            for g in self._groups:
                for slots in g.slots:
                    for mod, attr in slots:
                        mod._parameters.pop(attr, None)
            for n in self._flat_names:
                self._parameters[n] = saved[n]
            if self._unflat_state_dict:
                self.bind(self.flat_params)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        if not self._unflat_state_dict or args:
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        with self.unflattened():
            sd = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        inner = prefix + "_fpw_module."
        for key in [k for k in sd if k.startswith(inner)]:
            sd[prefix + key[len(inner):]] = sd.pop(key)
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if not self._unflat_state_dict or any(k in state_dict for k in self._flat_names):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        mapped = {k if k in self._flat_names else "_fpw_module." + k: v for k, v in state_dict.items()}
        with self.unflattened():
            return super().load_state_dict(mapped, strict=strict)
