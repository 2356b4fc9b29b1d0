"""Pack small integer codes into uint32 words and back.

mx.quantize packs its own affine codes; this is for codes we compute ourselves (codebook
indices of kvquant and turboquant_rvq). A word holds 32 // bits codes (10 for 3 bits, 2 bits of
each word unused), packed along the last axis; the last axis is padded with code 0.
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.errors import QuantizerConfigError


def codes_per_word(bits: int) -> int:
    if bits not in (1, 2, 3, 4, 5, 6, 8):
        raise QuantizerConfigError(f"pack bits={bits!r} is invalid: allowed is 1, 2, 3, 4, 5, 6, 8")
    return 32 // bits


def packed_length(n_codes: int, bits: int) -> int:
    per = codes_per_word(bits)
    return (n_codes + per - 1) // per


def pack_codes(codes: mx.array, bits: int) -> mx.array:
    """codes: integer array (..., n) with values < 2**bits -> uint32 (..., ceil(n / per))."""
    per = codes_per_word(bits)
    n = codes.shape[-1]
    words = packed_length(n, bits)
    pad = words * per - n
    codes = codes.astype(mx.uint32)
    if pad:
        codes = mx.concatenate([codes, mx.zeros((*codes.shape[:-1], pad), mx.uint32)], axis=-1)
    codes = codes.reshape(*codes.shape[:-1], words, per)
    shifts = mx.arange(per, dtype=mx.uint32) * bits
    # Codes occupy disjoint bit ranges, so the sum is a bitwise or.
    return mx.sum(mx.left_shift(codes, shifts), axis=-1).astype(mx.uint32)


def unpack_codes(packed: mx.array, bits: int, n_codes: int) -> mx.array:
    """uint32 (..., words) -> uint8 codes (..., n_codes)."""
    per = codes_per_word(bits)
    shifts = mx.arange(per, dtype=mx.uint32) * bits
    mask = mx.array((1 << bits) - 1, dtype=mx.uint32)
    codes = mx.bitwise_and(mx.right_shift(packed[..., None], shifts), mask)
    codes = codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)
    return codes[..., :n_codes].astype(mx.uint8)
