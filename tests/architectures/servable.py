"""The methods a test can serve today: every registry entry whose module exists and that is not
standalone, so new methods are covered as soon as they are merged."""

import importlib

import veloxquant_mlx.cache.base as cache_base
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.registry import CACHE_CLASSES

# Small windows so that a ~100-token prompt already reaches each method's compressed history.
OVERRIDES = {
    "kivi": dict(kivi_residual_length=32),
}


def _importable(module_name):
    try:
        importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            return False
        raise
    return True


def servable_methods():
    return [m for m, (module, _) in CACHE_CLASSES.items()
            if _importable(module) and m not in cache_base.STANDALONE_METHODS]


def missing_methods():
    return [m for m, (module, _) in CACHE_CLASSES.items() if not _importable(module)]


def config_for(method):
    return KVCacheConfig(method=method, **OVERRIDES.get(method, {}))
