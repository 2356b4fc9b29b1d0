"""prefill_pieces: chained pieces (SYNC = 0, no host sync) give the synced pieces' K/V bit for
bit, for turboquant_rvq's portable prefill decode (gear orders its own pieces since session 6:
tests/cache/test_gear_prefill.py checks that order and its bits)."""

import mlx.core as mx
import pytest

from veloxquant_mlx.cache import prefill_pieces
from veloxquant_mlx.cache.factory import KVCacheFactory
from veloxquant_mlx.config import KVCacheConfig


@pytest.mark.parametrize("method, piece_attr", [("turboquant_rvq", "prefill_decode_bytes")])
def test_chained_pieces_are_the_synced_pieces_bit_for_bit(monkeypatch, method, piece_attr):
    cache = KVCacheFactory.create(KVCacheConfig(method=method), layer_index=0, n_layers=1)
    # Small pieces (a few blocks) so a 1200-token history takes several.
    monkeypatch.setattr(type(cache), piece_attr, 2 * 64 * 4 * 128)
    mx.random.seed(5)
    k = mx.random.normal((1, 2, 1200, 64)).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, 1200, 64)).astype(mx.bfloat16)
    q = mx.random.normal((1, 8, 32, 64)).astype(mx.bfloat16)
    cache.update_and_fetch(k, v)
    cache._flush()
    cache.update_and_fetch(k[:, :, :40], v[:, :, :40])  # a window beside the history
    results = {}
    syncs = {}
    real_eval = mx.eval
    for sync in (1, 0):
        monkeypatch.setattr(prefill_pieces, "SYNC", sync)
        calls = []
        mx.eval = lambda *a, calls=calls: calls.append(a) or real_eval(*a)
        try:
            keys, values = cache._prefill_keys_values(q)
        finally:
            mx.eval = real_eval
        mx.eval(keys, values)
        results[sync], syncs[sync] = (keys, values), len(calls)
    assert cache.n_compressed > 2 * 256  # several pieces
    # Chained: only the base's evaluation of the queries (one) is left.
    assert syncs[0] == 1 and syncs[1] > 2, syncs
    for a, b in zip(results[1], results[0]):
        assert mx.array_equal(a, b).item()
