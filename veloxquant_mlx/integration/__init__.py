"""Putting our caches into mlx-lm / mlx-vlm models: patch, dispatcher, unpatch."""

from veloxquant_mlx.integration.patch import (
    patch_model_kv_cache,
    patch_vlm_kv_cache,
    unpatch_model_kv_cache,
)

__all__ = ["patch_model_kv_cache", "patch_vlm_kv_cache", "unpatch_model_kv_cache"]
