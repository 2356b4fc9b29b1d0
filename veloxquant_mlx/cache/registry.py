"""Method name -> cache class, as module paths imported on first use (a cache module pulls in
only what its method needs)."""

from __future__ import annotations

import importlib

from veloxquant_mlx.errors import QuantizerConfigError

CACHE_CLASSES: dict[str, tuple[str, str]] = {
    "turboquant_rvq": ("veloxquant_mlx.cache.turboquant_rvq", "TurboQuantRVQCache"),
    "kivi": ("veloxquant_mlx.cache.kivi", "KIVICache"),
    "kvquant": ("veloxquant_mlx.cache.kvquant", "KVQuantCache"),
    "gear": ("veloxquant_mlx.cache.gear", "GEARCache"),
    "xquant": ("veloxquant_mlx.cache.xquant", "XQuantCache"),
    "minicache": ("veloxquant_mlx.cache.minicache", "MiniCacheCache"),
    "pyramidkv": ("veloxquant_mlx.cache.pyramidkv", "PyramidKVCache"),
}


def cache_class(method: str):
    try:
        module_name, class_name = CACHE_CLASSES[method]
    except KeyError:
        raise QuantizerConfigError(
            f"no cache for method {method!r}: allowed is one of {tuple(CACHE_CLASSES)}"
        ) from None
    return getattr(importlib.import_module(module_name), class_name)
