"""XQuantCache: real bytes, code sharing within a pair, attention over its own decoded K/V,
state round trip (each layer alone, then relinked), trim, bad input."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache.cross_layer import CrossLayerCoordinator
from veloxquant_mlx.cache.xquant import XQuantCache, pack_bitstream

B, H, D, REP = 1, 2, 64, 3


def kv(n, seed, dtype=mx.float16):
    k = mx.random.normal((B, H, n, D), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((B, H, n, D), key=mx.random.key(seed + 1000)).astype(dtype)
    return k, v


def step(caches, n, seed):
    """One forward pass over all layers in order: update, then attention (what a model does).
    Returns, per layer, (our attention output, plain attention over the K/V we returned)."""
    results = []
    for i, cache in enumerate(caches):
        k, v = kv(n, seed * 100 + i)
        fk, fv = cache.update_and_fetch(k, v)
        mx.eval(fk, fv)  # before attention flushes the window into the store
        q = mx.random.normal((B, H * REP, n, D), key=mx.random.key(seed * 100 + i + 50)).astype(mx.float16)
        mask = "causal" if n > 1 else None
        ours = cache.attention(q, scale=D**-0.5, mask=mask)
        ref = mx.fast.scaled_dot_product_attention(
            q, mx.repeat(fk, REP, axis=1), mx.repeat(fv, REP, axis=1), scale=D**-0.5, mask=mask
        )
        results.append((ours, ref))
    return results


def test_bitstream_matches_mlx_packing():
    for bits in (2, 3, 4):
        w = mx.random.normal((4, 64), key=mx.random.key(bits))
        packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
        codes = mx.dequantize(packed, mx.ones_like(scales), mx.zeros_like(biases), group_size=32, bits=bits)
        assert mx.array_equal(pack_bitstream(codes.astype(mx.uint32), bits), packed).item()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_attention_equals_attention_over_own_decoded_kv(bits):
    config = KVCacheConfig(method="xquant", bit_width_inlier=bits, xquant_residual_length=8)
    caches = XQuantCache.build_layers(config, 3)
    for seed, n in enumerate([70, 1, 1, 33, 1] + [1] * 10):
        for ours, ref in step(caches, n, seed):
            assert mx.allclose(ours, ref, atol=2e-2, rtol=2e-2).item(), mx.abs(ours - ref).max()
    assert caches[1].shared and not caches[0].shared and not caches[2].shared
    assert caches[1].n_compressed == caches[0].n_compressed > 0


def test_bytes_shrink_and_follower_holds_no_codes():
    config = KVCacheConfig(method="xquant", bit_width_inlier=2, xquant_residual_length=0)
    caches = XQuantCache.build_layers(config, 2)
    n = 512
    step(caches, n, 0)
    leader, follower = caches
    assert "k_codes" in leader.store and "k_codes" not in follower.store
    fp16 = 2 * B * H * n * D * 2
    assert leader.nbytes <= 0.19 * fp16  # 3 bits of 16 (2-bit codes + fp16 scale and zero per 32)
    assert follower.nbytes <= 0.07 * fp16  # 1 bit of 16: scales and zeros only
    for cache in caches:
        measured_bits = cache.nbytes * 8 / (2 * B * H * n * D)
        assert abs(measured_bits - cache.bits_per_element()) <= 0.1 * cache.bits_per_element()


def test_follower_waits_for_its_leader():
    """A follower never encodes a block its leader has not: those tokens stay exact."""
    config = KVCacheConfig(method="xquant", xquant_residual_length=0)
    leader, follower = XQuantCache.build_layers(config, 2)
    leader.update_and_fetch(*kv(10, 1))  # leader has dtype, nothing compressed
    k, v = kv(64, 2)
    follower.update_and_fetch(k, v)
    follower.attention(mx.zeros((B, H * REP, 64, D), mx.float16), scale=1.0, mask="causal")
    assert follower.shared and follower.n_compressed == 0
    fk, fv = follower._full_keys_values()
    assert mx.array_equal(fk, k).item()


def test_state_round_trip_each_layer_alone_then_relink():
    config = KVCacheConfig(method="xquant", xquant_residual_length=8)
    caches = XQuantCache.build_layers(config, 2)
    step(caches, 100, 0)
    loaded = [XQuantCache.from_state(c.state) for c in caches]
    for before, after in zip(caches, loaded):
        assert after.coordinator is None and after.offset == before.offset
        a, b = before._full_keys_values(), after._full_keys_values()
        assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()
    assert "k_codes" in loaded[1].store  # alone, the follower carries its leader's codes
    coordinator = CrossLayerCoordinator.relink(loaded)
    assert loaded[1].shared and "k_codes" not in loaded[1].store
    assert loaded[1].nbytes == caches[1].nbytes and loaded[0].coordinator is coordinator
    for (ours_a, ref_a), (ours_b, _) in zip(step(caches, 1, 9), step(loaded, 1, 9)):
        assert mx.array_equal(ours_a, ours_b).item()


def test_trim_into_history_then_decode():
    config = KVCacheConfig(method="xquant", xquant_residual_length=0)
    caches = XQuantCache.build_layers(config, 2)
    step(caches, 100, 0)
    for cache in caches:
        assert cache.trim(20) == 20 and cache.offset == 80
    assert caches[1].n_compressed == 64
    for ours, ref in step(caches, 1, 3):
        assert mx.allclose(ours, ref, atol=2e-2, rtol=2e-2).item()
    with pytest.raises(QuantizerConfigError, match="trim"):
        caches[0].trim(-1)


def test_bad_input():
    with pytest.raises(QuantizerConfigError, match="bit_width_inlier=5"):
        KVCacheConfig(method="xquant", bit_width_inlier=5)
    with pytest.raises(QuantizerConfigError, match="xquant_eta=0.6"):
        KVCacheConfig(method="xquant", xquant_eta=0.6)
    with pytest.raises(QuantizerConfigError, match="same bit width within each pair"):
        XQuantCache.build_layers(KVCacheConfig(method="xquant", bit_width_inlier=[2, 4, 2, 2]), 4)
    cache = XQuantCache(KVCacheConfig(method="xquant", xquant_group_size=64))
    with pytest.raises(QuantizerConfigError, match="value head_dim=96"):
        cache.update_and_fetch(mx.zeros((1, 2, 4, 96)), mx.zeros((1, 2, 4, 96)))
    with pytest.raises(QuantizerConfigError, match="shape"):
        cache.update_and_fetch(mx.zeros((2, 64)), mx.zeros((2, 64)))
    with pytest.raises(QuantizerConfigError, match="XQuantCache"):
        XQuantCache(KVCacheConfig(method="kivi"))


def test_share_from_limits_sharing_and_the_fit_beats_min_max():
    config = KVCacheConfig(method="xquant", xquant_share_from=0.5, xquant_residual_length=0)
    caches = XQuantCache.build_layers(config, 4)
    step(caches, 64, 0)
    assert [c.shared for c in caches] == [False, False, False, True]
    # The follower's fitted side data reconstructs its own block no worse than min/max would.
    from veloxquant_mlx.cache.xquant import minmax_params
    follower = caches[3]
    k, _ = kv(64, 3)  # what step() fed layer 3
    fk, _ = follower._full_keys_values()
    codes, _ = follower._leader_codes(0, 64)
    groups = k.swapaxes(2, 3).reshape(B, H, D, 2, 32).astype(mx.float32)
    _, _, s_cal, z_cal = minmax_params(groups, 2, 0.05)
    paper = (codes * s_cal + z_cal).reshape(B, H, D, 64).swapaxes(2, 3)
    ours_err = mx.sum((fk.astype(mx.float32) - k.astype(mx.float32)) ** 2).item()
    paper_err = mx.sum((paper - k.astype(mx.float32)) ** 2).item()
    assert ours_err <= paper_err * 1.01


@pytest.mark.parametrize("bits, eta", [(2, 0.05), (3, 0.0), (4, 0.0)])
def test_compiled_encoders_are_bit_identical_to_the_plain_ones(bits, eta):
    from veloxquant_mlx.cache.xquant import fit_to_codes, fit_to_codes_fused, quantize_groups, quantize_groups_fused

    groups = (mx.random.normal((1, 2, 8, 3, 32), key=mx.random.key(bits)) * 2).astype(mx.bfloat16)
    for a, b in zip(quantize_groups(groups, bits, eta), quantize_groups_fused(groups, bits, eta)):
        assert a.dtype == b.dtype and mx.array_equal(a, b).item()
    codes = mx.random.randint(0, 1 << bits, groups.shape, key=mx.random.key(7)).astype(mx.float32)
    for a, b in zip(fit_to_codes(groups, codes), fit_to_codes_fused(groups, codes)):
        assert a.dtype == b.dtype and mx.array_equal(a, b).item()
