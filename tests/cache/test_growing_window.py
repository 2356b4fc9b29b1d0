"""MiniCache's plain layers keep their whole history exact in a buffer grown in place
(cache/growing_window.py) and attend with the fused attention: same numbers as the reference,
no per-step copy of the window, trim and state as before."""

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.minicache import MiniCacheCache

B, H, REP, D = 1, 2, 3, 32


def _plain():
    cache = MiniCacheCache(KVCacheConfig(method="minicache"), layer_index=0, n_layers=4)
    assert cache.role == "plain"
    return cache


def _kv(n, seed):
    return (mx.random.normal((B, H, n, D), key=mx.random.key(seed)).astype(mx.float16),
            mx.random.normal((B, H, n, D), key=mx.random.key(seed + 100)).astype(mx.float16))


def test_plain_layer_matches_the_fp16_cache_through_prefill_and_decode():
    ours, ref = _plain(), KVCache()
    steps = [(300, "causal")] + [(1, None)] * 5 + [(20, "causal")]
    for i, (n, mask) in enumerate(steps):
        k, v = _kv(n, i)
        ok, ov = ours.update_and_fetch(k, v)
        rk, rv = ref.update_and_fetch(k, v)
        assert mx.array_equal(ok, rk).item() and mx.array_equal(ov, rv).item()
        q = mx.random.normal((B, H * REP, n, D), key=mx.random.key(50 + i)).astype(mx.float16)
        got = ours.attention(q, scale=D**-0.5, mask=mask)
        want = mx.fast.scaled_dot_product_attention(q, rk, rv, scale=D**-0.5, mask=mask)
        assert mx.allclose(got, want, atol=1e-3).item()
    assert ours.offset == ref.offset == 325 and ours.n_compressed == 0


def test_decode_steps_write_into_the_buffer_instead_of_copying_the_window():
    cache = _plain()
    cache.update_and_fetch(*_kv(300, 1))
    buffer = cache._window_k
    assert buffer.shape[2] == 512  # grown by window_step (256) tokens at a time
    for i in range(5):
        cache.update_and_fetch(*_kv(1, 10 + i))
        assert cache._window_k is buffer  # written by slice, not replaced by a concatenation
    assert cache.window_keys.shape[2] == cache.window_values.shape[2] == 305
    assert cache.nbytes == 2 * B * H * 512 * D * 2  # slack counted, as mlx-lm's KVCache does
    cache.update_and_fetch(*_kv(300, 20))
    assert cache._window_k.shape[2] == 768 and cache.window_keys.shape[2] == 605


def test_trim_and_state_round_trip_keep_every_token():
    cache = _plain()
    k, v = _kv(280, 3)
    cache.update_and_fetch(k, v)
    assert cache.trim(30) == 30
    assert mx.array_equal(cache.window_keys, k[:, :, :250]).item()
    assert mx.array_equal(cache.window_values, v[:, :, :250]).item()
    k2, v2 = _kv(4, 4)
    cache.update_and_fetch(k2, v2)
    assert mx.array_equal(cache.window_values, mx.concatenate([v[:, :, :250], v2], axis=2)).item()
    loaded = MiniCacheCache.from_state(cache.state)
    assert loaded.role == "plain" and loaded.offset == cache.offset == 254
    assert mx.array_equal(loaded.window_keys, cache.window_keys).item()
    loaded.update_and_fetch(*_kv(1, 5))
    assert loaded.offset == 255 and loaded.window_values.shape[2] == 255


def test_a_window_read_is_one_view_until_the_window_changes():
    # Reads between two writes share one view (each read was a slice op of its own); a write
    # drops it, so the next read sees the new token and no view of ours holds the old buffer.
    cache = _plain()
    k, v = _kv(40, 1)
    cache.update_and_fetch(k, v)
    first = cache.window_keys
    assert cache.window_keys is first and cache.window_values is cache.window_values
    k1, v1 = _kv(1, 2)
    cache.update_and_fetch(k1, v1)
    assert "_window_view_k" not in cache.__dict__ or cache.__dict__["_window_view_k"] is not first
    keys = cache.window_keys
    assert keys is not first and keys.shape[2] == 41
    assert mx.array_equal(keys, mx.concatenate([k, k1], axis=2)).item()
    cache.window_keys = k  # an assignment (trim, a state load) replaces the view too
    assert cache.window_keys.shape[2] == 40 and mx.array_equal(cache.window_keys, k).item()
