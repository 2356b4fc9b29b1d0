"""GEAR's power-iteration kernel (gear_power_kernel.py) against the MLX ops' power iteration
(gear_lowrank._power_iteration): on the CPU through the thread-level CUDA emulation
(tests/cache/cuda_emulation.py), on MLX's CUDA backend for real (`pytest -m cuda`), and compiled
by nvcc for sm_90 without spills (slow). Its sums run in another order than the ops', so the
factors are compared to float32 rounding, and the whole encoder's stored arrays: equal where the
low rank does not enter, within rounding where it does."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.stable_selection import stable_argpartition
from tests.cache.test_encoder_identity import _bits, _kv
from tests.cache.test_gear_encode_kernel import encoder_sources
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from veloxquant_mlx.cache import gear_lowrank, gear_power_kernel
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.config import KVCacheConfig

needs_compiler = pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")


def _residuals(n: int, d: int, seed: int) -> mx.array:
    """(1, 2, 2, n, d) float32 blocks: Gaussian noise (a quantizer's residual), one with a strong
    rank-2 part (the directions the low rank is for), one of rank 1 (later columns are rounding
    noise after Gram-Schmidt: only finite), one all zero (the norm's floor: zero factors, no NaN)."""
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    blocks = mx.random.normal((1, 2, 2, n, d), key=k1) * 0.1
    u, v = mx.random.normal((n, 2), key=k2), mx.random.normal((2, d), key=k3)
    blocks[0, 0, 1] = blocks[0, 0, 1] + u @ v
    blocks[0, 1, 0] = u[:, :1] @ v[:1]
    blocks[0, 1, 1] = 0.0
    return blocks


def _emulated(residual: mx.array, rank: int):
    start = gear_lowrank.start_matrix(residual.shape[-1], rank)
    with cuda_emulation.emulated_kernels() as made:
        ours = gear_power_kernel.factors(residual, start, gear_lowrank.POWER_STEPS)
        mx.eval(ours)
    assert [k.name for k in made] == ["vq_gear_power_iteration"]
    return ours


def _assert_close_to_the_ops(residual: mx.array, ours, rank: int, tolerance: float = 1e-4) -> None:
    left, right = gear_lowrank._power_iteration(residual, rank, gear_lowrank.POWER_STEPS)
    a, b = np.array(ours[0]), np.array(ours[1])
    assert a.shape == left.shape and b.shape == right.shape
    assert np.isfinite(a).all() and np.isfinite(b).all()
    # Blocks of rank >= r only: in a block of lower rank, Gram-Schmidt's later columns are
    # rounding noise normalized (single-pass Gram-Schmidt, the ops' too, loses orthogonality
    # there), which any other order of sums makes another noise.
    res = np.array(residual)
    full = np.linalg.matrix_rank(res.reshape(-1, *res.shape[-2:])).reshape(res.shape[:-2]) >= rank
    fitted, expected = (a @ b.swapaxes(-1, -2))[full], np.array(left @ right.swapaxes(-1, -2))[full]
    # The fit A B^T, per block relative to the residual's size: rounding of float32 sums in
    # another order, amplified at most by the power iteration's few steps.
    scale = np.abs(res[full]).max(axis=(-2, -1), keepdims=True)
    assert (np.abs(fitted - expected) <= tolerance * scale).all()
    np.testing.assert_allclose(a[full], np.array(left)[full], rtol=0, atol=2 * tolerance)


@needs_compiler
@pytest.mark.parametrize("n, d, rank", [(256, 128, 4), (64, 64, 1), (32, 512, 8), (48, 96, 3)])
def test_factors_match_the_ops_power_iteration(n, d, rank):
    # (256, 128, 4): the 8B shape of the H200 runs; (32, 512): more channels than threads (one
    # part per channel); (48, 96): neither divides the block's 256 threads.
    residual = _residuals(n, d, seed=n + d + rank)
    ours = _emulated(residual, rank)
    _assert_close_to_the_ops(residual, ours, rank)
    left = np.array(ours[0])
    # Orthonormal columns where the block has rank >= r; the zero block's factors are zero.
    gram = left[0, 0, 0].T @ left[0, 0, 0]
    np.testing.assert_allclose(gram, np.eye(rank), atol=1e-5)
    assert not left[0, 1, 1].any() and not np.array(ours[1])[0, 1, 1].any()


@needs_compiler
def test_the_low_rank_takes_the_kernel_on_cuda_and_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(gear_lowrank, "_compile_here", lambda: False)
    residual = _residuals(64, 64, seed=9)
    with cuda_emulation.emulated_kernels() as made:
        mx.eval(gear_lowrank.low_rank_factors(residual, 2))
    assert "vq_gear_power_iteration" in {k.name for k in made}
    monkeypatch.setattr(gear_power_kernel, "ENABLED", False)
    with cuda_emulation.emulated_kernels() as made:
        mx.eval(gear_lowrank.low_rank_factors(residual, 2))
    assert "vq_gear_power_iteration" not in {k.name for k in made} and made  # the Gram-Schmidt kernels


def test_a_start_of_the_wrong_shape_or_too_large_a_block_is_refused():
    with pytest.raises(ValueError, match=r"start of shape \(64, r\) with r >= 1, d a multiple of 4"):
        gear_power_kernel.factors(mx.zeros((1, 16, 64)), mx.zeros((32, 2)), 3)
    assert gear_power_kernel.fits(256, 128, 8) and not gear_power_kernel.fits(4096, 128, 8)
    assert not gear_power_kernel.fits(256, 128, 0) and not gear_power_kernel.fits(64, 66, 2)  # 16-byte rows
    with pytest.raises(ValueError, match="bytes of shared memory"):
        gear_power_kernel.factors(mx.zeros((1, 4096, 128)), mx.zeros((128, 8)), 3)


@needs_compiler
def test_the_encoder_with_the_kernel_stores_what_the_ops_store_up_to_the_low_rank_s_rounding(monkeypatch):
    """A whole GEAR cache (a prefill chunk, then a decode flush), kernels emulated, with the power
    kernel and without: the quantized codes, scales, zeros and outlier positions are the same
    arrays; the factors and the outliers' corrections (which subtract A B^T) within the side
    dtype's rounding; and the reconstruction error the same."""
    monkeypatch.setattr(gear_lowrank, "_compile_here", lambda: False)
    keys, values = _kv(512 + 256, 2, 64, mx.bfloat16, seed=5, real_shaped=True)
    stores = {}
    for on in (True, False):
        monkeypatch.setattr(gear_power_kernel, "ENABLED", on)
        cache = GEARCache(KVCacheConfig(method="gear"))
        with stable_argpartition(), cuda_emulation.emulated_kernels() as made:
            for start, size in ((0, 512), (512, 256)):
                cache.update_and_fetch(keys[:, :, start : start + size], values[:, :, start : start + size])
                cache._flush()
                mx.eval(cache.store)
        # The cache encodes both sides together: one paired launch (paired_rows) per encode.
        assert ("vq_gear_power_iteration_pair" in {k.name for k in made}) == on
        stores[on] = dict(cache.store), cache
    ours, theirs = stores[True][0], stores[False][0]
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        a, b = ours[name], theirs[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if "lr_" in name or "out_values" in name:
            np.testing.assert_allclose(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)),
                                       rtol=2e-2, atol=2e-2, err_msg=name)
        else:
            assert np.array_equal(_bits(a), _bits(b)), f"{name} differs"
    # What a reader gets back: the same keys and values up to the factors' rounding.
    restored = {on: [np.array(x.astype(mx.float32)) for x in stores[on][1].decode_float32()] for on in stores}
    for got, want in zip(restored[True], restored[False]):
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-2)


def _power_iteration_float64(residual: np.ndarray, start: np.ndarray, steps: int):
    """The power iteration in float64 (numpy), modified Gram-Schmidt as gear_lowrank's."""
    right = np.broadcast_to(start.astype(np.float64), (*residual.shape[:-2], *start.shape))
    for _ in range(steps):
        y = residual @ right
        columns = []
        for j in range(y.shape[-1]):
            v = y[..., j : j + 1]
            for c in columns:
                v = v - c * (c * v).sum(axis=-2, keepdims=True)
            columns.append(v / np.maximum(np.sqrt((v * v).sum(axis=-2, keepdims=True)), 1e-20))
        left = np.concatenate(columns, axis=-1)
        right = residual.swapaxes(-1, -2) @ left
    return left, right


@cuda_test
@pytest.mark.parametrize("n, d, rank", [(256, 128, 4), (64, 64, 1), (32, 512, 8), (48, 96, 3)])
def test_factors_on_cuda_fit_as_well_as_the_power_iteration_in_float64(n, d, rank):
    # On CUDA neither the ops (cuBLAS's float32 matmuls: session 17 on the H200, up to ~1e-3 of
    # the residual's size from the kernel at 32 x 512, rank 8) nor float64 are a reference to
    # the factors' bits: where the residual's next singular values are close (noise), which of
    # their directions three steps pick follows every rounding. What must hold is the fit: on
    # the blocks of full rank, |R - A B^T| as small as the same iteration's in float64.
    residual = _residuals(n, d, seed=n + d + rank)
    start = gear_lowrank.start_matrix(d, rank)
    ours = gear_power_kernel.factors(residual, start, gear_lowrank.POWER_STEPS)
    mx.eval(ours)
    res = np.array(residual).astype(np.float64)
    left, right = _power_iteration_float64(res, np.array(start), gear_lowrank.POWER_STEPS)
    a, b = np.array(ours[0]).astype(np.float64), np.array(ours[1]).astype(np.float64)
    assert np.isfinite(a).all() and np.isfinite(b).all()
    # Rank at float32's resolution (the blocks are float32: the rank-1 block's rounding is not rank).
    full = np.linalg.matrix_rank(np.array(residual).reshape(-1, n, d)).reshape(res.shape[:-2]) >= rank
    error = np.linalg.norm(res - a @ b.swapaxes(-1, -2), axis=(-2, -1))[full]
    reference = np.linalg.norm(res - left @ right.swapaxes(-1, -2), axis=(-2, -1))[full]
    # Emulated (the same float32 order): within 1e-8 of the residual's norm.
    assert (np.abs(error - reference) <= 1e-5 * np.linalg.norm(res, axis=(-2, -1))[full]).all()
    assert not a[0, 1, 1].any() and not b[0, 1, 1].any()  # the zero block


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_the_kernel_compiles_for_sm90_without_spills(tmp_path, monkeypatch):
    sources = []
    for n, d, rank in ((256, 128, 4), (256, 128, 8), (256, 64, 4)):
        residual = mx.zeros((1, 1, 1, n, d))
        with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
            gear_power_kernel.factors(residual, gear_lowrank.start_matrix(d, rank), gear_lowrank.POWER_STEPS)
            if rank == 4 and d == 128:
                gear_power_kernel.factors_pair(residual, residual, gear_lowrank.start_matrix(d, rank),
                                               gear_lowrank.POWER_STEPS, mx.bfloat16)
        sources += [kernel.cuda_source(sig) for kernel, sig in captured]
    assert len(sources) == 4
    # The encoder's launches with the kernel: the power iteration and the sparse part computing
    # A B^T from the factors (LOW = 2).
    encoder = encoder_sources(monkeypatch)
    assert any("LOW = 2;" in source for source in encoder)
    for i, source in enumerate(sources + sorted(encoder - set(sources))):
        compiled_without_spills(source, tmp_path, i)


@needs_compiler
def test_a_paired_launch_gives_each_side_its_own_launch_s_factors():
    """Two arrays of blocks in one launch (paired_rows): each side's factors are its own
    launch's, bit for bit."""
    first, second = _residuals(64, 64, seed=11), _residuals(64, 64, seed=12)[:, :1]
    start = gear_lowrank.start_matrix(64, 2)
    with cuda_emulation.emulated_kernels() as made:
        paired = gear_power_kernel.factors_pair(first, second, start, gear_lowrank.POWER_STEPS)
        alone = [gear_power_kernel.factors(side, start, gear_lowrank.POWER_STEPS) for side in (first, second)]
        mx.eval(paired, alone)
    assert sorted(k.name for k in made) == ["vq_gear_power_iteration", "vq_gear_power_iteration_pair"]
    for got, want in zip(paired, alone):
        for a, b in zip(got, want):
            assert a.shape == b.shape
            assert np.array_equal(_bits(a), _bits(b))


@needs_compiler
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_factors_in_a_16_bit_dtype_are_the_float32_ones_rounded(dtype):
    """What GEAR stores (its side dtype), written by the kernel: astype's rounding of its
    float32 factors, bit for bit."""
    residual = _residuals(64, 64, seed=15)
    start = gear_lowrank.start_matrix(64, 2)
    with cuda_emulation.emulated_kernels():
        rounded = gear_power_kernel.factors(residual, start, gear_lowrank.POWER_STEPS, dtype)
        full = gear_power_kernel.factors(residual, start, gear_lowrank.POWER_STEPS)
        mx.eval(rounded, full)
    for a, b in zip(rounded, full):
        assert a.dtype == dtype
        assert np.array_equal(_bits(a), _bits(b.astype(dtype)))


def test_a_paired_power_iteration_takes_blocks_of_one_shape():
    with pytest.raises(ValueError, match="blocks of one shape"):
        gear_power_kernel.factors_pair(mx.zeros((1, 64, 64)), mx.zeros((1, 32, 64)), mx.zeros((64, 2)), 3)


@cuda_test
def test_a_paired_launch_on_cuda_gives_each_side_its_own_launch_s_factors():
    first, second = _residuals(256, 128, seed=13), _residuals(256, 128, seed=14)
    start = gear_lowrank.start_matrix(128, 4)
    paired = gear_power_kernel.factors_pair(first, second, start, gear_lowrank.POWER_STEPS)
    for got, side in zip(paired, (first, second)):
        for a, b in zip(got, gear_power_kernel.factors(side, start, gear_lowrank.POWER_STEPS)):
            assert np.array_equal(_bits(a), _bits(b))
    # In the side dtype (what GEAR stores): the float32 factors rounded as astype rounds them.
    for got, side in zip(gear_power_kernel.factors_pair(first, second, start, gear_lowrank.POWER_STEPS, mx.bfloat16),
                         (first, second)):
        for a, b in zip(got, gear_power_kernel.factors(side, start, gear_lowrank.POWER_STEPS)):
            assert np.array_equal(_bits(a), _bits(b.astype(mx.bfloat16)))
