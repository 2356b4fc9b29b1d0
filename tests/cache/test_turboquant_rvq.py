"""TurboQuantRVQCache: rotation, storage, accuracy, compressed-form attention, config, state."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache import unpacked_products
from veloxquant_mlx.cache.hadamard import random_signs, rotate, unrotate
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache


def _config(**kw):
    return KVCacheConfig(method="turboquant_rvq", **kw)


def _keys_values(tokens, dim=64, heads=2, seed=0):
    """Gaussian keys with a few outlier channels and a constant offset (as real keys have)."""
    mx.random.seed(seed)
    k = mx.random.normal((1, heads, tokens, dim))
    k = k * mx.where(mx.arange(dim) % 16 == 3, 8.0, 1.0) + mx.where(mx.arange(dim) < 4, 3.0, 0.0)
    v = mx.random.normal((1, heads, tokens, dim))
    return k, v


def _filled(tokens=400, **kw):
    cache = TurboQuantRVQCache(_config(**kw))
    k, v = _keys_values(tokens)
    cache.update_and_fetch(k, v)
    cache.attention(mx.random.normal((1, 6, tokens, 64)), scale=0.125, mask="causal")  # flushes
    return cache, k, v


def _rel(a, b):
    return (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item()


def test_rotation_is_orthogonal_and_inverts():
    signs = random_signs(3, 5, 64)
    eye = mx.eye(64)
    r = rotate(eye, signs)
    assert mx.allclose(r @ r.T, eye, atol=1e-5).item()
    x = mx.random.normal((3, 64))
    assert mx.allclose(unrotate(rotate(x, signs), signs), x, atol=1e-5).item()
    assert mx.array_equal(random_signs(3, 5, 64), signs).item()
    assert not mx.array_equal(random_signs(3, 6, 64), signs).item()


@pytest.mark.parametrize("dim", [32, 64, 128])
def test_dense_fallback_rotation_equals_the_fast_transform(monkeypatch, dim):
    """A backend without mx.hadamard_transform rotates by a matmul with the same matrix."""
    from veloxquant_mlx.cache import hadamard

    signs = random_signs(0, 1, dim)
    x = mx.random.normal((2, 3, 5, dim))
    fast = rotate(x, signs)
    device = str(mx.default_device())
    monkeypatch.setitem(hadamard._FAST_ON, device, False)

    def refuse(*args, **kwargs):
        raise RuntimeError("Hadamard has no CUDA implementation.")

    monkeypatch.setattr(mx, "hadamard_transform", refuse)
    assert mx.allclose(rotate(x, signs), fast, atol=1e-5).item()
    assert mx.allclose(unrotate(rotate(x, signs), signs), x, atol=1e-5).item()
    # The probe itself reports the missing transform.
    monkeypatch.delitem(hadamard._FAST_ON, device)
    assert not hadamard.fast_transform_available()


def test_codes_are_uint32_and_bytes_match_accounting():
    cache, k, v = _filled(4096 + 64)
    assert cache.window_keys.shape[2] == 64
    for name, arr in cache.store.items():
        if "codes" in name:
            assert arr.dtype == mx.uint32
    elements = 2 * cache.capacity * cache.n_kv_heads * 64  # keys + values of the store's capacity
    measured_bits = 8 * sum(a.nbytes for a in cache.store.values()) / elements
    assert abs(measured_bits - cache.bits_per_element()) <= 0.1 * cache.bits_per_element()
    assert cache.bits_per_element() == pytest.approx(4.75)
    # fp16 comparison: the bytes an fp16 KVCache holds for the same tokens.
    fp16_bytes = 2 * 2 * cache.offset * cache.n_kv_heads * 64
    k16, v16 = _keys_values(4096 + 64)
    cache16 = TurboQuantRVQCache(_config())
    cache16.update_and_fetch(k16.astype(mx.float16), v16.astype(mx.float16))
    cache16.attention(mx.random.normal((1, 6, 1, 64)).astype(mx.float16), scale=0.125)
    assert cache16.nbytes / fp16_bytes <= 0.32


@pytest.mark.parametrize("bits,bound", [(4, 0.12), (3, 0.22), (2, 0.45), (1, 0.8)])
def test_decoded_error_bounds(bits, bound):
    cache, k, v = _filled(bit_width_inlier=bits)
    fk, fv = cache._full_keys_values()
    n = cache.n_compressed
    centered = k - mx.mean(k[:, :, :n], axis=2, keepdims=True)
    # Key error relative to the keys' varying part (a constant offset does not move softmax).
    err_k = (mx.linalg.norm(fk[:, :, :n] - k[:, :, :n]) / mx.linalg.norm(centered[:, :, :n])).item()
    err_v = _rel(fv[:, :, :n], v[:, :, :n])
    assert err_k < bound and err_v < bound
    # The exact window comes back exactly.
    assert mx.array_equal(fk[:, :, n:], k[:, :, n:]).item()


def test_more_bits_less_error():
    errors = []
    for bits in (1, 2, 3, 4):
        cache, k, v = _filled(bit_width_inlier=bits)
        _, fv = cache._full_keys_values()
        errors.append(_rel(fv, v))
    assert errors == sorted(errors, reverse=True)


@pytest.mark.parametrize("bits", [1, 3, 4])
def test_compressed_attention_equals_attention_over_decoded(bits):
    cache, k, v = _filled(300, bit_width_inlier=bits)
    fk, fv = cache._full_keys_values()
    for L, mask in ((1, None), (5, "causal")):
        q = mx.random.normal((1, 6, L, 64))
        # Queries for the last L positions: what a decode / chunk step sees.
        out = cache.attention(q, scale=0.125, mask=mask)
        T = fk.shape[2]
        keep = mx.arange(T - L, T)[:, None] >= mx.arange(T)[None]
        ref = mx.fast.scaled_dot_product_attention(
            q, mx.repeat(fk, 3, axis=1), mx.repeat(fv, 3, axis=1), scale=0.125, mask=keep
        )
        assert mx.allclose(out, ref, atol=1e-5).item()


def test_compressed_attention_beats_mlx_4bit_on_outlier_keys():
    cache, k, v = _filled(1024)
    q = mx.random.normal((1, 6, 1, 64)) * 2
    exact = mx.fast.scaled_dot_product_attention(q, mx.repeat(k, 3, 1), mx.repeat(v, 3, 1), scale=0.125)
    ours = cache.attention(q, scale=0.125)
    kq = mx.dequantize(*mx.quantize(k, group_size=64, bits=4), group_size=64, bits=4)
    vq = mx.dequantize(*mx.quantize(v, group_size=64, bits=4), group_size=64, bits=4)
    theirs = mx.fast.scaled_dot_product_attention(q, mx.repeat(kq, 3, 1), mx.repeat(vq, 3, 1), scale=0.125)
    assert _rel(ours, exact) < _rel(theirs, exact)


def test_per_layer_bits_and_key_value_override():
    config = _config(bit_width_inlier=[1, 2, 3, 4])
    assert [TurboQuantRVQCache(config, i, 4).key_bits for i in range(4)] == [1, 2, 3, 4]
    with pytest.raises(QuantizerConfigError, match="entries"):
        TurboQuantRVQCache(config, 0, 5)
    cache = TurboQuantRVQCache(_config(bit_width_inlier=2, key_bits=4, value_bits=1))
    assert (cache.key_bits, cache.value_bits) == (4, 1)
    k, v = _keys_values(200)
    cache.update_and_fetch(k, v)
    cache.attention(mx.random.normal((1, 6, 1, 64)), scale=0.125)
    assert cache.store["k_codes1"].shape[-1] == 6 and "v_codes1" not in cache.store
    assert cache.bits_per_element() == pytest.approx((4.75 + 1.25) / 2)


def test_state_round_trip_reproduces_attention():
    cache, k, v = _filled(300)
    q = mx.random.normal((1, 6, 1, 64))
    clone = TurboQuantRVQCache.from_state(cache.state)
    assert clone.offset == cache.offset and clone.nbytes == cache.nbytes
    assert mx.array_equal(clone.attention(q, 0.125), cache.attention(q, 0.125)).item()
    k2, v2 = _keys_values(70, seed=1)
    a = cache.update_and_fetch(k2, v2)[0]
    b = clone.update_and_fetch(k2, v2)[0]
    assert mx.array_equal(a, b).item()


def test_trim_into_compressed_history():
    cache, k, v = _filled(300)
    assert cache.n_compressed == 192
    assert cache.trim(150) == 150
    fk, fv = cache._full_keys_values()
    assert cache.offset == 150 and fk.shape[2] == 150
    assert _rel(fv, v[:, :, :150]) < 0.12
    cache.update_and_fetch(k[:, :, 150:], v[:, :, 150:])
    assert cache.offset == 300


def test_bad_input_is_refused():
    with pytest.raises(QuantizerConfigError, match="bit_width_inlier=5"):
        _config(bit_width_inlier=5)
    with pytest.raises(QuantizerConfigError, match="key_bits=0"):
        _config(key_bits=0)
    cache = TurboQuantRVQCache(_config(), layer_index=7)
    with pytest.raises(QuantizerConfigError, match=r"layer 7.*head_dim=96"):
        cache.update_and_fetch(mx.ones((1, 2, 3, 96)), mx.ones((1, 2, 3, 96)))
    with pytest.raises(QuantizerConfigError, match="head_dim=16"):
        cache.update_and_fetch(mx.ones((1, 2, 3, 16)), mx.ones((1, 2, 3, 16)))
    with pytest.raises(QuantizerConfigError, match="got 'kivi'"):
        TurboQuantRVQCache(KVCacheConfig(method="kivi"))
    assert cache.empty()


def _refuse_one_bit(monkeypatch):
    """Make every 1-bit affine op raise, as MLX's CUDA backend does for quantized_matmul."""
    calls = []

    def guard(name):
        original = getattr(mx, name)

        def wrapped(*args, **kwargs):
            bits = kwargs.get("bits", 4)
            calls.append((name, bits))
            if bits == 1:
                raise ValueError(f"[{name}] 1-bit quantization is not supported.")
            return original(*args, **kwargs)

        monkeypatch.setattr(mx, name, wrapped)

    for name in ("quantized_matmul", "dequantize", "quantize"):
        guard(name)
    return calls


@pytest.mark.parametrize("unpacked", [False, True])
@pytest.mark.parametrize("bits", [1, 4])
def test_no_one_bit_affine_op_in_decode_prefill_or_state(monkeypatch, bits, unpacked):
    # unpacked False: the path of a GPU backend without our kernels (Metal), the products
    # through MLX's affine kernels; True: the CPU's (cache/unpacked_products.py).
    monkeypatch.setattr(unpacked_products, "applies", lambda: unpacked)
    calls = _refuse_one_bit(monkeypatch)
    cache = TurboQuantRVQCache(_config(bit_width_inlier=bits))
    k, v = _keys_values(400)
    # Prefill chunks: a long one (fused attention over the decoded history) and a short one
    # (compressed-form attention); each flushes blocks through _encode.
    cache.update_and_fetch(k[:, :, :300], v[:, :, :300])
    mx.eval(cache.attention(mx.random.normal((1, 6, 300, 64)), scale=0.125, mask="causal"))
    cache.update_and_fetch(k[:, :, 300:305], v[:, :, 300:305])
    mx.eval(cache.attention(mx.random.normal((1, 6, 5, 64)), scale=0.125, mask="causal"))
    assert cache.n_compressed > 0
    cache.update_and_fetch(k[:, :, 305:400], v[:, :, 305:400])
    mx.eval(cache.attention(mx.random.normal((1, 6, 400 - 305, 64)), scale=0.125, mask="causal"))
    # Decode steps, before and after a state round trip.
    q = mx.random.normal((1, 6, 1, 64))
    cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
    mx.eval(cache.attention(q, scale=0.125))
    clone = TurboQuantRVQCache.from_state(cache.state)
    clone.update_and_fetch(k[:, :, :1], v[:, :, :1])
    mx.eval(clone.attention(q, scale=0.125), *clone._full_keys_values())
    # Nothing asked for 1 bit; the sign stage was read at 2 bits (scores), 4 bits (weighted
    # sum) and the uniform stage, if any, at its own width.
    assert all(b != 1 for _, b in calls)
    qmm_bits = {b for name, b in calls if name == "quantized_matmul"}
    if unpacked:  # the CPU's products unpack the codes themselves: no affine kernel at all
        assert qmm_bits == set()
    else:
        assert qmm_bits == ({2, 4} if bits == 1 else {2, 3, 4})


def test_first_token_is_read_back_exactly_and_survives_save_load(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    cache, k, v = _filled(300)
    fk, fv = cache._full_keys_values()
    # The attention sink (token 0) comes back exactly; the next token carries its codes' error.
    assert mx.allclose(fk[:, :, 0], k[:, :, 0], atol=1e-5).item()
    assert mx.allclose(fv[:, :, 0], v[:, :, 0], atol=1e-5).item()
    assert not mx.allclose(fk[:, :, 1], k[:, :, 1], atol=1e-3).item()
    q = mx.random.normal((1, 6, 1, 64))
    path = str(tmp_path / "tq.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    assert isinstance(loaded, TurboQuantRVQCache) and loaded.nbytes == cache.nbytes
    assert mx.allclose(loaded.attention(q, 0.125), cache.attention(q, 0.125), atol=1e-6).item()
    # A state written before the sink correction (ending at key_mean) still loads, uncorrected.
    old = TurboQuantRVQCache.from_state(cache.state[:-2])
    assert old.sink_deltas is None and old.offset == cache.offset
    with pytest.raises(QuantizerConfigError, match="state must be"):
        TurboQuantRVQCache.from_state(cache.state[:-1])


def test_sink_correction_is_rebuilt_when_trim_empties_the_history():
    cache, k, v = _filled(300)
    cache.trim(300 - 40)  # 40 tokens left: no whole block, all back in the window
    assert cache.n_compressed == 0
    k2, v2 = _keys_values(300, seed=3)
    cache.update_and_fetch(k2[:, :, 40:], v2[:, :, 40:])
    cache.attention(mx.random.normal((1, 6, 260, 64)), scale=0.125, mask="causal")  # flushes
    fk, _ = cache._full_keys_values()
    assert mx.allclose(fk[:, :, 0], k[:, :, 0], atol=1e-5).item()
