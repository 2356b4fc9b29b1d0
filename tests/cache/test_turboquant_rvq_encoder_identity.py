"""The compiled turboquant_rvq encoder and prefill decode store and decode exactly what main
714de0c's did.

Each case feeds the same K/V to the cache and to its frozen reference (turboquant_rvq_reference.py)
the way a prefill and decode do (a first chunk, a second chunk, then single tokens), and compares
bit for bit every stored array (stage codes, scales, zeros, sign words, magnitudes), the key mean
and the sink deltas; then the prefill decode (`_prefill_keys_values`, in pieces small enough
that the history takes several, the first with the sink) against the reference's. Device-
agnostic: run on the GPU it checks that mx.compile's fused kernels round as the separate ops did
there too.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache.turboquant_rvq_reference import ReferenceTurboQuantRVQCache
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.bench.rvq_attribution import UniformRVQCache
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache

BIT_VIEW = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}


def _bits(a: mx.array) -> np.ndarray:
    return np.array(mx.view(a, BIT_VIEW[a.dtype]) if a.dtype in BIT_VIEW else a)


def _same(a: mx.array, b: mx.array, name: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert np.array_equal(_bits(a), _bits(b)), f"{name} differs"


def _kv(tokens, heads, dim, dtype, seed, degenerate=False):
    """Real-shaped K/V: a key offset channel, wide key channels, a huge first token (the sink),
    rare value spikes; `degenerate` adds all-zero and constant stretches and coarse values full
    of ties (zero residuals, zero scales, zero magnitudes)."""
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    keys = mx.random.normal((1, heads, tokens, dim), key=k1)
    values = mx.random.normal((1, heads, tokens, dim), key=k2)
    channel = mx.arange(dim)
    keys = keys + mx.where(channel == 3, 12.0, 0.0) + keys * mx.where(channel % 17 == 7, 5.0, 0.0)
    keys = keys + mx.where(mx.arange(tokens)[:, None] == 0, 40.0, 0.0)
    values = mx.where(mx.random.uniform(shape=values.shape, key=k3) < 0.002, 15.0, values)
    if degenerate:
        token = mx.arange(tokens)[:, None]
        keys = mx.where(token < 200, 0.0, mx.round(keys * 2) / 2)
        values = mx.where(channel < 8, 1.0, mx.where((token > 300) & (token < 500), -0.0, mx.round(values)))
    return keys.astype(dtype), values.astype(dtype)


def _feed(cache, keys, values, pieces):
    start = 0
    for size in pieces:
        cache.update_and_fetch(keys[:, :, start : start + size], values[:, :, start : start + size])
        cache._flush()
        mx.eval(cache.store, cache.key_mean, cache.sink_deltas)
        start += size


def _compare(make, make_reference, keys, values, pieces, piece_bytes):
    cache, reference = make(), make_reference()
    for c in (cache, reference):
        _feed(c, keys, values, pieces)
        c.prefill_decode_bytes = piece_bytes
    assert cache.n_compressed == reference.n_compressed > 0
    assert sorted(cache.store) == sorted(reference.store)
    for name in reference.store:
        _same(cache.store[name], reference.store[name], name)
    _same(cache.key_mean, reference.key_mean, "key_mean")
    assert (cache.sink_deltas is None) == (reference.sink_deltas is None)
    for which, (a, b) in enumerate(zip(cache.sink_deltas or (), reference.sink_deltas or ())):
        _same(a, b, f"sink delta {'kv'[which]}")
    queries = mx.zeros((1, 2 * keys.shape[1], 256, keys.shape[3]), keys.dtype)
    for which, (a, b) in enumerate(zip(cache._prefill_keys_values(queries), reference._prefill_keys_values(queries))):
        _same(a, b, f"prefill {'kv'[which]}")
    # The uncompiled decode (what update_and_fetch returns) is unchanged too.
    for which, (a, b) in enumerate(zip(cache._decode(), reference._decode())):
        _same(a, b, f"decode {'kv'[which]}")


@pytest.mark.parametrize(
    "heads, dim, dtype, bits, degenerate",
    [
        (8, 128, mx.bfloat16, 4, False),  # the 8B shape in bf16, the H200 runs' setting
        (8, 128, mx.bfloat16, 3, False),
        (2, 128, mx.float32, 2, False),  # two sign stages
        (3, 64, mx.float16, 1, False),  # the sign stage alone
        (3, 64, mx.float16, 4, True),
        (3, 64, mx.bfloat16, 3, True),
        (2, 32, mx.float32, 4, False),
    ],
)
def test_turboquant_rvq_encoder_and_prefill_decode_are_bit_identical(heads, dim, dtype, bits, degenerate):
    config = KVCacheConfig(method="turboquant_rvq", bit_width_inlier=bits)
    keys, values = _kv(1024 + 128 + 3, heads, dim, dtype, seed=bits + dim, degenerate=degenerate)
    # Pieces of 256 tokens of float32 (B, H, tokens, d): the history is decoded in several.
    piece_bytes = 256 * heads * dim * 4
    _compare(
        lambda: TurboQuantRVQCache(config), lambda: ReferenceTurboQuantRVQCache(config),
        keys, values, [512, 512, 128, 1, 1, 1], piece_bytes,
    )


def test_separate_key_and_value_bits_are_bit_identical():
    config = KVCacheConfig(method="turboquant_rvq", bit_width_inlier=3, key_bits=4, value_bits=2)
    keys, values = _kv(512 + 3, 2, 64, mx.float16, seed=11)
    _compare(lambda: TurboQuantRVQCache(config), lambda: ReferenceTurboQuantRVQCache(config),
             keys, values, [256, 256, 1, 1, 1], 128 * 2 * 64 * 4)


def test_a_subclass_s_stage_split_is_bit_identical():
    """bench/rvq_attribution.py's UniformRVQCache overrides `stage_bits` (4 uniform bits, no
    sign stage): the compiled functions take their stages from it."""

    class ReferenceUniform(ReferenceTurboQuantRVQCache):
        stage_bits = staticmethod(UniformRVQCache.stage_bits)

    config = KVCacheConfig(method="turboquant_rvq", bit_width_inlier=4)
    keys, values = _kv(512 + 3, 2, 64, mx.bfloat16, seed=12)
    _compare(lambda: UniformRVQCache(config), lambda: ReferenceUniform(config),
             keys, values, [256, 256, 1, 1, 1], 128 * 2 * 64 * 4)


def test_without_the_fast_transform_the_encoder_is_bit_identical_too(monkeypatch):
    """A backend without mx.hadamard_transform rotates by a matmul (hadamard.py); on a GPU the
    encoder then runs uncompiled for d = 128 (`_encoder_fusion_is_exact`) and compiled for
    d = 64. Force the matmul form here and check both the compiled encoder (the CPU compiles
    it) and the uncompiled one against the reference."""
    from veloxquant_mlx.cache import hadamard, turboquant_rvq

    monkeypatch.setattr(hadamard, "fast_transform_available", lambda: False)
    monkeypatch.setattr(turboquant_rvq, "fast_transform_available", lambda: False)
    for compiled in (True, False):
        monkeypatch.setattr(turboquant_rvq, "_encoder_fusion_is_exact", lambda *dims: compiled)
        for dim in (128, 64):
            config = KVCacheConfig(method="turboquant_rvq", bit_width_inlier=4)
            keys, values = _kv(512 + 3, 2, dim, mx.bfloat16, seed=13)
            _compare(lambda: TurboQuantRVQCache(config), lambda: ReferenceTurboQuantRVQCache(config),
                     keys, values, [256, 256, 1, 1, 1], 128 * 2 * dim * 4)


def test_the_compiled_encoder_is_skipped_only_where_its_fusion_could_round_differently(monkeypatch):
    from veloxquant_mlx.cache import turboquant_rvq

    assert turboquant_rvq._encoder_fusion_is_exact(128, 128)  # the CPU: no FMA
    monkeypatch.setattr(turboquant_rvq, "fast_transform_available", lambda: False)
    monkeypatch.setattr(turboquant_rvq.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert not turboquant_rvq._encoder_fusion_is_exact(128, 128)
    assert not turboquant_rvq._encoder_fusion_is_exact(64, 32)
    assert turboquant_rvq._encoder_fusion_is_exact(64, 256)
