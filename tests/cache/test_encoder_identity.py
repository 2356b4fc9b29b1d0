"""The faster GEAR and KVQuant encoders store exactly what the encoders of main 2e28496 stored.

Each case feeds the same K/V to the cache and to its frozen reference (encoder_reference.py) the
way a prefill and decode do (a first chunk, a second chunk, then single tokens), and compares
every stored array bit for bit: codes, scales, zeros, low-rank factors, codebooks, sink, outlier
positions in their stored order and outlier values. GEAR stores a block's outlier pairs in
ascending position since session 29 (its decode kernel reads a tile's run of them); the
reference's pairs, in argpartition's order, are put in that order before the comparison.
Device-agnostic: run on the GPU it checks that mx.compile's fused kernels round as the separate
ops did there too.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache.encoder_reference import ReferenceGEARCache, ReferenceKVQuantCache
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.cache.gear_outliers import pairs_in_position_order
from veloxquant_mlx.cache.kvquant import KVQuantCache

BIT_VIEW = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}


def _bits(a: mx.array) -> np.ndarray:
    return np.array(mx.view(a, BIT_VIEW[a.dtype]) if a.dtype in BIT_VIEW else a)


def _kv(tokens, heads, dim, dtype, seed, real_shaped):
    """Gaussian K/V; `real_shaped` adds what real layers have: offset and wide key channels,
    a huge first token (the attention sink) and rare value spikes; "degenerate" instead gives
    all-zero and constant stretches and coarse values full of ties (zero residuals, zero scales,
    equal outlier scores)."""
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    keys = mx.random.normal((1, heads, tokens, dim), key=k1)
    values = mx.random.normal((1, heads, tokens, dim), key=k2)
    if real_shaped:
        channel = mx.arange(dim)
        keys = keys + mx.where(channel == 3, 12.0, 0.0) + keys * mx.where(channel % 17 == 7, 5.0, 0.0)
        keys = keys + mx.where(mx.arange(tokens)[:, None] == 0, 40.0, 0.0)
        values = mx.where(mx.random.uniform(shape=values.shape, key=k3) < 0.002, 15.0, values)
    if real_shaped == "degenerate":
        token, channel = mx.arange(tokens)[:, None], mx.arange(dim)
        keys = mx.where(token < 300, 0.0, mx.round(keys * 2) / 2)
        values = mx.where(channel < 8, 1.0, mx.where((token > 600) & (token < 900), -0.0, mx.round(values)))
    return keys.astype(dtype), values.astype(dtype)


def _feed_and_compare(make, make_reference, keys, values, pieces):
    cache, reference = make(), make_reference()
    start = 0
    for size in pieces:
        for c in (cache, reference):
            c.update_and_fetch(keys[:, :, start : start + size], values[:, :, start : start + size])
            c._flush()
            mx.eval(c.store)
        start += size
    assert cache.n_compressed == reference.n_compressed > 0
    assert sorted(cache.store) == sorted(reference.store)
    expected = pairs_in_position_order(reference.store)
    for name in reference.store:
        a, b = cache.store[name], expected[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(_bits(a), _bits(b)), f"{name} differs"


@pytest.mark.parametrize(
    "heads, dim, dtype, bits, fraction, real_shaped",
    [
        (8, 128, mx.bfloat16, 3, 0.01, True),  # the 8B shape in bf16, the H200 runs' setting
        (8, 128, mx.float32, 3, 0.01, False),
        (3, 64, mx.float16, 2, 0.01, True),  # SmolLM2's shape
        (3, 64, mx.float16, 4, 0.0, True),
        (3, 64, mx.float16, 3, 0.01, "degenerate"),
    ],
)
def test_kvquant_encoder_is_bit_identical(heads, dim, dtype, bits, fraction, real_shaped):
    config = KVCacheConfig(method="kvquant", kvquant_bits=bits, kvquant_outlier_fraction=fraction)
    keys, values = _kv(2048 + 64 + 3, heads, dim, dtype, seed=bits, real_shaped=real_shaped)
    _feed_and_compare(
        lambda: KVQuantCache(config), lambda: ReferenceKVQuantCache(config), keys, values, [1024, 1024, 64, 1, 1, 1]
    )


@pytest.mark.parametrize(
    "heads, dim, dtype, bits, rank, fraction, real_shaped",
    [
        (8, 128, mx.bfloat16, 2, 4, 0.01, True),
        (8, 128, mx.float32, 4, 4, 0.01, False),
        (3, 64, mx.float16, 2, 4, 0.01, True),
        (3, 64, mx.float16, 3, 0, 0.0, True),
        (3, 64, mx.float16, 2, 0, 0.01, True),  # outliers without a low rank
        (3, 64, mx.bfloat16, 4, 2, 0.0, True),  # a low rank without outliers
        (3, 64, mx.float16, 2, 12, 0.02, False),  # rank > 8: the QR path
        (3, 64, mx.float16, 2, 4, 0.01, "degenerate"),
    ],
)
def test_gear_encoder_is_bit_identical(heads, dim, dtype, bits, rank, fraction, real_shaped):
    config = KVCacheConfig(method="gear", gear_bits=bits, gear_rank=rank, gear_outlier_fraction=fraction)
    keys, values = _kv(2048 + 256 + 3, heads, dim, dtype, seed=bits + rank, real_shaped=real_shaped)
    _feed_and_compare(
        lambda: GEARCache(config), lambda: ReferenceGEARCache(config), keys, values, [1024, 1024, 256, 1, 1, 1]
    )


def test_gear_encoder_with_a_subclass_s_own_centres_is_bit_identical():
    """bench/ablations.py's MagnitudeGEAR overrides `_selection_centres`: the encoder takes
    those centres from outside its compiled stage."""
    from veloxquant_mlx.bench.ablations import MagnitudeGEAR

    class ReferenceMagnitudeGEAR(ReferenceGEARCache):
        _selection_centres = MagnitudeGEAR._selection_centres

    config = KVCacheConfig(method="gear")
    keys, values = _kv(1024 + 3, 3, 64, mx.float16, seed=5, real_shaped=True)
    _feed_and_compare(
        lambda: MagnitudeGEAR(config), lambda: ReferenceMagnitudeGEAR(config), keys, values, [512, 512, 1, 1, 1]
    )


def test_the_paths_cuda_takes_uncompiled_are_bit_identical_too(monkeypatch):
    """On CUDA the power iteration runs uncompiled (gear_lowrank.COMPILE_ON_GPU) and so does
    kvquant's normalize for a vector length that is not a power of two: force those paths here
    (head_dim 80, as some models have) and compare with the reference."""
    from veloxquant_mlx.cache import gear_lowrank, kvquant

    monkeypatch.setattr(gear_lowrank, "_compile_here", lambda: False)
    monkeypatch.setattr(kvquant, "_fusion_is_exact", lambda length: False)
    keys, values = _kv(1024 + 3, 2, 64, mx.float16, seed=9, real_shaped=True)
    config = KVCacheConfig(method="gear")
    _feed_and_compare(lambda: GEARCache(config), lambda: ReferenceGEARCache(config), keys, values, [512, 512, 1, 1, 1])
    keys, values = _kv(256 + 3, 2, 80, mx.float16, seed=9, real_shaped=True)
    config = KVCacheConfig(method="kvquant")
    _feed_and_compare(
        lambda: KVQuantCache(config), lambda: ReferenceKVQuantCache(config), keys, values, [128, 128, 1, 1, 1]
    )
