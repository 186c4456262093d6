"""fairscale.numerics: the float tolerance shared by ``fairscale check`` and the exactness tests."""

from __future__ import annotations

import pytest
import torch

from fairscale import numerics
from fairscale.testing.reference import Trajectory, compare_grads


def _grads(seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb.weight": torch.randn(16, 8, generator=g, dtype=dtype),
            "layers.0.fc.weight": torch.randn(8, 8, generator=g, dtype=dtype),
            "layers.0.fc.bias": torch.randn(8, generator=g, dtype=dtype),
            "layers.1.fc.weight": torch.randn(8, 8, generator=g, dtype=dtype),
            "head.weight": torch.randn(4, 8, generator=g, dtype=dtype)}


def test_tolerances_follow_unit_roundoff() -> None:
    assert numerics.unit_roundoff(torch.float32) == 2.0 ** -24
    assert numerics.grad_rtol(torch.float32) == pytest.approx(2.0 ** -14)  # 6.1e-5
    assert numerics.loss_rtol(torch.float32) == pytest.approx(2.0 ** -16)  # 1.5e-5
    assert numerics.grad_rtol(torch.float64) == pytest.approx(2.0 ** -43)
    assert numerics.grad_rtol(torch.bfloat16) == 2.0 ** -5  # capped: a coarse check, said so in the docstring
    assert numerics.least_precise([torch.float64, torch.float32, None]) == torch.float32


def test_rounding_noise_passes_and_every_real_difference_is_caught() -> None:
    ref = _grads()
    noisy = {k: v * (1 + 4 * 2.0 ** -24 * torch.randn_like(v)) for k, v in ref.items()}  # a few ulps
    assert numerics.compare([2.5], [2.5 * (1 + 2.0 ** -23)], ref, noisy).ok
    doubled = dict(noisy, **{"layers.0.fc.weight": 2 * ref["layers.0.fc.weight"]})  # a missing dp average
    result = numerics.compare([2.5], [2.5], ref, doubled)
    assert not result.ok and [d.key for d in result.grads if not d.ok] == ["layers.0.fc.weight"]
    slightly = dict(noisy, **{"layers.1.fc.weight": ref["layers.1.fc.weight"] * (1 + 1e-3)})
    assert not numerics.compare([2.5], [2.5], ref, slightly).ok
    assert not numerics.compare([2.5], [2.5001], ref, noisy).ok  # loss 4e-5 off > 1.5e-5


def test_first_bad_module_follows_the_given_order_and_reports_problems() -> None:
    ref = _grads()
    got = dict(ref)
    got["layers.0.fc.weight"] = ref["layers.0.fc.weight"] + 1.0
    got["layers.1.fc.weight"] = ref["layers.1.fc.weight"] + 1.0
    del got["head.weight"]
    backward = ["head.weight", "layers.1.fc.weight", "layers.0.fc.bias", "layers.0.fc.weight", "emb.weight"]
    result = numerics.compare([1.0], [1.0], ref, got, order=backward, order_note=" (backward order)")
    first = result.first_bad()
    assert first is not None and first.key == "head.weight" and first.problem == "no gradient in the parallel run"
    text = result.describe()
    assert "DIFFERENT" in text and "first module whose gradient differs (backward order): head" in text
    got["head.weight"] = ref["head.weight"]
    result = numerics.compare([1.0], [1.0], ref, got, order=backward)
    assert result.first_bad().module == "layers.1.fc"  # type: ignore[union-attr]
    shape = dict(ref, **{"emb.weight": torch.zeros(8, 16)})
    assert "shape (8, 16) != (16, 8)" in numerics.compare([1.0], [1.0], ref, shape).describe()


def test_vanishing_gradient_is_measured_against_the_typical_entry() -> None:
    """A key bias's gradient is rounding noise around 0 (softmax shift invariance): its noise is
    relative to the model's typical gradient entry, not to its own near-zero norm."""
    ref = _grads()
    ref["layers.0.attn.k_bias"] = torch.full((8,), 1e-9)
    got = dict(ref, **{"layers.0.attn.k_bias": torch.full((8,), -1e-9)})  # 200% off its own norm
    assert numerics.compare([1.0], [1.0], ref, got).ok
    got["layers.0.attn.k_bias"] = torch.full((8,), 1e-2)  # a real gradient where there is none
    assert not numerics.compare([1.0], [1.0], ref, got).ok


def test_mixed_precision_uses_the_least_precise_dtype() -> None:
    """A float64 model with float32 experts: every gradient carries float32 rounding."""
    ref = {k: v.double() for k, v in _grads().items()}
    ref["experts.w"] = torch.randn(4, 4)
    got = {k: v * (1 + 1e-7) for k, v in ref.items()}
    assert not numerics.compare([1.0], [1.0], ref, got, dtype=torch.float64).ok
    assert numerics.compare([1.0], [1.0], ref, got).ok


def test_compare_grads_reads_trajectories() -> None:
    ref = Trajectory(losses=[3.0, 2.9], grads=_grads(), loss_dtype=torch.float32)
    got = Trajectory(losses=[3.0, 2.9], grads={k: v.clone() for k, v in ref.grads.items()})
    assert compare_grads(ref, got).ok
    got.grads["emb.weight"] = got.grads["emb.weight"] * 0.5
    with pytest.raises(AssertionError, match="emb.weight"):
        compare_grads(ref, got)
    with pytest.raises(AssertionError, match="recorded no gradients"):
        compare_grads(ref, Trajectory(losses=[3.0, 2.9]))


def test_the_measured_float32_floor_widens_the_gradient_bound_to_twice_the_floor() -> None:
    """An ill-conditioned model (Hugging Face T5 in float32: 4.4e-3 from float64 in one process)
    is judged against its own measured floor: a run as accurate as the reference is within
    2 x floor of it (numerics module docstring); a well-conditioned model's floor changes nothing."""
    exact = {k: v.double() for k, v in _grads().items()}
    ref = {k: (v * (1 + 1e-3 * torch.randn_like(v))).float() for k, v in exact.items()}  # 1e-3 from exact
    floor = numerics.precision_floor(ref, exact)
    assert 5e-4 < floor < 2e-3
    other = {k: (v * (1 + 1e-3 * torch.randn_like(v))).float() for k, v in exact.items()}  # as accurate
    assert not numerics.compare([1.0], [1.0], ref, other).ok
    assert numerics.compare([1.0], [1.0], ref, other, floor=floor).ok
    wrong = dict(other, **{"head.weight": ref["head.weight"] * 1.05})  # a real difference stays one
    assert not numerics.compare([1.0], [1.0], ref, wrong, floor=floor).ok
    tiny = numerics.precision_floor({k: v.float() for k, v in exact.items()}, exact)
    assert 2 * tiny < numerics.grad_rtol(torch.float32)
