"""Turn a llama-architecture GGUF file (as read by ``mx.load``) into an mlx-lm llama model.

``mx.load(path, return_metadata=True)`` reads GGUF tensors and metadata. Quantized GGUF
tensors (Q4_0, Q4_1, Q8_0) come back in MLX's affine layout -- ``<name>.weight`` packed
uint32, ``<name>.scales`` and ``<name>.biases`` -- with 32 elements per group; we dequantize
them to the requested float dtype so the model runs with plain ``nn.Linear`` layers (fp32
matmul goes through BLAS on the CPU; quantized matmul does not).

llama.cpp's converter permutes the rows of ``q_proj`` and ``k_proj`` inside every head so that
its interleaved ("traditional") RoPE gives the same result as Hugging Face's rotate-half RoPE.
We undo that permutation and build the model with mlx-lm's default (non-traditional) RoPE, so
that the keys in the KV cache have the same channel order as the original Hugging Face model:
group-wise KV quantizers (groups along head_dim) then see the same groups as on the original.
Keeping the permuted rows with ``rope_traditional=True`` gives the same logits (checked in
tests/models/test_gguf_llama.py) but a different key channel order.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import mlx.core as mx
from mlx_lm.models import llama

# GGUF tensor name (after "blk.N.") -> mlx-lm llama parameter name (after "model.layers.N.").
_BLOCK_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# The group size mx.load uses for every quantized GGUF type it reads (Q4_0, Q4_1, Q8_0).
GGUF_GROUP_SIZE = 32


def _scalar(metadata: Mapping[str, Any], key: str, path: str):
    if key not in metadata:
        raise ValueError(f"{path}: GGUF metadata has no '{key}' (needed to build the llama model)")
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def model_args_from_gguf(metadata: Mapping[str, Any], has_output_tensor: bool, path: str = "<gguf>") -> llama.ModelArgs:
    """mlx-lm ``llama.ModelArgs`` from the GGUF ``llama.*`` metadata."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture is {arch!r}; only 'llama' is supported")
    n_heads = int(_scalar(metadata, "llama.attention.head_count", path))
    hidden = int(_scalar(metadata, "llama.embedding_length", path))
    head_dim = int(metadata["llama.rope.dimension_count"].item()) if "llama.rope.dimension_count" in metadata else hidden // n_heads
    if "llama.vocab_size" in metadata:
        vocab = int(_scalar(metadata, "llama.vocab_size", path))
    else:
        vocab = len(metadata["tokenizer.ggml.tokens"])
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(metadata, "llama.block_count", path)),
        intermediate_size=int(_scalar(metadata, "llama.feed_forward_length", path)),
        num_attention_heads=n_heads,
        num_key_value_heads=int(_scalar(metadata, "llama.attention.head_count_kv", path)),
        head_dim=head_dim,
        rms_norm_eps=float(_scalar(metadata, "llama.attention.layer_norm_rms_epsilon", path)),
        vocab_size=vocab,
        rope_theta=float(metadata["llama.rope.freq_base"].item()) if "llama.rope.freq_base" in metadata else 10000.0,
        max_position_embeddings=int(_scalar(metadata, "llama.context_length", path)),
        rope_traditional=False,
        tie_word_embeddings=not has_output_tensor,
    )


def unpermute_rope_rows(weight: mx.array, n_heads: int) -> mx.array:
    """Inverse of llama.cpp's ``permute``: rows (head, d/2, 2) -> (head, 2, d/2).

    llama.cpp (convert_hf_to_gguf.py, LlamaModel.permute) maps the Hugging Face row order
    ``reshape(n_head, 2, d/2).swapaxes(1, 2)``; this swaps back.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot unpermute {rows} rows into {n_heads} heads of even size")
    w = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def dequantized_tensors(raw: Mapping[str, mx.array], dtype: mx.Dtype) -> Dict[str, mx.array]:
    """GGUF tensors by base name ("blk.0.attn_q"), each a float array of ``dtype``."""
    out: Dict[str, mx.array] = {}
    for key, value in raw.items():
        base, _, kind = key.rpartition(".")
        if kind in ("scales", "biases"):
            continue
        if kind != "weight":
            raise ValueError(f"unexpected GGUF tensor {key!r}: expected '<name>.weight'")
        if value.dtype == mx.uint32:
            scales = raw.get(base + ".scales")
            biases = raw.get(base + ".biases")
            if scales is None:
                raise ValueError(f"quantized GGUF tensor {key!r} has no '{base}.scales'")
            bits = value.shape[-1] // scales.shape[-1]
            value = mx.dequantize(value, scales, biases, group_size=GGUF_GROUP_SIZE, bits=bits)
        out[base] = value.astype(dtype)
    return out


def llama_weights_from_gguf(raw: Mapping[str, mx.array], args: llama.ModelArgs, dtype: mx.Dtype) -> Dict[str, mx.array]:
    """mlx-lm llama parameter dict (flat names) from the GGUF tensors."""
    weights: Dict[str, mx.array] = {}
    for base, value in dequantized_tensors(raw, dtype).items():
        parts = base.split(".")
        if parts[0] == "blk":
            layer, name = parts[1], parts[2]
            if name not in _BLOCK_TENSOR_NAMES:
                raise ValueError(f"unexpected GGUF tensor 'blk.{layer}.{name}' for the llama architecture")
            if name == "attn_q":
                value = unpermute_rope_rows(value, args.num_attention_heads)
            elif name == "attn_k":
                value = unpermute_rope_rows(value, args.num_key_value_heads)
            weights[f"model.layers.{layer}.{_BLOCK_TENSOR_NAMES[name]}.weight"] = value
        elif base in _TOP_TENSOR_NAMES:
            weights[f"{_TOP_TENSOR_NAMES[base]}.weight"] = value
        elif base == "rope_freqs":
            raise ValueError("GGUF has 'rope_freqs' (llama-3 RoPE scaling), which this loader does not map")
        else:
            raise ValueError(f"unexpected GGUF tensor {base!r} for the llama architecture")
    return weights


def load_llama_gguf(path: str, dtype: mx.Dtype = mx.float32) -> Tuple[llama.Model, Dict[str, Any]]:
    """Load a llama GGUF file into an evaluated ``mlx_lm.models.llama.Model``; also return the metadata."""
    raw, metadata = mx.load(str(path), return_metadata=True)
    args = model_args_from_gguf(metadata, has_output_tensor="output.weight" in raw, path=str(path))
    model = llama.Model(args)
    weights = llama_weights_from_gguf(raw, args, dtype)
    # strict: every model parameter must come from the file, with its shape, and nothing else.
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model, metadata

