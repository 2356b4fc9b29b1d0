"""KVQuantCache and GEARCache keep alive only what they account for in nbytes.

The bench's memory part once measured kvquant's MLX active memory growing 4x its nbytes after
a prompt: the sink token was stored as a slice of the prompt chunk's keys/values, a view that
kept the whole chunk alive. These tests prefill a small synthetic cache through the patched
attention path, then run decode steps, drop every input, and compare the growth of
mx.get_active_memory() with the cache's own nbytes.
"""

import gc

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.cache.kvquant import KVQuantCache

B, H, REP, D = 1, 3, 3, 64
# Allocator rounding and MLX's small internal buffers (random keys, scalars).
SLACK_BYTES = 64 << 10


def _settled_active() -> int:
    gc.collect()
    mx.clear_cache()
    return mx.get_active_memory()


def _run(cache, prompt_tokens: int, decode_steps: int) -> None:
    k = mx.random.normal((B, H, prompt_tokens, D))
    v = mx.random.normal((B, H, prompt_tokens, D))
    q = mx.random.normal((B, H * REP, prompt_tokens, D))
    cache.update_and_fetch(k, v)
    mx.eval(cache.attention(q, D**-0.5, mask="causal"), *cache.store.values())
    for _ in range(decode_steps):
        k = mx.random.normal((B, H, 1, D))
        v = mx.random.normal((B, H, 1, D))
        q = mx.random.normal((B, H * REP, 1, D))
        cache.update_and_fetch(k, v)
        mx.eval(cache.attention(q, D**-0.5), *cache.store.values(), cache.window_keys)


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVQuantCache(KVCacheConfig(method="kvquant")),
        lambda: GEARCache(KVCacheConfig(method="gear")),
    ],
    ids=["kvquant", "gear"],
)
def test_active_memory_growth_matches_nbytes(make):
    before = _settled_active()
    cache = make()
    # A prompt chunk ~5x the compressed bytes, then enough decode steps to flush blocks.
    _run(cache, prompt_tokens=1023, decode_steps=40)
    growth = _settled_active() - before
    assert cache.nbytes > 0
    # Holding the prompt chunk (or any per-step transient) fails this bound.
    assert growth <= 1.2 * cache.nbytes + SLACK_BYTES, (growth, cache.nbytes)
