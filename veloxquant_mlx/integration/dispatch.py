"""The attention dispatcher: our caches attend over their compressed form, every other cache
goes to the model's own function untouched.

mlx-lm's model files do `from .base import scaled_dot_product_attention` and call it as
`scaled_dot_product_attention(queries, keys, values, cache=cache, scale=..., mask=...[,
sinks=...])`. We rebind that name in each model module that holds a layer we patched (found as
sys.modules[type(layer.self_attn).__module__]); the rebinding is reference-counted per module
and undone when the last patched model is unpatched.
"""

from __future__ import annotations

import sys
import warnings

from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.batch import BatchCompressedKVCache

OUR_CACHES = (CompressedKVCache, BatchCompressedKVCache)

FUNCTION_NAME = "scaled_dot_product_attention"

# module name -> [original function, dispatcher, number of patched models using it]
_installed: dict[str, list] = {}


def make_dispatcher(original):
    def scaled_dot_product_attention(queries, keys, values, cache=None, scale=1.0, mask=None, *args, **kwargs):
        if isinstance(cache, OUR_CACHES):
            sinks = args[0] if args else kwargs.get("sinks")
            # keys / values are unused here; from now on the cache does not even build them
            # (while this dispatcher stays installed).
            if cache._dispatcher is not scaled_dot_product_attention:
                cache._dispatcher = scaled_dot_product_attention
            return cache.attention(queries, scale=scale, mask=mask, sinks=sinks)
        return original(queries, keys, values, cache, scale, mask, *args, **kwargs)

    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention.veloxquant_dispatcher = True
    scaled_dot_product_attention.installed = False
    return scaled_dot_product_attention


def module_names_of(attention_modules) -> list[str]:
    names = []
    for module in attention_modules:
        name = type(module).__module__
        if name not in names:
            names.append(name)
    return names


def install(module_names) -> list[str]:
    """Install the dispatcher in these modules (once each); returns the ones now counted."""
    counted = []
    for name in module_names:
        module = sys.modules.get(name)
        original = getattr(module, FUNCTION_NAME, None) if module is not None else None
        if original is None:
            warnings.warn(
                f"veloxquant: {name} has no {FUNCTION_NAME}; its layers attend over the decoded "
                "K/V our caches return (correct, but the history is dequantized every step)",
                stacklevel=3,
            )
            continue
        if name in _installed:
            _installed[name][2] += 1
        else:
            dispatcher = make_dispatcher(original)
            setattr(module, FUNCTION_NAME, dispatcher)
            dispatcher.installed = True
            _installed[name] = [original, dispatcher, 1]
        counted.append(name)
    return counted


def uninstall(module_names) -> None:
    for name in module_names:
        entry = _installed.get(name)
        if entry is None:
            continue
        entry[2] -= 1
        if entry[2] > 0:
            continue
        original, dispatcher, _ = _installed.pop(name)
        dispatcher.installed = False
        module = sys.modules.get(name)
        # Restore only what we put there (someone may have rebound it since).
        if module is not None and getattr(module, FUNCTION_NAME, None) is dispatcher:
            setattr(module, FUNCTION_NAME, original)


def installed_modules() -> list[str]:
    return list(_installed)
