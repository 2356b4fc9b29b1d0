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


# spec name -> (class, the method whose KVCacheConfig fields it takes, label)
ABLATIONS: dict[str, tuple[type, str, str]] = {
    "gear-magnitude": (MagnitudeGEAR, "gear", "gear, outliers by |x| (paper literal)"),
    "gear-block64": (SmallBlockGEAR, "gear", "gear, 64-token blocks"),
}
