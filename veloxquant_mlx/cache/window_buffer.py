"""A decode step's token written into the exact window in place (base.DECODE_WINDOW_IN_PLACE).

Why: the base cache appends each step's K/V to its window by concatenation, a copy of the window
and of the token: 2 launches per array and step. Session 20's Nsight profile of a 32K decode
step on the H200 (results/ncu_decode_h200_s20_boost.json) has those 4 copies at ~2.9 us each
against the fp16 KVCache's 2 slice writes; our per-layer step is ~20-26 us of device time above
fp16's, ~6 us of it these copies. Written in place (as mlx-lm's KVCache writes its buffer) a
step costs 2 launches, and the decode kernels read the buffer as it is: its filled rows come as
a separate input (fused_decode.window_rows), so no contiguous copy of a sliced view is made.

The buffers live in cache.__dict__["_window_buffers"] as (keys buffer, values buffer, keys view,
values view, filled rows, capacity, keys dtype, values dtype), the views being what the cache's
window_keys / window_values hold; the numbers and dtypes are kept as Python values because
reading an array's shape or dtype is a call into MLX (~0.15 us each, at every layer and step
of a host-bound decode). They are
current only while those attributes are still these very views: whatever else assigns the
window (a flush's remainder, a trim, a state load, a prefill chunk's concatenation) makes them
stale, and the next decode step builds new ones from the window as it then is. Capacity: the
residual and one block (the most a window holds between two flushes), so the slack, which
`nbytes` counts as mlx-lm's KVCache counts its own, is under one block.
"""

from __future__ import annotations

import mlx.core as mx


def current(cache):
    """(keys buffer, values buffer, filled rows) while the cache's window is the buffers' view,
    else None."""
    return buffers_of(held(cache))


def buffers_of(entry):
    """(keys buffer, values buffer, filled rows) of held()'s tuple, or None for None."""
    return None if entry is None else (entry[0], entry[1], entry[4])


def held(cache):
    """The buffers' whole tuple (keys buffer, values buffer, keys view, values view, filled
    rows, capacity, keys dtype, values dtype) while the cache's window is the buffers' view, else
    None: a decode step's launch reads the rows and dtypes from it without calls into MLX."""
    entry = cache.__dict__.get("_window_buffers")
    if entry is None or entry[2] is not cache.window_keys or entry[3] is not cache.window_values:
        return None
    return entry


def append_token(cache, keys: mx.array, values: mx.array) -> None:
    """Write one step's keys / values (B, H, 1, D) after the window's filled rows, in the
    buffers (built or grown first where they are stale or full); the window becomes the view of
    the filled rows."""
    entry = held(cache)
    if entry is None:
        n = cache.window_keys.shape[2]
        buf_k, buf_v, capacity = _new_buffers(cache, keys, values, n)
    else:
        n, capacity = entry[4], entry[5]
        if n + 1 > capacity or entry[6] != keys.dtype or entry[7] != values.dtype:
            buf_k, buf_v, capacity = _new_buffers(cache, keys, values, n)
        else:
            buf_k, buf_v = entry[0], entry[1]
    # MLX writes a slice in place only into a buffer nothing else holds (else it copies the
    # whole buffer first): every view of ours goes before the write.
    entry = None
    cache.__dict__.pop("_window_buffers", None)
    cache.window_keys = cache.window_values = None
    buf_k[:, :, n : n + 1] = keys
    buf_v[:, :, n : n + 1] = values
    view_k, view_v = buf_k[:, :, : n + 1], buf_v[:, :, : n + 1]
    cache.window_keys, cache.window_values = view_k, view_v
    cache.__dict__["_window_buffers"] = (buf_k, buf_v, view_k, view_v, n + 1, capacity, buf_k.dtype, buf_v.dtype)


def _new_buffers(cache, keys: mx.array, values: mx.array, n: int):
    """(keys buffer, values buffer, capacity) holding the cache's window of n rows, typed as the
    step's token, with room for the residual and one block."""
    capacity = max(n + 1, cache.residual_length + cache.block_size)
    buf_k, buf_v = buffers_holding(keys, values, capacity, (cache.window_keys, cache.window_values))
    return buf_k, buf_v, capacity


def buffers_holding(keys: mx.array, values: mx.array, capacity: int, rows=None):
    """New keys / values buffers of `capacity` rows per head, shaped (batch, heads, dims) and
    typed as `keys` / `values` (a step's tokens), holding `rows` = (keys, values) first when
    given (growing_window.py's growth too)."""
    B, H, _, D = keys.shape
    buf_k = mx.zeros((B, H, capacity, D), dtype=keys.dtype)
    buf_v = mx.zeros((B, H, capacity, values.shape[3]), dtype=values.dtype)
    if rows is not None:
        n = rows[0].shape[2]
        buf_k[:, :, :n] = rows[0].astype(keys.dtype)
        buf_v[:, :, :n] = rows[1].astype(values.dtype)
    return buf_k, buf_v


def nbytes(cache) -> int:
    """The window's bytes: its buffers whole while they are current (slack included), else the
    window's arrays."""
    buffers = current(cache)
    if buffers is not None:
        return buffers[0].nbytes + buffers[1].nbytes
    if cache.window_keys is None:
        return 0
    return cache.window_keys.nbytes + cache.window_values.nbytes
