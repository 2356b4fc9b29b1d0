"""detect_hardware_info: read MLX when it answers, an empty HardwareInfo when it cannot."""

import builtins
import sys
import types

from veloxquant_mlx import HardwareInfo, detect_hardware_info


def _fake_mlx(monkeypatch, device_info, active):
    core = types.ModuleType("mlx.core")
    core.device_info = device_info
    core.get_active_memory = active
    package = types.ModuleType("mlx")
    package.core = core
    monkeypatch.setitem(sys.modules, "mlx", package)
    monkeypatch.setitem(sys.modules, "mlx.core", core)


def test_reads_metal_style_info(monkeypatch):
    _fake_mlx(monkeypatch, lambda: {"memory_size": 32 * 2**30, "architecture": "x"}, lambda: 123)
    assert detect_hardware_info() == HardwareInfo(32 * 2**30, 123)


def test_cpu_backend_without_total(monkeypatch):
    _fake_mlx(monkeypatch, lambda: {"architecture": "cpu"}, lambda: 7)
    assert detect_hardware_info() == HardwareInfo(None, 7)


def test_device_info_raises(monkeypatch):
    def boom():
        raise RuntimeError("no device")

    _fake_mlx(monkeypatch, boom, lambda: 0)
    assert detect_hardware_info() == HardwareInfo()


def test_active_memory_raises(monkeypatch):
    def boom():
        raise OSError("gone")

    _fake_mlx(monkeypatch, lambda: {"memory_size": 10}, boom)
    assert detect_hardware_info() == HardwareInfo()


def test_mlx_missing(monkeypatch):
    real_import = builtins.__import__

    def no_mlx(name, *args, **kwargs):
        if name == "mlx" or name.startswith("mlx."):
            raise ImportError("No module named 'mlx'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "mlx", raising=False)
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_mlx)
    assert detect_hardware_info() == HardwareInfo()


def test_real_mlx_does_not_raise():
    info = detect_hardware_info()
    assert isinstance(info, HardwareInfo) and info.active_memory_bytes >= 0
