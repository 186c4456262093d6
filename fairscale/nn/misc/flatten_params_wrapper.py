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
    """Flatten ``module``'s parameters (all, or ``param_list``) into ``flat_param_<name>`` parameters.

    Args:
        module: the module to wrap; reachable as ``wrapper.module`` and through attribute and index
            forwarding (``wrapper.layer`` is ``module.layer``, ``wrapper[0]`` is ``module[0]``).
        param_list: ``None``, a list of parameters, or a list of lists of parameters.
        flat_param_names: a name per flat parameter (default ``"0"``, ``"1"``...): the flat
            parameters are registered as ``flat_param_<name>``.

    ``state_dict()`` has the unwrapped module's keys; ``flat_state_dict()`` the flat parameters
    (and buffers) instead; ``load_state_dict`` takes either. ``unflatten_params()`` temporarily
    turns the flat parameters back into the original ones (views of the flat storage, or of the
    ``flat_params`` given), e.g. to save or load in the original layout.
    """

    def __init__(self, module: nn.Module, param_list: Sequence[Any] | None = None,
                 flat_param_names: Sequence[str] | None = None) -> None:
        super().__init__()
        self._fpw_module = module
        if param_list is None:
            param_list = [list(module.parameters())]
        elif len(param_list) and isinstance(param_list[0], nn.Parameter):
            param_list = [list(param_list)]
        groups = [list(g) for g in param_list if len(g)]
        if flat_param_names is None:
            flat_param_names = [str(i) for i in range(len(groups))]
        flat_param_names = list(flat_param_names)
        if len(flat_param_names) != len(groups):
            raise ValueError(f"flat_param_names has {len(flat_param_names)} names for {len(groups)} flat parameters "
                             "(non-empty groups of param_list)")
        if len(set(flat_param_names)) != len(flat_param_names):
            raise ValueError(f"flat_param_names must be distinct, got {flat_param_names}")
        self._groups = build_groups(module, groups)
        self._flat_names: list[str] = []
        for g, params, suffix in zip(self._groups, groups, flat_param_names):
            distinct = list({id(p): p for p in params}.values())
            with torch.no_grad():
                data = torch.cat([p.detach().reshape(-1) for p in distinct])  # groups are never empty
            flat = nn.Parameter(data, requires_grad=g.requires_grad)
            for slots in g.slots:
                for mod, name in slots:
                    del mod._parameters[name]
            name = f"flat_param_{suffix}"
            self.register_parameter(name, flat)
            self._flat_names.append(name)
        self.is_flattened = True
        self._unflat_state_dict = True
        """False when an FSDP instance owns this wrapper: FSDP then decides what state_dict shows."""
        self._flat_keys = False  # inside flat_state_dict()
        self.bind(self.flat_params)  # the original attributes read the flat storage from now on

    # ---------------------------------------------------------------------------------------------
    @property
    def flat_param_names(self) -> list[str]:
        return list(self._flat_names)

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
    def num_params_managed(self) -> int:
        """How many original (distinct) parameters the flat parameters hold."""
        return sum(len(g.members) for g in self._groups)

    @property
    def module(self) -> nn.Module:
        return self._fpw_module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fpw_module, name)

    def __getitem__(self, key: Any) -> Any:
        return self._fpw_module[key]  # type: ignore[index]  # e.g. an nn.Sequential

    def metadata(self, flat_param_idx: int) -> tuple[list[str], list[torch.Size], list[int]]:
        """``(names, shapes, numels)`` of the parameters in flat parameter ``flat_param_idx``, in
        flat order (names relative to the wrapped module)."""
        members = self._groups[flat_param_idx].members
        return [n for n, _ in members], [s for _, s in members], [s.numel() for _, s in members]

    def get_param_views(self, external_data_list: Sequence[torch.Tensor | None] | None = None) -> Iterator[torch.Tensor]:
        """Views shaped like the original parameters, of the flat parameters or of ``external_data_list``."""
        datas = list(external_data_list) if external_data_list is not None else [None] * len(self._groups)
        if len(datas) != len(self._groups):
            raise ValueError(f"external_data_list has {len(datas)} tensors for {len(self._groups)} flat parameters")
        for g, flat, data in zip(self._groups, self.flat_params, datas):
            if data is not None and data.numel() != g.numel:
                raise ValueError(f"Incorrect numel of supplied data: got {data.numel()} but expected {g.numel}")
            yield from g.views(flat if data is None else data)

    def bind(self, flats: Sequence[torch.Tensor]) -> None:
        """Bind views of ``flats`` (one full flat tensor per group) under the original names."""
        for g, flat in zip(self._groups, flats):
            bind_views(g, g.views(flat))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.is_flattened:
            self.bind(self.flat_params)
        return self._fpw_module(*args, **kwargs)

    # ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def unflattened(self, flats: Sequence[torch.Tensor] | None = None) -> Iterator[None]:
        """Temporarily register the original parameters (views of ``flats``, default the flat
        parameters' data, so writes reach the flat storage) under their own names, and hide the
        flat parameters. Nested use keeps the outer layout."""
        if not self.is_flattened:
            if flats is not None:
                raise AssertionError("unflattening with external flat params needs the wrapper to be flattened")
            yield
            return
        flats = [p.detach() for p in self.flat_params] if flats is None else list(flats)
        saved: dict[str, Any] = {n: self._parameters.pop(n) for n in self._flat_names}
        self.is_flattened = False
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
            self.is_flattened = True
            if self._unflat_state_dict:
                self.bind(self.flat_params)

    def unflatten_params(self, flat_params: Sequence[torch.Tensor] | None = None) -> contextlib.AbstractContextManager[None]:
        """FairScale's name for :meth:`unflattened`: the original parameters, as views of the flat
        parameters (or of ``flat_params``), inside the block."""
        return self.unflattened(flat_params)

    def _strip(self, sd: Any, prefix: str) -> Any:
        inner = prefix + "_fpw_module."
        for key in [k for k in sd if k.startswith(inner)]:
            sd[prefix + key[len(inner):]] = sd.pop(key)
        return sd

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        if args or not self._unflat_state_dict:  # torch's positional form, or FSDP owns the layout
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.is_flattened and not self._flat_keys:
            with self.unflattened():
                sd = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        else:
            sd = super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return self._strip(sd, prefix)

    def flat_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The state dict with the flat parameters (``flat_param_<name>``) instead of the originals."""
        assert self.is_flattened, "flat_state_dict() inside unflatten_params(): the wrapper is unflattened"
        self._flat_keys = True
        try:
            return self.state_dict(*args, **kwargs)
        finally:
            self._flat_keys = False

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if not self._unflat_state_dict:  # an FSDP instance owns the layout and hands its own keys
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        state_dict = dict(state_dict)
        if "flat_param" in state_dict and "flat_param_0" in self._flat_names:  # older FairScale checkpoints
            state_dict["flat_param_0"] = state_dict.pop("flat_param")
        mapped = {k if k in self._flat_names else "_fpw_module." + k: v for k, v in state_dict.items()}
        if any(k.startswith("flat_param_") for k in state_dict) or not self.is_flattened or not self._flat_names:
            return super().load_state_dict(mapped, strict=strict, assign=assign)
        with self.unflattened():  # original keys: load through views of the flat storage
            return super().load_state_dict(mapped, strict=strict)
