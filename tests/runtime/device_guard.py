"""Run-time guards for device placement and host syncs, for tests on CPU ranks.

:class:`DeviceGuard` is a ``TorchFunctionMode``. While it is active:

* a tensor factory call (``torch.zeros``, ``empty``, ``tensor``, ``arange``, ...) made directly
  from ``passes/`` or ``fairscale/runtime/`` without ``device=`` raises, naming the file and line.
  On a CPU rank such a call works by accident; on a GPU rank it makes a tensor on the wrong
  device. (The lint in ``tests/test_device_lint.py`` finds the same calls statically; this finds
  them on the paths a plan really runs, whatever name the call is made through.)
* with ``counting`` on, every call from those directories that makes the host wait for the
  device is counted by site (file, function): ``.item()``, ``.tolist()``, ``.cpu()``,
  ``.numpy()``, ``bool()``/``int()``/``float()`` of a tensor, ``torch.equal``. Calls on tensors
  that are already on the host (results of ``.cpu()``, of factory calls the lint's
  ``# lint: cpu -- <reason>`` mark declares host tensors, and anything computed from them) are
  host work, not syncs, and are not counted. On a GPU the same sites are where
  ``torch.cuda.set_sync_debug_mode("error")`` would stop.

Only the calling frame is looked at: torch's own internals (e.g. ``torch.optim`` reading a host
``step`` tensor) are not our syncs.
"""

from __future__ import annotations

import linecache
import sys
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[2]
GUARDED = (str(ROOT / "passes") + "/", str(ROOT / "fairscale" / "runtime") + "/")
FACTORIES = frozenset({"zeros", "ones", "empty", "full", "arange", "tensor", "as_tensor", "rand", "randn", "randint",
                       "randperm", "eye", "linspace", "logspace", "empty_strided", "scalar_tensor"})
SYNCS = frozenset({"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "equal",
                   "allclose", "is_nonzero"})


def _marked_cpu(filename: str, lineno: int) -> bool:
    """Whether the call at ``filename:lineno`` carries the lint's ``# lint: cpu -- <reason>`` mark
    (on its line or the three above): a tensor deliberately made on the host."""
    return any("# lint: cpu --" in linecache.getline(filename, n) for n in range(max(1, lineno - 3), lineno + 1))


class FactoryWithoutDevice(AssertionError):
    """A factory call from the runtime or the passes did not say which device."""


class DeviceGuard(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.counting = False
        self.syncs: Counter[tuple[str, str]] = Counter()
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}  # id -> ref (tensors compare elementwise)

    def _is_host(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    @staticmethod
    def _ours(filename: str) -> str | None:
        return filename[len(str(ROOT)) + 1:] if filename.startswith(GUARDED) else None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        frame = sys._getframe(1)
        ours = self._ours(frame.f_code.co_filename)
        if ours and name in FACTORIES and func is getattr(torch, name, None) and kwargs.get("device") is None:
            raise FactoryWithoutDevice(f"{ours}:{frame.f_lineno} ({frame.f_code.co_name}): torch.{name}(...) "
                                       "without device=")
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        from_host = any(self._is_host(t) for t in inputs)  # on a GPU, host and device tensors only mix as 0-d scalars
        if self.counting and ours and name in SYNCS and not from_host:
            self.syncs[(ours, frame.f_code.co_name)] += 1
        out = func(*args, **kwargs)
        meant_for_host = ours and name in FACTORIES and _marked_cpu(frame.f_code.co_filename, frame.f_lineno)
        # host-ness spreads only through our own host code: a CPU rank's "device" tensors are host
        # tensors too, and must not turn the model's activations into host work
        if ours and (name == "cpu" or meant_for_host or (from_host and name not in SYNCS)):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._host[id(t)] = weakref.ref(t)
        return out
