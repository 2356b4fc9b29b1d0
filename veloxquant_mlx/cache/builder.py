"""KVCacheBuilder: the cache list of a whole mlx-lm model, one compressed cache per attention
layer.

Which layers get our cache is decided by one rule, `classify_layer`: a layer whose `self_attn`
names its `n_kv_heads` and whose head_dim can be read (`head_dim`, or k_proj's rows) and that is
not a sliding-window layer (`use_sliding`) is plain attention (the llama family: llama, mistral,
qwen2, qwen3, smollm, ...). Every other layer keeps
the cache the model itself would build (its `make_cache()` entry, or mlx-lm's KVCache when the
model has no make_cache). A model in which no attention layer can be found is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.models.cache import KVCache

from veloxquant_mlx.cache.factory import KVCacheFactory
from veloxquant_mlx.config.kv_cache_config import KVCacheConfig
from veloxquant_mlx.errors import QuantizerConfigError


@dataclass(frozen=True)
class AttentionLayer:
    index: int  # position in the model's layer list (= in its cache list)
    module: object  # the attention module (layer.self_attn)
    head_dim: int
    value_dim: int
    n_kv_heads: int


def _projection_heads_dim(attn, name: str, n_kv_heads: int) -> int | None:
    """Per-head width from a projection's output rows (k_proj / v_proj: n_kv_heads * dim)."""
    weight = getattr(getattr(attn, name, None), "weight", None)
    if weight is None or weight.shape[0] % n_kv_heads:
        return None
    return weight.shape[0] // n_kv_heads


def classify_layer(layer) -> tuple[object, int, int, int] | None:
    """The rule: (attention module, n_kv_heads, head_dim, value_dim) when the layer is plain full
    attention, else None (the layer keeps the model's own cache).

    Plain attention: `layer.self_attn` with an integer `n_kv_heads` and a head_dim read from
    `self_attn.head_dim` or, when the model does not keep it (qwen2, qwen3), from k_proj's
    output rows; value_dim from `v_head_dim` or v_proj. Not a sliding-window layer
    (`use_sliding`): those keep the model's RotatingKVCache.
    """
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        return None  # Mamba / linear-attention / MLP-only layers
    if getattr(layer, "use_sliding", False) or getattr(attn, "use_sliding", False):
        return None
    n_kv_heads = getattr(attn, "n_kv_heads", None)
    if not isinstance(n_kv_heads, int) or n_kv_heads < 1:
        return None
    head_dim = getattr(attn, "head_dim", None)
    if not isinstance(head_dim, int):
        head_dim = _projection_heads_dim(attn, "k_proj", n_kv_heads)
    if head_dim is None:
        return None
    value_dim = getattr(attn, "v_head_dim", None)
    if not isinstance(value_dim, int):
        value_dim = _projection_heads_dim(attn, "v_proj", n_kv_heads) or head_dim
    return attn, n_kv_heads, head_dim, value_dim


def find_layers(model) -> list:
    """model.layers, model.model.layers, or the same under model.language_model."""
    for owner in (model, getattr(model, "model", None)):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, (list, tuple)) and layers:
            return list(layers)
    language_model = getattr(model, "language_model", None)
    if language_model is not None and language_model is not model:
        return find_layers(language_model)
    raise QuantizerConfigError(
        f"KVCacheBuilder: {type(model).__name__} has no layer list: looked for model.layers, "
        "model.model.layers and model.language_model.(model.)layers"
    )


class KVCacheBuilder:
    """Plans once (which layers, their shapes, their bits), builds fresh cache lists on demand."""

    def __init__(self, model, config: KVCacheConfig, default_make_cache=None):
        if not isinstance(config, KVCacheConfig):
            raise QuantizerConfigError(
                f"KVCacheBuilder needs a KVCacheConfig, got {type(config).__name__}"
            )
        self.config = config
        self.model_name = type(model).__name__
        self.layers = find_layers(model)
        # What the model would build on its own, for the layers we leave alone.
        self.default_make_cache = default_make_cache or getattr(model, "make_cache", None)
        self.attention = []
        for index, layer in enumerate(self.layers):
            found = classify_layer(layer)
            if found is None:
                continue
            attn, n_kv_heads, head_dim, value_dim = found
            self.attention.append(AttentionLayer(index, attn, head_dim, value_dim, n_kv_heads))
        if not self.attention:
            raise QuantizerConfigError(
                f"KVCacheBuilder: no attention layer in {self.model_name} ({len(self.layers)} "
                "layers): looked for layer.self_attn with an integer n_kv_heads, a head_dim (or "
                "k_proj) and no sliding window"
            )
        # Fail now, not at the first token: per-layer bits and head_dims the method refuses.
        for cache, layer in zip(self._new_caches(), self.attention):
            cache._check_shape(layer.head_dim, layer.value_dim)

    @property
    def attention_modules(self) -> list:
        return [layer.module for layer in self.attention]

    def _new_caches(self) -> list:
        n = len(self.attention)
        return [KVCacheFactory.create(self.config, layer_index=i, n_layers=n) for i in range(n)]

    def build(self) -> list:
        """A fresh cache list, one entry per model layer."""
        if self.default_make_cache is not None:
            caches = list(self.default_make_cache())
            if len(caches) != len(self.layers):
                raise QuantizerConfigError(
                    f"KVCacheBuilder: {self.model_name}.make_cache() returned {len(caches)} "
                    f"caches for {len(self.layers)} layers"
                )
        else:
            caches = [KVCache() for _ in self.layers]
        for layer, cache in zip(self.attention, self._new_caches()):
            caches[layer.index] = cache
        return caches

    @classmethod
    def for_model(cls, model, config: KVCacheConfig) -> list:
        """The cache list for `model`: our cache on each attention layer (per-layer bits from
        config.bits_for_layer over the attention layers), the model's own elsewhere."""
        return cls(model, config).build()
