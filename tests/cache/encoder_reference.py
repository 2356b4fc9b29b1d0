"""The GEAR and KVQuant encoders as they were at main 2e28496, frozen, to check the faster ones.

The encoders in veloxquant_mlx/cache (gear.py, kvquant.py and their helpers) were rewritten for
speed with the promise that they store exactly what these did: the same codes, scales, zeros,
low-rank factors, codebooks, outlier positions (in the same order) and values, bit for bit.
tests/cache/test_encoder_identity.py compares the two on random and real-shaped data, and
tests/cache/bench_encoders.py times them side by side. Do not "fix" or speed up this file: it is
the specification of the stored bits.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.cache.gear_lowrank import POWER_STEPS, _orthonormal
from veloxquant_mlx.cache.gear_outliers import index_dtype
from veloxquant_mlx.cache.kvquant import MIN_SCALE, KVQuantCache
from veloxquant_mlx.cache.packing import pack_codes
from veloxquant_mlx.cache.sink import with_sink_placeholder

MAX_FIT_SAMPLES = 16384


# ---- GEAR ------------------------------------------------------------------------------------
def gear_select_outliers(blocks, group_means, count):
    nb, d = blocks.shape[-2:]
    flat = mx.abs(blocks - group_means).reshape(*blocks.shape[:-2], nb * d)
    index = mx.argpartition(-flat, kth=count - 1, axis=-1)[..., :count]
    mask = mx.zeros(flat.shape, mx.bool_)
    mask = mx.put_along_axis(mask, index, mx.array(True), axis=-1)
    return index.astype(mx.int32), mask.reshape(blocks.shape)


def low_rank_factors(residual, rank, steps=POWER_STEPS):
    n, d = residual.shape[-2:]
    start = mx.random.normal((d, rank), key=mx.random.key(0x6EA2))
    right = mx.broadcast_to(start, (*residual.shape[:-2], d, rank))
    left = None
    for _ in range(steps):
        left = _reference_orthonormal(residual @ right)
        right = residual.swapaxes(-1, -2) @ left
    return left, right


def _reference_orthonormal(y):
    rank = y.shape[-1]
    if rank > 8:
        return _orthonormal(y)  # LAPACK QR on the CPU stream, unchanged
    columns = []
    for j in range(rank):
        v = y[..., j : j + 1]
        for c in columns:
            v = v - c * mx.sum(c * v, axis=-2, keepdims=True)
        norm = mx.sqrt(mx.sum(v * v, axis=-2, keepdims=True))
        columns.append(v / mx.maximum(norm, 1e-20))
    return mx.concatenate(columns, axis=-1)


class ReferenceGEARCache(GEARCache):
    """GEARCache whose `_encode` is the one of main 2e28496 (which took the outliers' centres
    from the overridable `_selection_centres`, the group means by default)."""

    def _encode(self, keys, values):
        out = {}
        out.update(self._reference_side("k", keys.astype(mx.float32), per_channel=True))
        out.update(self._reference_side("v", values.astype(mx.float32), per_channel=False))
        return out

    def _reference_group_means(self, blocks, per_channel, weights=None):
        *lead, nb, d = blocks.shape
        g = self.code_group
        shape = (*lead, nb // g, g, d) if per_channel else (*lead, nb, d // g, g)
        axis = -2 if per_channel else -1
        x = blocks.reshape(shape)
        if weights is None:
            mean = mx.mean(x, axis=axis, keepdims=True)
        else:
            w = weights.reshape(shape)
            mean = mx.sum(x * w, axis=axis, keepdims=True) / mx.maximum(mx.sum(w, axis=axis, keepdims=True), 1)
        return mx.broadcast_to(mean, shape).reshape(blocks.shape)

    def _reference_side(self, s, x, per_channel):
        B, H, n, d = x.shape
        n_blocks, side, g = n // self.block_tokens, self.side_dtype, self.code_group
        blocks = x.reshape(B, H, n_blocks, self.block_tokens, d)
        count = self._outlier_count(d)
        dense = blocks
        if count:
            index, mask = gear_select_outliers(blocks, self._selection_centres(blocks, per_channel), count)
            fill = self._reference_group_means(blocks, per_channel, weights=(~mask).astype(mx.float32))
            dense = mx.where(mask, fill, blocks)
        dense = dense.reshape(B, H, n, d).astype(side)
        result = {}
        if per_channel:
            codes, scales, zeros = mx.quantize(dense.swapaxes(-1, -2), group_size=g, bits=self.code_bits)
            approx = self._dequantize(codes, scales, zeros).swapaxes(-1, -2)
            codes = codes.reshape(B, H, d, n // 32, self.code_bits)
        else:
            codes, scales, zeros = mx.quantize(dense, group_size=g, bits=self.code_bits)
            approx = self._dequantize(codes, scales, zeros)
        result[f"{s}_codes"], result[f"{s}_scales"], result[f"{s}_zeros"] = codes, scales, zeros
        approx = approx.reshape(blocks.shape)
        if self.rank:
            residual = dense.astype(mx.float32).reshape(blocks.shape) - approx
            tokens, channels = low_rank_factors(residual, self.rank)
            tokens, channels = tokens.astype(side), channels.astype(side)
            result[f"{s}_lr_tokens"] = tokens.reshape(B, H, n, self.rank)
            result[f"{s}_lr_channels"] = channels
            approx = approx + tokens.astype(mx.float32) @ channels.astype(mx.float32).swapaxes(-1, -2)
        if count:
            missing = (blocks - approx).reshape(B, H, n_blocks, self.block_tokens * d)
            result[f"{s}_out_values"] = mx.take_along_axis(missing, index, axis=-1).astype(side)
            result[f"{s}_out_index"] = index.astype(index_dtype(self.block_tokens * d))
        return result


# ---- KVQuant ---------------------------------------------------------------------------------
def kvquant_select_outliers(blocks, count, axis):
    x = blocks.astype(mx.float32)
    mean = x.mean(axis=axis, keepdims=True)
    std = mx.sqrt(((x - mean) ** 2).mean(axis=axis, keepdims=True)) + 1e-6
    score = (mx.abs(x - mean) / std).reshape(*x.shape[:-2], -1)
    top = mx.argpartition(-score, kth=count - 1, axis=-1)[..., :count]
    return top.astype(mx.uint16)


def gather_entries(blocks, positions):
    flat = blocks.reshape(*blocks.shape[:-2], -1)
    return mx.take_along_axis(flat, positions.astype(mx.uint32), axis=-1)


def replace_with_vector_mean(blocks, positions, axis):
    x = blocks.astype(mx.float32)
    shape = x.shape
    ones = mx.ones_like(x).reshape(*shape[:-2], -1)
    hole = mx.put_along_axis(ones, positions.astype(mx.uint32), mx.zeros(positions.shape), axis=-1).reshape(shape)
    kept = (x * hole).sum(axis=axis, keepdims=True)
    n_kept = mx.maximum(hole.sum(axis=axis, keepdims=True), 1.0)
    fill = mx.broadcast_to(kept / n_kept, x.shape)
    return mx.where(hole > 0, x, fill)


def nearest_level(x, levels):
    mids = (levels[..., 1:] + levels[..., :-1]) * 0.5
    expand = mids.reshape(*mids.shape[:-1], *([1] * (x.ndim - mids.ndim + 1)), mids.shape[-1])
    return (x[..., None] > expand).sum(axis=-1).astype(mx.uint8)


def fit_codebook(samples, n_levels, iterations=20):
    x = samples.astype(mx.float32)
    n = x.shape[-1]
    if n > MAX_FIT_SAMPLES:
        x = x[..., :: (n + MAX_FIT_SAMPLES - 1) // MAX_FIT_SAMPLES]
        n = x.shape[-1]
    ordered = mx.sort(x, axis=-1)
    picks = ((mx.arange(n_levels) + 0.5) * n / n_levels).astype(mx.int32)
    levels = mx.take(ordered, mx.minimum(picks, n - 1), axis=-1)
    one = mx.arange(n_levels)
    for _ in range(iterations):
        codes = nearest_level(x, levels)
        hits = (codes[..., None] == one).astype(mx.float32)
        counts = hits.sum(axis=-2)
        sums = (hits * x[..., None]).sum(axis=-2)
        levels = mx.where(counts > 0, sums / mx.maximum(counts, 1.0), levels)
        levels = mx.sort(levels, axis=-1)
    return levels


class ReferenceKVQuantCache(KVQuantCache):
    """KVQuantCache whose `_encode` is the one of main 2e28496."""

    def _encode(self, keys, values):
        B, H, n, _ = keys.shape
        G, nb = self.group_size, keys.shape[2] // self.group_size
        first = self.n_compressed == 0
        if first:
            self.store["sink_keys"] = mx.contiguous(keys[:, :, :1])
            self.store["sink_values"] = mx.contiguous(values[:, :, :1])
            keys, values = with_sink_placeholder(keys, 1), with_sink_placeholder(values, 1)
        kb = keys.reshape(B, H, nb, G, self.head_dim)
        vb = values.reshape(B, H, nb, G, self.value_dim)
        out = {}
        for prefix, blocks, axis in (("key", kb, -2), ("value", vb, -1)):
            count = self._outliers(blocks.shape[-1])
            dense = blocks.astype(mx.float32)
            if count:
                positions = kvquant_select_outliers(blocks, count, axis)
                out[f"{prefix}_outlier_position"] = positions
                out[f"{prefix}_outlier_value"] = gather_entries(blocks, positions).astype(self.dtype)
                dense = replace_with_vector_mean(dense, positions, axis)
            lo, hi = dense.min(axis=axis), dense.max(axis=axis)
            zero = ((hi + lo) * 0.5).astype(self.dtype)
            scale = mx.maximum((hi - lo) * 0.5, MIN_SCALE).astype(self.dtype)
            z32, s32 = zero.astype(mx.float32), scale.astype(mx.float32)
            if axis == -2:
                normalized = (dense - z32[..., None, :]) / s32[..., None, :]
            else:
                normalized = (dense - z32[..., None]) / s32[..., None]
            if first:
                self.store[f"{prefix}_codebook"] = fit_codebook(normalized.reshape(B, H, -1), 1 << self.code_bits)
            codes = nearest_level(normalized, self.store[f"{prefix}_codebook"])
            out[f"{prefix}_codes"] = pack_codes(codes.reshape(B, H, nb, -1), self.code_bits)
            if axis == -1:
                zero, scale = zero.reshape(B, H, nb * G), scale.reshape(B, H, nb * G)
            out[f"{prefix}_zero"], out[f"{prefix}_scale"] = zero, scale
        return out
