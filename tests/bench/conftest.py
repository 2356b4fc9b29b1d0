import pytest

from veloxquant_mlx.bench.tiny import random_llama


@pytest.fixture(scope="module")
def tiny_model():
    # head_dim 64 so mlx-lm's QuantizedKVCache (group 64) fits; float32 is the fast CPU dtype.
    return random_llama(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256, vocab=256)
