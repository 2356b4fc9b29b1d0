"""Which entries of a model's cache list get our compressed cache: the layer plan.

The rule (one rule for every architecture; docs/architectures.md lists what it gives):
  1. Start from what the model itself builds: `model.make_cache()` when it has one, else one
     mlx-lm `KVCache` per layer (what `mlx_lm.models.cache.make_prompt_cache` does).
  2. An entry is replaced by our cache exactly when it is a plain `KVCache` (the type itself,
     not a subclass: mlx-lm's, or mlx-vlm's own copy in mlx_vlm.models.cache) AND its layer's attention can be read: an attention module under
     one of ATTENTION_ATTRIBUTES with a number of KV heads (KV_HEAD_ATTRIBUTES) and a head_dim
     (HEAD_DIM_ATTRIBUTES, else the k_proj output size / KV heads), that is not a sliding-window
     layer and has no attention sinks (our attention composes one softmax without them).
  3. Every other entry stays the model's own: RotatingKVCache (sliding window), ArraysCache /
     MambaCache (Mamba, linear attention), ChunkedKVCache, CacheList (a layer with two mixers),
     QuantizedKVCache, and a KVCache whose layer we cannot read.

Cache list index vs layer index: when the model's list has one entry per layer, entry i is layer
i. Hybrid models may build entries only for the layers that need a cache (nemotron_h skips its
MLP / MoE layers); then the k-th plain KVCache entry is matched to the k-th readable attention
layer, and a count that does not match is refused (we would otherwise guess).
"""

from __future__ import annotations

from dataclasses import dataclass

from veloxquant_mlx.errors import QuantizerConfigError

LAYER_LIST_PLACES = ("model.layers", "model.model.layers", "model.language_model.(model.)layers")
ATTENTION_ATTRIBUTES = ("self_attn", "attention", "attn", "mixer")
KV_HEAD_ATTRIBUTES = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head")
HEAD_DIM_ATTRIBUTES = ("head_dim",)
VALUE_DIM_ATTRIBUTES = ("v_head_dim",)
SLIDING_ATTRIBUTES = ("use_sliding", "is_sliding")


@dataclass(frozen=True)
class AttentionLayer:
    """A layer that gets our cache."""

    index: int  # position in the model's layer list
    cache_index: int  # position in the model's cache list (differs in some hybrids)
    module: object  # the attention module
    head_dim: int
    value_dim: int
    n_kv_heads: int


@dataclass(frozen=True)
class LayerEntry:
    """What one entry of the model's cache list gets, and why (for the docs table and errors)."""

    cache_index: int
    layer_index: int | None
    kept: str | None  # the model's own cache class name when kept, None when replaced
    reason: str


PLAIN_KV_CACHES = (("mlx_lm.models.cache", "KVCache"), ("mlx_vlm.models.cache", "KVCache"))


def is_plain_kv_cache(cache) -> bool:
    # By module and name: mlx-vlm is not imported for text models.
    kind = type(cache)
    return (kind.__module__, kind.__qualname__) in PLAIN_KV_CACHES


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
        f"KVCacheBuilder: {type(model).__module__}.{type(model).__qualname__} has no layer "
        "list: looked for "
        f"{', '.join(LAYER_LIST_PLACES)} (a non-empty list)"
    )


def _int_attribute(module, names):
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _projection_size(module, name):
    proj = getattr(module, name, None)
    weight = getattr(proj, "weight", None)
    # Linear and QuantizedLinear both keep the output features on axis 0.
    return int(weight.shape[0]) if weight is not None and weight.ndim == 2 else None


def read_attention(layer) -> tuple[object | None, str]:
    """(attention module, why) when the layer's attention can be read, else (None, why not)."""
    for name in ATTENTION_ATTRIBUTES:
        attn = getattr(layer, name, None)
        if attn is None:
            continue
        n_kv = _int_attribute(attn, KV_HEAD_ATTRIBUTES)
        if n_kv is None:
            continue  # e.g. a Mamba `mixer`: not attention
        if any(getattr(owner, flag, False) is True for owner in (layer, attn) for flag in SLIDING_ATTRIBUTES):
            return None, f"{name} is a sliding-window layer"
        if getattr(attn, "sinks", None) is not None:
            return None, f"{name} has attention sinks"
        return attn, f"{name} with {KV_HEAD_ATTRIBUTES[0]}-like heads"
    return None, (
        f"no attention module: looked for {'/'.join(ATTENTION_ATTRIBUTES)} with an integer "
        f"{'/'.join(KV_HEAD_ATTRIBUTES)}"
    )


def attention_shape(attn) -> tuple[int, int, int] | None:
    """(n_kv_heads, head_dim, value_dim) of an attention module, or None when unreadable."""
    n_kv = _int_attribute(attn, KV_HEAD_ATTRIBUTES)
    head_dim = _int_attribute(attn, HEAD_DIM_ATTRIBUTES)
    if head_dim is None:
        k_size = _projection_size(attn, "k_proj")
        if k_size is None or k_size % n_kv:
            return None
        head_dim = k_size // n_kv
    value_dim = _int_attribute(attn, VALUE_DIM_ATTRIBUTES)
    if value_dim is None:
        v_size = _projection_size(attn, "v_proj")
        value_dim = v_size // n_kv if v_size is not None and v_size % n_kv == 0 else head_dim
    return n_kv, head_dim, value_dim


def plan_layers(model_name: str, layers: list, caches: list) -> tuple[list[AttentionLayer], list[LayerEntry]]:
    """Apply the rule to the model's own cache list `caches`: (layers we replace, every entry)."""
    readable = []  # (layer index, attention module, shape)
    why_not = {}
    for index, layer in enumerate(layers):
        attn, why = read_attention(layer)
        shape = attention_shape(attn) if attn is not None else None
        if attn is not None and shape is None:
            why = "attention without a readable head_dim (no head_dim, no k_proj)"
        if shape is None:
            why_not[index] = why
            continue
        readable.append((index, attn, shape))

    plain = [i for i, cache in enumerate(caches) if is_plain_kv_cache(cache)]
    if len(caches) == len(layers):
        pairs = {index: index for index, _, _ in readable if index in plain}
        layer_of = dict(enumerate(range(len(layers))))
    else:
        # Entries only for layers that need a cache: pair plain KVCache entries with the
        # readable attention layers, in order.
        if len(plain) != len(readable):
            raise QuantizerConfigError(
                f"KVCacheBuilder: {model_name}.make_cache() returned {len(caches)} caches for "
                f"{len(layers)} layers, {len(plain)} of them plain KVCache, but {len(readable)} "
                "layers have readable attention: cannot tell which cache belongs to which layer"
            )
        pairs = {index: cache_index for (index, _, _), cache_index in zip(readable, plain)}
        layer_of = {cache_index: index for index, cache_index in pairs.items()}

    attention = []
    for index, attn, (n_kv, head_dim, value_dim) in readable:
        if index in pairs:
            attention.append(AttentionLayer(index, pairs[index], attn, head_dim, value_dim, n_kv))
    replaced = {layer.cache_index: layer for layer in attention}
    entries = []
    for cache_index, cache in enumerate(caches):
        layer_index = layer_of.get(cache_index)
        if cache_index in replaced:
            a = replaced[cache_index]
            reason = f"attention: {a.n_kv_heads} kv heads, head_dim {a.head_dim}"
            if a.value_dim != a.head_dim:
                reason += f", value head_dim {a.value_dim}"
            entries.append(LayerEntry(cache_index, layer_index, None, reason))
        elif not is_plain_kv_cache(cache):
            entries.append(LayerEntry(cache_index, layer_index, type(cache).__name__,
                                      "the model builds this cache itself"))
        else:
            entries.append(LayerEntry(cache_index, layer_index, type(cache).__name__,
                                      why_not.get(layer_index, "attention not readable")))
    return attention, entries
