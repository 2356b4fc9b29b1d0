"""Workload, hardware and cache configuration, and the policy-driven auto-config."""

from veloxquant_mlx.config.auto_config import AutoConfigResult, select_kv_cache_config
from veloxquant_mlx.config.hardware import HardwareInfo, detect_hardware_info
from veloxquant_mlx.config.kv_cache_config import KVCacheConfig
from veloxquant_mlx.config.workload import WorkloadSpec
from veloxquant_mlx.errors import PolicyError, QuantizerConfigError

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
