"""The algorithm of veloxquant_mlx/cache/fused_decode_rotated.py's CUDA kernel, in numpy.

The kernel cannot run on the CPU; this module performs its arithmetic step by step on the arrays
the kernel is handed (fused_decode_rotated.store_arrays / exact_sink / the window), so the CPU
tests can check it against the portable turboquant_rvq attention:
  * the codes are read the way the kernel reads them: keys in chunks of 32 channels (B words per
    chunk, code j at bit j * B, straddling words at 3 bits), values per lane of 16 channels up
    to 4 query rows and 8 above (fused_decode_rotated.channels_per_lane: the lane's words
    re-aligned with a funnel shift where its bits cross a word, else a plain shift; part of a
    sign word);
  * scores of compressed tokens in the kernel's form: per channel y = scale * code + (zero + a
    or zero - a by the sign bit), scores q_rot . y plus the bias q . key_mean; the sink's codes
    skipped;
  * partials (m, l, o) per block of `split` tokens, o summed in the rotated value basis and
    rotated back at the block's end; the exact block (sink, then window) against the
    unrotated query, in the original basis throughout;
  * the merge of fused_decode's kernel 2.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache import fused_decode_rotated as fdr
from veloxquant_mlx.cache.hadamard import rotate, unrotate

def _np(a) -> np.ndarray:
    return np.array(a.astype(mx.float32)) if a.dtype not in (mx.uint32,) else np.array(a)


def _code(words: list[np.ndarray], j: int, bits: int) -> np.ndarray:
    """vq_code<bits>(words, j): code j of an aligned little-endian stream held in `words`."""
    bit = j * bits
    wi, sh = bit >> 5, bit & 31
    v = words[wi].astype(np.uint64) >> np.uint64(sh)
    if sh + bits > 32:
        v |= words[wi + 1].astype(np.uint64) << np.uint64(32 - sh)
    return (v & np.uint64((1 << bits) - 1)).astype(np.float64)


def key_codes(words: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """(..., dim * bits / 32) stage-1 words -> (..., dim) codes, read per 32-channel chunk."""
    out = np.zeros(words.shape[:-1] + (dim,))
    for chunk in range(dim // 32):
        w = [words[..., chunk * bits + i] for i in range(bits)]
        for j in range(32):
            out[..., chunk * 32 + j] = _code(w, j, bits)
    return out


def value_codes(words: np.ndarray, bits: int, dim: int, channels: int = 16) -> np.ndarray:
    """(..., dim * bits / 32) stage-1 words -> (..., dim) codes, read per lane of `channels`
    channels: the lane's words from bit ch0 * bits on, clamped to the token; funnel-shifted
    into place where the lane's bits cross a word (one more word read), else shifted."""
    n_words = dim * bits // 32
    lane_bits = channels * bits
    na = (lane_bits + 31) // 32
    straddle = lane_bits % 32 != 0 and 32 % lane_bits != 0
    out = np.zeros(words.shape[:-1] + (dim,))
    for ch0 in range(0, dim, channels):
        bit0 = ch0 * bits
        w0, sh = bit0 >> 5, bit0 & 31
        raw = [words[..., min(w0 + i, n_words - 1)].astype(np.uint64) for i in range(na + straddle)]
        if straddle:
            aligned = [(((raw[i + 1] << np.uint64(32)) | raw[i]) >> np.uint64(sh)) & np.uint64(0xFFFFFFFF)
                       for i in range(na)]
        else:
            assert sh + lane_bits <= 32 * na, "a lane's bits inside its words"
            aligned = [raw[i] >> np.uint64(sh) for i in range(na)]
        for c in range(channels):
            out[..., ch0 + c] = _code(aligned, c, bits)
    return out


def sign_bits(words: np.ndarray, dim: int) -> np.ndarray:
    """(..., dim / 32) sign words -> (..., dim) bits 0/1, as the kernel shifts them out."""
    out = np.zeros(words.shape[:-1] + (dim,))
    for d in range(dim):
        out[..., d] = (words[..., d >> 5].astype(np.uint64) >> np.uint64(d & 31)) & np.uint64(1)
    return out


def _stage1(codes_words, scales, zeros, stage1_bits: int, dim: int, group: int, reader):
    """(codes (..., dim), per-channel scale, per-channel zero) of stage 1 as the kernel forms
    them: a sign stage 1 is scale 2a, zero -a over the whole vector."""
    if stage1_bits == 1:
        a = _np(scales)
        codes = sign_bits(np.array(codes_words), dim)
        return codes, np.repeat(2 * a, dim, axis=-1), np.repeat(-a, dim, axis=-1)
    codes = reader(np.array(codes_words), stage1_bits, dim)
    return codes, np.repeat(_np(scales), group, axis=-1), np.repeat(_np(zeros), group, axis=-1)


def rotated_values(cache, stores, rows: int) -> np.ndarray:
    """(B, H, cap, DV) rotated values as the value lanes decode them (stage 1 + stage 2) at
    `rows` query rows per kv head (which sets the lanes' channels)."""
    vb1 = cache.value_bits - 1
    dv = cache.value_dim
    _, _, _, _, _, vc1, vs1, vz1, vc2, vm2 = stores
    y = np.where(sign_bits(np.array(vc2), dv) > 0, 1.0, -1.0) * _np(vm2)
    if vb1:
        channels = fdr.channels_per_lane(rows)
        reader = lambda w, b, d: value_codes(w, b, d, channels)  # noqa: E731
        codes, sc, zp = _stage1(vc1, vs1, vz1, vb1, dv, cache._group(dv), reader)
        y = y + sc * codes + zp
    return y


def compressed_scores(cache, q_rot: np.ndarray, bias: np.ndarray, stores) -> np.ndarray:
    """(B, H, R, cap) scores as the kernel forms them: y = scale * code + (zero +- a)."""
    kb1 = cache.key_bits - 1
    d = cache.head_dim
    kc1, ks1, kz1, kc2, km2 = stores[:5]
    a2 = _np(km2)  # (B, H, cap, 1)
    y = np.where(sign_bits(np.array(kc2), d) > 0, a2, -a2)
    if kb1:
        codes, sc, zp = _stage1(kc1, ks1, kz1, kb1, d, cache._group(d), key_codes)
        y = sc * codes + (zp + y)
    return q_rot @ y.swapaxes(-1, -2) + bias


def _partial(scores: np.ndarray, values: np.ndarray):
    """(m, l, o) of scores (B, H, R, n) over values (B, H, n, DV)."""
    m = scores.max(-1)
    p = np.exp(scores - m[..., None])
    return m, p.sum(-1), p @ values


def reference_step(cache, queries: mx.array, scale: float, split: int) -> np.ndarray:
    """A decode step's attention (B, Hq, 1, DV) float64 by the kernel's algorithm, with history
    blocks of `split` tokens."""
    B, n_q_heads, _, D = queries.shape
    H = cache.n_kv_heads
    R = n_q_heads // H
    q = (queries.astype(mx.float32) * scale).reshape(B, H, R, D)
    q_rot = np.array(rotate(q, cache._signs[0]), dtype=np.float64)
    qx = np.array(q, dtype=np.float64)
    bias = qx @ _np(cache.key_mean).swapaxes(-1, -2)  # (B, H, R, 1)
    stores = fdr.store_arrays(cache)
    sink = fdr.exact_sink(cache)
    n_sink = 0 if sink is None else sink[0].shape[2]
    n_valid = cache.n_compressed

    scores = compressed_scores(cache, q_rot, bias, stores)
    values = rotated_values(cache, stores, R)
    parts = []
    for start in range(n_sink, n_valid, split):
        stop = min(start + split, n_valid)
        m, l, o_rot = _partial(scores[..., start:stop], values[:, :, start:stop])
        o = np.array(unrotate(mx.array(o_rot.astype(np.float32)), cache._signs[1]), dtype=np.float64)
        parts.append((m, l, o))
    # The exact block: sink then window, unrotated query, original basis.
    ek = _np(cache.window_keys.astype(queries.dtype))
    ev = _np(cache.window_values.astype(queries.dtype))
    if sink is not None:
        ek = np.concatenate([_np(sink[0]), ek], axis=2)
        ev = np.concatenate([_np(sink[1]), ev], axis=2)
    parts.append(_partial(qx @ ek.swapaxes(-1, -2), ev))

    top = np.max([m for m, _, _ in parts], axis=0)
    num = sum(np.exp(m - top)[..., None] * o for m, _, o in parts)
    den = sum(np.exp(m - top) * l for m, l, _ in parts)
    return (num / den[..., None]).reshape(B, n_q_heads, 1, -1)
