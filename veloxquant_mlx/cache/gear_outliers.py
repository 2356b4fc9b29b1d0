"""GEAR's sparse part: the few entries that would stretch a quantization group, kept aside.

Per block of `nb` tokens of one head (an (nb, d) matrix), `count` entries are taken out before
quantizing and stored as (value, index) pairs; index = token_in_block * d + channel (uint16 while
nb * d <= 65536), a block's pairs in ascending index since session 29 (the CUDA decode kernel's
tiles read their own run of them: pairs_in_position_order). Their stored value is an additive
correction, so the cache's reconstruction is Q(D) + A B^T + S like the paper's X ~ D_hat + L + S,
and at those positions it returns the original entry up to the fp16 rounding of the correction.

The helpers below apply S to attention without densifying it: a gather of the query (or
probability) entries the outliers touch, then a scatter-add into the few columns they land on.
"""

from __future__ import annotations

import mlx.core as mx


def index_dtype(block_entries: int) -> mx.Dtype:
    return mx.uint16 if block_entries <= 1 << 16 else mx.uint32


def select_outliers(blocks: mx.array, group_means: mx.array, count: int):
    """blocks (..., nb, d) float32; group_means the same shape (each entry's quantization-group
    mean). Returns (index (..., count) int32 over nb * d, mask (..., nb, d) bool).

    Selected: the `count` entries farthest from their group's mean. For values (groups along d
    per token) this is GEAR's largest-magnitude filter around each token's centre; for keys
    (groups along tokens per channel) it skips channels whose large but steady offset the
    per-channel zero point already absorbs, and takes the entries that widen a group's range.
    """
    index = mx.argpartition(outlier_scores(blocks, group_means), kth=count - 1, axis=-1)[..., :count]
    return index.astype(mx.int32), outlier_mask(index, blocks.shape)


def outlier_scores(blocks: mx.array, group_means: mx.array) -> mx.array:
    """Each entry's distance from its group's mean, negated, one row per block: blocks (..., nb,
    d) -> (..., nb * d); the outliers are a row's `count` smallest (`select_outliers`'
    argpartition, or outlier_select_kernel.py on CUDA)."""
    nb, d = blocks.shape[-2:]
    # Negated before the reshape: under mx.compile (gear_encoder) it fuses with the distance.
    return (-mx.abs(blocks - group_means)).reshape(*blocks.shape[:-2], nb * d)


def outlier_mask(index: mx.array, shape: tuple) -> mx.array:
    """index (..., count) over nb * d -> bool (..., nb, d), True at the outliers."""
    mask = mx.zeros((*shape[:-2], shape[-2] * shape[-1]), mx.bool_)
    mask = mx.put_along_axis(mask, index, mx.array(True), axis=-1)
    return mask.reshape(shape)


def block_positions(index: mx.array, block_tokens: int, dim: int):
    """index (B, H, n_blocks, k) over nb * d -> (token (B, H, n_blocks * k), channel, same)."""
    B, H, n_blocks, k = index.shape
    index = index.astype(mx.int32)
    token = index // dim + (mx.arange(n_blocks, dtype=mx.int32) * block_tokens)[:, None]
    return token.reshape(B, H, n_blocks * k), (index % dim).reshape(B, H, n_blocks * k)


def scatter_add_last(target: mx.array, columns: mx.array, contrib: mx.array) -> mx.array:
    """target (B, H, M, N) + contrib (B, H, M, K) added at columns (B, H, K) of the last axis.

    Rows of the transposed target are scattered into, so duplicates accumulate (mx .at[].add).
    """
    B, H, M, N = target.shape
    K = columns.shape[-1]
    rows = (mx.arange(B * H, dtype=mx.int32).reshape(B, H, 1) * N + columns).reshape(-1)
    flat = target.swapaxes(-1, -2).reshape(B * H * N, M)
    flat = flat.at[rows].add(contrib.swapaxes(-1, -2).reshape(B * H * K, M))
    return flat.reshape(B, H, N, M).swapaxes(-1, -2)


def sparse_scores(q: mx.array, token, channel, values, scores: mx.array) -> mx.array:
    """scores[m, token_j] += q[m, channel_j] * value_j (q: (B, H, M, d))."""
    B, H, K = channel.shape
    where = mx.broadcast_to(channel[:, :, None, :], (B, H, q.shape[2], K))
    picked = mx.take_along_axis(q, where, axis=-1)
    return scatter_add_last(scores, token, picked * values[:, :, None, :].astype(q.dtype))


def sparse_weighted_values(p: mx.array, token, channel, values, out: mx.array) -> mx.array:
    """out[m, channel_j] += p[m, token_j] * value_j (p: (B, H, M, capacity))."""
    B, H, K = token.shape
    where = mx.broadcast_to(token[:, :, None, :], (B, H, p.shape[2], K))
    picked = mx.take_along_axis(p, where, axis=-1)
    return scatter_add_last(out, channel, picked * values[:, :, None, :].astype(p.dtype))


def add_block_entries(x: mx.array, index: mx.array, values: mx.array, block_tokens: int) -> mx.array:
    """x (B, H, n_tokens, dim) + the sparse part given per block (index (B, H, n_blocks, k) over
    block_tokens * dim, values the same shape), without a dense zero array of x's size: bit for
    bit `x + densify(*block_positions(index, ...), values, ...)`. A block's entries are
    contiguous in x's (n_tokens, dim) rows, so an entry's flat position is its block's start
    plus its index (no token / channel split). Off the outliers the dense sum is x + 0.0, which
    turns a -0.0 into +0.0 (a dequantized entry can be -0.0: mx.quantize's scales may be
    negative), so x + 0.0 is computed here too (fused with what made x under mx.compile); at an
    outlier (x + 0.0) + v equals x + (0.0 + v) for every x and v. One block's outliers are
    distinct entries, so the scatter adds each once."""
    B, H, n_tokens, dim = x.shape
    n_blocks = index.shape[2]
    starts = (mx.arange(B * H * n_blocks, dtype=mx.int32) * (block_tokens * dim)).reshape(B, H, n_blocks, 1)
    where = (starts + index.astype(mx.int32)).reshape(-1)
    flat = (x + 0.0).reshape(-1).at[where].add(values.reshape(-1).astype(x.dtype))
    return flat.reshape(x.shape)


def pairs_in_position_order(store: dict) -> dict:
    """`store` with each block's outlier pairs (`{k,v}_out_index`, `{k,v}_out_values`, blocks on
    the second-to-last axis) in ascending position, each value moved with its position: the
    order the encoder stores and the CUDA decode kernel's scan relies on
    (fused_decode_gear.SORTED_SCAN). A block's positions are distinct, so the order is unique."""
    out = dict(store)
    for s in ("k", "v"):
        if f"{s}_out_index" in store:
            order = mx.argsort(store[f"{s}_out_index"], axis=-1)
            out[f"{s}_out_index"] = mx.take_along_axis(store[f"{s}_out_index"], order, axis=-1)
            out[f"{s}_out_values"] = mx.take_along_axis(store[f"{s}_out_values"], order, axis=-1)
    return out


def densify(token, channel, values, n_tokens: int, dim: int, dtype) -> mx.array:
    """The sparse part as a dense (B, H, n_tokens, dim) array (what add_block_entries adds
    without making it; tests compare the two)."""
    B, H, K = token.shape
    flat = mx.zeros((B * H * n_tokens * dim,), dtype)
    where = (mx.arange(B * H, dtype=mx.int32).reshape(B, H, 1) * (n_tokens * dim) + token * dim + channel)
    flat = flat.at[where.reshape(-1)].add(values.reshape(-1).astype(dtype))
    return flat.reshape(B, H, n_tokens, dim)
