"""Packed codes split into planes: plane j holds the j-th code of every byte (or 3-bit field) of
each row, centered (code - midpoint(bits)) as float32, so that a row's coordinate k * u + j is
plane j's column u.

Why planes and not the rows themselves: on the CPU, MLX's compiled elementwise kernels run fast
over contiguous arrays with scalar constants, and ~5x slower as soon as an input broadcasts (a
vector of shifts against each word, as unpacking whole rows needs). On this project's VM, one
core, 1M codes (session 39, scripts not kept): `(u >> 3) & 7` as float32 over contiguous words
129 us; the same with a vector of 8 shifts broadcast against each field 705 us (593 us with
both inputs contiguous: the per-element shift itself is slow); a broadcast float multiply-add
639 us. Each plane here is one contiguous pass with scalar shifts, so the unpacking costs about
what a copy of the codes as float32 costs, and a product over the rows becomes one small BLAS
product per plane (cache/unpacked_products.py).

Why centered: a product over affine codes applies the scale to the codes' sum and the bias to the
queries' (or probabilities') sum, two terms that cancel where the values sit near zero: a sign
plane's a (2b - 1) is 2a b + (-a), whose two sums over 8192 tokens cancelled to an error of
2e-5 of the largest output in float32 (tests/cache/test_sign_plane.py). With the codes centered
the bias becomes b + s * midpoint, the group's middle value (exactly 0 for a sign plane), and the
codes are symmetric about zero (exact in float32: halves of small integers).

Layouts (MLX's mx.quantize stream, as the caches store it): `words` (..., T, W) uint32, each row
packed from the low bits up, little-endian. Widths 1, 2, 4 and 8 are read byte by byte (8 / bits
codes per byte: byte u of a row holds its codes k * u .. k * u + k - 1); width 3 packs 8 codes
per 3 bytes, read as one 24-bit field per 8 codes. Width 1 is a sign plane's bits (bit j of word
w is coordinate 32 w + j: byte 4 w + j // 8, bit j % 8).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

SUPPORTED_BITS = (1, 2, 3, 4, 8)


def midpoint(bits: int) -> float:
    """The middle of the codes' range, subtracted from every code: (2^bits - 1) / 2."""
    return ((1 << bits) - 1) / 2


def per_unit(bits: int) -> int:
    """Codes per byte (per 24-bit field at 3 bits): the number of planes."""
    return 8 if bits == 3 else 8 // bits


def units(words: mx.array, bits: int) -> mx.array:
    """The rows' bytes (uint8), or at 3 bits their 24-bit fields (uint32): (..., T, d / per_unit)."""
    if bits != 3:
        return words.view(mx.uint8)
    # Sizes spelled out, not -1: a reshape cannot infer an axis of an empty array (no tokens).
    triples = words.view(mx.uint8).astype(mx.uint32).reshape(*words.shape[:-1], words.shape[-1] * 4 // 3, 3)
    return triples[..., 0] | mx.left_shift(triples[..., 1], 8) | mx.left_shift(triples[..., 2], 16)


@lru_cache(maxsize=None)
def _planes_function(bits: int):
    mask, middle = (1 << bits) - 1, midpoint(bits)

    def split(words):
        packed = units(words, bits)
        # Python integers only: a lazy constant (mx.arange) would belong to the stream of the
        # thread that first traced this, and another thread's evaluation of it fails (the demo
        # runs its two generations in two threads, each in its own stream).
        return [(mx.right_shift(packed, bits * j) & mask).astype(mx.float32) - middle for j in range(per_unit(bits))]

    return mx.compile(split)


def planes(words: mx.array, bits: int) -> list[mx.array]:
    """per_unit(bits) float32 arrays (..., T, d / per_unit(bits)) of the codes in `words`, each
    less midpoint(bits)."""
    return _planes_function(bits)(words)
