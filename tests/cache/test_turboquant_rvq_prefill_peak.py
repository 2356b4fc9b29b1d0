"""turboquant_rvq's prefill-chunk attention: bounded memory, same values as the one-graph decode.

A prefill chunk's attention decodes the layer's whole history (CompressedKVCache._attend_prefill).
Decoded as one lazy graph, its float32 intermediates (two stages, their sum, the unrotation, the
key mean, the sink correction) added ~12x the history's fp16 K/V at once (bf16 model;
`python -m veloxquant_mlx.bench.prefill_peak`, results/turboquant_rvq_prefill_peak_cpu.json).
TurboQuantRVQCache._prefill_keys_values builds the result once in the model dtype, piece by
piece.
"""

import gc

import mlx.core as mx
import pytest

from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache
from veloxquant_mlx.config import KVCacheConfig

HEADS, DIM = 8, 128


def filled(tokens: int, dtype=mx.bfloat16, window: int = 100) -> TurboQuantRVQCache:
    """A cache holding `tokens` compressed tokens (first block starts the sequence: sink
    correction on) plus `window` exact ones, all evaluated."""
    cache = TurboQuantRVQCache(KVCacheConfig(method="turboquant_rvq", bit_width_inlier=4), 0, 1)
    mx.random.seed(3)
    for n in (tokens, window):
        k = mx.random.normal((1, HEADS, n, DIM)).astype(dtype)
        v = mx.random.normal((1, HEADS, n, DIM)).astype(dtype)
        cache.update_and_fetch(k, v)
        cache._flush()
        # The whole state, as mlx-lm evaluates it after each chunk (the sink corrections too:
        # unevaluated, they would hold a view of the first block's input K/V).
        mx.eval([a for a in cache.state if isinstance(a, mx.array)])
    assert cache.sink_deltas is not None
    return cache


def peak_added(fn) -> int:
    gc.collect()
    mx.clear_cache()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    return mx.get_peak_memory() - start


def test_prefill_keys_values_equal_the_one_graph_decode_across_pieces():
    cache = filled(1024 + 64, mx.float32)
    q = mx.random.normal((1, HEADS, 16, DIM))
    # Pieces of 128 tokens (the smallest multiple of the block that fits 128 KiB of float32):
    # the sink lies in the first piece, the last one is partial, the window follows.
    cache.prefill_decode_bytes = 128 << 10
    ours = cache._prefill_keys_values(q)
    base = CompressedKVCache._prefill_keys_values(cache, q)
    assert ours[0].shape == base[0].shape == (1, HEADS, cache.offset, DIM)
    assert ours[0].dtype == base[0].dtype == mx.float32
    for a, b in zip(ours, base):
        assert mx.array_equal(a, b).item()


def test_prefill_attention_output_unchanged_bf16():
    cache = filled(2048)
    q = mx.random.normal((1, 2 * HEADS, 32, DIM)).astype(mx.bfloat16)
    k, v = mx.random.normal((2, 1, HEADS, 32, DIM)).astype(mx.bfloat16)
    cache.update_and_fetch(k, v)
    cache.prefill_decode_bytes = 256 << 10
    ours = cache._attend_prefill(q, DIM**-0.5, "causal")
    keys, values = CompressedKVCache._prefill_keys_values(cache, q)
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=DIM**-0.5, mask="causal")
    assert ours.dtype == mx.bfloat16
    assert mx.array_equal(ours, ref).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_one_prefill_chunk_attention_adds_little_beyond_the_historys_kv(dtype):
    """Peak memory one cache.attention call of a prefill chunk adds, over 8K history tokens:
    the history's K/V in the model dtype (the result the fused attention reads, which an fp16
    cache holds anyway) plus one bounded piece of float32 intermediates, not the whole
    history's. Measured here (8K tokens, 1 MiB pieces, peak over the history's fp16 K/V):
    before this fix 11.0x (bf16) / 11.1x (float32), after 1.21x / 2.2x; bounds 2x / 3x."""
    cache = filled(8192, dtype)
    cache.prefill_decode_bytes = 1 << 20
    rows = CompressedKVCache.prefill_rows
    q = mx.random.normal((1, HEADS, rows, DIM)).astype(dtype)
    k, v = mx.random.normal((2, 1, HEADS, rows, DIM)).astype(dtype)
    mx.eval(q, k, v)
    cache.update_and_fetch(k, v)
    kv_model_dtype = 2 * cache.offset * HEADS * DIM * dtype.size
    fp16_kv = 2 * cache.offset * HEADS * DIM * 2
    peak = peak_added(lambda: cache.attention(q, DIM**-0.5, mask="causal"))
    # The result itself is kv_model_dtype; the rest (one piece's float32 decode, the window,
    # the queries' attention) must stay below another fp16 K/V of the history.
    assert peak <= kv_model_dtype + fp16_kv, (peak / 2**20, kv_model_dtype / 2**20)


def test_piece_transient_does_not_grow_with_the_history():
    """Same piece size, 4x the history: the peak grows by the larger result only."""
    peaks = {}
    for tokens in (2048, 8192):
        cache = filled(tokens)
        cache.prefill_decode_bytes = 1 << 20
        q = mx.random.normal((1, HEADS, 16, DIM)).astype(mx.bfloat16)
        result = 2 * cache.offset * HEADS * DIM * 2
        peaks[tokens] = peak_added(lambda: cache._prefill_keys_values(q)) - result
    # What lies beyond the result: one piece's intermediates (~1 MiB of float32 per array).
    assert max(peaks.values()) < 16 << 20, {t: p / 2**20 for t, p in peaks.items()}
