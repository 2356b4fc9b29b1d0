"""GGUF -> mlx-lm llama conversion pieces that need no model file."""

import mlx.core as mx
import pytest
from mlx_lm.gguf import permute_weights

from veloxquant_mlx.models.gguf_llama import dequantized_tensors, unpermute_rope_rows


@pytest.mark.parametrize("n_heads,head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp_permutation(n_heads, head_dim):
    # mlx-lm's GGUF exporter uses llama.cpp's permutation; ours must be its exact inverse.
    w = mx.random.normal((n_heads * head_dim, 16))
    assert mx.array_equal(unpermute_rope_rows(permute_weights(w, n_heads), n_heads), w).item()


def test_unpermute_rejects_rows_that_do_not_split_into_heads():
    with pytest.raises(ValueError, match="cannot unpermute 10 rows into 3 heads"):
        unpermute_rope_rows(mx.zeros((10, 4)), 3)


def test_dequantized_tensors_matches_mx_dequantize():
    w = mx.random.normal((8, 64))
    q, scales, biases = mx.quantize(w, group_size=32, bits=4)
    raw = {"blk.0.attn_q.weight": q, "blk.0.attn_q.scales": scales, "blk.0.attn_q.biases": biases,
           "output_norm.weight": mx.ones((64,))}
    out = dequantized_tensors(raw, mx.float32)
    assert set(out) == {"blk.0.attn_q", "output_norm"}
    assert mx.array_equal(out["blk.0.attn_q"], mx.dequantize(q, scales, biases, group_size=32, bits=4)).item()
    assert out["blk.0.attn_q"].dtype == mx.float32


def test_quantized_tensor_without_scales_is_an_error():
    with pytest.raises(ValueError, match="has no 'blk.0.attn_q.scales'"):
        dequantized_tensors({"blk.0.attn_q.weight": mx.zeros((4, 8), dtype=mx.uint32)}, mx.float32)
