"""Tiny random-weight mlx-lm models, one per architecture, built from each model file's own
ModelArgs (no weights, no hub): a few layers, hidden 64-192, vocab 64."""

import importlib

import mlx.core as mx
from mlx.utils import tree_map

VOCAB = 64

COMMON = dict(vocab_size=VOCAB, rms_norm_eps=1e-5)

# name -> (mlx_lm.models module, ModelArgs fields)
ARCHITECTURES = {
    "llama": ("llama", dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    # mlx-lm maps model_type "mistral" to llama.py (MODEL_REMAPPING); GQA 4:1 here.
    "mistral": ("llama", dict(model_type="mistral", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                              num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False)),
    # qwen2's attention has no head_dim attribute: the builder reads it from k_proj.
    "qwen2": ("qwen2", dict(model_type="qwen2", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=2)),
    "qwen3": ("qwen3", dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                            rope_theta=10000.0, tie_word_embeddings=True)),
    # head_dim 192 / 2 = 96: not a power of two.
    "phi3": ("phi3", dict(model_type="phi3", hidden_size=192, num_hidden_layers=2, intermediate_size=256,
                          num_attention_heads=2, num_key_value_heads=1)),
    # Local layers (sliding window 16, RotatingKVCache) alternate with global ones (KVCache).
    "gemma3_text": ("gemma3_text", dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=4,
                                        intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                                        head_dim=32, query_pre_attn_scalar=32, sliding_window=16,
                                        sliding_window_pattern=2)),
    # Attention logit soft-capping: gemma2 computes attention itself (no
    # scaled_dot_product_attention), so our caches serve decoded K/V there.
    "gemma2": ("gemma2", dict(model_type="gemma2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                              query_pre_attn_scalar=32.0)),
    "mixtral": ("mixtral", dict(model_type="mixtral", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
                                num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                num_experts_per_tok=2)),
    # Hybrid: Mamba2 (M), attention (*), MLP (-) and MoE (E) blocks; make_cache() builds entries
    # only for M and * layers, so cache index != layer index.
    "nemotron_h": ("nemotron_h", dict(model_type="nemotron_h", hidden_size=64, intermediate_size=128,
                                      max_position_embeddings=4096, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=32, attention_bias=False, mamba_num_heads=4, mamba_head_dim=16,
                                      mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1,
                                      mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False,
                                      use_conv_bias=True, hybrid_override_pattern=["M", "*", "-", "M", "*"],
                                      vocab_size=VOCAB)),
}


def build(name, seed=0, weight_scale=3.0, dtype=mx.float32):
    module_name, fields = ARCHITECTURES[name]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    fields = dict(fields)
    for key, value in COMMON.items():
        if key in module.ModelArgs.__dataclass_fields__:
            fields.setdefault(key, value)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs(**fields))
    # Scaled-up random weights: at init a random model repeats one token; scaled, its greedy
    # path moves, so a cache that loses history changes the output.
    model.update(tree_map(lambda p: (p * weight_scale if p.ndim == 2 else p).astype(dtype), model.parameters()))
    mx.eval(model.parameters())
    return model
