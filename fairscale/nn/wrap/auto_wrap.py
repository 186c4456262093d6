"""enable_wrap / wrap / auto_wrap: FairScale's wrapping context and policies.

    from fairscale.nn import FullyShardedDataParallel as FSDP
    from fairscale.nn.wrap import auto_wrap, enable_wrap, wrap

    with enable_wrap(wrapper_cls=FSDP, reshard_after_forward=True):
        model.head = wrap(model.head)                      # wraps (inside the context only)
        model = auto_wrap(model, auto_wrap_policy=functools.partial(
            default_auto_wrap_policy, min_num_params=1e6))  # wraps large children, bottom-up
    model = FSDP(model)                                     # the root

A policy is called as ``policy(module=m, recurse=bool, unwrapped_params=int, module_is_root=bool)``.
With ``recurse=True`` it answers "look inside m's children?"; with ``recurse=False`` it answers
"wrap m itself?", where ``unwrapped_params`` counts m's parameters not already inside a wrapped child.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from torch import nn

__all__ = ["ConfigAutoWrap", "auto_wrap", "config_auto_wrap_policy", "default_auto_wrap_policy", "enable_wrap", "wrap"]


def default_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool,
                             min_num_params: float = 1e8, force_leaf_modules: set[type] | None = None,
                             exclude_wrap_modules: set[type] | None = None,
                             skip_params_check_for_root: bool = False) -> bool:
    """Wrap a module once it holds at least ``min_num_params`` not-yet-wrapped parameters.

    Args:
        min_num_params: size threshold.
        force_leaf_modules: types never recursed into (default ``{nn.MultiheadAttention}``, whose
            forward reads its children's parameters directly).
        exclude_wrap_modules: types never wrapped themselves (default ``{nn.ModuleList, nn.ModuleDict}``,
            which have no forward).
        skip_params_check_for_root: wrap the root regardless of its size.
    """
    force_leaf = tuple(force_leaf_modules if force_leaf_modules is not None else _FORCE_LEAF_MODULES)
    exclude = tuple(exclude_wrap_modules if exclude_wrap_modules is not None else _EXCLUDE_WRAP_MODULES)
    is_large = unwrapped_params >= min_num_params
    if recurse:
        return is_large and not isinstance(module, force_leaf)
    return (is_large or (module_is_root and skip_params_check_for_root)) and not isinstance(module, exclude)


# the defaults, readable as FairScale exposes them, to extend: e.g.
# force_leaf_modules=default_auto_wrap_policy.FORCE_LEAF_MODULES.union({nn.Linear})
_FORCE_LEAF_MODULES = frozenset({nn.MultiheadAttention})
_EXCLUDE_WRAP_MODULES = frozenset({nn.ModuleList, nn.ModuleDict})
default_auto_wrap_policy.FORCE_LEAF_MODULES = _FORCE_LEAF_MODULES  # type: ignore[attr-defined]
default_auto_wrap_policy.EXCLUDE_WRAP_MODULES = _EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]


def config_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
    """Wrap exactly the modules that carry a ``wrapper_config`` dict (its entries override the
    context's wrapper arguments); always recurse."""
    if recurse:
        return True
    return hasattr(module, "wrapper_config")


class ConfigAutoWrap:
    """The active wrapping context (one at a time, like FairScale's)."""

    in_autowrap_context: bool = False
    wrapper_cls: Callable[..., nn.Module] | None = None
    kwargs: dict[str, Any] = {}
    auto_wrap_policy: Callable[..., bool] = default_auto_wrap_policy

    @classmethod
    def enter(cls, auto_wrap_policy: Callable[..., bool] | None, kwargs: dict[str, Any]) -> None:
        if cls.in_autowrap_context:
            raise RuntimeError("enable_wrap: already inside an enable_wrap context; nesting is not supported "
                               "(pass per-module overrides to wrap(module, **overrides) instead)")
        if "wrapper_cls" not in kwargs:
            raise ValueError("enable_wrap needs wrapper_cls=..., e.g. enable_wrap(wrapper_cls=FullyShardedDataParallel)")
        cls.in_autowrap_context = True
        cls.wrapper_cls = kwargs.pop("wrapper_cls")
        cls.auto_wrap_policy = auto_wrap_policy or default_auto_wrap_policy
        cls.kwargs = kwargs

    @classmethod
    def exit(cls) -> None:
        cls.in_autowrap_context = False
        cls.wrapper_cls = None
        cls.kwargs = {}
        cls.auto_wrap_policy = default_auto_wrap_policy


@contextlib.contextmanager
def enable_wrap(auto_wrap_policy: Callable[..., bool] | None = None, **wrapper_kwargs: Any) -> Iterator[None]:
    """Context in which :func:`wrap` and :func:`auto_wrap` wrap with ``wrapper_cls(module, **wrapper_kwargs)``.

    Args:
        auto_wrap_policy: the default policy for :func:`auto_wrap` (default :func:`default_auto_wrap_policy`).
        wrapper_kwargs: must include ``wrapper_cls``; the rest are passed to every wrapper.
    """
    ConfigAutoWrap.enter(auto_wrap_policy, dict(wrapper_kwargs))
    try:
        yield
    finally:
        ConfigAutoWrap.exit()


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` inside :func:`enable_wrap`; outside it, return ``module`` unchanged.

    Precedence of arguments: ``wrap_overrides`` > ``module.wrapper_config`` > the context's.
    """
    if not ConfigAutoWrap.in_autowrap_context:
        return module
    module_overrides = getattr(module, "wrapper_config", None) or {}
    if not isinstance(module_overrides, dict):
        raise TypeError(f"wrapper_config of {type(module).__name__} must be a dict, got {type(module_overrides).__name__}")
    kwargs = {**ConfigAutoWrap.kwargs, **module_overrides, **wrap_overrides}
    assert ConfigAutoWrap.wrapper_cls is not None
    return ConfigAutoWrap.wrapper_cls(module, **kwargs)


def auto_wrap(module: nn.Module, auto_wrap_policy: Callable[..., bool] | None = None, **kwargs: Any) -> nn.Module:
    """Inside :func:`enable_wrap`, wrap ``module``'s descendants (and ``module`` itself if the
    policy says so) bottom-up; outside it, return ``module`` unchanged.

    Args:
        auto_wrap_policy: overrides the context's policy.
        kwargs: per-call overrides of the wrapper arguments.
    """
    if not ConfigAutoWrap.in_autowrap_context:
        return module
    policy = auto_wrap_policy or ConfigAutoWrap.auto_wrap_policy
    wrapped, _ = _recursive_wrap(module, policy, module_is_root=True, **kwargs)
    return wrapped


def _recursive_wrap(module: nn.Module, policy: Callable[..., bool], module_is_root: bool,
                    **kwargs: Any) -> tuple[nn.Module, int]:
    """Returns (maybe-wrapped module, number of its parameters now inside wrappers)."""
    cls = ConfigAutoWrap.wrapper_cls
    if isinstance(cls, type) and isinstance(module, cls):
        # already wrapped: leave it, and count its parameters as wrapped
        return module, sum(p.numel() for p in module.parameters())
    num_params = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, unwrapped_params=num_params, module_is_root=module_is_root):
        return module, 0
    wrapped_params = 0
    for name, child in list(module.named_children()):
        new_child, n = _recursive_wrap(child, policy, module_is_root=False, **kwargs)
        if new_child is not child:
            setattr(module, name, new_child)
        wrapped_params += n
    remainder = num_params - wrapped_params
    if policy(module=module, recurse=False, unwrapped_params=remainder, module_is_root=module_is_root):
        return wrap(module, **kwargs), num_params
    return module, wrapped_params

