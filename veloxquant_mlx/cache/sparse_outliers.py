"""Dense-and-sparse decomposition: keep the few most extreme entries of a block exactly.

KVQuant (Hooper et al. 2024, arXiv 2401.18079, section 3.4) and GEAR (Kang et al. 2024) remove
a small fraction of outlier entries from a matrix before quantizing it, store them sparsely at
full precision, and add them back when reading. Removing them shrinks the range the dense
quantizer must cover, which is where most of the low-bit error comes from.

This module is self-contained and method-agnostic. Its layout is one block per index of a
leading axis: a block is an (R, C) matrix (e.g. 32 tokens x head_dim), and every block keeps
the same number `count` of outliers, so the sparse part is two dense arrays per block:
  positions (..., count) uint16: row * C + column inside the block (R * C <= 65536),
  values    (..., count) in the block's dtype: the exact entries.
A fixed count per block makes the storage a plain array that grows with the cache; the paper
uses a threshold instead (a variable count, stored as CSR/CSC): see `select_outliers`.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.errors import QuantizerConfigError

MAX_BLOCK_ENTRIES = 1 << 16  # positions are uint16


def outlier_count(fraction: float, rows: int, cols: int) -> int:
    """Entries kept per (rows, cols) block for a target fraction (rounded to nearest)."""
    if not 0.0 <= fraction <= 1.0:
        raise QuantizerConfigError(f"outlier fraction={fraction!r} is invalid: allowed is 0..1")
    if rows * cols > MAX_BLOCK_ENTRIES:
        raise QuantizerConfigError(
            f"outlier block of {rows}x{cols} entries is too large: allowed is at most "
            f"{MAX_BLOCK_ENTRIES} entries (uint16 positions)"
        )
    return int(round(fraction * rows * cols))


def select_outliers(blocks: mx.array, count: int, axis: int) -> mx.array:
    """Positions of the `count` entries of each block that lie farthest from their vector.

    blocks: (..., R, C). `axis` is the axis (-2 or -1) along which a vector's statistics are
    taken: -2 measures each entry against its column (per-channel, for keys grouped over tokens),
    -1 against its row (per-token, for values). An entry's score is |x - mean| / std of its
    vector, i.e. a per-vector threshold in the paper's sense, but ranked over the whole block so
    the count is fixed. Returns uint16 positions (..., count), row-major inside the block.
    """
    return outlier_ranking(blocks, count, axis)[..., :count].astype(mx.uint16)


def outlier_ranking(blocks: mx.array, count: int, axis: int) -> mx.array:
    """The whole argpartition behind `select_outliers`: (..., R * C) uint32 entry indices of
    each block whose first `count` are select_outliers' positions, in the same order. A kernel
    can read those from this array in place (kvquant_encode_kernel.py), where the uint16 slice
    would cost a launch of its own."""
    # argpartition puts the `count` smallest of -score (largest scores) first; their order
    # does not matter to the method, but it is what is stored: keep this exact call.
    return mx.argpartition(outlier_scores(blocks, axis), kth=count - 1, axis=-1)


def outlier_scores(blocks: mx.array, axis: int) -> mx.array:
    """Each entry's outlier score, negated, one row per block: blocks (..., R, C) -> (..., R * C)
    float32 -|x - mean| / std (`select_outliers`): the outliers are a row's `count` smallest
    (outlier_ranking's argpartition, or outlier_select_kernel.py on CUDA)."""
    x = blocks.astype(mx.float32)
    # The vector's mean as mx.mean computes it (its sum times 1 / length), written twice: as
    # (1 / length) * sum - x, squared, for the variance and as x - sum * (1 / length) in the
    # score. The same values as one mean and x - mean (IEEE products commute, subtraction is
    # antisymmetric and squaring drops the sign), but distinct expressions, so that under
    # mx.compile each fuses into its own consumer instead of the mean and the centred entries
    # being written out once for both: one launch fewer per call on a GPU.
    total = x.sum(axis=axis, keepdims=True)
    inverse = 1.0 / x.shape[axis]
    # mx.multiply with the constant first: Python's `inverse * total` would call total * inverse
    # (the reflected product), the same op as the score's, which mx.compile would then share.
    mean_first = mx.multiply(mx.array(inverse, mx.float32), total)
    std = mx.sqrt(((mean_first - x) ** 2).mean(axis=axis, keepdims=True)) + 1e-6
    # Negated before the reshape, so that under mx.compile (kvquant's encoder) the negation
    # fuses with the score's other elementwise ops instead of costing a pass of its own.
    return (-(mx.abs(x - total * inverse) / std)).reshape(*x.shape[:-2], -1)


def gather_entries(blocks: mx.array, positions: mx.array) -> mx.array:
    """The entries of blocks (..., R, C) at positions (..., count) -> (..., count)."""
    flat = blocks.reshape(*blocks.shape[:-2], -1)
    return mx.take_along_axis(flat, positions.astype(mx.uint32), axis=-1)


def scatter_entries(blocks: mx.array, positions: mx.array, values: mx.array) -> mx.array:
    """A copy of blocks (..., R, C) with values (..., count) written at positions."""
    shape = blocks.shape
    flat = blocks.reshape(*shape[:-2], -1)
    flat = mx.put_along_axis(flat, positions.astype(mx.uint32), values.astype(flat.dtype), axis=-1)
    return flat.reshape(shape)


def replace_with_vector_mean(blocks: mx.array, positions: mx.array, axis: int) -> mx.array:
    """The dense part: outlier entries replaced by the mean of their vector's other entries,
    so they no longer stretch the dense quantizer's range (the paper zeroes them; after
    per-vector normalization a vector's mean is the neutral value, zero is not)."""
    x = blocks.astype(mx.float32)
    # The holes as a bool scatter (a quarter of the bytes of a float one); cast to 0.0 / 1.0 the
    # products and counts below are exactly those of a float mask.
    keep = scatter_entries(mx.ones(x.shape, mx.bool_), positions, mx.zeros(positions.shape, mx.bool_))
    weight = keep.astype(mx.float32)
    kept = (x * weight).sum(axis=axis, keepdims=True)
    n_kept = mx.maximum(weight.sum(axis=axis, keepdims=True), 1.0)
    fill = mx.broadcast_to(kept / n_kept, x.shape)
    return mx.where(keep, x, fill)
