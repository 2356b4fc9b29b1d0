"""Read head_dim and the number of attention layers from a loaded mlx-lm / mlx-vlm model."""

from __future__ import annotations

from veloxquant_mlx.errors import QuantizerConfigError


def _find_layers(model):
    # Text models keep layers at model.layers or model.model.layers; VLM wrappers hold the
    # text model at model.language_model.
    for path in ("layers", "model.layers", "language_model.layers", "language_model.model.layers"):
        node = model
        for name in path.split("."):
            node = getattr(node, name, None)
            if node is None:
                break
        if node is not None:
            return list(node)
    raise QuantizerConfigError(
        f"{type(model).__name__}: no decoder layers found; looked for model.layers, "
        "model.model.layers and model.language_model(.model).layers"
    )


def _attention_of(layer):
    for name in ("self_attn", "attention", "attn"):
        attn = getattr(layer, name, None)
        if attn is not None:
            return attn
    return None


def _head_dim_of(attn) -> int | None:
    head_dim = getattr(attn, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    k_proj = getattr(attn, "k_proj", None)
    n_kv_heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
    weight = getattr(k_proj, "weight", None)
    if weight is not None and isinstance(n_kv_heads, int) and n_kv_heads > 0:
        rows = weight.shape[0]
        # Quantized linears keep packed columns, but rows are still the output features.
        return rows // n_kv_heads
    return None


def read_model_shape(model) -> tuple[int, int]:
    """(head_dim of the widest attention layer, number of attention layers)."""
    layers = _find_layers(model)
    head_dims = [h for h in (_head_dim_of(a) for a in map(_attention_of, layers) if a is not None) if h]
    if not head_dims:
        raise QuantizerConfigError(
            f"{type(model).__name__}: no attention layer with a readable head_dim; looked for "
            "layer.self_attn / .attention / .attn with head_dim or k_proj and n_kv_heads"
        )
    return max(head_dims), len(head_dims)
