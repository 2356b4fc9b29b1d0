"""VeloxQuant-MLX: compressed KV caches for MLX, chosen per workload by a versioned policy."""

from veloxquant_mlx.config import (
    AutoConfigResult,
    HardwareInfo,
    KVCacheConfig,
    PolicyError,
    QuantizerConfigError,
    WorkloadSpec,
    detect_hardware_info,
    select_kv_cache_config,
)
from veloxquant_mlx.cache import STANDALONE_METHODS, KVCacheBuilder, KVCacheFactory
from veloxquant_mlx.integration import (
    patch_model_kv_cache,
    patch_vlm_kv_cache,
    unpatch_model_kv_cache,
)

__all__ = [
    "AutoConfigResult",
    "HardwareInfo",
    "KVCacheBuilder",
    "KVCacheConfig",
    "KVCacheFactory",
    "PolicyError",
    "QuantizerConfigError",
    "STANDALONE_METHODS",
    "WorkloadSpec",
    "detect_hardware_info",
    "patch_model_kv_cache",
    "patch_vlm_kv_cache",
    "select_kv_cache_config",
    "unpatch_model_kv_cache",
]
