"""The placeholder an exact attention sink leaves in the quantized stream.

kivi and kvquant keep the first token(s) of the sequence exact beside their store (the sink takes
most of the attention mass and its entries are outliers). The codes still hold a column for
them, so the block that starts the sequence is quantized with each sink token replaced by the
first token after the sink: it then adds nothing to any group's range or statistics, and the
cache never reads those placeholder codes back.
"""

from __future__ import annotations

import mlx.core as mx


def with_sink_placeholder(x: mx.array, n_sink: int) -> mx.array:
    """x (B, H, T, D), T > n_sink, with tokens [0, n_sink) replaced by token n_sink."""
    return mx.concatenate([mx.repeat(x[:, :, n_sink : n_sink + 1], n_sink, axis=2), x[:, :, n_sink:]], axis=2)
