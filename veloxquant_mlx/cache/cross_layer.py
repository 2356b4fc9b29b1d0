"""The coordinator that the layers' caches of one cross-layer method share.

Cross-layer methods (xquant, minicache, pyramidkv) need to know about other layers: XQuant's
upper layer of a pair reads the lower layer's codes, MiniCache's upper layer reads the merged
directions its lower layer wrote, PyramidKV's budget of a layer depends on its depth. One
`CrossLayerCoordinator` is made per model and every layer's cache holds a reference to it and
its own layer index; the coordinator holds the caches by index.

How the builder uses it: `CrossLayerCoordinator.build_layers(config, n_layers)` (or the same
classmethod on the cache class) returns one cache per attention layer, all sharing a fresh
coordinator. A cache made on its own (`Cache(config, layer_index, n_layers)`) has no
coordinator and works alone (XQuant / MiniCache layers then keep their own data).

Loading: mlx-lm's `load_prompt_cache` restores caches one by one with `from_state`, so every
layer's state holds what that layer needs to run alone; `CrossLayerCoordinator.relink(caches)`
(optional) makes a fresh coordinator for a loaded list and lets each method re-share what it can
(XQuant drops a follower's copy of its leader's codes when they are identical).
"""

from __future__ import annotations

from veloxquant_mlx.config.kv_cache_config import KVCacheConfig
from veloxquant_mlx.errors import QuantizerConfigError

CROSS_LAYER_METHODS = ("xquant", "minicache", "pyramidkv")


class CrossLayerCoordinator:
    """Shared by the caches of one model's layers: the config, the layer count, the caches."""

    def __init__(self, config: KVCacheConfig, n_layers: int):
        if config.method not in CROSS_LAYER_METHODS:
            raise QuantizerConfigError(
                f"CrossLayerCoordinator: method {config.method!r} is not cross-layer: allowed is "
                f"one of {CROSS_LAYER_METHODS}"
            )
        if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
            raise QuantizerConfigError(
                f"CrossLayerCoordinator: n_layers={n_layers!r} is invalid: allowed is an integer >= 1"
            )
        self.config = config
        self.n_layers = n_layers
        self.caches: list = [None] * n_layers

    def register(self, cache) -> None:
        index = cache.layer_index
        if not 0 <= index < self.n_layers:
            raise QuantizerConfigError(
                f"CrossLayerCoordinator: layer_index={index} is out of range: allowed is "
                f"0..{self.n_layers - 1}"
            )
        if self.caches[index] is not None and self.caches[index] is not cache:
            raise QuantizerConfigError(
                f"CrossLayerCoordinator: layer {index} already has a cache; build a fresh "
                "coordinator for a fresh list of caches"
            )
        self.caches[index] = cache

    def layer(self, index: int):
        """The cache of layer `index`, or None when there is none (out of range or not built)."""
        if 0 <= index < self.n_layers:
            return self.caches[index]
        return None

    @classmethod
    def build_layers(cls, config: KVCacheConfig, n_layers: int) -> list:
        """One cache per layer of `config.method`, all sharing one new coordinator."""
        from veloxquant_mlx.cache.registry import cache_class

        if config.method not in CROSS_LAYER_METHODS:
            raise QuantizerConfigError(
                f"CrossLayerCoordinator.build_layers: method {config.method!r} is not "
                f"cross-layer: allowed is one of {CROSS_LAYER_METHODS}"
            )
        return cache_class(config.method).build_layers(config, n_layers)

    @classmethod
    def relink(cls, caches: list) -> "CrossLayerCoordinator":
        """Give caches loaded one by one (from_state) a shared coordinator again."""
        if not caches:
            raise QuantizerConfigError("CrossLayerCoordinator.relink: the list of caches is empty")
        first = caches[0]
        coordinator = cls(first.config, len(caches))
        for index, cache in enumerate(caches):
            if type(cache) is not type(first) or cache.layer_index != index:
                raise QuantizerConfigError(
                    f"CrossLayerCoordinator.relink: entry {index} is {type(cache).__name__} "
                    f"layer {getattr(cache, 'layer_index', None)}; allowed is "
                    f"{type(first).__name__} with layer_index == its position"
                )
            if cache.config != first.config:
                raise QuantizerConfigError(
                    f"CrossLayerCoordinator.relink: layer {index} has config {cache.config}, "
                    f"layer 0 has {first.config}: all layers must share one config"
                )
            cache.coordinator = coordinator
            coordinator.register(cache)
        for cache in caches:
            cache._relinked()
        return coordinator


class CrossLayerMixin:
    """What the three caches share: the coordinator reference and `build_layers`."""

    coordinator: CrossLayerCoordinator | None = None

    def _attach(self, coordinator: CrossLayerCoordinator | None) -> None:
        self.coordinator = coordinator
        if coordinator is None:
            return
        if coordinator.config != self.config or coordinator.n_layers != self.n_layers:
            raise QuantizerConfigError(
                f"{type(self).__name__} layer {self.layer_index}: its coordinator has config "
                f"{coordinator.config} and n_layers={coordinator.n_layers}, the cache "
                f"{self.config} and n_layers={self.n_layers}: they must match"
            )
        coordinator.register(self)

    def _peer(self, index: int):
        """Another layer's cache through the coordinator (None without one)."""
        return None if self.coordinator is None else self.coordinator.layer(index)

    def _relinked(self) -> None:
        """Called by CrossLayerCoordinator.relink once every layer is registered."""

    @classmethod
    def build_layers(cls, config: KVCacheConfig, n_layers: int) -> list:
        coordinator = CrossLayerCoordinator(config, n_layers)
        return [cls(config, index, n_layers, coordinator=coordinator) for index in range(n_layers)]
