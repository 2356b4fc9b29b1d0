"""VeloxQuant-MLX: compressed KV caches for MLX, chosen per workload by a versioned policy."""

from veloxquant_mlx.config import (
    HardwareInfo,
    KVCacheConfig,
    PolicyError,
    QuantizerConfigError,
    WorkloadSpec,
    detect_hardware_info,
)

__all__ = [
    "HardwareInfo",
    "KVCacheConfig",
    "PolicyError",
    "QuantizerConfigError",
    "WorkloadSpec",
    "detect_hardware_info",
]
