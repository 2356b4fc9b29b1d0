"""KVCacheFactory: one cache for one attention layer, from a KVCacheConfig."""

from __future__ import annotations

from veloxquant_mlx.cache.registry import cache_class
from veloxquant_mlx.config.kv_cache_config import KVCacheConfig
from veloxquant_mlx.errors import QuantizerConfigError


class KVCacheFactory:
    @staticmethod
    def create(config: KVCacheConfig, layer_index: int = 0, n_layers: int = 1):
        """The cache of `config.method` for attention layer `layer_index` of `n_layers`
        (per-layer settings such as a bit_width_inlier list are indexed by it)."""
        if not isinstance(config, KVCacheConfig):
            raise QuantizerConfigError(
                f"KVCacheFactory.create needs a KVCacheConfig, got {type(config).__name__}"
            )
        for name, value, low in (("n_layers", n_layers, 1), ("layer_index", layer_index, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise QuantizerConfigError(
                    f"KVCacheFactory.create({name}={value!r}): allowed is an integer >= {low}"
                )
        if layer_index >= n_layers:
            raise QuantizerConfigError(
                f"KVCacheFactory.create(layer_index={layer_index}): allowed is 0..{n_layers - 1} "
                f"for n_layers={n_layers}"
            )
        return cache_class(config.method)(config, layer_index=layer_index, n_layers=n_layers)
