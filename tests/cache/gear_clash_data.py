"""K/V whose GEAR outlier entries meet on one target within a step of the decode kernel's scan.

fused_decode_gear's sorted scan adds a step's key entries (one per lane) with plain
read-add-writes where no two lanes name one token, and with atomics where some do
(vq_gear_tile_entries); the value sums (by channel) always take atomics. Random K/V rarely make
such a step; these do, so that the tests run the atomic branch and would see an add lost to a
missed clash, and make the value sums' atomics meet.
"""

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache import fused_decode_gear

SPIKE = 25.0


def clashing_keys_values(B: int, H: int, n: int, D: int, seed: int = 0):
    """(keys, values) float32 (B, H, n, D): every 16th token's keys spike in every channel (its
    block's key outliers are then mostly a few tokens' runs of ~20 entries each: neighbouring
    lanes name one token), and value channel 9 spikes in every third token (a quarter of a
    block's value outliers name one channel)."""
    mx.random.seed(seed)
    token, channel = mx.arange(n)[:, None], mx.arange(D)
    keys = mx.random.normal((B, H, n, D)) + mx.where(token % 16 == 5, SPIKE, 0.0)
    values = mx.random.normal((B, H, n, D)) + mx.where((token % 3 == 1) & (channel == 9), SPIKE, 0.0)
    return keys, values


def largest_runs(cache) -> tuple[int, int]:
    """(the most key outliers one token holds in a block, the most value outliers one channel
    holds in a block), over the cache's compressed blocks."""
    blocks = cache.n_compressed // cache.block_tokens
    keys = np.array(cache.store["k_out_index"][:, :, :blocks]).astype(np.int64) // cache.head_dim
    values = np.array(cache.store["v_out_index"][:, :, :blocks]).astype(np.int64) % cache.value_dim
    return _most_in_a_row(keys), _most_in_a_row(values)


def _most_in_a_row(a: np.ndarray) -> int:
    """The largest count of one value in any row of `a` (rows along its last axis)."""
    return max(np.bincount(row).max() for row in a.reshape(-1, a.shape[-1]))


def clashing_cache(cache, heads: int, tokens: int, dim: int = 128, rows: int = 4):
    """`cache` (a GEARCache of the defaults) after a prefill of clashing_keys_values, its window
    flushed by one attention step, and one decode token; checks that the clashes are there (a
    token with at least two steps' worth of key entries, a channel with 32 value entries)."""
    keys, values = clashing_keys_values(1, heads, tokens, dim)
    cache.update_and_fetch(keys, values)
    mx.eval(cache.attention(mx.random.normal((1, rows * heads, 1, dim)), scale=dim**-0.5))
    cache.update_and_fetch(mx.random.normal((1, heads, 1, dim)), mx.random.normal((1, heads, 1, dim)))
    key_run, value_run = largest_runs(cache)
    assert key_run >= 2 * fused_decode_gear.OUTLIER_BATCH and value_run >= 32, (key_run, value_run)
    return cache
