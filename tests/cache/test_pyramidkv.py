"""PyramidKVCache: budgets shrink with depth, attention-vote eviction at prefill, positions and
offset after eviction, attention over its own kept K/V, state round trip, trim rules, bad input."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache.pyramidkv import PyramidKVCache, average_pool, pyramid_budgets

B, H, D, REP = 1, 2, 32, 2


def kv(n, seed):
    k = mx.random.normal((B, H, n, D), key=mx.random.key(seed))
    v = mx.random.normal((B, H, n, D), key=mx.random.key(seed + 1000))
    return k, v


def query(n, seed):
    return mx.random.normal((B, H * REP, n, D), key=mx.random.key(seed + 2000))


def forward(cache, n, seed, array_mask=False):
    """update, then attention; returns (ours, plain attention over the K/V update returned).
    array_mask: a boolean mask array (the explicit, tiled path) instead of mlx-lm's "causal"."""
    k, v = kv(n, seed)
    mask = cache.make_mask(n, return_array=array_mask)
    fk, fv = cache.update_and_fetch(k, v)
    mx.eval(fk, fv)
    q = query(n, seed)
    ours = cache.attention(q, scale=D**-0.5, mask=mask)
    ref = mx.fast.scaled_dot_product_attention(
        q, mx.repeat(fk, REP, axis=1), mx.repeat(fv, REP, axis=1), scale=D**-0.5, mask=mask
    )
    return ours, ref


def test_budgets_are_an_arithmetic_pyramid_with_the_given_mean():
    budgets = pyramid_budgets(budget=128, window=8, beta=20, n_layers=30)
    assert budgets[0] > budgets[-1] and all(a >= b for a, b in zip(budgets, budgets[1:]))
    assert budgets[-1] == 8 + round(120 / 20)
    assert abs(sum(budgets) / 30 - 128) <= 1
    assert pyramid_budgets(64, 8, 20, 1) == [64]


def test_average_pool_matches_a_direct_mean():
    x = mx.arange(10, dtype=mx.float32)[None]
    pooled = average_pool(x, 3)
    assert pooled.shape == x.shape
    assert mx.allclose(pooled[0, 1:-1], (x[0, :-2] + x[0, 1:-1] + x[0, 2:]) / 3).item()
    assert pooled[0, 0].item() == pytest.approx((0 + 1) / 3)


def test_eviction_keeps_budget_window_and_voted_tokens():
    config = KVCacheConfig(method="pyramidkv", pyramidkv_budget=40, pyramidkv_window=8, pyramidkv_kernel=1)
    caches = PyramidKVCache.build_layers(config, 4)
    cache = caches[3]
    k, v = kv(100, 0)
    cache.update_and_fetch(k, v)
    # Queries equal to a chosen key score that key highest; the last 8 queries vote for key 5.
    q = mx.zeros((B, H * REP, 100, D))
    q[:, :, -8:] = mx.repeat(k[:, :, 5:6], REP, axis=1) * 10
    cache.attention(q, scale=1.0, mask="causal")
    assert cache.n_kept == cache.layer_budget < 100 and cache.offset == 100
    positions = cache.store["positions"][:, :, : cache.n_kept]
    assert (positions[..., -8:] == mx.arange(92, 100)).all().item()  # the window is kept
    assert (positions == 5).any(axis=-1).all().item()  # the voted token is kept in every head
    assert (positions[..., 1:] > positions[..., :-1]).all().item()  # token order kept
    assert caches[0].layer_budget > caches[3].layer_budget


def test_decode_after_eviction_equals_attention_over_kept_kv():
    config = KVCacheConfig(method="pyramidkv", pyramidkv_budget=24, pyramidkv_window=4)
    cache = PyramidKVCache(config)
    ours, ref = forward(cache, 64, 0)
    assert mx.allclose(ours, ref, atol=1e-4).item()  # prefill sees everything
    assert cache.n_kept == 24
    for seed in range(1, 6):
        ours, ref = forward(cache, 1, seed)
        assert mx.allclose(ours, ref, atol=1e-4).item()
    assert cache.offset == 69 and cache.n_kept == 29 and cache.size() == 69
    # A multi-token chunk after decoding started (e.g. speculative verification): no eviction,
    # causal mask from positions equals mlx-lm's lower-right causal mask over the kept keys.
    ours, ref = forward(cache, 3, 9)
    assert mx.allclose(ours, ref, atol=1e-4).item() and cache.n_kept == 32
    mask = cache.make_mask(2, return_array=True)
    assert mask.shape == (2, 34)


def test_bytes_shrink_to_the_budget():
    config = KVCacheConfig(method="pyramidkv", pyramidkv_budget=64, pyramidkv_window=8)
    caches = PyramidKVCache.build_layers(config, 4)
    for cache in caches:
        k, v = kv(1024, 1)
        cache.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
        cache.attention(query(1024, 1).astype(mx.float16), scale=D**-0.5, mask="causal")
    fp16 = 4 * 2 * B * H * 1024 * D * 2
    held = sum(c.nbytes for c in caches)
    # 64 tokens kept on average, stored with 256-token growth slack, plus int32 positions.
    assert held <= 0.3 * fp16, held / fp16
    assert sum(c.n_kept for c in caches) == sum(c.layer_budget for c in caches)


def test_state_round_trip_and_trim_rules():
    config = KVCacheConfig(method="pyramidkv", pyramidkv_budget=24, pyramidkv_window=4)
    cache = PyramidKVCache(config, layer_index=1, n_layers=3)
    forward(cache, 64, 0)
    forward(cache, 1, 1)
    forward(cache, 1, 2)
    loaded = PyramidKVCache.from_state(cache.state)
    assert (loaded.offset, loaded.n_kept, loaded.layer_budget) == (cache.offset, cache.n_kept, cache.layer_budget)
    a, _ = forward(cache, 1, 3)
    b, _ = forward(loaded, 1, 3)
    assert mx.array_equal(a, b).item()
    assert loaded.trim(2) == 2 and loaded.offset == 65
    with pytest.raises(QuantizerConfigError, match="allowed is trimming at most the 1 tokens"):
        loaded.trim(5)
    meta = cache.state[0].replace("PyramidKVCache", "XQuantCache")
    with pytest.raises(QuantizerConfigError, match="XQuantCache"):
        PyramidKVCache.from_state((meta, *cache.state[1:]))


def test_without_attention_nothing_is_evicted_and_a_warning_says_so():
    cache = PyramidKVCache(KVCacheConfig(method="pyramidkv", pyramidkv_budget=16, pyramidkv_window=4))
    cache.update_and_fetch(*kv(40, 0))
    with pytest.warns(UserWarning, match="nothing was evicted"):
        cache.update_and_fetch(*kv(1, 1))
    assert cache.n_kept == 41
    with pytest.raises(QuantizerConfigError, match="kv_bits"):
        forward_evicted = PyramidKVCache(KVCacheConfig(method="pyramidkv", pyramidkv_budget=16, pyramidkv_window=4))
        forward(forward_evicted, 40, 0)
        forward_evicted.to_quantized()


def test_bad_input():
    with pytest.raises(QuantizerConfigError, match="must exceed"):
        PyramidKVCache(KVCacheConfig(method="pyramidkv", pyramidkv_budget=32, pyramidkv_window=32))
    with pytest.raises(QuantizerConfigError, match="pyramidkv_kernel=4"):
        KVCacheConfig(method="pyramidkv", pyramidkv_kernel=4)
    with pytest.raises(QuantizerConfigError, match="pyramidkv_budget=8"):
        KVCacheConfig(method="pyramidkv", pyramidkv_budget=8)
    cache = PyramidKVCache(KVCacheConfig(method="pyramidkv"))
    with pytest.raises(QuantizerConfigError, match="dtype"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, 8), mx.int32), mx.zeros((1, 2, 3, 8), mx.int32))
    with pytest.raises(QuantizerConfigError, match="sliding-window"):
        cache.make_mask(4, window_size=2)
    with pytest.raises(QuantizerConfigError, match="trim"):
        cache.trim(-1)


def test_long_chunk_is_tiled_over_query_rows_with_the_same_result():
    config = KVCacheConfig(method="pyramidkv", pyramidkv_budget=24, pyramidkv_window=4)
    whole, tiled = PyramidKVCache(config), PyramidKVCache(config)
    tiled.attention_tile_bytes = 4 * H * REP * 80 * 7  # 7 query rows per tile
    a, _ = forward(whole, 80, 0)
    b, ref = forward(tiled, 80, 0, array_mask=True)
    assert mx.allclose(a, b, atol=1e-5).item() and mx.allclose(b, ref, atol=1e-4).item()
    assert mx.array_equal(whole.store["positions"], tiled.store["positions"]).item()


def test_fused_attention_tiled_over_rows_on_the_cpu_is_the_same():
    # A tile budget of 7 query rows: the string-mask (fused) path splits the chunk's rows and
    # cuts the keys per tile; the result equals one untiled call and the reference.
    config = KVCacheConfig(method="pyramidkv", pyramidkv_budget=24, pyramidkv_window=4)
    whole, tiled = PyramidKVCache(config), PyramidKVCache(config)
    tiled.attention_tile_bytes = 4 * H * REP * 80 * 7
    a, ref = forward(whole, 80, 0)
    b, _ = forward(tiled, 80, 0)
    assert mx.allclose(a, b, atol=1e-5).item() and mx.allclose(b, ref, atol=1e-4).item()
    for seed in (1, 2):  # decode steps after the eviction, then a 5-token chunk
        a, _ = forward(whole, 1, seed)
        b, ref = forward(tiled, 1, seed)
        assert mx.allclose(a, b, atol=1e-5).item() and mx.allclose(b, ref, atol=1e-4).item()
    tiled.attention_tile_bytes = 4 * H * REP * 40 * 2  # 2 rows per tile
    a, _ = forward(whole, 5, 3)
    b, ref = forward(tiled, 5, 3)
    assert mx.allclose(a, b, atol=1e-5).item() and mx.allclose(b, ref, atol=1e-4).item()


def test_decode_steps_write_their_positions_when_read():
    # A decode step appends its token's K/V only; the positions of those tokens (contiguous up to
    # offset - 1) are written when something reads them: an array mask, the state, an eviction.
    # The store then holds what writing them at each step held.
    config = KVCacheConfig(method="pyramidkv", pyramidkv_budget=24, pyramidkv_window=4)
    cache = PyramidKVCache(config)
    forward(cache, 64, 0)
    kept = cache.store["positions"][:, :, : cache.n_kept]
    for seed in range(1, 6):
        forward(cache, 1, seed)
    assert cache.positions_written == 24 < cache.n_kept == 29
    cache.state  # a saved state holds every position
    assert cache.positions_written == 29
    state_positions = cache.store["positions"]
    expected = mx.concatenate([kept, mx.broadcast_to(mx.arange(64, 69, dtype=mx.int32), (B, H, 5))], axis=-1)
    assert mx.array_equal(state_positions[:, :, :29], expected).item()
    # Two more steps, then a trim into them, then a chunk under an array mask: the same output
    # as attention over the K/V the update returned.
    forward(cache, 1, 7)
    forward(cache, 1, 8)
    assert cache.trim(1) == 1 and cache.positions_written == 29 and cache.n_kept == 30
    ours, ref = forward(cache, 3, 9, array_mask=True)
    assert mx.allclose(ours, ref, atol=1e-4).item()
    positions = cache.store["positions"][:, :, : cache.n_kept]
    assert mx.array_equal(positions[..., -6:], mx.broadcast_to(mx.arange(67, 73, dtype=mx.int32), (B, H, 6))).item()


def test_a_prefill_eviction_starts_its_work_without_waiting(monkeypatch):
    # The eviction at a prefill chunk hands its kept tokens to mx.async_eval: a wait there
    # (mx.eval) stopped the host at every layer of every chunk (session 13: 1.19x fp16's 32K
    # prefill on the H200, 0.77x started). Same kept tokens either way.
    config = KVCacheConfig(method="pyramidkv", pyramidkv_budget=24, pyramidkv_window=4)
    started, waited = [], []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: started.append(a) or real_async_eval(*a))
    monkeypatch.setattr(mx, "eval", lambda *a: waited.append(a))
    cache = PyramidKVCache(config)
    k, v = kv(64, 0)
    cache.update_and_fetch(k, v)
    cache.attention(query(64, 0), scale=D**-0.5, mask="causal")
    assert waited == [] and len(started) == 1
    assert {id(a) for a in started[0]} == {id(a) for a in cache.store.values()}
    monkeypatch.undo()
    assert cache.n_kept == 24
    positions = cache.store["positions"][:, :, :24]
    assert (positions[..., -4:] == mx.arange(60, 64)).all().item()
