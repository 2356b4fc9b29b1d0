"""cpu_softmax: on the CPU, past MIN_ELEMENTS scores, the polynomial softmax gives mx.softmax's
probabilities to float32 rounding: masked columns exactly 0, rows summing to 1, any shape as
the window grows; elsewhere it is mx.softmax itself."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache import cpu_softmax

from .other_thread import failures_in_another_threads_stream


def _scores(shape, seed: int, spread: float = 8.0) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)) * spread


def _close(ours, theirs):
    ours, theirs = np.array(ours), np.array(theirs)
    assert ours.shape == theirs.shape
    # A few float32 ulp of the largest probability (the sum and the exp round apart).
    assert np.abs(ours - theirs).max() <= 5e-7 * max(1e-30, np.abs(theirs).max())


@pytest.mark.parametrize("columns", [911, 912, 2112, 2113, 8448])
@pytest.mark.parametrize("spread", [0.1, 8.0, 60.0])
def test_probabilities_are_mx_softmax(columns, spread):
    scores = _scores((1, 3, 3, columns), seed=columns, spread=spread)
    assert cpu_softmax.applies(scores)
    ours = cpu_softmax.softmax(scores)
    _close(ours, mx.softmax(scores, axis=-1, precise=True))
    assert np.allclose(np.array(ours.sum(-1)), 1.0, atol=1e-6)


def test_the_exponential_over_its_range():
    # Every x from 0 down to the underflow: within one float32 ulp of e^x (float64's), where
    # MLX's own exp errs by up to 3.8e-6 relative on this range.
    x = mx.linspace(-87.0, 0.0, 400_001)
    ours = np.array(cpu_softmax.scaled(*cpu_softmax._reduced(x)))
    exact = np.exp(np.array(x).astype(np.float64))
    assert np.max(np.abs(ours - exact) / exact) <= 1.2e-7


def test_masked_and_underflowing_columns_are_exactly_zero():
    scores = _scores((1, 2, 4, 4096), seed=1)
    low = mx.finfo(mx.float32).min
    masked = mx.concatenate([scores[..., :4000], mx.full((1, 2, 4, 96), low)], axis=-1)
    masked = mx.concatenate([masked[..., :10], masked[..., 10:11] - 200.0, masked[..., 11:]], axis=-1)
    ours = np.array(cpu_softmax.softmax(masked))
    assert (ours[..., 4000:] == 0.0).all() and (ours[..., 10] == 0.0).all()
    _close(mx.array(ours), mx.softmax(masked, axis=-1, precise=True))


def test_a_growing_window_reuses_the_shapeless_function():
    # One compiled function serves every width: the decode step's scores widen by one a step.
    cpu_softmax._polynomial.cache_clear()
    for columns in range(3000, 3010):
        scores = _scores((1, 3, 3, columns), seed=columns)
        _close(cpu_softmax.softmax(scores), mx.softmax(scores, axis=-1, precise=True))
    assert cpu_softmax._polynomial.cache_info().misses == 1


def test_small_scores_and_other_dtypes_take_mx_softmax(monkeypatch):
    small = _scores((1, 3, 3, 100), seed=2)
    assert not cpu_softmax.applies(small)
    assert np.array_equal(np.array(cpu_softmax.softmax(small)), np.array(mx.softmax(small, axis=-1, precise=True)))
    half = _scores((1, 3, 3, 4096), seed=3).astype(mx.float16)
    assert not cpu_softmax.applies(half)
    big = _scores((1, 3, 3, 4096), seed=4)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
    assert not cpu_softmax.applies(big)


def test_a_function_first_built_in_another_threads_stream_serves_this_thread():
    cpu_softmax._polynomial.cache_clear()
    scores = _scores((1, 3, 3, 4096), seed=5)
    mx.eval(scores)
    assert not failures_in_another_threads_stream(lambda: cpu_softmax.softmax(scores))
    _close(cpu_softmax.softmax(scores), mx.softmax(scores, axis=-1, precise=True))
