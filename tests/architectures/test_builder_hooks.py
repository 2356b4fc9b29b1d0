"""Per-layer bit widths over the replaced entries, and the cross-layer build_layers hook."""

import pytest

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache import registry
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.kivi import KIVICache
from tests.architectures.tiny_models import build


def test_bit_list_has_one_entry_per_replaced_layer_in_model_order():
    # gemma3_text: layers 1 and 3 are global (ours); 0 and 2 keep RotatingKVCache.
    model = build("gemma3_text")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kivi", bit_width_inlier=[4, 2]))
    ours = [(i, c) for i, c in enumerate(caches) if isinstance(c, CompressedKVCache)]
    assert [(i, c.key_bits, c.value_bits) for i, c in ours] == [(1, 4, 4), (3, 2, 2)]


def test_bit_list_of_the_wrong_length_names_the_model_and_its_attention_layers():
    with pytest.raises(QuantizerConfigError, match=r"Model has 2 attention layers that get our cache "
                                                   r"\(model layers \[1, 3\]\).*has 4 entries"):
        KVCacheBuilder(build("gemma3_text"), KVCacheConfig(method="kivi", bit_width_inlier=[2, 2, 4, 4]))


class _Coordinator:
    def __init__(self, n_layers):
        self.n_layers = n_layers
        self.caches = []


class SharedKIVICache(KIVICache):
    """A test double of a cross-layer method: KIVI whose layers share one coordinator."""

    coordinator = None
    builds = 0

    @classmethod
    def build_layers(cls, config, n_layers):
        cls.builds += 1
        coordinator = _Coordinator(n_layers)
        caches = [cls(config, layer_index=i, n_layers=n_layers) for i in range(n_layers)]
        for cache in caches:
            cache.coordinator = coordinator
            coordinator.caches.append(cache)
        return caches


def test_a_method_with_build_layers_gets_one_fresh_coordinator_per_cache_list(monkeypatch):
    monkeypatch.setitem(registry.CACHE_CLASSES, "kivi", (__name__, "SharedKIVICache"))
    model = build("nemotron_h")  # ours at cache entries 1 and 3 (layers 1 and 4)
    builder = KVCacheBuilder(model, KVCacheConfig(method="kivi"))
    first, second = builder.build(), builder.build()
    ours = [c for c in first if isinstance(c, SharedKIVICache)]
    assert [c.layer_index for c in ours] == [0, 1]
    assert ours[0].coordinator is ours[1].coordinator and ours[0].coordinator.n_layers == 2
    assert ours[0].coordinator.caches == ours
    assert second[1].coordinator is not ours[0].coordinator
