"""KVQuant's attention products over its compressed form, as compiled pure functions.

scores(q) = q K^T and weighted_values(p) = p V over the whole capacity, read chunk by chunk of
`chunk_blocks` blocks (at most KVQuantCache.decode_chunk_tokens tokens): each chunk's codes are
unpacked and looked up in the per-head codebook (levels, float32); the chunk's outliers and (in
chunk 0) the sink are written into those levels in codebook units, (exact - zero) / scale; then
the keys' per-channel block scales are folded into the query (one small product per block) and
the values' per-token scales into the probabilities, with the zeros as one extra sum. The
transient is one chunk of levels, whatever the context; K and V are never materialized.
`decode_key_blocks` / `decode_value_blocks` give the same K/V decoded (trim, unpatched use).

Why this shape (measured on the CPU, one layer, 8 KV heads x head_dim 128, 8K tokens; see
python -m veloxquant_mlx.bench.ops):
  - codes are unpacked to uint8 in one fused kernel (mx.compile) and the padding slice is taken
    on those indices, not on the gathered floats: the eager uint32 shift-and-mask plus a copy of
    the sliced float32 levels cost more than the codebook gather itself;
  - the outliers are put into the levels (unique positions, no accumulation) instead of being
    scatter-added into the (rows x tokens) scores or the (rows x head_dim) output, whose
    broadcast index arrays cost ~20% of a step; likewise the sink, so neither the scores nor the
    probabilities are concatenated per step;
  - folding the scales into q and p saves a full pass over the chunk (levels * scale + zero)
    that costs more than the 128 small per-block products it replaces (measured ~2x);
  - slack capacity is read as well: its scales and zeros are zero, so it contributes exactly 0
    (and the base masks it), and the shapes change only when the capacity grows, so one trace
    serves `step` tokens of decoding;
  - mx.compile also removes the per-op Python overhead, which dominates on the GPU (the former
    eager version issued hundreds of small ops per layer per step).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache.nonuniform_codebook import lookup_packed, lookup_table


def decode_key_blocks(codes, scale, zero, codebook, b0, b1, bits, group, dim, sparse=None, sink=None, table=None,
                      product_apart=False):
    """Keys of blocks [b0, b1) as float32 (B, H, (b1 - b0) * group, dim): codebook levels times
    each block's channel scale plus its zero, exact outliers written over their entries and,
    when given (b0 == 0), the exact sink over token 0. `product_apart`: see `_apart`."""
    B, H = codes.shape[:2]
    u = lookup_packed(codebook, codes[:, :, b0:b1], bits, group * dim, table)
    k = u.reshape(B, H, b1 - b0, group, dim) * scale[:, :, b0:b1, None].astype(mx.float32)
    k = _apart(k, product_apart) + zero[:, :, b0:b1, None].astype(mx.float32)
    return _finish(k.reshape(B, H, b1 - b0, group * dim), b0, b1, group, dim, sparse, sink)


def decode_value_blocks(codes, scale, zero, codebook, b0, b1, bits, group, dim, sparse=None, sink=None, table=None,
                        product_apart=False):
    """Values of blocks [b0, b1) as float32 (B, H, (b1 - b0) * group, dim): codebook levels times
    each token's scale plus its zero, with the exact outliers and sink as for the keys."""
    B, H = codes.shape[:2]
    t0, t1 = b0 * group, b1 * group
    u = lookup_packed(codebook, codes[:, :, b0:b1], bits, group * dim, table)
    v = u.reshape(B, H, t1 - t0, dim) * scale[:, :, t0:t1, None].astype(mx.float32)
    v = _apart(v, product_apart) + zero[:, :, t0:t1, None].astype(mx.float32)
    return _finish(v.reshape(B, H, b1 - b0, group * dim), b0, b1, group, dim, sparse, sink)


def _apart(product: mx.array, apart: bool) -> mx.array:
    """The scaled levels, written out before the zero is added when `apart`. Under mx.compile
    `levels * scale + zero` fuses into one kernel, which nvrtc (--fmad=true) may contract into
    an FMA: one rounding where the eager ops round twice, so other bits. mx.contiguous ends
    the fused kernel (checked: the compiled graph then holds a Multiply kernel, Contiguous and
    an Add kernel, tests/cache/test_kvquant_prefill.py) and the add reads the rounded product
    from memory; on an already contiguous product it shares the buffer (no copy). mx.stop_gradient
    does not: compile drops it and fuses across."""
    return mx.contiguous(product) if apart else product


def _finish(flat, b0, b1, group, dim, sparse, sink):
    B, H = flat.shape[:2]
    if sparse is not None:
        # Positions are unique within a block: a plain put, no accumulation.
        positions, exact = sparse
        flat = mx.put_along_axis(
            flat, positions[:, :, b0:b1].astype(mx.uint32), exact[:, :, b0:b1].astype(mx.float32), axis=-1
        )
    x = flat.reshape(B, H, (b1 - b0) * group, dim)
    if sink is not None:
        x[:, :, :1] = sink.astype(mx.float32)
    return x


def chunks(n_blocks: int, chunk_blocks: int) -> list[tuple[int, int]]:
    """(first block, last block) ranges of at most chunk_blocks blocks covering n_blocks."""
    return [(b, min(b + chunk_blocks, n_blocks)) for b in range(0, n_blocks, chunk_blocks)]


def _normalized(exact, scale, zero):
    """An exact entry in its vector's codebook units, (exact - zero) / scale, so that the
    attention's scale-and-zero folding returns it; 0 in growth slack (scale 0 there)."""
    scale = scale.astype(mx.float32)
    safe = mx.where(scale > 0, scale, 1.0)
    return mx.where(scale > 0, (exact.astype(mx.float32) - zero.astype(mx.float32)) / safe, 0.0)


def _levels_with_exact(codes, table, b0, b1, bits, group, dim, scale_at, zero_at, sparse, sink, sink_scale, sink_zero):
    """Codebook levels (B, H, blocks, group * dim) of blocks [b0, b1) with the outliers and the
    sink written in as normalized values. scale_at / zero_at(row, col) give the scale and zero
    of each outlier (uint32 row-in-block and column arrays)."""
    B, H = codes.shape[:2]
    u = lookup_packed(None, codes[:, :, b0:b1], bits, group * dim, table)
    if sparse is not None:
        positions, exact = sparse
        pos = positions[:, :, b0:b1].astype(mx.uint32)
        row, col = pos // dim, pos % dim
        u = mx.put_along_axis(u, pos, _normalized(exact[:, :, b0:b1], scale_at(row, col), zero_at(row, col)), axis=-1)
    if sink is not None:
        u[:, :, :1, :dim] = _normalized(sink, sink_scale, sink_zero).reshape(B, H, 1, dim)
    return u


@lru_cache(maxsize=None)
def scores_function(bits: int, group: int, dim: int, chunk_blocks: int, outliers: bool):
    """Compiled (q, codes, scale, zero, codebook, sink, [positions, exact]) -> (B, H, R, capacity)
    float32 scores; q (B, H, R, dim) already scaled, codes (B, H, blocks, W), scale and zero
    (B, H, blocks, dim) per channel of each block.

    Each block's channel scales are folded into the query (R x dim multiplies per block instead
    of group x dim), so the codebook levels go straight into one batched product per block."""

    def scores(q, codes, scale, zero, codebook, sink, *sparse):
        B, H, R, D = q.shape
        q = q.astype(mx.float32)
        table = lookup_table(codebook, bits, group * dim)
        parts = []
        for b0, b1 in chunks(codes.shape[2], chunk_blocks):
            sc = scale[:, :, b0:b1].astype(mx.float32)
            ze = zero[:, :, b0:b1].astype(mx.float32)
            u = _levels_with_exact(
                codes, table, b0, b1, bits, group, dim,
                lambda row, col: mx.take_along_axis(sc, col, axis=-1),
                lambda row, col: mx.take_along_axis(ze, col, axis=-1),
                sparse if outliers else None,
                sink if b0 == 0 else None, sc[:, :, :1], ze[:, :, :1],
            )
            qs = q[:, :, None] * sc[:, :, :, None]  # (B, H, blocks, R, dim)
            # levels (group x dim) @ qs^T per block: measured ~30% faster on the CPU than
            # qs @ levels^T (the big operand untransposed), same products.
            s = u.reshape(B, H, b1 - b0, group, dim) @ qs.swapaxes(-1, -2)  # (B, H, blocks, group, R)
            s = s + (q[:, :, None] * ze[:, :, :, None]).sum(-1)[:, :, :, None]
            parts.append(s.transpose(0, 1, 4, 2, 3).reshape(B, H, R, (b1 - b0) * group))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)

    return mx.compile(scores)


@lru_cache(maxsize=None)
def values_function(bits: int, group: int, dim: int, chunk_blocks: int, outliers: bool):
    """Compiled (p, codes, scale, zero, codebook, sink, [positions, exact]) -> (B, H, R, dim)
    float32; p (B, H, R, capacity), codes (B, H, blocks, W), scale and zero (B, H, capacity)
    per token. Each token's scale is folded into its probability, its zero into one sum."""

    def weighted_values(p, codes, scale, zero, codebook, sink, *sparse):
        B, H, R, _ = p.shape
        p = p.astype(mx.float32)
        table = lookup_table(codebook, bits, group * dim)
        out = None
        for b0, b1 in chunks(codes.shape[2], chunk_blocks):
            t0, t1 = b0 * group, b1 * group
            sc = scale[:, :, t0:t1].astype(mx.float32)
            ze = zero[:, :, t0:t1].astype(mx.float32)
            blocks_sc = sc.reshape(B, H, b1 - b0, group)
            blocks_ze = ze.reshape(B, H, b1 - b0, group)
            u = _levels_with_exact(
                codes, table, b0, b1, bits, group, dim,
                lambda row, col: mx.take_along_axis(blocks_sc, row, axis=-1),
                lambda row, col: mx.take_along_axis(blocks_ze, row, axis=-1),
                sparse if outliers else None,
                sink if b0 == 0 else None, sc[:, :, :1, None], ze[:, :, :1, None],
            )
            pc = p[..., t0:t1]
            part = (pc * sc[:, :, None]) @ u.reshape(B, H, t1 - t0, dim)
            part = part + (pc * ze[:, :, None]).sum(-1, keepdims=True)
            out = part if out is None else out + part
        return out

    return mx.compile(weighted_values)
