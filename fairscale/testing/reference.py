"""Single-process reference training: the numbers every parallel configuration must reproduce.

Two comparisons:

* :func:`compare`: losses of every step, then parameters after the last step within ``atol``.
  Tight and right in float64, where rounding stays far below any tolerance.
* :func:`compare_grads`: losses of every step and the FULL gradients of the first step, each
  tensor relative to its norm, through :func:`fairscale.numerics.compare` (the bound and why it is
  principled are there; ``fairscale check`` uses the same code). This is the float32 standard: after
  a few Adam steps, float32 parameters differ by up to ``lr`` from rounding noise alone in entries
  whose gradient is ~0 (``m/√v`` is scale-free), by an amount that depends on the machine.
"""


from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from fairscale import numerics
from fairscale.runtime.model_guard import mark_current
from fairscale.testing.models import Case
from planner.capture import LossModule

__all__ = ["Trajectory", "RankResult", "start_again", "train_reference", "train_on_rank", "rank_trajectory", "compare", "compare_grads",
           "grad_comparison"]


@dataclass
class Trajectory:
    losses: list[float] = field(default_factory=list)
    """Loss of each step (before its optimizer update)."""
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """state_dict after the last step (detached clones)."""
    grad_norms: list[float] = field(default_factory=list)
    """Gradient 2-norm of each step before clipping (only when trained with ``clip_norm``)."""
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    """Full gradients of the first step (user keys, before clipping and the optimizer step); a
    parallel run fills it from ``ParallelModule.full_grads`` / ``fairscale.runtime.state.full_grads``."""
    loss_dtype: torch.dtype | None = None
    """The dtype the loss was computed in (a float64 model may compute it in float32, as
    ``lm_loss`` does); it sets the losses' tolerance in :func:`compare_grads`."""


def start_again(model: torch.nn.Module) -> None:
    """Let ``model`` be parallelized again from the weights it was built with, as a test comparing
    plans from one start wants: its own tensors still hold them (each ParallelModule trained copies),
    and a module built from a model behind another's ranks refuses to train
    (``fairscale.runtime.model_owners``)."""
    mark_current(model)


def make_optimizer(params, lr: float = 1e-2) -> torch.optim.Optimizer:
    """The optimizer every exactness test uses: Adam, lr 1e-2 (large enough that 3 steps move weights)."""
    return torch.optim.Adam(params, lr=lr)


def train_reference(build: Callable[[], Case], *, steps: int = 3, global_batch: int = 8, lr: float = 1e-2,
                    clip_norm: float | None = None,
                    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
                    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None) -> Trajectory:
    """Train ``build()``'s model for ``steps`` optimizer steps on the full global batch, in one process.

    Args:
        clip_norm: clip each step's gradients with ``torch.nn.utils.clip_grad_norm_(params,
            clip_norm)`` before the step, recording the returned norms in ``grad_norms``.
        optimizer: ``optimizer(params)`` makes the optimizer (default :func:`make_optimizer` with
            ``lr``). Clipping tests want SGD: Adam's update barely depends on the gradient's scale.
        scheduler: ``scheduler(optimizer)`` makes a learning-rate scheduler, stepped after each step.
    """
    case = build()
    wrapped = LossModule(case.model, case.loss_fn)
    opt = optimizer(case.model.parameters()) if optimizer is not None else make_optimizer(case.model.parameters(), lr)
    sched = scheduler(opt) if scheduler is not None else None
    out = Trajectory()
    for step in range(steps):
        batch = case.make_batch(step, global_batch)
        opt.zero_grad(set_to_none=True)
        loss = wrapped(*batch)
        loss.backward()
        if step == 0:
            out.loss_dtype = loss.dtype
            out.grads = {k: p.grad.detach().clone() for k, p in case.model.named_parameters() if p.grad is not None}
        if clip_norm is not None:
            out.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(case.model.parameters(), clip_norm)))
        opt.step()
        if sched is not None:
            sched.step()
        out.losses.append(loss.item())
    out.params = {k: v.detach().clone() for k, v in case.model.state_dict().items()}
    return out


RankResult = tuple[list[float], dict[str, Any]]
"""What :func:`train_on_rank` returns from each rank: the losses, and the first step's full
gradients as numpy arrays (they cross the launcher's pipe without torch's shared-memory handles)."""


def train_on_rank(case: Case, plan: Any = None, *, steps: int = 3, global_batch: int = 8,
                  optimizer: Callable[..., torch.optim.Optimizer] | None = None, **options: Any) -> RankResult:
    """One rank's side of an exactness test: ``fairscale.parallelize(case.model, plan=plan, **options)``
    trained for ``steps`` steps on ``case.make_batch(step, global_batch)``, as :func:`train_reference`
    trains the model in one process. ``optimizer``: a factory of the parameters, as ``parallelize``
    takes it (default :func:`make_optimizer`); ``options``: other arguments of ``parallelize``
    (``constraints`` for its own search when ``plan`` is None). Turn the result into a
    :class:`Trajectory` with :func:`rank_trajectory`."""
    import fairscale  # the face imports this module's package; importing it at call time keeps the cycle out

    pm = fairscale.parallelize(case.model, example_inputs=case.make_batch(0, global_batch), loss_fn=case.loss_fn,
                               plan=plan, optimizer=optimizer or make_optimizer, **options)
    losses: list[float] = []
    grads: dict[str, Any] = {}
    for step in range(steps):
        losses.append(pm.train_step(case.make_batch(step, global_batch)))
        if step == 0:
            grads = {k: v.numpy() for k, v in pm.full_grads().items()}
    return losses, grads


def rank_trajectory(result: RankResult) -> Trajectory:
    """The :class:`Trajectory` of one rank's :func:`train_on_rank` result, for :func:`compare_grads`."""
    losses, grads = result
    return Trajectory(losses=list(losses), grads={k: torch.from_numpy(v) for k, v in grads.items()})


def compare(ref: Trajectory, got: Trajectory, *, rtol: float = 1e-5, atol: float = 1e-5,
            dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """Assert ``got`` reproduces ``ref``: losses (and gradient norms, when ``ref`` has them) within
    ``rtol`` relative, parameters within ``atol``. With ``dtypes`` only parameters of those dtypes
    are compared (e.g. the float64 ones of a mixed model; check the rest with :func:`compare_grads`)."""
    assert len(ref.losses) == len(got.losses), (ref.losses, got.losses)
    for i, (a, b) in enumerate(zip(ref.losses, got.losses)):
        assert abs(a - b) <= rtol * max(abs(a), 1e-12), f"step {i}: loss {b!r} != reference {a!r}"
    if ref.grad_norms:
        assert len(ref.grad_norms) == len(got.grad_norms), f"gradient norms {got.grad_norms} != {ref.grad_norms}"
        for i, (a, b) in enumerate(zip(ref.grad_norms, got.grad_norms)):
            assert abs(a - b) <= rtol * abs(a), f"step {i}: gradient norm {b!r} != reference {a!r}"
    missing = sorted(set(ref.params) - set(got.params))
    assert not missing, f"parameters missing from the parallel run: {missing[:5]}"
    for k, v in ref.params.items():
        if dtypes is not None and v.dtype not in dtypes:
            continue
        w = got.params[k]
        assert w.shape == v.shape, f"{k}: shape {tuple(w.shape)} != {tuple(v.shape)}"
        err = (w.float() - v.float()).abs().max().item() if v.numel() else 0.0
        assert err <= atol, f"{k}: max abs diff {err:.3e} > {atol:.0e}"


def compare_grads(ref: Trajectory, got: Trajectory, *, loss_dtype: torch.dtype | None = None) -> numerics.Comparison:
    """Assert ``got`` has the losses of every step and the first step's gradients of ``ref`` within
    float tolerance (:mod:`fairscale.numerics`: each gradient relative to its norm, at ``2¹⁰·u``
    and losses at ``2⁸·u``, ``u`` the roundoff of the least precise dtype of the computation: of
    the parameters and the reference's loss). Returns the comparison (``.describe()`` for the
    numbers). ``loss_dtype``: the precision the run reported its losses in, when coarser."""
    result = grad_comparison(ref, got, loss_dtype=loss_dtype)
    result.assert_ok()
    return result


def grad_comparison(ref: Trajectory, got: Trajectory, *, loss_dtype: torch.dtype | None = None,
                    floor: float = 0.0) -> numerics.Comparison:
    """:func:`compare_grads` without the assertion: the comparison, within tolerance or not.
    ``floor``: the model's measured float precision floor (``numerics.precision_floor``)."""
    assert ref.grads, "the reference recorded no gradients (train it with train_reference)"
    assert got.grads, "the parallel run recorded no gradients: fill Trajectory.grads from pm.full_grads()"
    dtype = numerics.least_precise([t.dtype for t in ref.grads.values()] + [ref.loss_dtype])
    return numerics.compare(ref.losses, got.losses, ref.grads, got.grads, dtype=dtype, loss_dtype=loss_dtype,
                            floor=floor)
