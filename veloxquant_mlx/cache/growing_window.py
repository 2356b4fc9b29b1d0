"""The exact window as a buffer that grows in place: every cache's, as mlx-lm's KVCache keeps K/V.

Why: the base cache appended each decode step's K/V to its exact window with mx.concatenate, a
copy of the whole window, twice per layer and step (keys, values): two copy kernels each on
MLX's CUDA backend, 1.43 + 7.50 us of host per concatenation against 1.96 + 2.46 for a one-token
slice write into a buffer (results/launch_cost_h200_s8.json), where the decode step is bound by
the host. MiniCache's "plain" layers (below `minicache_start_fraction`, and an unpaired last
layer) never compress: their window is the whole context, so each step copied it whole (at 32K
tokens, 8 KV heads, head_dim 128, bf16: 134 MB per layer and step); they were the first users.

`GrowingWindowMixin` keeps the window as a buffer with slack, grown `window_step` tokens at a
time, written by slice at each one-token update (`_append_in_place`; a prefill chunk still
concatenates); `window_keys` / `window_values` read it as views of the filled part, made once
per window change. Whatever a cache assigns to them (a flush's remainder, trim, a state load)
becomes the new buffer. The decode kernels read the buffers whole with the length apart
(`window_buffers`, fused_decode.window_count): a view of the filled part is not contiguous and
MLX would copy it. `_attend_whole_window` is the fused mx.fast attention over the window.
"""

from __future__ import annotations

import mlx.core as mx


class GrowingWindowMixin:
    """Window storage as a buffer plus a filled length; the cache decides when to use
    `_append_in_place` (the base: at every one-token step) and `_attend_whole_window`."""

    # Tokens of slack added per growth. A compressing layer's window is at most residual + one
    # block, and each flush makes it exact again (the setter): 32 keeps the slack small.
    window_step = 32

    # Keys and values each keep their own filled length: the base assigns them one after the
    # other (keys first), and reads the values' old length while doing so.
    # The filled part's view is made once per window change and kept until the next one (a step
    # reads the window ~7 times, if only to test it for None: each read was a slice op, ~1 us of
    # host each); _append_in_place drops them with its write, so that none of ours holds the
    # buffer when MLX runs the write and it can write the slice in place.
    @property
    def window_keys(self):
        view = self.__dict__.get("_window_view_k", _UNSET)
        if view is _UNSET:
            view = _filled(self.__dict__.get("_window_k"), self.__dict__.get("_window_nk", 0))
            self.__dict__["_window_view_k"] = view
        return view

    @window_keys.setter
    def window_keys(self, array):
        self.__dict__["_window_k"] = array
        self.__dict__["_window_nk"] = 0 if array is None else array.shape[2]
        self.__dict__.pop("_window_view_k", None)

    @property
    def window_values(self):
        view = self.__dict__.get("_window_view_v", _UNSET)
        if view is _UNSET:
            view = _filled(self.__dict__.get("_window_v"), self.__dict__.get("_window_nv", 0))
            self.__dict__["_window_view_v"] = view
        return view

    @window_values.setter
    def window_values(self, array):
        self.__dict__["_window_v"] = array
        self.__dict__["_window_nv"] = 0 if array is None else array.shape[2]
        self.__dict__.pop("_window_view_v", None)

    @property
    def nbytes(self) -> int:
        """The store plus the window's buffers, slack included (as mlx-lm's KVCache counts)."""
        total = sum(a.nbytes for a in self.store.values())
        for name in ("_window_k", "_window_v"):
            buffer = self.__dict__.get(name)
            total += 0 if buffer is None else buffer.nbytes
        return total

    def window_buffers(self):
        """(keys buffer, values buffer, filled length): the window as a decode kernel reads it,
        the buffers whole (B, H, capacity, D / DV), slack included."""
        return self.__dict__.get("_window_k"), self.__dict__.get("_window_v"), self.__dict__.get("_window_nk", 0)

    def _has_window(self) -> bool:
        """Whether a window is held (possibly empty): read without making a view."""
        return self.__dict__.get("_window_k") is not None

    def _window_length(self) -> int:
        return self.__dict__.get("_window_nk", 0) if self.__dict__.get("_window_k") is not None else 0

    def _append_in_place(self, keys: mx.array, values: mx.array) -> None:
        """Write keys / values (B, H, L, D) after the filled part, growing the buffer first
        when it lacks room."""
        buf_k, buf_v = self.__dict__.get("_window_k"), self.__dict__.get("_window_v")
        n, L = (0 if buf_k is None else self.__dict__.get("_window_nk", 0)), keys.shape[2]
        if buf_k is None or n + L > buf_k.shape[2] or buf_k.dtype != keys.dtype:
            capacity = -(-(n + L) // self.window_step) * self.window_step
            B, H = keys.shape[:2]
            new_k = mx.zeros((B, H, capacity - n, keys.shape[3]), keys.dtype)
            new_v = mx.zeros((B, H, capacity - n, values.shape[3]), values.dtype)
            if n:
                new_k = mx.concatenate([buf_k[:, :, :n].astype(keys.dtype), new_k], axis=2)
                new_v = mx.concatenate([buf_v[:, :, :n].astype(values.dtype), new_v], axis=2)
            buf_k, buf_v = new_k, new_v
        buf_k[:, :, n : n + L] = keys
        buf_v[:, :, n : n + L] = values
        self.__dict__.update(_window_k=buf_k, _window_v=buf_v, _window_nk=n + L, _window_nv=n + L)
        # The old views are stale, and they hold the buffer: MLX writes the slice in place only
        # when nothing else does by the time it runs.
        self.__dict__.pop("_window_view_k", None)
        self.__dict__.pop("_window_view_v", None)

    def _attend_whole_window(self, queries: mx.array, scale: float, mask) -> mx.array:
        """The fused attention over the whole exact window (GQA handled by the kernel). mask:
        None or "causal" (a chunk of L > 1 queries is the window's last L positions)."""
        L = queries.shape[2]
        if mask is None and L > 1:
            mask = "causal"  # the base's convention: no mask means causal over the history
        keys, values = self.window_keys, self.window_values
        return mx.fast.scaled_dot_product_attention(
            queries, keys.astype(queries.dtype), values.astype(queries.dtype), scale=scale, mask=mask
        )


_UNSET = object()


def _filled(buffer, n: int):
    if buffer is None or n == buffer.shape[2]:
        return buffer
    return buffer[:, :, :n]
