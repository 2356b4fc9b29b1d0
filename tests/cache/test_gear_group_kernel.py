"""GEAR's per-group kernels (gear_group_kernel.py: the outlier scores, the dense part, Q(D) and the
residual) against the MLX ops: on the CPU through the thread-level CUDA emulation
(tests/cache/cuda_emulation.py), where MLX's sums of a group run in the kernels' order and every
result is bit for bit the ops'; on MLX's CUDA backend for real (`pytest -m cuda`), where MLX's
reductions sum in their own order, so a score or a fill may differ in its last bits (bounded
there) while Q(D) and the residual stay bit for bit; compiled by nvcc for sm_90 without spills
(slow)."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.test_encoder_identity import _bits, _kv
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from veloxquant_mlx.cache import gear_group_kernel
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.cache.gear_encoder import EncoderSetting, group_means, quantized
from veloxquant_mlx.cache.gear_outliers import outlier_mask, outlier_scores
from veloxquant_mlx.config import KVCacheConfig

needs_compiler = pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")


def _blocks(shape, seed: int) -> mx.array:
    """Gaussian blocks with an offset channel and spikes (outliers that matter), float32."""
    x = mx.random.normal(shape, key=mx.random.key(seed))
    x = x + mx.where(mx.arange(shape[-1]) == 3, 6.0, 0.0)
    return mx.where(mx.random.uniform(shape=shape, key=mx.random.key(seed + 1)) < 0.01, 9.0, x)


def _picks(blocks: mx.array, group: int, per_channel: bool, count: int) -> mx.array:
    """The `count` farthest entries of each block (a stable argsort of the ops' scores), and in
    block (0, 0, 0) a whole group (its first) among them, so one group has no entry left."""
    scores = np.array(outlier_scores(blocks, group_means(blocks, group, per_channel)))
    picks = np.argsort(scores, axis=-1, kind="stable")[..., :count].astype(np.uint32)
    d = blocks.shape[-1]
    whole_group = np.arange(group) * d if per_channel else np.arange(group)
    row = [p for p in picks[0, 0, 0] if p not in set(whole_group)][: count - group]
    picks[0, 0, 0] = np.concatenate([whole_group, row]).astype(np.uint32)
    return mx.array(picks)


def _ops_dense(blocks: mx.array, picks: mx.array, group: int, per_channel: bool, side) -> mx.array:
    """gear_encoder's stage 1 up to mx.quantize's input, as ops."""
    B, H, n_blocks, nb, d = blocks.shape
    mask = outlier_mask(picks, blocks.shape)
    fill = group_means(blocks, group, per_channel, weights=(~mask).astype(mx.float32))
    dense = mx.where(mask, fill, blocks).reshape(B, H, n_blocks * nb, d).astype(side)
    return dense.swapaxes(-1, -2) if per_channel else dense


CASES = [  # (blocks shape, group, count)
    ((1, 2, 2, 64, 64), 32, 41),
    ((2, 1, 3, 32, 128), 16, 40),
    ((1, 1, 1, 256, 128), 32, 328),  # one block of the default
]


@needs_compiler
@pytest.mark.parametrize("shape, group, count", CASES)
@pytest.mark.parametrize("per_channel", [True, False], ids=["keys", "values"])
@pytest.mark.parametrize("side", [mx.float16, mx.bfloat16, mx.float32])
def test_scores_and_dense_are_the_ops_bit_for_bit_on_the_cpu(shape, group, count, per_channel, side):
    blocks = _blocks(shape, seed=group + count)
    picks = _picks(blocks, group, per_channel, count)
    with cuda_emulation.emulated_kernels() as made:
        scores = gear_group_kernel.scores(blocks, group, per_channel)
        dense = gear_group_kernel.dense(blocks, picks, group, per_channel, side)
        mx.eval(scores, dense)
    assert {k.name.split("__")[0] for k in made} == {"vq_gear_group_scores", "vq_gear_group_dense"}
    expected_scores = outlier_scores(blocks, group_means(blocks, group, per_channel))
    expected = _ops_dense(blocks, picks, group, per_channel, side)
    assert dense.dtype == side and dense.shape == expected.shape
    assert np.array_equal(_bits(scores), _bits(expected_scores))
    assert np.array_equal(_bits(dense), _bits(expected))


TILED_CASES = [  # (blocks shape, group, count, per_channel): tiles other than the default's
    ((1, 1, 2, 256, 128), 128, 300, True),  # keys: 128 tokens x 32 channels, four tiles across d
    ((1, 2, 1, 128, 96), 64, 100, True),  # keys: 64 x 48, d not a power of two
    ((1, 1, 2, 48, 128), 32, 60, False),  # values: 24 tokens x 128 (48 tokens do not halve to 32)
    ((2, 1, 1, 32, 256), 64, 80, False),  # values: 16 x 256
]


@needs_compiler
@pytest.mark.parametrize("shape, group, count, per_channel", TILED_CASES)
def test_other_tiles_are_the_ops_bit_for_bit_on_the_cpu(shape, group, count, per_channel):
    blocks = _blocks(shape, seed=group + count)
    picks = _picks(blocks, group, per_channel, count)
    with cuda_emulation.emulated_kernels():
        scores = gear_group_kernel.scores(blocks, group, per_channel)
        dense = gear_group_kernel.dense(blocks, picks, group, per_channel, mx.bfloat16)
        mx.eval(scores, dense)
    assert np.array_equal(_bits(scores), _bits(outlier_scores(blocks, group_means(blocks, group, per_channel))))
    assert np.array_equal(_bits(dense), _bits(_ops_dense(blocks, picks, group, per_channel, mx.bfloat16)))


def test_the_tile_holds_whole_groups_within_its_entries():
    assert gear_group_kernel.tile_shape(256, 128, 32, True) == (32, 128)
    assert gear_group_kernel.tile_shape(256, 128, 32, False) == (32, 128)
    assert gear_group_kernel.tile_shape(256, 128, 128, True) == (128, 32)
    assert gear_group_kernel.tile_shape(128, 96, 64, True) == (64, 48)
    assert gear_group_kernel.tile_shape(48, 128, 32, False) == (24, 128)
    assert gear_group_kernel.tile_shape(256, 8192, 32, False) == (1, 8192)  # over TILE_ENTRIES: applies refuses


@needs_compiler
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("per_channel", [True, False], ids=["keys", "values"])
@pytest.mark.parametrize("side", [mx.float16, mx.bfloat16])
def test_approx_and_residual_are_the_ops_bit_for_bit(bits, per_channel, side):
    """Q(D) and D - Q(D) from mx.quantize's codes (3 bits: codes straddling words) against
    gear_encoder.quantized's ops, on two blocks of 64 x 64 per head."""
    shape, group, count = CASES[0]
    blocks = _blocks(shape, seed=bits)
    dense = _ops_dense(blocks, _picks(blocks, group, per_channel, count), group, per_channel, side)
    setting = EncoderSetting(bits, group, 4, count, shape[-2], side, per_channel)
    _, _, _, expected_approx, expected_residual = quantized(setting, dense, shape)
    codes, scales, zeros = mx.quantize(dense, group_size=group, bits=bits)
    with cuda_emulation.emulated_kernels():
        approx, residual = gear_group_kernel.approx_and_residual(dense, codes, scales, zeros, bits, group,
                                                                 per_channel, shape)
        mx.eval(approx, residual)
    assert approx.shape == residual.shape == shape
    assert np.array_equal(_bits(approx), _bits(expected_approx))
    assert np.array_equal(_bits(residual), _bits(expected_residual))


@needs_compiler
def test_without_a_low_rank_the_residual_is_not_made():
    shape, group, count = CASES[0]
    blocks = _blocks(shape, seed=7)
    dense = _ops_dense(blocks, _picks(blocks, group, True, count), group, True, mx.bfloat16)
    setting = EncoderSetting(2, group, 0, count, shape[-2], mx.bfloat16, True)
    _, _, _, expected_approx = quantized(setting, dense, shape)
    codes, scales, zeros = mx.quantize(dense, group_size=group, bits=2)
    with cuda_emulation.emulated_kernels():
        approx, residual = gear_group_kernel.approx_and_residual(dense, codes, scales, zeros, 2, group, True, shape,
                                                                 with_residual=False)
        mx.eval(approx)
    assert residual is None
    assert np.array_equal(_bits(approx), _bits(expected_approx))


def _stores(on: bool, monkeypatch, keys, values, pieces, emulated: bool):
    monkeypatch.setattr(gear_group_kernel, "ENABLED", on)
    cache = GEARCache(KVCacheConfig(method="gear"))
    start = 0
    with cuda_emulation.emulated_kernels() if emulated else contextlib.nullcontext() as made:
        for size in pieces:
            cache.update_and_fetch(keys[:, :, start : start + size], values[:, :, start : start + size])
            cache._flush()
            mx.eval(cache.store)
            start += size
    return cache.store, {k.name.split("__")[0] for k in (made or [])}


@needs_compiler
@pytest.mark.parametrize("dtype, real_shaped", [(mx.bfloat16, True), (mx.float16, "degenerate")])
def test_the_cache_s_stores_are_the_same_with_the_kernels_on_or_off(monkeypatch, dtype, real_shaped):
    """A prefill chunk and a decode flush through GEARCache, every other encode kernel emulated
    as on CUDA: the group kernels change no stored bit (on the CPU)."""
    keys, values = _kv(1024 + 256, 2, 64, dtype, seed=5, real_shaped=real_shaped)
    on, made = _stores(True, monkeypatch, keys, values, [1024, 256], emulated=True)
    off, made_off = _stores(False, monkeypatch, keys, values, [1024, 256], emulated=True)
    assert made - made_off == {"vq_gear_group_scores", "vq_gear_group_dense", "vq_gear_group_residual"}
    assert sorted(on) == sorted(off)
    for name in off:
        assert np.array_equal(_bits(on[name]), _bits(off[name])), f"{name} differs"


@needs_compiler
@pytest.mark.parametrize(
    "source, text, replacement",
    [
        ("_DENSE_SOURCE", "1u << (p[i] & 31u)", "1u << (p[i] & 15u)"),  # a pick's bit misplaced
        ("_DENSE_SOURCE", "(kept > 0 ? kept : 1)", "G"),  # the fill averages over the whole group
        ("_DENSE_SOURCE", "blk * NB + t0 + tt", "blk * NB + tt"),  # keys' tokens misplaced (the tile's offset lost)
        ("_TILE", "PC ? ((tt / G) * CB + cl) * GS + tt % G", "PC ? (tt * (CB / G) + cl / G) * GS + cl % G"),  # keys' groups along channels
        ("_TILE", "const int t0 = (blockIdx.x / NCB) * TT", "const int t0 = 0 * TT"),  # every tile the row's first
        ("_SCORES_SOURCE", "__fdiv_rn(sum, (float)G)", "__fdiv_rn(sum, (float)(G + 1))"),  # the mean
    ],
)
def test_a_corrupted_source_is_caught(monkeypatch, source, text, replacement):
    shape, group, count = CASES[0]
    blocks = _blocks(shape, seed=1)
    picks = _picks(blocks, group, True, count)
    original = getattr(gear_group_kernel, source)
    assert text in original
    if source == "_TILE":
        for name in ("_SCORES_SOURCE", "_DENSE_SOURCE"):
            monkeypatch.setattr(gear_group_kernel, name, getattr(gear_group_kernel, name).replace(text, replacement))
    else:
        monkeypatch.setattr(gear_group_kernel, source, original.replace(text, replacement))
    with cuda_emulation.emulated_kernels():
        scores = gear_group_kernel.scores(blocks, group, True)
        dense = gear_group_kernel.dense(blocks, picks, group, True, mx.float32)
        mx.eval(scores, dense)
    same_scores = np.array_equal(_bits(scores), _bits(outlier_scores(blocks, group_means(blocks, group, True))))
    same_dense = np.array_equal(_bits(dense), _bits(_ops_dense(blocks, picks, group, True, mx.float32)))
    assert not (same_scores and same_dense)


def test_the_kernels_take_only_the_shapes_they_handle(monkeypatch):
    monkeypatch.setattr(gear_group_kernel.fused_decode, "kernels_enabled", lambda: True)
    assert gear_group_kernel.applies((1, 8, 8, 256, 128), 32, True)
    assert not gear_group_kernel.applies((1, 8, 8, 256, 100), 32, False)  # values' groups do not tile d
    assert gear_group_kernel.applies((1, 8, 8, 256, 100), 32, True)  # keys' groups run along tokens
    assert not gear_group_kernel.applies((1, 8, 8, 1024, 256), 32, True)  # the bitmap over 48 KB
    assert not gear_group_kernel.applies((1, 8, 65536, 256, 128), 32, True)  # rows over a grid's y
    monkeypatch.setattr(gear_group_kernel, "ENABLED", False)
    assert not gear_group_kernel.applies((1, 8, 8, 256, 128), 32, True)


@cuda_test
@pytest.mark.parametrize("shape, group, count, per_channel",
                         [(*case, per_channel) for case in CASES for per_channel in (True, False)] + TILED_CASES)
def test_scores_and_dense_on_cuda_agree_with_the_ops(shape, group, count, per_channel):
    """On CUDA MLX's reductions sum a group in their own order: a score or a fill may differ in
    its last bits (float32: within 4 ulp of the entry's magnitude); every kept entry is equal."""
    blocks = _blocks(shape, seed=group + count)
    picks = _picks(blocks, group, per_channel, count)
    scores = np.array(gear_group_kernel.scores(blocks, group, per_channel))
    dense = np.array(gear_group_kernel.dense(blocks, picks, group, per_channel, mx.float32))
    expected_scores = np.array(outlier_scores(blocks, group_means(blocks, group, per_channel)))
    expected = np.array(_ops_dense(blocks, picks, group, per_channel, mx.float32))
    bound = 4 * np.spacing(np.float32(np.abs(np.array(blocks)).max()))
    assert np.abs(scores - expected_scores).max() <= bound
    assert np.abs(dense - expected).max() <= bound
    mask = np.array(outlier_mask(picks, blocks.shape)).reshape(*shape[:2], -1, shape[-1])
    kept = ~(mask.swapaxes(-1, -2) if per_channel else mask)
    assert np.array_equal(dense[kept], expected[kept])


@cuda_test
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("per_channel", [True, False], ids=["keys", "values"])
def test_approx_and_residual_on_cuda_are_the_ops_bit_for_bit(bits, per_channel):
    """On CUDA too: scale * code is exact in float32, so MLX's dequantize rounds once, as here."""
    shape, group, count = CASES[2]
    blocks = _blocks(shape, seed=bits)
    dense = _ops_dense(blocks, _picks(blocks, group, per_channel, count), group, per_channel, mx.bfloat16)
    setting = EncoderSetting(bits, group, 4, count, shape[-2], mx.bfloat16, per_channel)
    _, _, _, expected_approx, expected_residual = quantized(setting, dense, shape)
    codes, scales, zeros = mx.quantize(dense, group_size=group, bits=bits)
    approx, residual = gear_group_kernel.approx_and_residual(dense, codes, scales, zeros, bits, group, per_channel, shape)
    assert np.array_equal(_bits(approx), _bits(expected_approx))
    assert np.array_equal(_bits(residual), _bits(expected_residual))


@cuda_test
def test_the_cache_s_stores_on_cuda_barely_move_with_the_kernels(monkeypatch):
    """The 8B shape's chunk in bf16 through GEARCache on CUDA, the group kernels on and off: the
    same outliers but for near-ties of scores, codes equal but where a last-bit fill crosses a
    rounding."""
    keys, values = _kv(2048 + 256, 8, 128, mx.bfloat16, seed=6, real_shaped=True)
    on, _ = _stores(True, monkeypatch, keys, values, [2048, 256], emulated=False)
    off, _ = _stores(False, monkeypatch, keys, values, [2048, 256], emulated=False)
    for name in off:
        if name.endswith(("_codes", "_out_index")):
            assert np.mean(_bits(on[name]) == _bits(off[name])) >= 0.999, name


def kernel_sources() -> set[str]:
    """The three kernels' CUDA sources for the default's 256 x 128 blocks, keys and values, bf16."""
    blocks = mx.zeros((1, 2, 2, 256, 128))
    picks = mx.zeros((1, 2, 2, 328), dtype=mx.uint32)
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        for per_channel in (True, False):
            gear_group_kernel.scores(blocks, 32, per_channel)
            gear_group_kernel.dense(blocks, picks, 32, per_channel, mx.bfloat16)
            rows = (1, 2, 128, 512) if per_channel else (1, 2, 512, 128)
            codes = mx.zeros((*rows[:-1], rows[-1] // 16), dtype=mx.uint32)
            scales = mx.zeros((*rows[:-1], rows[-1] // 32), dtype=mx.bfloat16)
            gear_group_kernel.approx_and_residual(mx.zeros(rows, dtype=mx.bfloat16), codes, scales, scales, 2, 32,
                                                  per_channel, blocks.shape)
    return {kernel.cuda_source(sig) for kernel, sig in captured}


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    sources = sorted(kernel_sources())
    assert len(sources) == 6
    for i, source in enumerate(sources):
        compiled_without_spills(source, tmp_path, i)


@needs_compiler
@pytest.mark.parametrize(
    "text, replacement",
    [
        ("if (sh + KB > 32) q |= row[w + 1] << (32 - sh);", ""),  # a straddling 3-bit code cut
        ("const int j = PC ? t : c;", "const int j = PC ? c : t;"),  # keys' codes read along channels
        ("qrow * (size_t)(COLS / G) + j / G", "qrow * (size_t)(COLS / G)"),  # every code the row's first group's scale
        ("if (RES) tr[cl * 33 + tt]", "if (RES) tr[tt * 33 + cl]"),  # keys' tile not transposed
        ("const int t0 = (blockIdx.x / TILES_C) * 32", "const int t0 = 0"),  # keys' tiles all at the first tokens
    ],
)
def test_a_corrupted_residual_source_is_caught(monkeypatch, text, replacement):
    shape, group, count = CASES[0]
    blocks = _blocks(shape, seed=3)
    assert text in gear_group_kernel._RESIDUAL_SOURCE
    monkeypatch.setattr(gear_group_kernel, "_RESIDUAL_SOURCE", gear_group_kernel._RESIDUAL_SOURCE.replace(text, replacement))
    dense = _ops_dense(blocks, _picks(blocks, group, True, count), group, True, mx.bfloat16)
    setting = EncoderSetting(3, group, 4, count, shape[-2], mx.bfloat16, True)
    expected = quantized(setting, dense, shape)[4]
    codes, scales, zeros = mx.quantize(dense, group_size=group, bits=3)
    with cuda_emulation.emulated_kernels():
        _, residual = gear_group_kernel.approx_and_residual(dense, codes, scales, zeros, 3, group, True, shape)
        mx.eval(residual)
    assert not np.array_equal(_bits(residual), _bits(expected))
