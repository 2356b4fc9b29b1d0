"""p @ V over a long token axis, split into chunks of tokens that run as one batch, then summed.

One decode step weighs the values of every cached token with a single query row per head: a
matmul whose only long dimension is the reduction. mx.quantized_matmul runs such a shape as a
long serial reduction; on the H200 (FACTS.md) it took 2.7 ms at 128K tokens where the whole
fp16 attention took 0.23 ms. Splitting the tokens into C chunks turns it into C independent
short reductions in one batched call, followed by a cheap sum over C.

On the CPU both this weighted sum and its scores twin (`quantized_scores`, one call elsewhere)
read the codes as planes for BLAS products (cache/unpacked_products.py) where it reads the width.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache import unpacked_products

# Below this many tokens a single call is already fast (and the CPU gains nothing).
SPLIT_FROM_TOKENS = 8192
CHUNK_CANDIDATES = (2048, 1024, 512, 256)
MIN_CHUNKS = 8


def chunk_for(tokens: int) -> int | None:
    """The largest candidate chunk dividing `tokens` into at least MIN_CHUNKS, or None."""
    if tokens < SPLIT_FROM_TOKENS:
        return None
    for chunk in CHUNK_CANDIDATES:
        if tokens % chunk == 0 and tokens // chunk >= MIN_CHUNKS:
            return chunk
    return None


def quantized_weighted_sum(p, codes, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """p (..., R, T) times the values quantized per token, codes (..., T, W), in p's dtype."""
    if unpacked_products.serves(bits):
        # The CPU: the codes read as planes for BLAS products (cache/unpacked_products.py),
        # 2-4x faster there than MLX's affine kernel at a decode step's shapes.
        return unpacked_products.affine_weighted_sum(
            p, codes, scales, biases, group_size=group_size, bits=bits
        ).astype(p.dtype)
    tokens = p.shape[-1]
    chunk = chunk_for(tokens)
    if chunk is None:
        return mx.quantized_matmul(
            p, codes, scales, biases, transpose=False, group_size=group_size, bits=bits
        )
    n_chunks, lead, rows = tokens // chunk, p.shape[:-2], p.shape[-2]
    p_chunks = p.reshape(*lead, rows, n_chunks, chunk).swapaxes(-2, -3)

    def split(a):
        return a.reshape(*lead, n_chunks, chunk, a.shape[-1])

    partial = mx.quantized_matmul(
        p_chunks, split(codes), split(scales), split(biases),
        transpose=False, group_size=group_size, bits=bits,
    )
    # Partials summed in float32: bf16 partial sums would add rounding per chunk.
    return partial.astype(mx.float32).sum(axis=-3).astype(p.dtype)


def quantized_scores(x, codes, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """x (..., R, d) against the keys quantized per token, codes (..., T, W) -> (..., R, T), in
    x's dtype: mx.quantized_matmul(transpose=True), or on the CPU the planes' product."""
    if unpacked_products.serves(bits):
        return unpacked_products.affine_scores(
            x, codes, scales, biases, group_size=group_size, bits=bits
        ).astype(x.dtype)
    return mx.quantized_matmul(x, codes, scales, biases, transpose=True, group_size=group_size, bits=bits)
