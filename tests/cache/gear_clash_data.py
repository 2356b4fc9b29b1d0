"""K/V whose GEAR outlier entries meet on one target within a step of the decode kernel's scan.

fused_decode_gear's sorted scan adds a step's key entries (one per lane) with plain
read-add-writes where no two lanes name one token, and with atomics where some do
(vq_gear_tile_entries); the value sums (by channel) always take atomics. Random K/V rarely make
such a step; these do, so that the tests run the atomic branch and would see an add lost to a
missed clash, and make the value sums' atomics meet.
"""

import mlx.core as mx
import numpy as np

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
    most = lambda a: max(np.bincount(row).max() for row in a.reshape(-1, a.shape[-1]))  # noqa: E731
    return most(keys), most(values)
