"""Random numbers a model draws outside torch while it is traced (numpy, Python's ``random``).

A trace records torch ops; a value numpy draws during the trace enters the graph as a constant.
Hugging Face's audio models draw their SpecAugment time masks with ``np.random``
(``_compute_mask_indices``): captured, one mask drawn at plan time was reused at every step and
on every rank, where the model draws a new one at each call (eager losses 0.69439, 0.69405,
0.69459 for one batch; the graph's 0.69406 every time). :func:`watch_host_random` records such
draws during a trace, so the capture can refuse the model before anything runs.

A draw that follows a seed the forward sets itself (``np.random.seed(self.seed)``, as Hugging Face's
BigBird block-sparse attention picks its random blocks in training) is the same at every call: the
trace's constants are what the model draws each time, so it is not refused. The seed must be fixed
when the model is built: where the forward also changes an attribute of one of its modules (a step
counter it could seed from), the seeded draws are refused as the others.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

__all__ = ["HostRandom", "watch_host_random", "call_site"]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (np, torch))
_SKIP += tuple(os.path.join(_ROOT, package) + os.sep for package in ("planner", "passes", "fairscale"))
# contextlib and functools are single files in the standard library's folder, which also holds
# site-packages where Python is installed without a virtual environment: skip the files, not the folder
_SKIP += tuple(m.__file__ or "<none>" for m in (contextlib, functools))
_MODELS = os.path.join(_ROOT, "fairscale", "testing") + os.sep
"""The project's own model code (the corpus's styles, the test models): a call site, not a frame to skip."""


@dataclass
class HostRandom:
    """What the watched code drew: call sites of numpy's global random functions, and whether the
    global states of numpy and ``random`` moved (a draw the wrappers did not see)."""

    sites: list[str] = field(default_factory=list)
    """``op numpy.random.rand at module inner.wav2vec2 (Wav2Vec2Model), source modeling_wav2vec2.py:210``
    (or ``op random.random ...``: Python's global functions)."""
    moved: list[str] = field(default_factory=list)
    """``numpy.random`` / ``random``: global states that changed."""
    seeded: list[str] = field(default_factory=list)
    """Call sites of draws that followed a seed the forward set (the same numbers at every call)."""
    rebound: list[str] = field(default_factory=list)
    """``buffer <name>: <call site>`` where the forward assigned a new tensor to one of the model's
    buffers (``self.ema = 0.9 * self.ema + ...``): torch.export drops the assignment; ``parameter
    <name>: ...`` for a new ``nn.Parameter`` in a parameter's place (a VQ-VAE's EMA codebook,
    ``self._ema_w = nn.Parameter(...)``), which torch.export fails on."""

    def describe(self) -> str:
        return self.sites[0] if self.sites else f"op {self.moved[0]}.* (its global state moved; where was not recorded)"


def call_site(name: str, model: nn.Module) -> str:
    """``op <name> at module <path> (<class>), source <file>:<line>``: the model's code running now
    (the first frame outside torch, numpy and this project; its nearest module of ``model``)."""
    paths = {id(m): p for p, m in model.named_modules()}
    frame: FrameType | None = sys._getframe(2)
    line, module = "", ""
    while frame is not None:
        path = frame.f_code.co_filename
        if not line and (not path.startswith(_SKIP + ("<",)) or path.startswith(_MODELS)):
            line = f"{os.path.basename(path)}:{frame.f_lineno}"
        owner = frame.f_locals.get("self")
        if line and isinstance(owner, nn.Module) and id(owner) in paths:
            module = f" at module {paths[id(owner)] or '<model top level>'} ({type(owner).__name__})"
            break
        frame = frame.f_back
    return f"op {name}{module}" + (f", source {line}" if line else "")


@contextlib.contextmanager
def watch_host_random(model: nn.Module) -> Iterator[HostRandom]:
    """Record the random draws outside torch of the code run inside (module docstring)."""
    found = HostRandom()
    patched: list[tuple[Any, str, Any]] = []
    seeded: set[str] = set()  # the spaces whose state the watched code set with a seed of its own
    # numpy's global functions, and Python's (a seq2seq's per-step teacher forcing, random.random() < ratio)
    for space, owner, prefix in ((np.random, np.random.mtrand._rand, "numpy.random"), (random, random._inst, "random")):
        for name in getattr(space, "__all__", []):
            fn = getattr(space, name, None)
            if name in ("get_state", "set_state", "getstate", "setstate") or fn is None or (
                    getattr(fn, "__self__", None) is not owner and name != "seed"):  # numpy's seed is a plain function
                continue
            if name == "seed":
                def reseed(*args: Any, _fn: Any = fn, _prefix: str = prefix, **kwargs: Any) -> Any:
                    value = args[0] if args else kwargs.get("seed", kwargs.get("a"))
                    if isinstance(value, int) and not isinstance(value, bool):
                        seeded.add(_prefix)
                    else:  # seed() or seed(None) draws the state from the operating system
                        seeded.discard(_prefix)
                    return _fn(*args, **kwargs)
                wrapper: Any = reseed
            else:
                def wrapper(*args: Any, _fn: Any = fn, _name: str = f"{prefix}.{name}", _prefix: str = prefix,
                            **kwargs: Any) -> Any:
                    (found.seeded if _prefix in seeded else found.sites).append(call_site(_name, model))
                    return _fn(*args, **kwargs)
            patched.append((space, name, fn))
            setattr(space, name, wrapper)
    writes: list[str] = []  # numbers or strings the watched code set on a module (a seed could come from one)
    module_setattr = nn.Module.__setattr__
    paths = {id(m): p for p, m in model.named_modules()}
    own = set(paths)
    kept: dict[tuple[int, str], tuple[nn.Module, str, Any]] = {}  # real buffers fx's trace rebound to a Proxy

    def noting(self: nn.Module, name: str, value: Any) -> None:
        if id(self) in own and isinstance(value, (int, float, str)) and not isinstance(value, bool):
            writes.append(f"{type(self).__name__}.{name}")
        if id(self) in own and name in self._buffers and isinstance(value, torch.fx.Proxy):
            kept.setdefault((id(self), name), (self, name, self._buffers[name]))  # fx would leave its Proxy there
        elif id(self) in own and isinstance(value, torch.Tensor) and (
                (name in self._buffers and value is not self._buffers[name])  # (self.pe = self.pe.to(x.device): itself)
                or (name in self._parameters and value is not self._parameters[name])):  # a new nn.Parameter
            kind = "buffer" if name in self._buffers else "parameter"
            found.rebound.append(f"{kind} {paths[id(self)] + '.' if paths[id(self)] else ''}{name}: "
                                 f"{call_site(f'{type(self).__name__}.{name} =', model)}")
        module_setattr(self, name, value)
    np_state: Any = np.random.get_state()
    py_state = random.getstate()
    nn.Module.__setattr__ = noting  # type: ignore[method-assign]
    try:
        yield found
    finally:
        nn.Module.__setattr__ = module_setattr  # type: ignore[method-assign]
        for module, name, tensor in kept.values():
            module._buffers[name] = tensor
        for space, name, fn in patched:
            setattr(space, name, fn)
        if found.seeded and writes:
            found.sites.extend(found.seeded)  # the forward changes its modules: a seed may change with them
        after: Any = np.random.get_state()
        if "numpy.random" not in seeded and (after[2] != np_state[2] or not np.array_equal(after[1], np_state[1])):
            found.moved.append("numpy.random")
        if "random" not in seeded and random.getstate() != py_state:
            found.moved.append("random")
