"""KIVICache's exact attention sink: token 0 is kept exact beside the store, group 0 quantizes
without it, and every path (portable attention, decode, prefill, fused-decode wiring, trim,
state, nbytes) reads the exact sink instead of its compressed placeholder columns."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from tests.cache.split_softmax_reference import merge_with_window, reference_partials
from veloxquant_mlx import KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.cache.kivi import KIVICache


def _kivi(**fields):
    fields.setdefault("kivi_residual_length", 32)
    return KIVICache(KVCacheConfig(method="kivi", **fields))


def _sink_kv(n, D=64, H=2, seed=0, outlier=40.0):
    """Random K/V whose token 0 is an outlier (as real attention sinks are), so that it would
    widen the range of every key channel's first group."""
    mx.random.seed(seed)
    k = mx.random.normal((1, H, n, D))
    v = mx.random.normal((1, H, n, D))
    scale = mx.concatenate([mx.full((1, 1, 1, 1), outlier), mx.ones((1, 1, n - 1, 1))], axis=2)
    return k * scale, v * scale


def _fill(cache, k, v, chunks):
    start = 0
    for n in chunks:
        cache.update_and_fetch(k[:, :, start : start + n], v[:, :, start : start + n])
        q = mx.random.normal((1, 2 * k.shape[1], n, k.shape[3]))
        mx.eval(cache.attention(q, scale=0.125, mask="causal" if n > 1 else None))
        start += n
    return cache


def _store_decoded(cache):
    """The store read back without the sink substitution: what the codes say."""
    sink = cache.sink_keys, cache.sink_values
    cache.sink_keys = cache.sink_values = None
    try:
        return cache._decode()
    finally:
        cache.sink_keys, cache.sink_values = sink


def test_the_sink_is_exact_and_does_not_widen_group_zero():
    k, v = _sink_kv(200)
    cache = _fill(_kivi(bit_width_inlier=2), k, v, [200, 1])
    assert cache.n_compressed == 160 and cache.sink_keys.shape == (1, 2, 1, 64)
    assert cache.sink_keys.dtype == mx.float32
    fk, fv = cache._full_keys_values()
    assert mx.array_equal(fk[:, :, :1], k[:, :, :1]).item()
    assert mx.array_equal(fv[:, :, :1], v[:, :, :1]).item()
    # Tokens 1..31 share key groups with the sink; their error is within half a step of the
    # range of tokens 1..31 alone (plus fp16 side-data rounding), not of the outlier's range.
    rest = k[:, :, 1:32]
    step = (rest.max(axis=2) - rest.min(axis=2)) / 3
    err = mx.abs(fk[:, :, 1:32] - rest).max(axis=2)
    assert mx.all(err <= 0.5 * step + 3e-3).item()
    # Without the sink the same tokens err by far more (the outlier sets the step).
    plain = _kivi(bit_width_inlier=2)
    plain.exact_sink_tokens = 0
    _fill(plain, k, v, [200, 1])
    assert plain.sink_keys is None
    plain_err = mx.abs(plain._full_keys_values()[0][:, :, 1:32] - rest).mean().item()
    assert plain_err > 5 * mx.abs(fk[:, :, 1:32] - rest).mean().item()
    # The placeholder columns [0, 1) hold token 1's codes and are never read.
    sk, _ = _store_decoded(cache)
    assert mx.allclose(sk[:, :, 0], sk[:, :, 1]).item()


@pytest.mark.parametrize(
    "fields, chunks",
    [
        ({"bit_width_inlier": 2}, [100, 1, 1, 60, 1, 1]),
        ({"key_bits": 4, "value_bits": 2}, [37, 90, 1, 1]),
        ({"bit_width_inlier": 3, "kivi_group_size": 64, "kivi_residual_length": 0}, [130, 1, 70, 1]),
    ],
)
def test_attention_is_over_the_exact_sink_then_the_decoded_history_then_the_window(fields, chunks):
    # The reference is built from the codes themselves (no sink substitution) with column 0
    # replaced by the exact token 0: [exact sink, decoded history minus sink, window].
    k, v = _sink_kv(sum(chunks) + 8, seed=2)
    cache = _kivi(**fields)
    start = 0
    for n in chunks:
        kc, vc = k[:, :, start : start + n], v[:, :, start : start + n]
        cache.update_and_fetch(kc, vc)
        T = start + n
        q = mx.random.normal((1, 4, n, 64))
        if cache.n_compressed:
            hk, hv = _store_decoded(cache)
            ref_k = mx.concatenate([k[:, :, :1], hk[:, :, 1:], cache.window_keys], axis=2)
            ref_v = mx.concatenate([v[:, :, :1], hv[:, :, 1:], cache.window_values], axis=2)
        else:
            ref_k, ref_v = k[:, :, :T], v[:, :, :T]
        mask = mx.arange(T - n, T)[:, None] >= mx.arange(T)[None]
        ref = mx.fast.scaled_dot_product_attention(q, ref_k, ref_v, scale=0.125, mask=mask)
        out = cache.attention(q, scale=0.125, mask="causal" if n > 1 else None)
        assert mx.allclose(out, ref, atol=2e-4, rtol=1e-3).item(), mx.abs(out - ref).max().item()
        start = T
    assert cache.n_compressed > 0 and cache.sink_keys is not None


def test_an_array_mask_and_the_prefill_path_read_the_sink_too(monkeypatch):
    k, v = _sink_kv(300, seed=3)
    cache = _fill(_kivi(bit_width_inlier=2), k, v, [200])
    cache.update_and_fetch(k[:, :, 200:300], v[:, :, 200:300])
    q = mx.random.normal((1, 4, 100, 64))
    twin = KIVICache.from_state(cache.state)  # attention flushes: each path gets its own copy
    mask = mx.arange(200, 300)[:, None] >= mx.arange(300)[None]
    prefill = cache.attention(q, scale=0.125, mask=mask)  # 100 rows: the decoded prefill path
    monkeypatch.setattr(KIVICache, "prefill_rows", None)
    portable = twin.attention(q, scale=0.125, mask=mask)  # the compressed products
    assert mx.allclose(prefill, portable, atol=2e-4, rtol=1e-3).item(), mx.abs(prefill - portable).max().item()


def test_the_kernels_algorithm_with_skip_and_exact_prefix_is_the_portable_attention():
    # What decode_step(skip=S, exact_prefix=sink) asks the kernels to compute: partials over
    # the compressed tokens [S, n), merged with the exact sink placed before the window.
    k, v = _sink_kv(700, seed=4)
    cache = _fill(_kivi(bit_width_inlier=2), k, v, [699, 1])
    assert cache.n_compressed == 640 and cache.capacity > 640
    q_heads = mx.random.normal((1, 8, 1, 64))
    expected = cache.attention(q_heads, scale=0.125)
    q = (q_heads * 0.125).reshape(1, 2, 4, 64)
    hk, hv = _store_decoded(cache)
    n = cache.n_compressed
    o, m, l = reference_partials(q, hk[:, :, 1:], hv[:, :, 1:], n - 1, 128)
    exact_k = mx.concatenate([cache.sink_keys, cache.window_keys], axis=2)
    exact_v = mx.concatenate([cache.sink_values, cache.window_values], axis=2)
    got = merge_with_window(q, o, m, l, exact_k, exact_v)
    assert mx.allclose(got.reshape(expected.shape), expected, atol=2e-5).item()


def test_decode_step_gets_skip_and_the_exact_sink(monkeypatch):
    k, v = _sink_kv(700, seed=5)
    cache = _fill(_kivi(bit_width_inlier=2), k, v, [699, 1])
    q_heads = mx.random.normal((1, 8, 1, 64))
    seen = {}

    def spy(cache_arg, queries, scale, arrays, **kwargs):
        seen.update(cache=cache_arg, queries=queries, scale=scale, arrays=arrays(), kwargs=kwargs)
        return "kernel output"

    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    monkeypatch.setattr(fused_decode, "decode_step", spy)
    assert cache._fused_decode(q_heads, 0.5) == "kernel output"
    assert seen["cache"] is cache and seen["queries"] is q_heads and seen["scale"] == 0.5
    kw = seen["kwargs"]
    assert (kw["group_size"], kw["key_bits"], kw["value_bits"], kw["skip"]) == (32, 2, 2, 1)
    assert kw["exact_prefix"][0] is cache.sink_keys and kw["exact_prefix"][1] is cache.sink_values
    names = ("key_codes", "key_scales", "key_biases", "value_codes", "value_scales", "value_biases")
    assert all(a is cache.store[name] for a, name in zip(seen["arrays"], names))
    # A cache without a sink (a state written before it) asks for nothing to be skipped.
    cache.sink_keys = cache.sink_values = None
    cache._fused_decode(q_heads, 0.5)
    assert seen["kwargs"]["skip"] == 0 and seen["kwargs"]["exact_prefix"] is None
    # Off CUDA decode_step (its own gate) answers None: the portable path runs.
    monkeypatch.undo()
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: False)
    assert cache._fused_decode(q_heads, 0.5) is None


def test_trim_into_the_first_group_keeps_the_sink_exact_and_sets_it_aside_again():
    k, v = _sink_kv(200, seed=6)
    cache = _fill(_kivi(bit_width_inlier=2), k, v, [200, 1])
    fk, fv = cache._full_keys_values()
    assert cache.trim(200 - 40) == 160  # keep 40 tokens: group 0 stays compressed, sink kept
    assert (cache.offset, cache.n_compressed) == (40, 32) and cache.sink_keys is not None
    assert mx.array_equal(cache._full_keys_values()[0], fk[:, :, :40]).item()
    assert cache.trim(30) == 30  # keep 10: group 0 is decoded into the window, sink included
    assert (cache.offset, cache.n_compressed, cache.sink_keys) == (10, 0, None)
    wk, wv = cache._full_keys_values()
    assert mx.array_equal(wk, fk[:, :, :10]).item() and mx.array_equal(wv, fv[:, :, :10]).item()
    assert mx.array_equal(wk[:, :, :1], k[:, :, :1]).item()  # token 0 is still exact
    assert cache.trim(9) == 9 and cache.offset == 1  # keep only the sink itself
    assert mx.array_equal(cache.window_keys, k[:, :, :1]).item()
    # Refilled, the first group is encoded anew and its sink set aside again, exact.
    cache.update_and_fetch(k[:, :, 1:200], v[:, :, 1:200])
    cache.attention(mx.random.normal((1, 4, 199, 64)), scale=0.125, mask="causal")
    assert cache.n_compressed == 160 and mx.array_equal(cache.sink_keys, k[:, :, :1]).item()
    assert cache.trim(1000) == 200 and cache.empty() and cache.sink_keys is None
    assert cache.nbytes == sum(a.nbytes for a in cache.store.values())  # the store's slack stays


def _step(cache, seed=9):
    mx.random.seed(seed)
    x = mx.random.normal((1, 2, 1, 64))
    cache.update_and_fetch(x, x)
    return cache.attention(mx.random.normal((1, 4, 1, 64)), scale=0.125)


def test_state_and_prompt_cache_round_trip_keep_the_sink(tmp_path):
    k, v = _sink_kv(150, seed=7)
    cache = _fill(_kivi(key_bits=4, value_bits=2), k, v, [150])
    clone = KIVICache.from_state(cache.state)
    assert mx.array_equal(clone.sink_keys, cache.sink_keys).item()
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    assert mx.array_equal(loaded.sink_values, v[:, :, :1]).item() and loaded.nbytes == cache.nbytes
    want = _step(cache)
    for other in (clone, loaded):
        assert mx.array_equal(_step(other), want).item()
    # A cache still in its first group has no sink yet: None entries round-trip too.
    early = _fill(_kivi(), k, v, [20])
    save_prompt_cache(path, [early])
    (loaded,) = load_prompt_cache(path)
    assert loaded.sink_keys is None and loaded.offset == 20


def test_a_state_written_before_the_sink_loads_and_attends_as_before():
    # A cache without the sink writes what this class wrote before the change: token 0's own
    # codes in column 0 and no sink entries at the end of the state.
    k, v = _sink_kv(150, seed=8)
    old = _kivi(bit_width_inlier=2)
    old.exact_sink_tokens = 0
    _fill(old, k, v, [150])
    *old_state, sink_k, sink_v = old.state
    assert sink_k is None and sink_v is None
    loaded = KIVICache.from_state(tuple(old_state))
    assert loaded.sink_keys is None and loaded.n_compressed == old.n_compressed
    assert mx.array_equal(_step(loaded), _step(old)).item()


def test_malformed_states_are_refused():
    k, v = _sink_kv(150, seed=10)
    state = _fill(_kivi(), k, v, [150]).state
    with pytest.raises(QuantizerConfigError, match="sink_keys, sink_values"):
        KIVICache.from_state(state[:-1])
    with pytest.raises(QuantizerConfigError, match="both"):
        KIVICache.from_state((*state[:-1], None))
    with pytest.raises(QuantizerConfigError, match="sink shapes"):
        KIVICache.from_state((*state[:-2], state[-2][:, :1], state[-1]))
