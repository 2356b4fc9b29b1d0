"""Compressed KV caches (one module per method), the factory and the model builder.

Importing this package imports every method module that exists, so that each cache class is
bound in mlx_lm.models.cache (CompressedKVCache.__init_subclass__) and
`mlx_lm.models.cache.load_prompt_cache` can restore a saved cache list.
"""

import importlib

from veloxquant_mlx.cache.base import STANDALONE_METHODS, CompressedKVCache
from veloxquant_mlx.cache.builder import KVCacheBuilder
from veloxquant_mlx.cache.factory import KVCacheFactory
from veloxquant_mlx.cache.registry import CACHE_CLASSES


def _import_method_modules() -> None:
    for module_name, _ in CACHE_CLASSES.values():
        try:
            importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:  # a method module that exists but fails: say so
                raise


_import_method_modules()

__all__ = ["STANDALONE_METHODS", "CompressedKVCache", "KVCacheBuilder", "KVCacheFactory"]
