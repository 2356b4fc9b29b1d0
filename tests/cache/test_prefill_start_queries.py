"""base.PREFILL_START_QUERIES: a prefill chunk's attention starts evaluating its queries
(mx.async_eval) before building the layer's cache work, so the GPU runs the model up to this
layer while the host builds the rest; off, the old order. Results are the same either way."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import base
from veloxquant_mlx.cache.kivi import KIVICache


def _prefill(monkeypatch, start: int):
    monkeypatch.setattr(base, "PREFILL_START_QUERIES", start)
    started = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: started.append(a) or real(*a))
    cache = KIVICache(KVCacheConfig(method="kivi", bit_width_inlier=2, kivi_residual_length=32))
    outs = []
    for n, seed in ((300, 0), (200, 1)):  # the second chunk reads a compressed history
        k, v, q = (mx.random.normal(shape, key=mx.random.key(seed * 3 + i))
                   for i, shape in enumerate(((1, 2, n, 64), (1, 2, n, 64), (1, 8, n, 64))))
        cache.update_and_fetch(k, v)
        outs.append((q, cache.attention(q, scale=0.125, mask="causal")))
    monkeypatch.undo()
    return started, outs, cache


def test_each_prefill_chunk_starts_its_queries_first(monkeypatch):
    started, outs, cache = _prefill(monkeypatch, 1)
    assert cache.n_compressed > 0
    assert [a[0] is q for a, (q, _) in zip(started, outs)] == [True, True] and len(started) == 2


def test_off_nothing_is_started_and_the_attention_is_the_same(monkeypatch):
    started_on, on, _ = _prefill(monkeypatch, 1)
    started_off, off, _ = _prefill(monkeypatch, 0)
    assert started_off == [] and len(started_on) == 2
    for (_, a), (_, b) in zip(on, off):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("n", [1, 8])
def test_decode_steps_and_short_chunks_start_nothing(monkeypatch, n):
    # Below prefill_rows the attention reads the compressed form: no early start (a decode step
    # is already queued by mlx-lm's generate_step as a whole).
    started, _, cache = _prefill(monkeypatch, 1)
    monkeypatch.setattr(mx, "async_eval", lambda *a: started.append(a))
    k = mx.random.normal((1, 2, n, 64))
    cache.update_and_fetch(k, k)
    cache.attention(mx.random.normal((1, 8, n, 64)), scale=0.125, mask="causal" if n > 1 else None)
    assert len(started) == 2
