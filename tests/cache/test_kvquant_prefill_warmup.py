"""What KVQuantCache compiles on first use and per prompt chunk: the codebook fit gives the
same levels eager (as on a GPU, where every fused kernel is a JIT compile) as compiled, and a
long prefill traces its compiled functions only while the history is shorter than one piece."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache import kvquant, kvquant_prefill_kernel, nonuniform_codebook
from veloxquant_mlx.cache.kvquant import KVQuantCache
from veloxquant_mlx.config import KVCacheConfig


def _samples(kind: str) -> mx.array:
    mx.random.seed(5)
    if kind == "normal":
        return mx.random.normal((1, 3, 5000))
    if kind == "heavy":
        return mx.random.normal((2, 2, 3000)) * mx.exp(mx.random.normal((2, 2, 3000)))
    # degenerate: constants, ties and zeros (levels that lose all their samples)
    return mx.concatenate([mx.zeros((1, 2, 100)), mx.ones((1, 2, 900)) * 0.25], axis=-1)


@pytest.mark.parametrize("kind", ["normal", "heavy", "degenerate"])
@pytest.mark.parametrize("levels", [4, 8, 16])
def test_codebook_fit_eager_is_the_compiled_fit_bit_for_bit(monkeypatch, kind, levels):
    x = _samples(kind)
    monkeypatch.setattr(nonuniform_codebook, "_fit_compiled", lambda: True)
    compiled = nonuniform_codebook.fit_codebook(x, levels)
    monkeypatch.setattr(nonuniform_codebook, "_fit_compiled", lambda: False)
    eager = nonuniform_codebook.fit_codebook(x, levels)
    assert bytes(memoryview(compiled)) == bytes(memoryview(eager))
    assert np.isfinite(np.array(eager)).all()


@pytest.fixture
def traces(monkeypatch):
    """Counts Python traces of the prefill piece decode and the encoder's normalize (their
    compiled functions rebuilt so that they call the counting wrappers)."""
    counts = Counter()

    def counting(name, fn):
        def wrapped(*a, **k):
            counts[name] += 1
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(kvquant, "decode_key_blocks", counting("piece", kvquant.decode_key_blocks))
    monkeypatch.setattr(kvquant, "decode_value_blocks", counting("piece", kvquant.decode_value_blocks))
    monkeypatch.setattr(kvquant, "select_outliers", counting("normalize", kvquant.select_outliers))
    # The pieces' path (on CUDA the kernel decodes the history instead: nothing traced).
    monkeypatch.setattr(kvquant_prefill_kernel, "enabled", lambda: False)
    # Compiled pieces (what traces), as fused on the CPU, with the product apart elsewhere.
    monkeypatch.setattr(kvquant, "_prefill_piece_mode", lambda: (True, mx.default_device() != mx.cpu))
    caches = (kvquant._prefill_piece_function, kvquant._compiled_normalize, kvquant._normalize_function)
    for c in caches:
        c.cache_clear()
    yield counts
    for c in caches:
        c.cache_clear()


def test_prefill_chunks_trace_nothing_once_the_history_holds_a_piece(traces):
    # On the CPU the pieces run compiled: a trace per new shape. Pieces of 4 blocks, chunks of
    # 2 blocks: the history holds 2 blocks at the second chunk, 4 from the third on.
    cache = KVQuantCache(KVCacheConfig(method="kvquant"))
    cache.decode_chunk_tokens = 4 * 32
    # As under the integration's dispatcher: update_and_fetch builds no decoded K/V.
    cache._dispatcher = type("Installed", (), {"installed": True})()
    mx.random.seed(2)
    k = mx.random.normal((1, 2, 64 * 10, 64))
    per_chunk = []
    for i in range(10):
        before = Counter(traces)
        part = slice(64 * i, 64 * (i + 1))
        cache.update_and_fetch(k[:, :, part], k[:, :, part])
        out = cache._attend_prefill(mx.random.normal((1, 4, 64, 64)), 0.125, "causal")
        cache._flush()
        mx.eval(out, cache.store)
        per_chunk.append(dict(traces - before))
    # Chunk 0: the encoder's normalize (keys, values); chunk 1 (history 2 blocks): one 2-block
    # piece with the sink, keys and values; chunk 2 (4 blocks): one 4-block piece with the
    # sink; chunk 3 (6 blocks): the overlapping last 4-block piece, without the sink.
    assert per_chunk[0] == {"normalize": 2}
    assert per_chunk[1] == {"piece": 2}
    assert per_chunk[2] == {"piece": 2}
    assert per_chunk[3] == {"piece": 2}
    assert all(c == {} for c in per_chunk[4:]), per_chunk
