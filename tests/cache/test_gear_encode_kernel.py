"""GEAR's encode kernels (gear_encode_kernel.py: Gram-Schmidt's steps, the sparse part) against the
MLX ops, bit for bit: on the CPU through the thread-level CUDA emulation (tests/cache/cuda_emulation.py, which cannot
check nvrtc's acceptance nor speed), on MLX's CUDA backend for real (`pytest -m cuda`), and compiled
by nvcc for sm_90 without spills (slow) as a proxy for nvrtc."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.encoder_reference import ReferenceGEARCache
from tests.cache.test_encoder_identity import _bits, _feed_and_compare, _kv
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from tests.cache.stable_selection import stable_argpartition
from veloxquant_mlx.cache import gear_encode_kernel, gear_encoder, gear_group_kernel, gear_lowrank, gear_power_kernel, outlier_select_kernel
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.config import KVCacheConfig

needs_compiler = pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")


@pytest.fixture(autouse=True)
def gram_schmidt_kernels(monkeypatch):
    """These tests pin the Gram-Schmidt kernels' bits: the power iteration's own kernel
    (gear_power_kernel.py, which takes its place on CUDA and sums in another order) off."""
    monkeypatch.setattr(gear_power_kernel, "ENABLED", False)


@pytest.fixture
def uncompiled(monkeypatch):
    """The power iteration as on CUDA: not through mx.compile (gear_lowrank.COMPILE_ON_GPU)."""
    monkeypatch.setattr(gear_lowrank, "_compile_here", lambda: False)


# The batched way is off by default (until a GPU confirms its bits): its emulated cases are slow
# tests, the default's stay in the fast subset.
@pytest.fixture(params=[pytest.param(True, marks=pytest.mark.slow), False], ids=["batched_sums", "sum_per_column"])
def batched(request, monkeypatch):
    """Both ways of summing a round of projections (gear_encode_kernel.BATCHED_SUMS)."""
    monkeypatch.setattr(gear_encode_kernel, "BATCHED_SUMS", request.param)
    return request.param


def _kernel_names(rank: int, batched: bool) -> set[str]:
    suffix = lambda later: "_batched" if batched and later else ""  # noqa: E731
    return {f"vq_gear_gs_normalize_{i}{suffix(i)}" for i in range(rank)} | {
        f"vq_gear_gs_project_{i}{suffix(i)}" for i in range(1, rank)}


def _same_bits(a: mx.array, b: mx.array) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(_bits(a), _bits(b))


def _iterates(rank: int, seed: int) -> mx.array:
    """(1, 2, 3, 64, rank) iterates: Gaussian, one block of rank < r (a repeated column: a
    zero column after Gram-Schmidt), one so tiny that its squares underflow (the norm's floor
    divides), one all-zero block, one huge-scaled."""
    y = mx.random.normal((1, 2, 3, 64, rank), key=mx.random.key(seed))
    if rank > 1:
        y[0, 0, 1, :, rank - 1] = y[0, 0, 1, :, 0] * 2
    y[0, 0, 2] = y[0, 0, 2] * 1e-25
    y[0, 1, 0] = 0.0
    y[0, 1, 2] = y[0, 1, 2] * 1e18
    return y


@needs_compiler
@pytest.mark.parametrize("rank", [1, 2, 4])
def test_orthonormal_is_the_ops_bit_for_bit(rank, batched):
    y = _iterates(rank, seed=rank)
    reference = gear_lowrank._orthonormal(y)
    with cuda_emulation.emulated_kernels() as made:
        ours = gear_encode_kernel.orthonormal(y)
        mx.eval(ours)
    # normalize per column, project per column but the last
    assert {k.name for k in made} == _kernel_names(rank, batched)
    _same_bits(reference, ours)
    assert not np.isnan(np.array(ours)).any()


@needs_compiler
def test_power_iteration_takes_the_kernels_on_cuda_and_stays_bit_identical(uncompiled, batched):
    residual = mx.random.normal((1, 2, 2, 256, 128), key=mx.random.key(3)) * 0.1
    reference = gear_lowrank.low_rank_factors(residual, 4)
    mx.eval(reference)
    with cuda_emulation.emulated_kernels() as made:
        ours = gear_lowrank.low_rank_factors(residual, 4)
        mx.eval(ours)
    assert {k.name for k in made} == _kernel_names(4, batched)
    for a, b in zip(reference, ours):
        _same_bits(a, b)


@needs_compiler
@pytest.mark.parametrize("dtype, real_shaped", [(mx.bfloat16, True), (mx.float16, "degenerate")])
def test_gear_encoder_with_the_kernels_matches_the_frozen_encoder(uncompiled, batched, dtype, real_shaped):
    """The whole cache's stores (a prefill chunk, then decode flushes), kernels emulated, against
    the frozen encoder of main 2e28496 (tests/cache/test_encoder_identity.py's comparison)."""
    keys, values = _kv(1024 + 256, 2, 64, dtype, seed=5, real_shaped=real_shaped)
    config = KVCacheConfig(method="gear")
    # The reference's argpartition under the selection kernel's rule (tests/cache/stable_selection.py).
    with stable_argpartition(), cuda_emulation.emulated_kernels() as made:
        _feed_and_compare(lambda: GEARCache(config), lambda: ReferenceGEARCache(config), keys, values, [1024, 256])
    names = {k.name for k in made}
    # The cache's two sides select their outliers in one launch (gear_encoder.encode_sides).
    assert "vq_gear_sparse_part" in names and "vq_gear_gs_normalize_0" in names and "vq_outlier_select_pair" in names


@needs_compiler
def test_the_enabled_switch_turns_the_kernels_off(monkeypatch, uncompiled):
    monkeypatch.setattr(gear_encode_kernel, "ENABLED", False)
    monkeypatch.setattr(outlier_select_kernel, "ENABLED", False)  # its own switch, the selection's
    residual = mx.random.normal((1, 1, 1, 256, 64), key=mx.random.key(4))
    keys, values = _kv(512, 2, 64, mx.bfloat16, seed=2, real_shaped=True)
    with cuda_emulation.emulated_kernels() as made:
        mx.eval(gear_lowrank.low_rank_factors(residual, 4))
        cache = GEARCache(KVCacheConfig(method="gear"))
        cache.update_and_fetch(keys, values)
        cache._flush()
        mx.eval(cache.store)
    assert cache.n_compressed == 512 and made == []


def _setting(rank: int, count: int, dim: int, side=mx.bfloat16, per_channel=False):
    return gear_encoder.EncoderSetting(2, 32, rank, count, 256, side, per_channel)


@needs_compiler
@pytest.mark.parametrize("rank, dim, per_channel", [(0, 64, False), (2, 64, True), (1, 512, False)])
def test_sparse_part_is_the_ops_bit_for_bit(uncompiled, rank, dim, per_channel):
    """Without a low rank (HAS_LOW = 0), keys and values, and uint32 positions (256 x 512
    entries per block: over uint16), through encode_side with the kernels on and off."""
    blocks = mx.random.normal((1, 2, 2, 256, dim), key=mx.random.key(dim + rank)) * 3
    count = max(1, round(0.01 * 256 * dim))
    setting = _setting(rank, count, dim, per_channel=per_channel)
    with stable_argpartition():
        reference = gear_encoder.encode_side(setting, blocks)
        mx.eval(reference)
        with cuda_emulation.emulated_kernels() as made:
            ours = gear_encoder.encode_side(setting, blocks)
            mx.eval(ours)
    assert {"vq_gear_sparse_part", "vq_outlier_select"} <= {k.name for k in made}
    assert ours["out_index"].dtype == (mx.uint32 if dim == 512 else mx.uint16)
    assert sorted(ours) == sorted(reference)
    for name in reference:
        _same_bits(reference[name], ours[name])


CORRUPTIONS = [
    # (kernel source builder, text, replacement): each must change some stored bit.
    ("_project_source", "__fmul_rn(v[J], ", "__fmul_rn(v[J] * 1.0000001f, "),  # a rounding off
    ("_normalize_source", "(norm != norm || norm > FLOOR) ? norm : FLOOR", "norm > 0.0f ? norm : 1.0f"),  # floor
    ("_normalize_source", "__fsqrt_rn(norm_sum[blk])", "__fsqrt_rn(norm_sum[blk] * 1.0000002f)"),
    ("_project_source", "q[row] = __fmul_rn(v[J + 1], v[J + 1])", "q[row] = __fmul_rn(v[J + 1], v[J])"),
    ("_ROW", "row / (size_t)N", "row / (size_t)(N / 2)"),  # a wrong block's sums
    ("_sum_at", "(rows / N) + blk]", "(rows / N) + (blk ^ 1)]"),  # batched: another block's sum
    ("_product_at", "rows + row]", "rows + (row ^ 1)]"),  # batched: a product in the wrong row
]


@needs_compiler
@pytest.mark.parametrize("builder, text, replacement", CORRUPTIONS)
def test_a_corrupted_source_is_caught(monkeypatch, builder, text, replacement):
    """The bit-for-bit comparison finds a changed rounding, a wrong operand or a wrong block."""
    monkeypatch.setattr(gear_encode_kernel, "BATCHED_SUMS", True)
    original = getattr(gear_encode_kernel, builder)
    if builder == "_ROW":
        assert text in original
        monkeypatch.setattr(gear_encode_kernel, "_ROW", original.replace(text, replacement))
    else:
        assert text in original(2, True)

        def corrupted(*args, original=original):
            return original(*args).replace(text, replacement)

        monkeypatch.setattr(gear_encode_kernel, builder, corrupted)
    y = _iterates(4, seed=9)
    reference = gear_lowrank._orthonormal(y)
    with cuda_emulation.emulated_kernels():
        ours = gear_encode_kernel.orthonormal(y)
        mx.eval(ours)
    assert not np.array_equal(_bits(reference), _bits(ours))


SPARSE_CORRUPTIONS = [
    ("if (LOW == 1) fitted = __fadd_rn(fitted, low[at]);", ""),  # the low rank left out
    ("const size_t at = blk * E + (size_t)p;", "const size_t at = blk * E + (size_t)(p ^ 1);"),  # wrong entry
    ("vq_cast<VT>(__fsub_rn(blocks[at], fitted))", "vq_cast<VT>(__fsub_rn(fitted, blocks[at]))"),  # sign
]


@needs_compiler
@pytest.mark.parametrize("text, replacement", SPARSE_CORRUPTIONS)
def test_a_corrupted_sparse_source_is_caught(monkeypatch, uncompiled, text, replacement):
    assert text in gear_encode_kernel._SPARSE_SOURCE
    monkeypatch.setattr(gear_encode_kernel, "_SPARSE_SOURCE", gear_encode_kernel._SPARSE_SOURCE.replace(text, replacement))
    blocks = mx.random.normal((1, 1, 2, 256, 64), key=mx.random.key(8)) * 3
    setting = _setting(4, 164, 64)
    reference = gear_encoder.encode_side(setting, blocks)["out_values"]
    with cuda_emulation.emulated_kernels():
        ours = gear_encoder.encode_side(setting, blocks)["out_values"]
        mx.eval(ours)
    assert not np.array_equal(_bits(reference), _bits(ours))


def _sparse_inputs(side, rank: int, dim: int, seed: int):
    """blocks, approx (1, 2, 3, 256, dim) float32, factors in the side dtype, 1% outliers."""
    k = mx.random.split(mx.random.key(seed), 5)
    shape = (1, 2, 3, 256, dim)
    blocks = mx.random.normal(shape, key=k[0]) * 3
    approx = mx.round(blocks * 2) / 2
    tokens = mx.random.normal((1, 2, 3 * 256, rank), key=k[1]).astype(side)
    channels = (mx.random.normal((1, 2, 3, dim, rank), key=k[2]) * 0.1).astype(side)
    count = max(1, round(0.01 * 256 * dim))
    index = mx.argsort(mx.random.uniform(shape=(1, 2, 3, 256 * dim), key=k[3]), axis=-1)[..., :count]
    return blocks, approx, (tokens, channels), index.astype(mx.int32)


def _sequential_product(tokens: mx.array, channels: mx.array, blocks_shape) -> np.ndarray:
    """A B^T per block as the kernel's LOW = 2 sums it: in rank order, each product and each sum
    rounded to float32 (numpy's float32 ufuncs, no FMA), (B, H, blocks, tokens, d)."""
    B, H, n_blocks, nb, d = blocks_shape
    a = np.array(tokens.astype(mx.float32)).reshape(B, H, n_blocks, nb, 1, -1)
    c = np.array(channels.astype(mx.float32))[:, :, :, None]  # (B, H, blocks, 1, d, rank)
    total = np.zeros((B, H, n_blocks, nb, d), dtype=np.float32)
    for j in range(a.shape[-1]):
        total = total + a[..., j] * c[..., j]
    return total


def _cpu_product(tokens: mx.array, channels: mx.array, blocks_shape) -> mx.array:
    """A B^T per block as the ops' stage 3 makes it: MLX's CPU matmul in float32."""
    B, H, n_blocks, nb, _ = blocks_shape
    rank = tokens.shape[-1]
    return tokens.astype(mx.float32).reshape(B, H, n_blocks, nb, rank) @ channels.astype(mx.float32).swapaxes(-1, -2)


def _missing(blocks: mx.array, approx: mx.array, low, index: mx.array, side) -> mx.array:
    """The ops' stage 3 at the outliers: blocks - (approx + low), cast to the side dtype."""
    B, H, n_blocks, nb, d = blocks.shape
    missing = (blocks - (approx + mx.array(low))).reshape(B, H, n_blocks, nb * d)
    return mx.take_along_axis(missing, index, axis=-1).astype(side)


@needs_compiler
@pytest.mark.parametrize("side, rank, dim", [(mx.bfloat16, 4, 128), (mx.float16, 1, 64), (mx.float32, 3, 64)])
def test_sparse_part_from_the_factors_is_the_ops_with_the_product_in_rank_order(side, rank, dim):
    """LOW = 2 (A B^T at each outlier from the stored factors, a sequential sum) against the ops'
    stage 3 with that product summed in rank order, and LOW = 1 (the kernel reading a product)
    against the ops with the CPU's matmul product it reads: bit for bit, float32 factors
    (inexact products) included. Whether the CPU's matmul is that sequential sum depends on the
    BLAS: test_the_cpu_s_product_of_the_factors_is_their_sum_in_rank_order."""
    blocks, approx, (tokens, channels), index = _sparse_inputs(side, rank, dim, seed=rank + dim)
    low = _cpu_product(tokens, channels, blocks.shape)
    with cuda_emulation.emulated_kernels():
        from_factors = gear_encode_kernel.sparse_part(blocks, approx, None, index, side, mx.uint16,
                                                      factors=(tokens, channels))
        from_product = gear_encode_kernel.sparse_part(blocks, approx, low, index, side, mx.uint16)
        mx.eval(from_factors, from_product)
    _same_bits(_missing(blocks, approx, _sequential_product(tokens, channels, blocks.shape), index, side), from_factors[0])
    _same_bits(_missing(blocks, approx, low, index, side), from_product[0])
    _same_bits(index.astype(mx.uint16), from_factors[1])


@pytest.mark.skipif("openblas" in os.environ.get("LD_PRELOAD", "").lower(),
                    reason="a preloaded OpenBLAS orders (and may fuse) the CPU's matmul otherwise; MLX's "
                           "bundled BLAS, which CI and the wheel use, sums in rank order")
@pytest.mark.parametrize("side, rank, dim", [(mx.bfloat16, 4, 128), (mx.float16, 1, 64), (mx.float32, 3, 64)])
def test_the_cpu_s_product_of_the_factors_is_their_sum_in_rank_order(side, rank, dim):
    """Why LOW = 2 stores the CPU path's bits: MLX's CPU matmul of GEAR's factors is the
    sequential sum the kernel makes."""
    blocks, _, (tokens, channels), _ = _sparse_inputs(side, rank, dim, seed=rank + dim)
    low = _cpu_product(tokens, channels, blocks.shape)
    assert np.array_equal(np.array(low).view(np.uint32),
                          _sequential_product(tokens, channels, blocks.shape).view(np.uint32))


FACTOR_CORRUPTIONS = [
    ("const int t = p / DIM, c = p - t * DIM;", "const int c = p / DIM, t = p - c * DIM;"),  # A's and B's rows swapped
    ("vq_f32(channels[b0 + j])", "vq_f32(channels[b0])"),  # one column of B for every r
    ("lr = __fadd_rn(lr, __fmul_rn(", "lr = __fadd_rn(lr * 0.5f, __fmul_rn("),  # a wrong sum
]


@needs_compiler
@pytest.mark.parametrize("text, replacement", FACTOR_CORRUPTIONS)
def test_a_corrupted_factor_sum_is_caught(monkeypatch, text, replacement):
    assert text in gear_encode_kernel._SPARSE_SOURCE
    monkeypatch.setattr(gear_encode_kernel, "_SPARSE_SOURCE", gear_encode_kernel._SPARSE_SOURCE.replace(text, replacement))
    blocks, approx, factors, index = _sparse_inputs(mx.float32, 3, 64, seed=11)
    with cuda_emulation.emulated_kernels():
        reference = gear_encode_kernel.sparse_part(blocks, approx, None, index, mx.float32, mx.uint16, factors=factors)
        mx.eval(reference)
    monkeypatch.setattr(gear_encode_kernel, "_SPARSE_SOURCE", gear_encode_kernel._SPARSE_SOURCE.replace(replacement, text))
    with cuda_emulation.emulated_kernels():
        ours = gear_encode_kernel.sparse_part(blocks, approx, None, index, mx.float32, mx.uint16, factors=factors)
        mx.eval(ours)
    assert not np.array_equal(_bits(reference[0]), _bits(ours[0]))


def test_the_sparse_part_takes_the_product_or_the_factors_not_both():
    blocks, approx, factors, index = _sparse_inputs(mx.bfloat16, 2, 64, seed=1)
    with pytest.raises(ValueError, match="both `low` and `factors`"):
        gear_encode_kernel.sparse_part(blocks, approx, blocks, index, mx.bfloat16, mx.uint16, factors=factors)


@cuda_test
@pytest.mark.parametrize("dtype, real_shaped", [(mx.bfloat16, True), (mx.float16, "degenerate"), (mx.float32, True)])
def test_gear_encoder_on_cuda_with_the_kernels_matches_the_frozen_encoder(monkeypatch, batched, dtype, real_shaped):
    """On MLX's CUDA backend (power iteration uncompiled there): kernels on, then off, both
    against the frozen encoder run on the same device."""
    keys, values = _kv(2048 + 512, 8, 128, dtype, seed=6, real_shaped=real_shaped)
    config = KVCacheConfig(method="gear")
    # The group kernels sum a group in their own order, MLX's CUDA reductions in theirs: their
    # own tests bound that (tests/cache/test_gear_group_kernel.py); here the other kernels' bits.
    monkeypatch.setattr(gear_group_kernel, "ENABLED", False)
    for on in (True, False):
        monkeypatch.setattr(gear_encode_kernel, "ENABLED", on)
        _feed_and_compare(lambda: GEARCache(config), lambda: ReferenceGEARCache(config), keys, values, [2048, 256, 256])


@cuda_test
@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_orthonormal_on_cuda_is_the_ops_bit_for_bit(rank, batched):
    y = _iterates(rank, seed=rank)
    _same_bits(gear_lowrank._orthonormal(y), gear_encode_kernel.orthonormal(y))


def encoder_sources(monkeypatch) -> set[str]:
    """The CUDA sources of the kernels one gear `_encode` (2 KV heads x 128, bf16, 256 tokens)
    launches, as MLX's backend would compile them (signatures only: nothing runs). The selection
    kernel off (it has its own nvcc test): its recorded launch would hand the quantizing stage
    placeholder positions."""
    monkeypatch.setattr(outlier_select_kernel, "ENABLED", False)
    keys, values = _kv(256, 2, 128, mx.bfloat16, seed=1, real_shaped=True)
    cache = GEARCache(KVCacheConfig(method="gear"))
    cache.batch_size, cache.n_kv_heads, cache.head_dim, cache.value_dim, cache.dtype = 1, 2, 128, 128, mx.bfloat16
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        cache._encode(keys, values)
    return {kernel.cuda_source(sig) for kernel, sig in captured}


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_kernels_compile_for_sm90_without_spills(tmp_path, monkeypatch):
    monkeypatch.setattr(gear_lowrank, "_compile_here", lambda: False)
    monkeypatch.setattr(gear_encode_kernel, "BATCHED_SUMS", True)  # first the batched sources
    sources = sorted(encoder_sources(monkeypatch))
    # normalize with 3, 2, 1, 0 later columns; project with 3, 2, 1; the sparse part (keys and
    # values share it: same block entries, count and dtypes); then the per-column sums' kernels
    assert len(sources) == 8
    monkeypatch.setattr(gear_encode_kernel, "BATCHED_SUMS", False)
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        gear_encode_kernel.orthonormal(mx.random.normal((1, 2, 1, 256, 4)))  # blocks of 256 as above
    sources += sorted({kernel.cuda_source(sig) for kernel, sig in captured} - set(sources))
    assert len(sources) == 8 + 6  # normalize_0 is the same source either way
    for i, source in enumerate(sources):
        compiled_without_spills(source, tmp_path, i)
