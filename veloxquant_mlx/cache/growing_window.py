"""An exact window that grows in place, for layers whose window is their whole history.

Why: the base cache appends each step's K/V to its exact window with mx.concatenate, a copy of
the window. For a compressing layer that window is at most residual + block tokens, but
MiniCache's "plain" layers (below `minicache_start_fraction`, and an unpaired last layer) never
compress: their window is the whole context, so every decode step copied it whole (at 32K
tokens, 8 KV heads, head_dim 128, bf16: 134 MB per layer and step), and their decode attention
took the explicit-scores path. On the H200 minicache decoded at 0.39x the fp16 cache's speed
at 32K (results/gpu_speed_h200.json) with half its layers plain.

`GrowingWindowMixin` keeps such a window the way mlx-lm's KVCache keeps its K/V: a buffer with
slack, grown `step` tokens at a time, written by slice at each update; `window_keys` /
`window_values` read it as views of the filled part (made on each read and not held, so MLX
can write the next step's slice in place). Whatever the base assigns to them (trim, a state
load) becomes the new buffer. `_attend_whole_window` is the fused mx.fast attention over it.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache import window_buffer


class GrowingWindowMixin:
    """Window storage as a buffer plus a filled length; a subclass decides when to use
    `_append_in_place` (instead of the base's concatenation) and `_attend_whole_window`."""

    window_step = 256  # tokens of slack added per growth, as mlx-lm's KVCache

    # Keys and values each keep their own filled length: the base assigns them one after the
    # other (keys first), and reads the values' old length while doing so.
    # The filled part's view is made once per window change and kept until the next one (a step
    # reads the window ~7 times, if only to test it for None: each read was a slice op, ~1 us of
    # host each); _append_in_place drops the views before it writes, so that none of ours holds
    # the buffer and MLX can write the slice in place.
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
        held = window_buffer.current(self)  # a paired layer's decode window in place (base.py)
        if held is not None:
            return total + held[0].nbytes + held[1].nbytes
        for name in ("_window_k", "_window_v"):
            buffer = self.__dict__.get(name)
            total += 0 if buffer is None else buffer.nbytes
        return total

    def _window_length(self) -> int:
        return self.__dict__.get("_window_nk", 0) if self.__dict__.get("_window_k") is not None else 0

    def _append_in_place(self, keys: mx.array, values: mx.array) -> None:
        """Write keys / values (B, H, L, D) after the filled part, growing the buffer first
        when it lacks room."""
        self.__dict__.pop("_window_view_k", None)
        self.__dict__.pop("_window_view_v", None)
        n, L = self._window_length(), keys.shape[2]
        buf_k, buf_v = self.__dict__.get("_window_k"), self.__dict__.get("_window_v")
        if buf_k is None or n + L > buf_k.shape[2] or buf_k.dtype != keys.dtype:
            capacity = -(-(n + L) // self.window_step) * self.window_step
            buf_k, buf_v = window_buffer.buffers_holding(
                keys, values, capacity, (buf_k[:, :, :n], buf_v[:, :, :n]) if n else None)
        buf_k[:, :, n : n + L] = keys
        buf_v[:, :, n : n + L] = values
        self.__dict__.update(_window_k=buf_k, _window_v=buf_v, _window_nk=n + L, _window_nv=n + L)

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
