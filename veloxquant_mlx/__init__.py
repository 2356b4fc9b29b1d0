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

__all__ = [
    "AutoConfigResult",
    "HardwareInfo",
    "KVCacheConfig",
    "PolicyError",
    "QuantizerConfigError",
    "WorkloadSpec",
    "detect_hardware_info",
    "select_kv_cache_config",
]
