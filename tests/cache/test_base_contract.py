"""The base cache's bookkeeping, checked with an exact-store double against plain attention."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig, QuantizerConfigError
from tests.cache.exact_store_cache import ExactStoreCache


def _reference(q, k, v, scale):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if q.shape[2] > 1 else None)


@pytest.mark.parametrize("chunks", [[40], [37, 1, 1, 1, 30, 1], [5, 5, 5, 64, 1]])
def test_attention_matches_plain_attention(chunks):
    mx.random.seed(0)
    cache = ExactStoreCache(KVCacheConfig(method="kivi"))
    all_k, all_v = [], []
    for n in chunks:
        q = mx.random.normal((1, 6, n, 32))
        k = mx.random.normal((1, 2, n, 32))
        v = mx.random.normal((1, 2, n, 32))
        all_k.append(k)
        all_v.append(v)
        fk, fv = cache.update_and_fetch(k, v)
        full_k, full_v = mx.concatenate(all_k, axis=2), mx.concatenate(all_v, axis=2)
        assert mx.allclose(fk, full_k).item() and mx.allclose(fv, full_v).item()
        # Causal over the whole history for a multi-token chunk: queries sit at the end.
        rep_k = mx.repeat(full_k, 3, axis=1)
        rep_v = mx.repeat(full_v, 3, axis=1)
        T = full_k.shape[2]
        mask = mx.arange(T - n, T)[:, None] >= mx.arange(T)[None]
        ref = mx.fast.scaled_dot_product_attention(q, rep_k, rep_v, scale=0.2, mask=mask)
        out = cache.attention(q, scale=0.2, mask=cache_mask(n))
        assert mx.allclose(out, ref, atol=1e-4).item()
    assert cache.offset == sum(chunks)
    assert cache.n_compressed % 16 == 0


def cache_mask(n):
    return None if n == 1 else "causal"


def test_trim_into_compressed_history_keeps_the_rest():
    mx.random.seed(1)
    cache = ExactStoreCache(KVCacheConfig(method="kivi"))
    k = mx.random.normal((1, 2, 70, 8))
    v = mx.random.normal((1, 2, 70, 8))
    cache.update_and_fetch(k, v)
    cache.attention(mx.random.normal((1, 2, 70, 8)), scale=1.0, mask="causal")
    assert cache.n_compressed == 48
    assert cache.trim(30) == 30
    fk, fv = cache._full_keys_values()
    assert cache.offset == 40 and fk.shape[2] == 40
    assert mx.allclose(fk, k[:, :, :40]).item()


def test_state_round_trip_and_wrong_class():
    cache = ExactStoreCache(KVCacheConfig(method="kivi"))
    cache.update_and_fetch(mx.ones((1, 2, 50, 8)), mx.ones((1, 2, 50, 8)))
    cache.attention(mx.ones((1, 2, 50, 8)), scale=1.0, mask="causal")
    clone = ExactStoreCache.from_state(cache.state)
    assert clone.offset == 50 and clone.nbytes == cache.nbytes
    meta = cache.state[0].replace("ExactStoreCache", "OtherCache")
    with pytest.raises(QuantizerConfigError, match="OtherCache"):
        ExactStoreCache.from_state((meta, *cache.state[1:]))


def test_bad_input_is_refused():
    cache = ExactStoreCache(KVCacheConfig(method="kivi"))
    with pytest.raises(QuantizerConfigError, match="shape"):
        cache.update_and_fetch(mx.ones((2, 8)), mx.ones((2, 8)))
    with pytest.raises(QuantizerConfigError, match="dtype"):
        cache.update_and_fetch(mx.ones((1, 2, 3, 8), mx.int32), mx.ones((1, 2, 3, 8), mx.int32))
    cache.update_and_fetch(mx.ones((1, 2, 3, 8)), mx.ones((1, 2, 3, 8)))
    with pytest.raises(QuantizerConfigError, match="head_dim=8"):
        cache.update_and_fetch(mx.ones((1, 2, 3, 16)), mx.ones((1, 2, 3, 16)))


def test_inputs_after_an_accepted_step_are_still_checked():
    # The check returns at once only for the shapes and dtypes it accepted last (the decode
    # step's fast path); anything else gets the full check, also after a state load.
    cache = ExactStoreCache(KVCacheConfig(method="kivi"))
    for _ in range(3):  # accepted, then the fast path
        cache.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    with pytest.raises(QuantizerConfigError, match="kv_heads=2"):
        cache.update_and_fetch(mx.ones((1, 4, 1, 8)), mx.ones((1, 4, 1, 8)))
    with pytest.raises(QuantizerConfigError, match="dtype"):
        cache.update_and_fetch(mx.ones((1, 2, 1, 8), mx.int32), mx.ones((1, 2, 1, 8), mx.int32))
    with pytest.raises(QuantizerConfigError, match="differ"):
        cache.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 2, 8)))
    assert cache.offset == 3  # nothing refused was appended
    # A state of other shapes loaded into this object: the old acceptance no longer holds.
    other = ExactStoreCache(KVCacheConfig(method="kivi"))
    other.update_and_fetch(mx.ones((1, 3, 1, 8)), mx.ones((1, 3, 1, 8)))
    cache.state = other.state
    with pytest.raises(QuantizerConfigError, match="kv_heads=3"):
        cache.update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
