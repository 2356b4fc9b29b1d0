"""The MLX ops' outlier selection under outlier_select_kernel.py's rule, for comparisons with it.

mx.argpartition leaves to its implementation which of tied entries it picks and the order of
its first `count` (the CPU's nth_element); the selection kernel takes a stable ascending
argsort's first `count` (ties to the lower position, ascending order). Within `stable_argpartition()`
mx.argpartition is that argsort, a valid partition with the kernel's rule, so an encode through
the ops (a frozen reference, the same encoder with the kernels off) stores what the kernel's
does, bit for bit. The compiled encoders (whose traces hold the selection made at trace time)
are emptied before and after, so no trace of either kind outlives the block."""

from __future__ import annotations

from contextlib import contextmanager

import mlx.core as mx

from veloxquant_mlx.cache import gear_encoder, kvquant


def _clear_compiled() -> None:
    for module in (gear_encoder, kvquant):
        for f in vars(module).values():
            if callable(f) and hasattr(f, "cache_clear"):
                f.cache_clear()


@contextmanager
def stable_argpartition():
    saved = mx.argpartition
    _clear_compiled()
    mx.argpartition = lambda a, kth, axis=-1, stream=None: mx.argsort(a, axis=axis, stream=stream)
    try:
        yield
    finally:
        mx.argpartition = saved
        _clear_compiled()
