"""patch_model_kv_cache / patch_vlm_kv_cache / unpatch_model_kv_cache.

The patch replaces the model's `make_cache` (which mlx-lm's make_prompt_cache calls at every
generate()) with one that builds a FRESH cache list on every call, so a second generate() never
sees the first one's state, and installs the attention dispatcher (integration/dispatch.py) in
the modules of the model's attention layers. The first cache list is built eagerly and
returned, so a bad config fails at patch time. `unpatch_model_kv_cache` undoes both.
"""

from __future__ import annotations

from dataclasses import dataclass

import veloxquant_mlx.cache.base as cache_base
from veloxquant_mlx.cache.builder import KVCacheBuilder
from veloxquant_mlx.config.kv_cache_config import KVCacheConfig
from veloxquant_mlx.errors import QuantizerConfigError
from veloxquant_mlx.integration import dispatch

_PATCH_ATTRIBUTE = "_veloxquant_patch"
_MISSING = object()


@dataclass
class _PatchRecord:
    config: KVCacheConfig
    previous_make_cache: object  # the instance attribute before patching, or _MISSING
    dispatcher_modules: list
    targets: list  # the objects whose make_cache we replaced


def _refuse_standalone(config) -> None:
    if not isinstance(config, KVCacheConfig):
        raise QuantizerConfigError(
            f"patch_model_kv_cache needs a KVCacheConfig, got {type(config).__name__}"
        )
    # Read the set at call time (it lives in cache/base.py and may grow).
    if config.method in cache_base.STANDALONE_METHODS:
        raise QuantizerConfigError(
            f"KVCacheConfig.method={config.method!r} is a standalone method: it does not "
            "implement the mlx-lm cache contract and cannot be patched into a model; allowed "
            f"are methods not in {sorted(cache_base.STANDALONE_METHODS)}"
        )


def _set_make_cache(target, function) -> object:
    previous = target.__dict__.get("make_cache", _MISSING)
    # object.__setattr__: nn.Module stores some values as parameters; a function never is one,
    # but be explicit that this is a plain instance attribute.
    object.__setattr__(target, "make_cache", function)
    return previous


def _restore_make_cache(target, previous) -> None:
    if previous is _MISSING:
        if "make_cache" in target.__dict__:
            object.__delattr__(target, "make_cache")
    else:
        object.__setattr__(target, "make_cache", previous)


def _patch(model, config, targets) -> list:
    _refuse_standalone(config)
    if getattr(model, _PATCH_ATTRIBUTE, None) is not None:
        unpatch_model_kv_cache(model)
    text_model = targets[-1]
    builder = KVCacheBuilder(text_model, config)
    first = builder.build()
    previous = [_set_make_cache(t, builder.build) for t in targets]
    modules = dispatch.install(dispatch.module_names_of(builder.attention_modules))
    record = _PatchRecord(config, previous, modules, targets)
    object.__setattr__(model, _PATCH_ATTRIBUTE, record)
    return first


def patch_model_kv_cache(model, config: KVCacheConfig) -> list:
    """Make `model` use our compressed caches in mlx_lm.generate; returns the first cache list."""
    return _patch(model, config, [model])


def patch_vlm_kv_cache(model, config: KVCacheConfig) -> list:
    """The same for an mlx-vlm model: caches for `model.language_model`'s layers; make_cache is
    replaced on the language model (what mlx-vlm's generate asks) and on the wrapper."""
    language_model = getattr(model, "language_model", None)
    if language_model is None:
        raise QuantizerConfigError(
            f"patch_vlm_kv_cache: {type(model).__name__} has no language_model; for a text "
            "model use patch_model_kv_cache"
        )
    return _patch(model, config, [model, language_model])


def unpatch_model_kv_cache(model) -> bool:
    """Undo a patch: the model's own make_cache and attention come back. False if not patched."""
    record = model.__dict__.get(_PATCH_ATTRIBUTE)
    if record is None:
        return False
    for target, previous in zip(record.targets, record.previous_make_cache):
        _restore_make_cache(target, previous)
    dispatch.uninstall(record.dispatcher_modules)
    object.__delattr__(model, _PATCH_ATTRIBUTE)
    return True
