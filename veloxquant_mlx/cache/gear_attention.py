"""GEAR's two attention products over the compressed form, as compiled pure functions.

scores(q) = quantized_matmul(q, K codes) + (q B_k) A_k^T + sparse_k,
values(p) = quantized_matmul(p, V codes) + (p A_v) B_v^T + sparse_v.

mx.compile fuses the casts, transposes and the gather / scatter of the sparse part into few
kernels; on the CPU the per-op overhead of ~15 small ops per layer otherwise rivals the two
quantized matmuls themselves. One compiled function per static setting (bits, group, rank,
whether outliers are kept, block length, head_dim, CPU or not); MLX retraces it when the
capacity grows.

On the CPU (`on_cpu`) both products run in float32 whatever the cache dtype: MLX's CPU
quantized_matmul and matmul in bfloat16 / float16 have no fast path (measured, one layer of 8
KV heads x 128, 8K tokens: ~7x slower than in float32; python -m veloxquant_mlx.bench.ops),
and the side data is small, so the casts cost little. Elsewhere the input dtype is kept, and
p @ V over a long history is split into chunks summed afterwards (split_reduction.py: a single
transpose=False quantized_matmul is a long serial reduction on the GPU; on the CPU the split
gains nothing).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache.split_reduction import quantized_weighted_sum
from veloxquant_mlx.cache.gear_outliers import block_positions, sparse_scores, sparse_weighted_values


def _to_float32(*arrays):
    return [a.astype(mx.float32) for a in arrays]


@lru_cache(maxsize=None)
def scores_function(bits: int, group: int, rank: int, outliers: bool, block: int, dim: int, on_cpu: bool = False):
    def scores(q, codes, scales, zeros, *side):
        if on_cpu:
            q, scales, zeros = _to_float32(q, scales, zeros)
        B, H, M, D = q.shape
        cap = scales.shape[-1] * group
        out = mx.quantized_matmul(
            q, codes.reshape(B, H, D, cap * bits // 32), scales, zeros,
            transpose=False, group_size=group, bits=bits,
        )
        n_blocks = cap // block
        if rank:
            lr_tokens, lr_channels, *side = side
            # (q B_k) A_k^T per block: (B, H, n_blocks, M, r) @ (B, H, n_blocks, r, nb).
            q_channels = q[:, :, None] @ lr_channels.astype(q.dtype)
            tokens = lr_tokens.reshape(B, H, n_blocks, block, rank).astype(q.dtype)
            low = (q_channels @ tokens.swapaxes(-1, -2)).transpose(0, 1, 3, 2, 4).reshape(B, H, M, cap)
            out = out + low.astype(out.dtype)
        if outliers:
            index, values = side
            token, channel = block_positions(index, block, dim)
            out = sparse_scores(q, token, channel, values.reshape(B, H, -1), out)
        return out

    return mx.compile(scores)


@lru_cache(maxsize=None)
def values_function(bits: int, group: int, rank: int, outliers: bool, block: int, dim: int, on_cpu: bool = False,
                    codes_given: bool = False):
    """codes_given: the function takes (p, the codes' product, *side) instead of (p, codes,
    scales, zeros, *side), the product made outside (on the CPU by cache/unpacked_products.py,
    which evaluates chunk by chunk and so cannot run inside mx.compile)."""
    def weighted_values(p, *arrays):
        B, H, M, cap = p.shape
        if codes_given:
            out, *side = arrays
            p = p.astype(mx.float32) if on_cpu else p
        elif on_cpu:
            codes, scales, zeros, *side = arrays
            p, scales, zeros = _to_float32(p, scales, zeros)
            out = mx.quantized_matmul(p, codes, scales, zeros, transpose=False, group_size=group, bits=bits)
        else:
            codes, scales, zeros, *side = arrays
            out = quantized_weighted_sum(p, codes, scales, zeros, group_size=group, bits=bits)
        n_blocks = cap // block
        if rank:
            lr_tokens, lr_channels, *side = side
            p_blocks = p.reshape(B, H, M, n_blocks, block).swapaxes(2, 3)
            tokens = lr_tokens.reshape(B, H, n_blocks, block, rank).astype(p.dtype)
            low = ((p_blocks @ tokens) @ lr_channels.astype(p.dtype).swapaxes(-1, -2)).sum(axis=2)
            out = out + low.astype(out.dtype)
        if outliers:
            index, values = side
            token, channel = block_positions(index, block, dim)
            out = sparse_weighted_values(p, token, channel, values.reshape(B, H, -1), out)
        return out

    return mx.compile(weighted_values)
