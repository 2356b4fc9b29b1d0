"""KIVICache: what it stores, how close its decode is, and that its compressed attention is the
attention over its own decoded K/V."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig, KVCacheFactory, QuantizerConfigError
from veloxquant_mlx.cache.kivi import KIVICache, pack_stream


def _kivi(**fields):
    fields.setdefault("kivi_residual_length", 32)
    return KIVICache(KVCacheConfig(method="kivi", **fields))


def _fill(cache, n, D=64, H=2, seed=0, chunk=None):
    mx.random.seed(seed)
    k = mx.random.normal((1, H, n, D))
    v = mx.random.normal((1, H, n, D))
    chunk = chunk or n
    for start in range(0, n, chunk):
        cache.update_and_fetch(k[:, :, start : start + chunk], v[:, :, start : start + chunk])
        cache.attention(mx.random.normal((1, 2 * H, min(chunk, n - start), D)), scale=0.1,
                        mask="causal" if chunk > 1 else None)
    return k, v


def _group_bound(x, bits, G, axis):
    """Per element: the quantization step of its group (range / (2**bits - 1))."""
    moved = mx.moveaxis(x, axis, -1)
    groups = moved.reshape(*moved.shape[:-1], -1, G)
    step = (groups.max(-1, keepdims=True) - groups.min(-1, keepdims=True)) / (2**bits - 1)
    step = mx.broadcast_to(step, groups.shape).reshape(moved.shape)
    return mx.moveaxis(step, -1, axis)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_decoded_error_is_within_the_group_step_and_the_window_is_exact(bits):
    cache = _kivi(bit_width_inlier=bits)
    k, v = _fill(cache, 300)
    n = cache.n_compressed
    assert n == 256 and cache.offset == 300  # 300 - 32 exact -> 8 whole groups of 32
    fk, fv = cache._full_keys_values()
    # Keys: groups of 32 tokens per channel; values: groups of 32 channels per token.
    # Round to nearest: at most half a step; the fp16 scales and biases add up to ~5e-4 of the
    # values' magnitude (3e-3 here).
    key_err = mx.abs(fk[:, :, :n] - k[:, :, :n])
    value_err = mx.abs(fv[:, :, :n] - v[:, :, :n])
    assert mx.all(key_err <= _group_bound(k[:, :, :n], bits, 32, axis=2) * 0.5 + 3e-3).item()
    assert mx.all(value_err <= _group_bound(v[:, :, :n], bits, 32, axis=3) * 0.5 + 3e-3).item()
    assert mx.array_equal(fk[:, :, n:], k[:, :, n:]).item()
    assert mx.array_equal(fv[:, :, n:], v[:, :, n:]).item()
    if bits == 8:
        assert mx.abs(fk - k).max().item() < 0.05


@pytest.mark.parametrize(
    "fields, chunks",
    [
        ({"bit_width_inlier": 2}, [100, 1, 1, 60, 1, 1, 1]),
        ({"bit_width_inlier": 3}, [37, 90, 1, 1]),
        ({"key_bits": 4, "value_bits": 2}, [200, 1, 1, 1]),
        ({"bit_width_inlier": 4, "kivi_group_size": 64, "kivi_residual_length": 0}, [130, 1, 70, 1]),
    ],
)
def test_compressed_attention_equals_attention_over_its_decoded_kv(fields, chunks):
    mx.random.seed(3)
    cache = _kivi(**fields)
    for n in chunks:
        q = mx.random.normal((1, 6, n, 64))
        k = mx.random.normal((1, 2, n, 64))
        v = mx.random.normal((1, 2, n, 64))
        fk, fv = cache.update_and_fetch(k, v)  # the cache's own decode, before this step's flush
        T = fk.shape[2]
        mask = mx.arange(T - n, T)[:, None] >= mx.arange(T)[None]
        ref = mx.fast.scaled_dot_product_attention(q, fk, fv, scale=0.125, mask=mask)
        out = cache.attention(q, scale=0.125, mask="causal" if n > 1 else None)
        assert mx.allclose(out, ref, atol=2e-4, rtol=1e-3).item()
    assert cache.n_compressed > 0


def test_long_chunks_are_tiled_over_query_rows_with_the_same_result(monkeypatch):
    mx.random.seed(4)
    k = mx.random.normal((1, 2, 400, 64))
    v = mx.random.normal((1, 2, 400, 64))
    q = mx.random.normal((1, 4, 300, 64))
    outs = []
    for tile_bytes in (1 << 30, 20_000):
        cache = _kivi()
        cache.update_and_fetch(k[:, :, :100], v[:, :, :100])
        cache.attention(q[:, :, :100], scale=0.1, mask="causal")
        monkeypatch.setattr(KIVICache, "attention_tile_bytes", tile_bytes)
        cache.update_and_fetch(k[:, :, 100:], v[:, :, 100:])
        outs.append(cache.attention(q, scale=0.1, mask="causal"))
    assert mx.allclose(outs[0], outs[1], atol=1e-5).item()


def test_nbytes_is_the_arrays_held_and_matches_the_accounting():
    cache = _kivi(bit_width_inlier=2, kivi_residual_length=128)
    mx.random.seed(5)
    k = mx.random.normal((1, 3, 4096, 64)).astype(mx.float16)
    cache.update_and_fetch(k, k)
    cache.attention(mx.zeros((1, 9, 1, 64), mx.float16), scale=1.0)  # flushes the window
    held = sum(a.nbytes for a in cache.store.values())
    held += cache.window_keys.nbytes + cache.window_values.nbytes
    sink = cache.sink_keys.nbytes + cache.sink_values.nbytes
    assert sink == 2 * 3 * 64 * 2  # one exact fp16 token of K and V per head
    assert cache.nbytes == held + sink
    elements = 2 * 3 * 64  # K and V per token
    expected = cache.capacity * elements * cache.bits_per_element() / 8
    expected += cache.window_keys.nbytes + cache.window_values.nbytes + sink
    assert abs(cache.nbytes - expected) <= 0.1 * expected
    fp16 = 2 * 4096 * elements
    assert cache.nbytes <= 0.23 * fp16
    assert cache.bits_per_element() == 3.0


def test_side_data_is_half_precision_for_a_float32_model():
    cache = _kivi()
    _fill(cache, 100)
    assert cache.store["key_scales"].dtype == mx.float16
    assert cache.store["key_codes"].dtype == mx.uint32
    assert cache.window_keys.dtype == mx.float32


def test_bf16_scores_run_in_float32_on_the_cpu():
    # MLX's CPU kernel with bf16 queries and side data ran ~12x slower and rounded each score
    # to bf16 (2.4% of the largest score off at the 8B shape, session 39): the queries go in as
    # float32 there, and the scores are the float32 product of the decoded keys.
    cache = _kivi()
    mx.random.seed(4)
    k, v = (mx.random.normal((1, 2, 300, 64)).astype(mx.bfloat16) for _ in range(2))
    cache.update_and_fetch(k, v)
    cache._flush()
    q = mx.random.normal((1, 2, 3, 64)).astype(mx.bfloat16)
    scores = cache._scores(q)
    s = cache.store
    keys = mx.dequantize(s["key_codes"], s["key_scales"].astype(mx.float32), s["key_biases"].astype(mx.float32),
                         group_size=cache.group_size, bits=cache.key_bits)
    exact = q.astype(mx.float32) @ keys
    S = cache._sink_length()
    assert scores.dtype == mx.float32
    assert mx.allclose(scores[..., S:exact.shape[-1]], exact[..., S:], rtol=1e-5, atol=1e-5).item()


def test_trim_reopens_compressed_groups():
    cache = _kivi(bit_width_inlier=4)
    k, v = _fill(cache, 200)
    before = cache._full_keys_values()
    assert cache.trim(100) == 100
    assert cache.offset == 100 and cache.n_compressed == 96
    fk, fv = cache._full_keys_values()
    assert fk.shape[2] == 100
    assert mx.allclose(fk, before[0][:, :, :100]).item()
    assert cache.trim(1000) == 100 and cache.empty()
    with pytest.raises(QuantizerConfigError, match="trim"):
        cache.trim(-1)


def test_state_round_trip_gives_the_same_attention():
    cache = _kivi(key_bits=4, value_bits=2)
    _fill(cache, 150)
    clone = KIVICache.from_state(cache.state)
    assert (clone.key_bits, clone.value_bits, clone.offset) == (4, 2, 150)
    q = mx.random.normal((1, 4, 1, 64))
    k = mx.random.normal((1, 2, 1, 64))
    cache.update_and_fetch(k, k)
    clone.update_and_fetch(k, k)
    assert mx.allclose(cache.attention(q, scale=0.1), clone.attention(q, scale=0.1)).item()


def test_per_layer_bits_and_the_factory():
    config = KVCacheConfig(method="kivi", bit_width_inlier=[2, 4, 8])
    caches = [KVCacheFactory.create(config, layer_index=i, n_layers=3) for i in range(3)]
    assert [c.key_bits for c in caches] == [2, 4, 8]
    assert not hasattr(caches[0], "bits")  # mlx-lm would take it for its QuantizedKVCache
    with pytest.raises(QuantizerConfigError, match="3 entries"):
        KVCacheFactory.create(config, layer_index=0, n_layers=2)
    with pytest.raises(QuantizerConfigError, match="layer_index"):
        KVCacheFactory.create(config, layer_index=3, n_layers=3)
    with pytest.raises(QuantizerConfigError, match="bit_width_inlier"):
        KVCacheConfig(method="kivi", bit_width_inlier=5)


def test_bad_input_is_refused_and_nothing_is_written():
    cache = _kivi(kivi_group_size=64)
    with pytest.raises(QuantizerConfigError, match="kivi_group_size=64"):
        cache.update_and_fetch(mx.ones((1, 2, 4, 32)), mx.ones((1, 2, 4, 32)))
    assert cache.empty() and cache.nbytes == 0
    with pytest.raises(QuantizerConfigError, match="dtype"):
        cache.update_and_fetch(mx.ones((1, 2, 4, 64), mx.int32), mx.ones((1, 2, 4, 64), mx.int32))
    with pytest.raises(QuantizerConfigError, match="differ"):
        cache.update_and_fetch(mx.ones((1, 2, 4, 64)), mx.ones((1, 2, 5, 64)))
    assert cache.empty()
    with pytest.raises(QuantizerConfigError, match="method"):
        KIVICache(KVCacheConfig(method="gear"))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_packed_codes_are_in_the_layout_mlx_reads(bits):
    codes = mx.random.randint(0, 2**bits, (2, 3, 96)).astype(mx.uint32)
    words = pack_stream(codes, bits)
    assert words.shape == (2, 3, 96 * bits // 32) and words.dtype == mx.uint32
    ones = mx.ones((2, 3, 3))
    decoded = mx.dequantize(words, ones, mx.zeros_like(ones), group_size=32, bits=bits)
    assert mx.array_equal(decoded, codes.astype(mx.float32)).item()


def test_save_and_load_with_an_empty_window(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    cache = _kivi(bit_width_inlier=4, kivi_residual_length=0)
    _fill(cache, 64)
    assert cache.window_keys is None and cache.n_compressed == 64
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    assert type(loaded) is KIVICache and loaded.window_keys is None
    for a, b in zip(loaded._full_keys_values(), cache._full_keys_values()):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("bits, side", [(2, mx.float16), (3, mx.bfloat16), (4, mx.float16), (8, mx.bfloat16)])
def test_compiled_encoder_is_bit_identical_to_the_plain_one(bits, side):
    # The cache encodes through mx.compile (fused ops); the compiled graph must not change a code,
    # scale or bias.
    from veloxquant_mlx.cache.kivi import affine_quantize, compiled_affine_quantize

    x = (mx.random.normal((1, 2, 40, 96), key=mx.random.key(bits)) * 3).astype(mx.float32)
    plain = affine_quantize(x, 32, bits, side)
    fused = compiled_affine_quantize(32, bits, side)(x)
    for a, b in zip(plain, fused):
        assert a.dtype == b.dtype and mx.array_equal(a, b).item()
    assert compiled_affine_quantize(32, bits, side) is compiled_affine_quantize(32, bits, side)
