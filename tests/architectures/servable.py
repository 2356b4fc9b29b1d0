"""The methods a test can serve today: every registry entry whose module exists and that is not
standalone, so new methods are covered as soon as they are merged."""

import importlib

import veloxquant_mlx.cache.base as cache_base
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.registry import CACHE_CLASSES

# Small windows so that a ~100-token prompt already reaches each method's compressed history.
# (Fields of methods not merged yet are only read once their module exists.)
OVERRIDES = {
    "kivi": dict(kivi_residual_length=32),
    "turboquant_rvq": dict(),
    "xquant": dict(xquant_residual_length=32),
    # The tiny models have 2 replaced layers: merging must start at depth 0 to pair them.
    "minicache": dict(minicache_start_fraction=0.0),
    "pyramidkv": dict(pyramidkv_budget=48, pyramidkv_window=16),
}

# Methods whose unpatched path (attention over the K/V update_and_fetch returns) is by design not
# the patched one, so "patched == dequantized" does not apply to them.
DECODED_PATH_DIFFERS = {
    "pyramidkv": "evicts by attention scores, which only the dispatcher's attention sees; "
                 "unpatched it evicts nothing",
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


def decoded_path_matches(method):
    return method not in DECODED_PATH_DIFFERS


def config_for(method):
    return KVCacheConfig(method=method, **OVERRIDES.get(method, {}))
