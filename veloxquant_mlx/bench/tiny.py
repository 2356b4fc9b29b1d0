"""Random-weight llama models of any shape, for speed runs and fast tests.

Speed does not depend on weight values (FACTS.md), so a model of a real model's shape with
random weights measures what the real one would. Built on mlx-lm's own llama so the attention
path (and our dispatcher's hook into it) is the one users run.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map


def random_llama(*, hidden: int = 128, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                 head_dim: int | None = 64, intermediate: int = 256, vocab: int = 256,
                 dtype=mx.float32, seed: int = 0):
    from mlx_lm.models.llama import Model, ModelArgs

    args = ModelArgs(
        model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        intermediate_size=intermediate, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=1e-5, vocab_size=vocab, tie_word_embeddings=False,
        rope_theta=500000.0,
    )
    mx.random.seed(seed)
    model = Model(args)
    # Scale the random init down so activations stay finite through many layers in bf16.
    model.update(tree_map(lambda p: (p * 0.5).astype(dtype) if p.ndim > 1 else p.astype(dtype),
                          model.parameters()))
    mx.eval(model.parameters())
    model.eval()
    return model


def parameter_bytes(model: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(p.nbytes for _, p in tree_flatten(model.parameters()))
