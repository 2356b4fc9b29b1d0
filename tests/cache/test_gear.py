"""GEARCache: what it stores, what it returns, and attention over its compressed form."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache.gear import BLOCK_TOKENS, GEARCache
from veloxquant_mlx.cache.gear_outliers import block_positions


def _data(tokens=2 * BLOCK_TOKENS + 40, heads=2, dim=64, seed=0, dtype=mx.float16):
    """Random K/V with two outlier channels in the keys (a large offset and a large spread) and
    a few spikes in the values, like real attention layers."""
    key = mx.random.key(seed)
    k1, k2, k3 = mx.random.split(key, 3)
    keys = mx.random.normal((1, heads, tokens, dim), key=k1)
    keys = keys + mx.where(mx.arange(dim) == 3, 12.0, 0.0) + keys * mx.where(mx.arange(dim) == 7, 6.0, 0.0)
    values = mx.random.normal((1, heads, tokens, dim), key=k2)
    spikes = mx.random.uniform(shape=values.shape, key=k3) < 0.002
    values = mx.where(spikes, 15.0, values)
    return keys.astype(dtype), values.astype(dtype)


def _filled(config=None, **data_kwargs):
    cache = GEARCache(config or KVCacheConfig(method="gear"))
    keys, values = _data(**data_kwargs)
    cache.update_and_fetch(keys, values)
    cache.attention(mx.zeros((1, keys.shape[1] * 3, keys.shape[2], keys.shape[3]), keys.dtype), 0.125, mask="causal")
    return cache, keys, values


def _mse(a, b):
    return mx.mean((a.astype(mx.float32) - b.astype(mx.float32)) ** 2).item()


def test_codes_are_packed_uint32_and_side_data_is_small():
    cache, keys, _ = _filled()
    assert cache.n_compressed == 2 * BLOCK_TOKENS and cache.window_keys.shape[2] == 40
    assert cache.store["k_codes"].dtype == mx.uint32 and cache.store["v_codes"].dtype == mx.uint32
    # 2-bit codes: 16 per word, so 64 channels x 512 tokens of keys -> 64 x 32 words.
    assert cache.store["k_codes"].size == 2 * 64 * 512 // 16
    for name, array in cache.store.items():
        if not name.endswith(("codes", "index")):
            assert array.dtype == mx.float16, name
    assert cache.store["k_out_index"].dtype == mx.uint16


@pytest.mark.parametrize("rank,fraction,bits", [(4, 0.01, 2), (0, 0.0, 2), (2, 0.05, 4), (8, 0.02, 3)])
def test_stored_bytes_match_the_accounting(rank, fraction, bits):
    config = KVCacheConfig(method="gear", gear_rank=rank, gear_outlier_fraction=fraction, gear_bits=bits)
    cache, keys, _ = _filled(config, tokens=2 * BLOCK_TOKENS)
    assert cache.window_keys is None and cache.capacity == cache.n_compressed
    elements = 2 * keys.size
    accounted = cache.bits_per_element() * elements / 8
    assert abs(cache.nbytes - accounted) <= 0.1 * accounted
    if (rank, fraction, bits) == (4, 0.01, 2):
        # The default at head_dim 64: 2 + 1 + 1 + 0.25 + 0.32 bits, under 0.30x of fp16.
        assert cache.bits_per_element() == pytest.approx(4.57, abs=0.01)
        assert cache.nbytes / (keys.nbytes * 2) < 0.30


def test_outliers_are_kept_exactly():
    cache, keys, values = _filled()
    dk, dv = cache.decode_float32()
    for s, original, decoded in (("k", keys, dk), ("v", values, dv)):
        st = cache.store
        token, channel = block_positions(st[f"{s}_out_index"], BLOCK_TOKENS, 64)
        n = cache.n_compressed
        flat_orig = original[:, :, :n].astype(mx.float32).reshape(1, 2, -1)
        flat_dec = decoded.reshape(1, 2, -1)
        where = token * 64 + channel
        kept = mx.take_along_axis(flat_orig, where, axis=-1)
        got = mx.take_along_axis(flat_dec, where, axis=-1)
        # Up to the fp16 rounding of the stored correction (about 1e-3 relative).
        assert mx.all(mx.abs(got - kept) <= 2e-3 * mx.abs(kept) + 2e-3).item()
        # They are the big ones: their mean magnitude beats the whole block's by far.
        assert mx.mean(mx.abs(kept)).item() > 2 * mx.mean(mx.abs(flat_orig)).item()
    # The values' spikes (15.0) are all among the kept outliers.
    token, channel = block_positions(cache.store["v_out_index"], BLOCK_TOKENS, 64)
    n = cache.n_compressed
    spikes = mx.sum(values[:, :, :n] == 15.0).item()
    kept_spikes = mx.sum(mx.take_along_axis(values[:, :, :n].reshape(1, 2, -1), token * 64 + channel, axis=-1) == 15.0)
    assert spikes > 0 and kept_spikes.item() == spikes


def test_low_rank_term_and_outliers_reduce_the_error():
    errors = {}
    for rank, fraction in ((0, 0.0), (4, 0.0), (0, 0.01), (4, 0.01)):
        cache, keys, values = _filled(KVCacheConfig(method="gear", gear_rank=rank, gear_outlier_fraction=fraction))
        dk, dv = cache.decode_float32()
        n = cache.n_compressed
        errors[rank, fraction] = _mse(dk, keys[:, :, :n]) + _mse(dv, values[:, :, :n])
    assert errors[4, 0.0] < 0.97 * errors[0, 0.0]
    assert errors[4, 0.01] < 0.97 * errors[0, 0.01]
    assert errors[0, 0.01] < 0.7 * errors[0, 0.0]


def test_decoded_error_bounds():
    cache, keys, values = _filled()
    fk, fv = cache._full_keys_values()
    n = cache.n_compressed
    # The exact window is returned unchanged.
    assert mx.array_equal(fk[:, :, n:], keys[:, :, n:]).item()
    assert mx.array_equal(fv[:, :, n:], values[:, :, n:]).item()
    # 2-bit codes of unit-variance data with group 32: relative MSE well under a quarter.
    for got, want in ((fk[:, :, :n], keys[:, :, :n]), (fv[:, :, :n], values[:, :, :n])):
        assert got.dtype == mx.float16
        assert _mse(got, want) < 0.25 * mx.mean(want.astype(mx.float32) ** 2).item()


@pytest.mark.parametrize("bits", [2, 3, 8])
def test_compressed_attention_equals_attention_over_decoded_kv(bits):
    cache, keys, _ = _filled(KVCacheConfig(method="gear", gear_bits=bits), dtype=mx.float32)
    dk, dv = cache.decode_float32()
    fk = mx.concatenate([dk, cache.window_keys.astype(mx.float32)], axis=2)
    fv = mx.concatenate([dv, cache.window_values.astype(mx.float32)], axis=2)
    for L in (1, 5):
        q = mx.random.normal((1, 6, L, 64), key=mx.random.key(L))
        T = fk.shape[2]
        mask = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None] if L > 1 else None
        out = cache.attention(q, 0.125, mask="causal" if L > 1 else None)
        ref = mx.fast.scaled_dot_product_attention(
            q, mx.repeat(fk, 3, axis=1), mx.repeat(fv, 3, axis=1), scale=0.125, mask=mask
        )
        assert mx.allclose(out, ref, atol=2e-4, rtol=1e-3).item(), mx.max(mx.abs(out - ref)).item()


def test_bfloat16_input_and_wider_values():
    mx.random.seed(5)
    cache = GEARCache(KVCacheConfig(method="gear", gear_group_size=64))
    keys = mx.random.normal((1, 1, BLOCK_TOKENS + 3, 64)).astype(mx.bfloat16)
    values = mx.random.normal((1, 1, BLOCK_TOKENS + 3, 128)).astype(mx.bfloat16)
    fk, fv = cache.update_and_fetch(keys, values)
    out = cache.attention(mx.random.normal((1, 2, BLOCK_TOKENS + 3, 64)).astype(mx.bfloat16), 0.125, mask="causal")
    assert out.shape == (1, 2, BLOCK_TOKENS + 3, 128) and out.dtype == mx.bfloat16
    assert cache.store["v_out_values"].dtype == mx.bfloat16  # bf16 range kept for bf16 models
    dk, dv = cache._full_keys_values()
    assert dk.dtype == mx.bfloat16 and dv.shape == values.shape
    assert _mse(dv, values) < 0.25


def test_decode_steps_cross_a_block_boundary():
    mx.random.seed(3)
    cache, keys, values = _filled(tokens=BLOCK_TOKENS + 250)
    for _ in range(10):  # 250 -> 260 window tokens: one more block is encoded on the way
        k = mx.random.normal((1, 2, 1, 64)).astype(mx.float16)
        cache.update_and_fetch(k, k)
        out = cache.attention(mx.random.normal((1, 6, 1, 64)).astype(mx.float16), 0.125)
        assert out.shape == (1, 6, 1, 64) and mx.all(mx.isfinite(out)).item()
    assert cache.n_compressed == 2 * BLOCK_TOKENS and cache.offset == BLOCK_TOKENS + 260


def test_state_round_trip():
    cache, keys, values = _filled()
    clone = GEARCache.from_state(cache.state)
    assert clone.offset == cache.offset and clone.nbytes == cache.nbytes
    assert clone.bits_per_element() == cache.bits_per_element()
    q = mx.random.normal((1, 6, 1, 64)).astype(mx.float16)
    assert mx.array_equal(clone.attention(q, 0.125), cache.attention(q, 0.125)).item()
    meta = cache.state[0].replace('"gear_rank": 4', '"gear_rank": -1')
    with pytest.raises(QuantizerConfigError, match="gear_rank"):
        GEARCache.from_state((meta, *cache.state[1:]))


def test_the_encoder_stores_outlier_pairs_in_position_order_and_a_state_loads_them_so():
    # The CUDA decode kernel reads a tile's run of a block's pairs (fused_decode_gear.SORTED_SCAN):
    # the encoder sorts them, and a state saved in another order (before session 29: the
    # selection's) is sorted on loading, values moving with their positions.
    cache, keys, values = _filled()
    for s in ("k", "v"):
        index = np.array(cache.store[f"{s}_out_index"])
        assert index.shape[-1] > 1 and (np.diff(index.astype(np.int64), axis=-1) > 0).all()
    state = list(cache.state)
    names = sorted(cache.store)
    reversed_pairs = {n: cache.store[n][..., ::-1] for n in names if "_out_" in n}
    for n, a in reversed_pairs.items():
        state[3 + names.index(n)] = a
    clone = GEARCache.from_state(tuple(state))
    for n in reversed_pairs:
        assert mx.array_equal(clone.store[n], cache.store[n]).item(), n
    q = mx.random.normal((1, 6, 1, 64)).astype(mx.float16)
    assert mx.array_equal(clone.attention(q, 0.125), cache.attention(q, 0.125)).item()


def test_trim_into_the_compressed_history():
    cache, keys, values = _filled()
    before, _ = cache._full_keys_values()
    n = cache.offset - 300
    assert cache.trim(n) == n
    assert cache.offset == 300 and cache.n_compressed == BLOCK_TOKENS
    fk, fv = cache._full_keys_values()
    assert fk.shape[2] == 300
    assert mx.array_equal(fk, before[:, :, :300]).item()
    out = cache.attention(mx.ones((1, 6, 1, 64), mx.float16), 0.125)
    assert mx.all(mx.isfinite(out)).item()


def test_unpatched_mlx_lm_attention_gets_correct_kv():
    # mlx-lm routes caches with a `bits` attribute to its quantized SDPA; ours must not have one.
    from mlx_lm.models.base import scaled_dot_product_attention

    cache, keys, values = _filled()
    assert not hasattr(cache, "bits")
    q = mx.random.normal((1, 6, 1, 64)).astype(mx.float16)
    k, v = cache.update_and_fetch(keys[:, :, :1], values[:, :, :1])
    out = scaled_dot_product_attention(q, k, v, cache=cache, scale=0.125, mask=None)
    ref = mx.fast.scaled_dot_product_attention(q, mx.repeat(k, 3, axis=1), mx.repeat(v, 3, axis=1), scale=0.125)
    assert mx.allclose(out, ref, atol=1e-3).item()


def test_bad_input_is_refused():
    with pytest.raises(QuantizerConfigError, match="gear_bits"):
        KVCacheConfig(method="gear", gear_bits=5)
    with pytest.raises(QuantizerConfigError, match="got 'kivi'"):
        GEARCache(KVCacheConfig(method="kivi"))
    cache = GEARCache(KVCacheConfig(method="gear"))
    with pytest.raises(QuantizerConfigError, match="head_dim=48"):
        cache.update_and_fetch(mx.ones((1, 2, 3, 48)), mx.ones((1, 2, 3, 48)))
    assert cache.offset == 0 and cache.dtype is None
    cache = GEARCache(KVCacheConfig(method="gear", gear_rank=80))
    with pytest.raises(QuantizerConfigError, match="gear_rank=80"):
        cache.update_and_fetch(mx.ones((1, 2, 3, 64)), mx.ones((1, 2, 3, 64)))
    cache = GEARCache(KVCacheConfig(method="gear"))
    with pytest.raises(QuantizerConfigError, match="dtype"):
        cache.update_and_fetch(mx.ones((1, 2, 3, 64), mx.int32), mx.ones((1, 2, 3, 64), mx.int32))
    with pytest.raises(QuantizerConfigError, match="trim"):
        cache.trim(-1)


def test_long_history_both_attention_paths_agree():
    # The CPU path computes in float32 with one quantized_matmul; the other (GPU) path keeps the
    # cache dtype and, from split_reduction.SPLIT_FROM_TOKENS tokens on, splits p @ V into
    # chunks summed afterwards. Both run here on the CPU, on the same store.
    from veloxquant_mlx.cache.gear_attention import scores_function, values_function
    from veloxquant_mlx.cache.split_reduction import SPLIT_FROM_TOKENS, chunk_for

    cache = GEARCache(KVCacheConfig(method="gear"))
    keys, values = _data(tokens=SPLIT_FROM_TOKENS, heads=1, dim=32, dtype=mx.float32)
    cache.update_and_fetch(keys, values)
    cache._flush()
    assert cache.capacity == SPLIT_FROM_TOKENS and chunk_for(cache.capacity) is not None
    dk, dv = cache.decode_float32()
    q = mx.random.normal((1, 3, 1, 32), key=mx.random.key(4))
    out = cache.attention(q, 0.125)
    ref = mx.fast.scaled_dot_product_attention(q, mx.repeat(dk, 3, axis=1), mx.repeat(dv, 3, axis=1), scale=0.125)
    assert mx.allclose(out, ref, atol=2e-4, rtol=1e-3).item(), mx.max(mx.abs(out - ref)).item()
    settings = (cache.code_bits, cache.code_group, cache.rank, True, cache.block_tokens, 32)
    q3 = q.reshape(1, 1, 3, 32)
    p = mx.softmax(mx.random.normal((1, 1, 3, cache.capacity), key=mx.random.key(5)) * 3, axis=-1)
    for fn, x, side in ((scores_function, q3, cache._side("k")), (values_function, p, cache._side("v"))):
        cpu, other = fn(*settings, True)(x, *side), fn(*settings, False)(x, *side)
        assert mx.allclose(cpu, other, atol=1e-4, rtol=1e-4).item(), mx.max(mx.abs(cpu - other)).item()
    # The cache's own CPU values (the codes' product read as planes outside the compiled
    # function, cache/unpacked_products.py) are the compiled CPU function's with it inside.
    planes, inside = cache._weighted_values(p), values_function(*settings, True)(p, *cache._side("v"))
    assert planes.dtype == inside.dtype == mx.float32
    assert mx.allclose(planes, inside, atol=1e-5, rtol=1e-4).item(), mx.max(mx.abs(planes - inside)).item()
