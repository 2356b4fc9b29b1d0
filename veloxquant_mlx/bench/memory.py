"""Bytes a cache holds after the prompt, and the memory MLX used to get there.

- `cache_bytes`: the sum of the caches' own `nbytes` (arrays actually held, growth slack
  included) after the prompt.
- `fp16_bytes`: what an fp16 cache holding exactly the same tokens needs, from each layer's
  offset and shape (2 bytes per element, no slack); the ratio `cache_bytes / fp16_bytes` is the
  compression a user sees. On the CPU the reference model runs in float32, so mlx-lm's KVCache
  itself holds 4-byte elements: its measured nbytes is recorded beside this figure.
- `peak_bytes`: `mx.get_peak_memory()` after `mx.reset_peak_memory()` just before the prompt
  (so it includes the weights); `peak_over_start_bytes` subtracts the active memory at that
  moment, i.e. what the prompt's activations and cache added at their highest.
- `active_growth_bytes`: `mx.get_active_memory()` after the prompt minus before it: the cache
  plus anything the prefill left alive.
"""

from __future__ import annotations

import gc

import mlx.core as mx

from veloxquant_mlx.bench.drive import prefill


def _layer_fp16_bytes(model_layer_shapes, tokens: int) -> int:
    return sum(2 * kv_heads * tokens * (k_dim + v_dim) for kv_heads, k_dim, v_dim in model_layer_shapes)


def kv_shapes(model) -> list[tuple[int, int, int]]:
    """(kv_heads, key head_dim, value head_dim) of each attention layer, read from the model."""
    layers = getattr(model, "layers", None)
    if layers is None:
        layers = model.model.layers
    shapes = []
    for layer in layers:
        attn = getattr(layer, "self_attn", None) or getattr(layer, "attention", None)
        if attn is None:
            continue
        heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
        head_dim = getattr(attn, "head_dim", None)
        if head_dim is None:
            head_dim = attn.k_proj.weight.shape[0] // heads
        shapes.append((int(heads), int(head_dim), int(head_dim)))
    return shapes


def fp16_bytes_for(model, tokens: int, batch_size: int = 1) -> int:
    return batch_size * _layer_fp16_bytes(kv_shapes(model), tokens)


def measure_memory(model, make_cache, prompt: mx.array, prefill_step_size: int = 2048) -> dict:
    """Prefill `prompt` into a fresh cache list and report its bytes and MLX memory figures."""
    gc.collect()
    mx.clear_cache()
    active_before = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = make_cache()
    prefill(model, cache, prompt, prefill_step_size)
    cache_bytes = int(sum(c.nbytes for c in cache))
    result = {
        "tokens": int(prompt.size),
        "cache_bytes": cache_bytes,
        "fp16_bytes": int(fp16_bytes_for(model, int(prompt.size))),
        "peak_bytes": int(mx.get_peak_memory()),
        "peak_over_start_bytes": int(mx.get_peak_memory() - active_before),
        "active_growth_bytes": int(mx.get_active_memory() - active_before),
        "cache_classes": sorted({type(c).__name__ for c in cache}),
    }
    result["ratio_vs_fp16"] = cache_bytes / result["fp16_bytes"] if result["fp16_bytes"] else None
    del cache
    gc.collect()
    mx.clear_cache()
    return result
