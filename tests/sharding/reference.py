"""The model and prompt both the single-process reference and each rank use."""

import mlx.core as mx

from tests.integration.tiny_llama import tiny_llama

# 300 tokens: past the largest block + exact window of the methods (GEAR: 256-token blocks).
PROMPT = mx.array([(i * 7 + 3) % 64 for i in range(300)])
N_NEW = 24


def sharding_model():
    # 4 query heads and 2 KV heads of head_dim 32: one KV head per rank at world size 2.
    return tiny_llama(n_layers=2, seed=0, heads=4, kv_heads=2)
