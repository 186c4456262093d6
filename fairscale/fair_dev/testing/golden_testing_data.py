"""AdaScale test cases for a ``Linear(2, 2)`` model trained on ``model(x).sum()``, two gradients per
step (two ranks, or two accumulated backward passes), with their expected gain and gradients.

The expected values are derived here in closed form, not recorded from a run: for ``y = W x + b``
and loss ``sum(y)``, the gradient of one input is ``dW = [x, x]`` (every output row sees ``x``) and
``db = [1, 1]``, independent of the weights. With the per-input gradients ``g_i`` of ``S = 2``
inputs and their mean ``ḡ`` (what the averaged/accumulated ``.grad`` holds), AdaScale's estimates
(Johnson et al. 2020, "AdaScale SGD", section 3.3; FairScale 0.4.13 clamps them at 1e-6 and 0) are::

    σ² = S/(S-1) · ((1/S) Σ‖g_i‖² − ‖ḡ‖²),   μ² = ‖ḡ‖² − σ²/S,   gain = (σ² + μ²) / (σ²/S + μ²)

smoothed by a bias-corrected moving average with factor ``1 - S/1000`` when a case has several
steps ("inputs"); a single-step case ("input") is checked after each of two identical steps.
"""

from __future__ import annotations

import numpy as np

__all__ = ["adascale_test_data", "corr_mean_test_data"]

_S = 2
_SMOOTHING = max(1.0 - _S / 1000.0, 0.0)


def _grads(x: list[float]) -> np.ndarray:
    """The flattened gradient (dW, db) of ``sum(W x + b)`` for one input, in float32 as torch has it."""
    x32 = np.asarray(x, dtype=np.float32)
    return np.concatenate([np.tile(x32, 2), np.ones(2, dtype=np.float32)]).astype(np.float64)


def _estimates(pair: list[list[float]]) -> tuple[float, float, np.ndarray]:
    g = np.stack([_grads(x) for x in pair])
    mean = g.mean(axis=0)
    sum_sqr = float((g ** 2).sum())
    mean_sqr = float((mean ** 2).sum())
    var = _S / (_S - 1) * (sum_sqr / _S - mean_sqr)
    sqr = mean_sqr - var / _S
    return max(var, 1e-6), max(sqr, 0.0), mean


def _case(steps: list[list[list[float]]]) -> dict:
    """Expected gain after the last step (debiased moving average over the steps) and its mean gradient."""
    var_b = sqr_b = unbias = 0.0
    for pair in steps:
        var, sqr, mean = _estimates(pair)
        var_b = _SMOOTHING * var_b + (1 - _SMOOTHING) * var
        sqr_b = _SMOOTHING * sqr_b + (1 - _SMOOTHING) * sqr
        unbias = _SMOOTHING * unbias + (1 - _SMOOTHING)
    var, sqr = var_b / unbias, sqr_b / unbias
    mean32 = np.stack([_grads(x) for x in steps[-1]]).astype(np.float32).mean(axis=0, dtype=np.float32)
    return {"expected_gain": (var + sqr) / (var / _S + sqr),
            "expected_grad": [mean32[:2].astype(float).tolist()] * 2,
            "expected_bias_grad": mean32[4:].astype(float).tolist()}


_SINGLE = [[[1.0, 0.0], [0.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]], [[-1.0, 1.0], [1.0, -1.0]],
           [[1.0, 4.0], [5.0, 0.5]], [[-0.2, 3.0], [5.0, 0.5]]]
_MULTI = [[[[-0.2, 3.3], [5.2, 0.7]], [[1.0, 4.0], [3.1, 0.1]]]]

# "input": the inputs of micro-batch/rank 0 and 1, the same on both steps; "inputs": one pair per step
adascale_test_data = ([{"input": pair, **_case([pair])} for pair in _SINGLE]
                      + [{"inputs": steps, **_case(steps)} for steps in _MULTI])

# Two ranks' gradients of ``sum(Linear(3, 1, bias=False)(x))`` (the gradient is ``x``) on three steps:
# their mean, their Pearson correlation, and the cosine similarity of each step's mean gradient
# with the previous step's (none for the first).
_CORR_INPUTS = [[[1.0, 0.0, 2.0], [2.0, 0.0, 1.0]], [[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]],
                [[3.0, 1.0, 2.0], [2.0, 1.0, -1.0]]]


def _corr(a: list[float], b: list[float]) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def _cos(a: list[float], b: list[float]) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return float(np.dot(a, b) / (na * nb)) if na and nb else float("nan")


_CORR_MEANS = [np.mean(pair, axis=0).tolist() for pair in _CORR_INPUTS]
corr_mean_test_data = [{
    "inputs": _CORR_INPUTS,
    "expected_grad": _CORR_MEANS,
    "expected_corr": [_corr(*pair) for pair in _CORR_INPUTS],
    "expected_cos_similarity": [float("nan")] + [_cos(a, b) for a, b in zip(_CORR_MEANS[1:], _CORR_MEANS)],
}]
