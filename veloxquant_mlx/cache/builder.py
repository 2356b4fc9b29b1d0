"""KVCacheBuilder: the cache list of a whole mlx-lm model, our compressed cache on each plain
attention layer and the model's own cache everywhere else.

Which entries get our cache is decided by one rule, documented in cache/layer_plan.py (start
from what the model builds; replace exactly the plain KVCache entries whose layer's attention
can be read). docs/architectures.md lists what it gives on each architecture we test.

Cross-layer methods (xquant, minicache, pyramidkv): when the method's cache class has a
`build_layers(config, n_layers)` classmethod, every build calls it once, so the layers of one
cache list share one fresh coordinator; other methods get one KVCacheFactory.create per layer.
"""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

import veloxquant_mlx.cache.batch  # noqa: F401  (CompressedKVCache.merge -> batch cache)
from veloxquant_mlx.cache.factory import KVCacheFactory
from veloxquant_mlx.cache.layer_plan import (
    ATTENTION_ATTRIBUTES,
    KV_HEAD_ATTRIBUTES,
    AttentionLayer,
    LayerEntry,
    find_layers,
    plan_layers,
    read_attention,
)
from veloxquant_mlx.cache.registry import cache_class
from veloxquant_mlx.config.kv_cache_config import KVCacheConfig
from veloxquant_mlx.errors import QuantizerConfigError

__all__ = ["AttentionLayer", "KVCacheBuilder", "LayerEntry", "classify_layer", "find_layers"]


def classify_layer(layer) -> tuple[object, str] | None:
    """(attention module, why) when the layer's attention can be read, else None."""
    attn, why = read_attention(layer)
    return None if attn is None else (attn, why)


class KVCacheBuilder:
    """Plans once (which entries, their shapes, their bits), builds fresh cache lists on demand.

    Nothing outside the builder is changed: a model the rule does not understand raises here,
    before any patch touches it.
    """

    def __init__(self, model, config: KVCacheConfig, default_make_cache=None):
        if not isinstance(config, KVCacheConfig):
            raise QuantizerConfigError(
                f"KVCacheBuilder needs a KVCacheConfig, got {type(config).__name__}"
            )
        self.config = config
        # Module-qualified: every mlx-lm model class is called `Model`.
        self.model_name = f"{type(model).__module__}.{type(model).__qualname__}"
        self.layers = find_layers(model)
        # What the model would build on its own, for the entries we leave alone.
        self.default_make_cache = default_make_cache or getattr(model, "make_cache", None)
        own = self._own_caches()
        self.attention, self.entries = plan_layers(self.model_name, self.layers, own)
        if not self.attention:
            kinds = sorted({type(c).__name__ for c in own})
            raise QuantizerConfigError(
                f"KVCacheBuilder: no layer of {self.model_name} ({len(self.layers)} layers, "
                f"model caches {kinds}) can take a compressed cache: looked for a plain "
                f"KVCache entry whose layer has an attention module "
                f"({'/'.join(ATTENTION_ATTRIBUTES)}) with an integer "
                f"{'/'.join(KV_HEAD_ATTRIBUTES)}, a head_dim (or k_proj), no sliding window "
                "and no sinks"
            )
        # Fail now, not at the first token: per-layer bits and head_dims the method refuses.
        try:
            planned = self._new_caches()
        except QuantizerConfigError as exc:
            replaced = [layer.index for layer in self.attention]
            raise QuantizerConfigError(
                f"KVCacheBuilder: {self.model_name} has {len(replaced)} attention layers that "
                f"get our cache (model layers {replaced}): {exc}"
            ) from exc
        for cache, layer in zip(planned, self.attention):
            try:
                cache._check_shape(layer.head_dim, layer.value_dim)
            except QuantizerConfigError as exc:
                raise QuantizerConfigError(
                    f"KVCacheBuilder: {self.model_name} layer {layer.index} "
                    f"({type(layer.module).__name__}, head_dim={layer.head_dim}, value head_dim="
                    f"{layer.value_dim}) cannot take method {config.method!r}: {exc}"
                ) from exc

    @property
    def attention_modules(self) -> list:
        return [layer.module for layer in self.attention]

    def _own_caches(self) -> list:
        if self.default_make_cache is None:
            return [KVCache() for _ in self.layers]
        return list(self.default_make_cache())

    def _new_caches(self) -> list:
        n = len(self.attention)
        build_layers = getattr(cache_class(self.config.method), "build_layers", None)
        if build_layers is not None:  # cross-layer: one coordinator shared by this list
            caches = list(build_layers(self.config, n))
            if len(caches) != n:
                raise QuantizerConfigError(
                    f"KVCacheBuilder: {self.config.method}.build_layers returned {len(caches)} "
                    f"caches for {n} attention layers"
                )
            return caches
        return [KVCacheFactory.create(self.config, layer_index=i, n_layers=n) for i in range(n)]

    def build(self) -> list:
        """A fresh cache list, one entry per entry of the model's own list."""
        caches = self._own_caches()
        if len(caches) != len(self.entries):
            raise QuantizerConfigError(
                f"KVCacheBuilder: {self.model_name}.make_cache() returned {len(caches)} caches, "
                f"{len(self.entries)} when planned"
            )
        for layer, cache in zip(self.attention, self._new_caches()):
            # The model module whose attention the dispatcher replaces for this layer (batching
            # checks that it is installed: cache/batch.py).
            cache.attention_module = type(layer.module).__module__
            caches[layer.cache_index] = cache
        return caches

    def describe(self) -> list[tuple[int, int | None, str, str]]:
        """(cache index, layer index, what it gets, why) per cache entry, for docs and logs."""
        method = type(self._new_caches()[0]).__name__
        return [(e.cache_index, e.layer_index, e.kept or method, e.reason) for e in self.entries]

    @classmethod
    def for_model(cls, model, config: KVCacheConfig) -> list:
        """The cache list for `model`: our cache on each plain attention entry (per-layer bits
        from config.bits_for_layer over those entries), the model's own elsewhere."""
        return cls(model, config).build()
