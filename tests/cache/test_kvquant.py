"""KVQuantCache: storage, exactness of the sparse part, error bounds, compressed attention,
state, trim and bad input."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache.kvquant import KVQuantCache
from veloxquant_mlx.cache.nonuniform_codebook import fit_codebook, nearest_level
from veloxquant_mlx.cache.sparse_outliers import outlier_count


def _kv(T, dtype=mx.float32, seed=0, B=1, H=2, D=64):
    """Keys with two large-offset outlier channels and a few spikes; Gaussian values."""
    mx.random.seed(seed)
    k = mx.random.normal((B, H, T, D))
    k = k + mx.zeros((D,)).at[3].add(12.0).at[40].add(-8.0)
    spikes = mx.random.uniform(shape=(B, H, T, D)) < 0.003
    k = mx.where(spikes, k * 15, k)
    v = mx.random.normal((B, H, T, D))
    return k.astype(dtype), v.astype(dtype)


def _cache(bits=3, fraction=0.01, group=32):
    return KVQuantCache(
        KVCacheConfig(method="kvquant", kvquant_bits=bits, kvquant_outlier_fraction=fraction, kvquant_group_size=group)
    )


def _filled(T=256, bits=3, dtype=mx.float32, fraction=0.01):
    cache = _cache(bits, fraction)
    k, v = _kv(T, dtype)
    cache.update_and_fetch(k, v)
    cache._flush()
    return cache, k, v


def test_codes_are_packed_uint32_and_bytes_match_accounting():
    cache, k, v = _filled(512, dtype=mx.float16)
    assert cache.store["key_codes"].dtype == mx.uint32
    assert cache.store["value_codes"].dtype == mx.uint32
    assert cache.n_compressed == 512 and cache.window_keys is None
    elements = 2 * k.size
    measured_bits = cache.nbytes * 8 / elements
    assert abs(measured_bits - cache.bits_per_element()) / cache.bits_per_element() < 0.10
    # 3-bit codes + side data stay well under a third of the fp16 bytes.
    assert cache.nbytes < 0.28 * (k.nbytes + v.nbytes)


def test_outliers_are_kept_exactly():
    cache, k, v = _filled(256)
    dk, dv = cache._full_keys_values()
    for prefix, orig, dec in (("key", k, dk), ("value", v, dv)):
        pos = cache.store[f"{prefix}_outlier_position"].astype(mx.uint32)  # (B, H, nb, n)
        stored = cache.store[f"{prefix}_outlier_value"]
        blocks = orig.reshape(1, 2, 8, -1)
        dec_blocks = dec.reshape(1, 2, 8, -1)
        original = mx.take_along_axis(blocks, pos, axis=-1)
        decoded = mx.take_along_axis(dec_blocks, pos, axis=-1)
        not_sink = (pos > 63) | (mx.arange(8)[:, None] > 0)  # token 0 of block 0 is the sink
        assert mx.all(mx.where(not_sink, stored == original, True)).item()
        assert mx.all(mx.where(not_sink, decoded == original, True)).item()
    # The spikes of the keys are among the outliers: the largest entry decodes exactly.
    big = mx.argmax(mx.abs(k).reshape(-1)).item()
    assert dk.reshape(-1)[big].item() == k.reshape(-1)[big].item()
    # The sink token is exact.
    assert mx.array_equal(dk[:, :, 0], k[:, :, 0]).item() and mx.array_equal(dv[:, :, 0], v[:, :, 0]).item()


@pytest.mark.parametrize("bits,key_bound,value_bound", [(2, 0.25, 0.40), (3, 0.12, 0.20), (4, 0.06, 0.10)])
def test_decoded_error_bounds(bits, key_bound, value_bound):
    cache, k, v = _filled(256, bits)
    dk, dv = cache._full_keys_values()

    def rel(a, b):
        return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()

    # keys measured after removing each channel's mean (the offsets alone would flatter them)
    centered = k - k.mean(axis=2, keepdims=True)
    assert rel(dk - k.mean(axis=2, keepdims=True), centered) < key_bound
    assert rel(dv, v) < value_bound


def test_nonuniform_codebook_beats_uniform_levels_on_gaussian_data():
    mx.random.seed(3)
    x = mx.clip(mx.random.normal((1, 1, 8192)) / 2.5, -1, 1)
    levels = fit_codebook(x, 8)
    uniform = mx.linspace(-1, 1, 8)[None, None]

    def mse(lv):
        return ((mx.take_along_axis(lv, nearest_level(x, lv).astype(mx.uint32), axis=-1) - x) ** 2).mean().item()

    assert mse(levels) < 0.8 * mse(uniform)


@pytest.mark.parametrize("chunks", [[100], [64, 1, 1, 30, 1, 1], [31, 1, 40]])
def test_compressed_attention_equals_attention_over_decoded_kv(chunks):
    cache = _cache(3)
    k_all, v_all = _kv(sum(chunks), seed=5)
    start = 0
    for n in chunks:
        k, v = k_all[:, :, start : start + n], v_all[:, :, start : start + n]
        start += n
        q = mx.random.normal((1, 6, n, 64))
        fk, fv = cache.update_and_fetch(k, v)
        T = fk.shape[2]
        mask = mx.arange(T - n, T)[:, None] >= mx.arange(T)[None]
        ref = mx.fast.scaled_dot_product_attention(
            q, mx.repeat(fk, 3, axis=1), mx.repeat(fv, 3, axis=1), scale=0.125, mask=mask
        )
        out = cache.attention(q, scale=0.125, mask=None if n == 1 else "causal")
        assert mx.allclose(out, ref, atol=2e-5, rtol=1e-4).item(), mx.abs(out - ref).max().item()
    assert cache.n_compressed > 0


def test_attention_with_small_decode_chunks_matches():
    cache, k, v = _filled(256)
    q = mx.random.normal((1, 6, 1, 64))
    whole = cache.attention(q, scale=0.125)
    cache.decode_chunk_tokens = 64  # four chunks
    chunked = cache.attention(q, scale=0.125)
    assert mx.allclose(whole, chunked, atol=1e-5).item()


def test_decode_chunks_by_device_and_the_chunk_ablations(monkeypatch):
    # The CPU reads 1024-token chunks (cache locality); a GPU backend's portable path 16384 (each
    # chunk is ~25 launches per part there); a cache's own decode_chunk_tokens, which the
    # bench's kvquant-chunk<N> ablations set, wins on both.
    from veloxquant_mlx.bench.ablations import ABLATIONS
    from veloxquant_mlx.cache import kvquant

    cache, _, _ = _filled(64)
    group = cache.group_size
    assert cache._chunk_blocks() == kvquant.CPU_CHUNK_TOKENS // group
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
    assert cache._chunk_blocks() == kvquant.GPU_CHUNK_TOKENS // group == 16384 // group
    marker, method, _ = ABLATIONS["kvquant-chunk4096"]
    assert method == "kvquant" and marker.mark([cache])[0]._chunk_blocks() == 4096 // group


def test_state_round_trip():
    cache, k, v = _filled(200)
    restored = KVQuantCache.from_state(cache.state)
    assert restored.offset == 200 and restored.n_compressed == cache.n_compressed
    q = mx.random.normal((1, 6, 1, 64))
    cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    restored.update_and_fetch(k[:, :, :1], v[:, :, :1])
    assert mx.array_equal(cache.attention(q, 0.125), restored.attention(q, 0.125)).item()
    a, b = cache._full_keys_values(), restored._full_keys_values()
    assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()


def test_trim_into_history_and_to_zero():
    cache, k, v = _filled(256)
    before, _ = cache._full_keys_values()
    assert cache.trim(50) == 50
    assert cache.offset == 206 and cache.n_compressed == 192
    after, _ = cache._full_keys_values()
    assert after.shape[2] == 206 and mx.array_equal(after, before[:, :, :206]).item()
    cache.trim(206)
    assert cache.offset == 0 and cache.empty()
    k2, v2 = _kv(64, seed=9)
    cache.update_and_fetch(k2, v2)
    cache._flush()
    dk, _ = cache._full_keys_values()
    assert mx.array_equal(dk[:, :, 0], k2[:, :, 0]).item()  # sink re-taken from the new sequence


def test_no_bits_attribute_so_mlx_lm_does_not_take_it_for_its_quantized_cache():
    assert not hasattr(_cache(), "bits")


def test_zero_outlier_fraction_has_no_sparse_part():
    cache, k, v = _filled(64, fraction=0.0)
    assert not any("outlier" in name for name in cache.store)
    q = mx.random.normal((1, 6, 1, 64))
    fk, fv = cache._full_keys_values()
    ref = mx.fast.scaled_dot_product_attention(q, mx.repeat(fk, 3, 1), mx.repeat(fv, 3, 1), scale=0.125)
    assert mx.allclose(cache.attention(q, 0.125), ref, atol=2e-5).item()


@pytest.mark.parametrize(
    "field,value",
    [("kvquant_bits", 1), ("kvquant_bits", 5), ("kvquant_outlier_fraction", 0.5), ("kvquant_outlier_fraction", -0.1),
     ("kvquant_group_size", 48)],
)
def test_bad_config_is_refused(field, value):
    with pytest.raises(QuantizerConfigError, match=field):
        KVCacheConfig(method="kvquant", **{field: value})


@pytest.mark.parametrize("head_dim", [4, 4096])
def test_head_dim_the_method_cannot_take(head_dim):
    cache = _cache()
    with pytest.raises(QuantizerConfigError, match="head_dim"):
        cache.update_and_fetch(mx.zeros((1, 1, 4, head_dim)), mx.zeros((1, 1, 4, head_dim)))
    assert cache.offset == 0 and cache.window_keys is None


def test_outlier_count_refuses_blocks_too_large_for_uint16():
    assert outlier_count(0.01, 32, 64) == 20
    with pytest.raises(QuantizerConfigError, match="uint16"):
        outlier_count(0.01, 128, 1024)


def test_save_and_load_prompt_cache_round_trip(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from veloxquant_mlx.cache import KVCacheFactory

    cache = KVCacheFactory.create(KVCacheConfig(method="kvquant"))
    assert isinstance(cache, KVQuantCache)
    k, v = _kv(100, mx.float16)
    cache.update_and_fetch(k, v)
    cache._flush()
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    assert isinstance(loaded, KVQuantCache) and loaded.offset == 100
    q = mx.random.normal((1, 6, 1, 64)).astype(mx.float16)
    assert mx.array_equal(cache.attention(q, 0.125), loaded.attention(q, 0.125)).item()


def _attention_over_decoded(cache, q, scale=0.125):
    fk, fv = cache._full_keys_values()
    rep = q.shape[1] // fk.shape[1]
    return mx.fast.scaled_dot_product_attention(
        q, mx.repeat(fk, rep, axis=1).astype(q.dtype), mx.repeat(fv, rep, axis=1).astype(q.dtype), scale=scale
    )


def test_attention_after_trim_ignores_stale_blocks_beyond_the_history():
    # Trimming into the history leaves the old blocks' codes in the store past n_compressed;
    # the compressed attention reads the whole capacity, so they must contribute nothing.
    cache, k, v = _filled(256)
    cache.trim(100)
    assert cache.n_compressed == 128 and cache.capacity == 256 and cache.offset == 156
    q = mx.random.normal((1, 6, 1, 64))
    out = cache.attention(q, scale=0.125)
    assert mx.allclose(out, _attention_over_decoded(cache, q), atol=2e-5, rtol=1e-4).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits", [2, 4])
def test_half_precision_attention_equals_attention_over_decoded_kv(dtype, bits):
    cache, k, v = _filled(320, bits, dtype)
    cache.decode_chunk_tokens = 128  # three chunks, the last one partial
    q = mx.random.normal((1, 6, 1, 64)).astype(dtype)
    # The decoded K/V are rounded to the cache dtype; the compressed attention is not.
    ref = _attention_over_decoded(cache, q.astype(mx.float32))
    out = cache.attention(q, scale=0.125).astype(mx.float32)
    assert mx.allclose(out, ref, atol=2e-2, rtol=2e-2).item(), mx.abs(out - ref).max().item()
