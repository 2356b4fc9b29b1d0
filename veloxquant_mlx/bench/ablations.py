"""Code ablations: variants of a method that no KVCacheConfig field expresses, for measuring
what one design choice of ours is worth. Named like cache specs (`gear-magnitude`,
`gear-block64:gear_rank=0`) and accepted wherever the measurement modules take `--methods`.

They exist only for measurements; nothing outside veloxquant_mlx.bench builds them.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache.gear import GEARCache


class MagnitudeGEAR(GEARCache):
    """GEAR with outliers picked by largest |x|, the paper's literal filter (Kang et al. 2024,
    GEAR, Sec. 3), instead of our distance from the quantization group's mean."""

    def _selection_centres(self, blocks, per_channel):
        return mx.zeros_like(blocks)


class SmallBlockGEAR(GEARCache):
    """GEAR with 64-token blocks: the history is compressed from position 64 on instead of 256
    (costs bytes: the per-block factor B and the outlier indices amortize over fewer tokens)."""

    block_tokens = 64


def in_place_windows(caches: list) -> list:
    """Mark each of our caches in `caches` to write its decode steps' tokens into the exact
    window in place (cache/window_buffer.py), whatever base.DECODE_WINDOW_IN_PLACE says: `kivi`
    and `kivi-inplace` in one interleaved gpu_speed run are an A/B on one machine, seconds
    apart (a --set holds for a whole process, and two processes meet two machine states)."""
    from veloxquant_mlx.cache.base import CompressedKVCache

    ours = [c for c in caches if isinstance(c, CompressedKVCache)]
    if not ours:
        raise TypeError(f"no cache of {[type(c).__name__ for c in caches]} keeps the base's exact window")
    for cache in ours:
        cache.decode_window_in_place = True
    return caches


def in_place_window(config, layer_index: int, n_layers: int):
    """One layer's cache as the factory builds it, its decode window written in place. A
    model's lists come from the patch instead (layer_specs.LayerSpec.open): cross-layer methods
    share a coordinator over the list."""
    from veloxquant_mlx.cache.factory import KVCacheFactory

    return in_place_windows([KVCacheFactory.create(config, layer_index, n_layers)])[0]


# The methods whose decode steps append to the base's exact window (pyramidkv's update is its own).
WINDOW_METHODS = ("kivi", "xquant", "turboquant_rvq", "minicache", "gear", "kvquant")

# spec name -> (builder: class or function of (config, layer_index, n_layers), the method whose
# KVCacheConfig fields it takes, label)
ABLATIONS: dict[str, tuple] = {
    "gear-magnitude": (MagnitudeGEAR, "gear", "gear, outliers by |x| (paper literal)"),
    "gear-block64": (SmallBlockGEAR, "gear", "gear, 64-token blocks"),
    **{f"{m}-inplace": (in_place_window, m, f"{m}, decode window written in place") for m in WINDOW_METHODS},
}
