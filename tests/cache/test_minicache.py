"""MiniCacheCache: pairing from the start fraction, SLERP merge, retention, the pair's merge
order (lower layer first), attention over its own decoded K/V, bytes, state, trim, bad input."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache.cross_layer import CrossLayerCoordinator
from veloxquant_mlx.cache.minicache import MiniCacheCache, pair_roles, slerp_merge

B, H, D, REP = 1, 2, 64, 3


def layer_kv(shared, layer, pos, n, noise=0.3):
    """K/V of one layer: a component shared by all layers plus the layer's own noise."""
    k0, v0 = shared
    k = k0[:, :, pos : pos + n] + noise * mx.random.normal((B, H, n, D), key=mx.random.key(layer * 7919 + pos))
    v = v0[:, :, pos : pos + n] + noise * mx.random.normal((B, H, n, D), key=mx.random.key(layer * 7919 + pos + 1))
    return k.astype(mx.float16), v.astype(mx.float16)


def shared_kv(n=600):
    return mx.random.normal((B, H, n, D), key=mx.random.key(1)), mx.random.normal((B, H, n, D), key=mx.random.key(2))


def forward(caches, shared, pos, n, check=True):
    for i, cache in enumerate(caches):
        k, v = layer_kv(shared, i, pos, n)
        fk, fv = cache.update_and_fetch(k, v)
        mx.eval(fk, fv)
        q = mx.random.normal((B, H * REP, n, D), key=mx.random.key(pos * 31 + i)).astype(mx.float16)
        mask = "causal" if n > 1 else None
        ours = cache.attention(q, scale=D**-0.5, mask=mask)
        if check:
            ref = mx.fast.scaled_dot_product_attention(
                q, mx.repeat(fk, REP, axis=1), mx.repeat(fv, REP, axis=1), scale=D**-0.5, mask=mask
            )
            assert mx.allclose(ours, ref, atol=2e-2, rtol=2e-2).item(), (i, pos, mx.abs(ours - ref).max())
    return pos + n


def test_roles_follow_the_start_fraction():
    assert pair_roles(30, 0.5) == ["plain"] * 15 + ["lower", "upper"] * 7 + ["plain"]
    assert pair_roles(4, 0.0) == ["lower", "upper"] * 2
    assert pair_roles(4, 1.0) == ["plain"] * 4


def test_slerp_merge_of_parallel_and_orthogonal_vectors():
    a = mx.array([[3.0, 0.0]])
    merged, mag_a, mag_b, cos = slerp_merge(a, mx.array([[0.0, 2.0]]))
    assert mx.allclose(merged, mx.array([[2**-0.5, 2**-0.5]])).item()
    assert (mag_a.item(), mag_b.item(), round(cos.item(), 6)) == (3.0, 2.0, 0.0)
    merged, *_ = slerp_merge(a, 2 * a)
    assert mx.allclose(merged, mx.array([[1.0, 0.0]])).item()


@pytest.mark.parametrize("bits", [None, 4])
def test_attention_equals_attention_over_own_decoded_kv(bits):
    config = KVCacheConfig(method="minicache", minicache_bits=bits, minicache_start_fraction=0.25)
    caches = MiniCacheCache.build_layers(config, 4)
    assert [c.role for c in caches] == ["plain", "lower", "upper", "plain"]
    shared = shared_kv()
    pos = forward(caches, shared, 0, 70)
    for _ in range(12):
        pos = forward(caches, shared, pos, 1)
    pos = forward(caches, shared, pos, 40)
    lower, upper = caches[1], caches[2]
    assert lower.n_compressed == upper.n_compressed == 96 and lower.offset == 122
    assert "dir_k" in lower.store and "dir_k" not in upper.store


def test_merged_history_is_close_and_retention_keeps_dissimilar_tokens_exact():
    config = KVCacheConfig(method="minicache", minicache_start_fraction=0.0, minicache_threshold=0.99)
    lower, upper = MiniCacheCache.build_layers(config, 2)
    shared = shared_kv()
    k_low, v_low = layer_kv(shared, 0, 0, 64)
    k_up, v_up = layer_kv(shared, 1, 0, 64)
    k_up[:, :, 10] = -k_up[:, :, 10]  # one token whose upper key points the other way
    lower.update_and_fetch(k_low, v_low)
    upper.update_and_fetch(k_up, v_up)
    upper._flush()
    assert upper.n_compressed == lower.n_compressed == 64
    fk_up, _ = upper._full_keys_values()
    fk_low, _ = lower._full_keys_values()
    assert mx.array_equal(fk_up[:, :, 10], k_up[:, :, 10]).item()  # retained exactly
    assert mx.array_equal(fk_low[:, :, 10], k_low[:, :, 10]).item()
    assert (upper.store["retpos_k"] == 10).sum().item() == H
    rel = mx.linalg.norm((fk_up - k_up).astype(mx.float32)) / mx.linalg.norm(k_up.astype(mx.float32))
    assert rel.item() < 0.35


def test_lower_layer_waits_for_the_upper_and_decode_order_is_safe():
    config = KVCacheConfig(method="minicache", minicache_start_fraction=0.0)
    lower, upper = MiniCacheCache.build_layers(config, 2)
    shared = shared_kv()
    k, v = layer_kv(shared, 0, 0, 64)
    lower.update_and_fetch(k, v)
    lower.attention(mx.zeros((B, H * REP, 64, D), mx.float16), scale=1.0, mask="causal")
    assert lower.n_compressed == 0  # cannot merge alone
    fk, _ = lower._full_keys_values()
    assert mx.array_equal(fk, k).item()


def test_bytes_shrink():
    config = KVCacheConfig(method="minicache", minicache_start_fraction=0.0, minicache_bits=4)
    caches = MiniCacheCache.build_layers(config, 2)
    shared = shared_kv(520)
    forward(caches, shared, 0, 512, check=False)
    fp16 = 2 * 2 * B * H * 512 * D * 2
    held = sum(c.nbytes for c in caches)
    assert held <= 0.35 * fp16, held / fp16
    for cache in caches:
        measured_bits = cache.nbytes * 8 / (2 * B * H * 512 * D)
        assert abs(measured_bits - cache.bits_per_element()) <= 0.1 * cache.bits_per_element()


def test_state_round_trip_each_layer_alone_then_relink():
    config = KVCacheConfig(method="minicache", minicache_start_fraction=0.0)
    caches = MiniCacheCache.build_layers(config, 2)
    shared = shared_kv()
    pos = forward(caches, shared, 0, 70)
    loaded = [MiniCacheCache.from_state(c.state) for c in caches]
    for before, after in zip(caches, loaded):
        a, b = before._full_keys_values(), after._full_keys_values()
        assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()
    assert "dir_k" in loaded[1].store and loaded[1].owns_directions
    CrossLayerCoordinator.relink(loaded)
    assert not loaded[1].owns_directions and "dir_k" not in loaded[1].store
    forward(loaded, shared, pos, 40)
    assert loaded[1].n_compressed == loaded[0].n_compressed == 96


def test_trim_both_layers_then_decode():
    config = KVCacheConfig(method="minicache", minicache_start_fraction=0.0)
    caches = MiniCacheCache.build_layers(config, 2)
    shared = shared_kv()
    pos = forward(caches, shared, 0, 100)
    for cache in caches:
        assert cache.trim(40) == 40
    assert caches[0].n_compressed == caches[1].n_compressed == 32
    pos = forward(caches, shared, 60, 1)
    forward(caches, shared, pos, 40)
    assert caches[1].n_compressed == 96


def test_bad_input():
    with pytest.raises(QuantizerConfigError, match="minicache_retain_slots=3"):
        KVCacheConfig(method="minicache", minicache_retain_slots=3)
    with pytest.raises(QuantizerConfigError, match="minicache_threshold=2"):
        KVCacheConfig(method="minicache", minicache_threshold=2)
    config = KVCacheConfig(method="minicache", minicache_start_fraction=0.0, minicache_bits=4)
    cache = MiniCacheCache(config, 0, 2)
    with pytest.raises(QuantizerConfigError, match="head_dim=48"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, 48)), mx.zeros((1, 2, 3, 48)))
    lower, upper = MiniCacheCache.build_layers(KVCacheConfig(method="minicache", minicache_start_fraction=0.0), 2)
    lower.update_and_fetch(mx.zeros((1, 2, 40, 32)), mx.zeros((1, 2, 40, 32)))
    upper.update_and_fetch(mx.zeros((1, 4, 40, 32)), mx.zeros((1, 4, 40, 32)))
    with pytest.raises(QuantizerConfigError, match="different KV shapes"):
        upper._flush()
