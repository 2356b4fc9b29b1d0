"""The algorithm of veloxquant_mlx/cache/fused_decode.py's CUDA kernels, in plain MLX ops.

The kernels split the compressed history into blocks of tokens, compute flash-decoding partials
per block and merge them with the exact window's; this module states the same arithmetic so the
CPU tests can check it against the portable attention path.

A split s of the history contributes (m_s, l_s, o_s): its largest score, the sum of
exp(score - m_s) and the values weighted by exp(score - m_s). With M the largest m over every
part (splits and window), softmax-attention is
    sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s,
the identity flash-decoding uses; an empty split has m = -inf, l = 0, o = 0 and drops out.
`reference_partials` computes the partials from decoded K/V.
"""

from __future__ import annotations

import mlx.core as mx


def merge_with_window(q, part_o, part_m, part_l, window_keys, window_values) -> mx.array:
    """q (B, H, R, D) scaled queries, partials (B, H, S, R, DV) / (B, H, S, R) in float32, the
    exact window (B, H, W, D) / (B, H, W, DV), W >= 1 -> attention output (B, H, R, DV) float32."""
    scores = (q @ window_keys.astype(q.dtype).swapaxes(-1, -2)).astype(mx.float32)
    m_w = scores.max(axis=-1)
    p_w = mx.exp(scores - m_w[..., None])
    o_w = (p_w.astype(q.dtype) @ window_values.astype(q.dtype)).astype(mx.float32)
    top = mx.maximum(part_m.max(axis=2), m_w)
    w_hist = mx.exp(part_m - top[:, :, None])
    w_win = mx.exp(m_w - top)
    num = (w_hist[..., None] * part_o).sum(axis=2) + w_win[..., None] * o_w
    den = (w_hist * part_l).sum(axis=2) + w_win * p_w.sum(axis=-1)
    return num / den[..., None]


def reference_partials(q, keys, values, n_valid: int, split: int):
    """Partials of q (B, H, R, D) over the first n_valid rows of decoded keys/values
    (B, H, T, D) / (B, H, T, DV), in splits of `split` tokens, float32."""
    B, H, R, _ = q.shape
    n_splits = -(-n_valid // split)
    pad = n_splits * split - n_valid
    k = keys[:, :, :n_valid].astype(mx.float32)
    v = values[:, :, :n_valid].astype(mx.float32)
    scores = q.astype(mx.float32) @ k.swapaxes(-1, -2)  # (B, H, R, n_valid)
    valid = mx.arange(n_splits * split) < n_valid
    if pad:
        scores = mx.concatenate([scores, mx.zeros((B, H, R, pad))], axis=-1)
        v = mx.concatenate([v, mx.zeros((B, H, pad, v.shape[-1]))], axis=2)
    scores = mx.where(valid, scores, -mx.inf).reshape(B, H, R, n_splits, split).swapaxes(2, 3)
    m = scores.max(axis=-1)  # (B, H, S, R)
    p = mx.where(valid.reshape(n_splits, 1, split), mx.exp(scores - m[..., None]), 0.0)
    o = p @ v.reshape(B, H, n_splits, split, -1)  # (B, H, S, R, DV)
    return o, m, p.sum(axis=-1)
