"""HardwareInfo and its detection from MLX."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HardwareInfo:
    total_memory_bytes: int | None = None
    active_memory_bytes: int = 0

    def pressure_fraction(self, additional_bytes: int) -> float | None:
        """(active + additional) / total; None when the total is unknown or zero."""
        if not self.total_memory_bytes:
            return None
        return (self.active_memory_bytes + additional_bytes) / self.total_memory_bytes


def _total_memory(info: dict) -> int | None:
    # Metal reports memory_size; the CPU backend reports none, so the total stays unknown
    # rather than guessed (a guess would silently change the policy's pressure rule).
    for key in ("memory_size", "total_memory", "max_recommended_working_set_size"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def detect_hardware_info() -> HardwareInfo:
    """From mx.device_info() and mx.get_active_memory(); an empty HardwareInfo when MLX is
    missing or its introspection raises for any reason."""
    try:
        import mlx.core as mx

        total = _total_memory(dict(mx.device_info()))
        active = int(mx.get_active_memory())
    except Exception:  # noqa: BLE001 - the fixed API promises an empty answer, never a crash
        return HardwareInfo()
    return HardwareInfo(total_memory_bytes=total, active_memory_bytes=active)
