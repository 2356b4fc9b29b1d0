"""The outlier selection kernel (outlier_select_kernel.py) against a stable ascending argsort's
first `count` entries: on the CPU through the thread-level CUDA emulation
(tests/cache/cuda_emulation.py), on MLX's CUDA backend for real (`pytest -m cuda`), and compiled
by nvcc for sm_90 without spills (slow)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from veloxquant_mlx.cache import outlier_select_kernel

needs_compiler = pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")


def _stable_first(scores: np.ndarray, count: int) -> np.ndarray:
    """The rule the kernel keeps: positions of the `count` smallest, ties to the lower position,
    in ascending (score, position) order. -0.0 and +0.0 compare equal, as floats do."""
    return np.argsort(scores, axis=-1, kind="stable")[..., :count].astype(np.uint32)


def _rows(kind: str, shape, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "random":  # outlier scores as the caches make them: -|x - mean| / std
        return -np.abs(rng.standard_normal(shape)).astype(np.float32)
    if kind == "ties":  # few distinct values: the count-th smallest is tied many times over
        return -rng.integers(0, 4, size=shape).astype(np.float32)
    if kind == "zeros":  # an all-zero block's scores: every entry -0.0 or +0.0
        signs = rng.integers(0, 2, size=shape).astype(bool)
        return np.where(signs, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    if kind == "signed":  # both signs, extreme magnitudes, subnormals
        x = rng.standard_normal(shape).astype(np.float32) * np.float32(1e30)
        x.flat[::7] = np.float32(1e-42)
        x.flat[::11] = np.float32(-1e-42)
        return x
    raise ValueError(kind)


CASES = [
    # (row shape, count, data)
    ((2, 3, 4096), 41, "random"),  # KVQuant's 8B blocks: 32 tokens x 128 channels, 1% outliers
    ((1, 2, 8192), 164, "random"),  # GEAR-sized blocks: 64 tokens x 128, 2%
    ((2, 2, 4096), 41, "ties"),
    ((1, 2, 2048), 20, "zeros"),
    ((3, 1000), 300, "signed"),  # a row length that is no multiple of the block's threads
    ((2, 64), 64, "random"),  # every entry picked
    ((2, 100), 1, "ties"),
    ((1, 2, 32768), 328, "random"),  # GEAR's 256 x 128 blocks: keys made again from the scores
    ((1, 16384), 50, "ties"),
]


@needs_compiler
@pytest.mark.parametrize("shape, count, data", CASES)
def test_emulated_kernel_picks_a_stable_sorts_first_entries(shape, count, data):
    scores = _rows(data, shape)
    with cuda_emulation.emulated_kernels() as made:
        got = outlier_select_kernel.smallest(mx.array(scores), count)
        mx.eval(got)
    assert [k.name.split("__")[0] for k in made] == ["vq_outlier_select"]
    assert got.dtype == mx.uint32 and got.shape == (*shape[:-1], count)
    np.testing.assert_array_equal(np.array(got), _stable_first(scores, count))


@needs_compiler
def test_the_picks_are_argpartitions_set_where_the_count_th_score_is_not_tied():
    scores = _rows("random", (2, 4, 4096), seed=3)
    with cuda_emulation.emulated_kernels():
        got = np.array(outlier_select_kernel.smallest(mx.array(scores), 41))
    reference = np.array(mx.argpartition(mx.array(scores), kth=40, axis=-1)[..., :41])
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(reference, axis=-1))


def test_what_does_not_fit_is_refused_with_the_limit():
    assert outlier_select_kernel.fits(8192, 164) and outlier_select_kernel.fits(32768, 328)
    assert outlier_select_kernel.fits(4096, 4096)  # the keys then left in global memory
    assert not outlier_select_kernel.fits(8192, 8192) and not outlier_select_kernel.fits(100, 0)
    assert not outlier_select_kernel.fits(100, 101)
    with pytest.raises(ValueError, match="outlier selection of 8192 among 8192 entries"):
        outlier_select_kernel.smallest(mx.zeros((1, 8192)), 8192)


def test_enabled_follows_the_switch_and_the_backend(monkeypatch):
    from veloxquant_mlx.cache import fused_decode

    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    assert outlier_select_kernel.enabled()
    monkeypatch.setattr(outlier_select_kernel, "ENABLED", False)
    assert not outlier_select_kernel.enabled()
    monkeypatch.setattr(outlier_select_kernel, "ENABLED", True)
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: False)
    assert not outlier_select_kernel.enabled()


@cuda_test
@pytest.mark.parametrize("shape, count, data", CASES + [((8, 64, 4096), 41, "random")])
def test_kernel_on_cuda_picks_a_stable_sorts_first_entries(shape, count, data):
    scores = _rows(data, shape)
    got = outlier_select_kernel.smallest(mx.array(scores), count)
    np.testing.assert_array_equal(np.array(got), _stable_first(scores, count))


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        outlier_select_kernel.smallest(mx.zeros((2, 4096)), 41)
        outlier_select_kernel.smallest(mx.zeros((2, 8192)), 164)
        outlier_select_kernel.smallest(mx.zeros((2, 32768)), 328)
    sources = sorted({kernel.cuda_source(sig) for kernel, sig in captured})
    assert len(sources) == 3
    for i, source in enumerate(sources):
        compiled_without_spills(source, tmp_path, i)
