"""On the CPU, queries scored against a sign plane through per-byte lookup tables.

A sign plane (cache/sign_plane.py) holds d sign bits per token and one magnitude a: the token
reads back as a (2b - 1), so x . token = a (2 (x . b) - sum(x)). Each byte of the plane holds 8
coordinates' bits, and x . b is the sum over the row's d / 8 bytes of one of 256 partial sums of
x's 8 coordinates there. Those 256 x d / 8 partial sums per query row are a small product made
once per step (x's 8-coordinate blocks times the 8 x 256 matrix of every byte's bits); the
scores are then one gather of them by the stored bytes and a sum over the bytes.

Why: the plane read as float32 planes for BLAS products (cache/unpacked_products.py, session
39) writes d floats per token and runs 8 products of an 8-wide inner axis; the gather reads one
table entry per byte instead, d / 8 per token and query row. TurboQuantRVQCache's sign stage
alone, timed in session 40's scripts (not kept) on the project's Xeon VM (one core, OpenBLAS,
float32; medians): SmolLM2's shape (3 KV
heads x 3 query rows, d 64) at 2048 tokens 442 -> 134 us, the 8B attention shape (8 x 4, d 128)
at 8192 tokens 6.6 -> 3.4 ms. The same trick for the weighted sum (a histogram of the
probabilities per byte value, a scatter-add) ran 8x slower than the planes; for the 3-bit
uniform stage, tables over each stored byte (its bits weighted 2^k within their code) ran 1.4x
faster at SmolLM2's shape but 1.3x slower at the 8B shape (a gather per byte and query row: 4
rows there), over 6- or 12-bit units 1.7x and 3.7x slower: those stay planes. Rerunnable:
the cache's whole scores, `python -m veloxquant_mlx.bench.ops --methods turboquant_rvq
--baseline 5a1d019 --context 2048 --dtype float32` (results/ops_cpu_s40_sign_lookup_*.json:
1229 -> 919 us; 19.5 -> 16.8 ms at the 8B shape, 8192 tokens, bf16).

Where: the CPU only (sign_plane.sign_scores routes here where unpacked_products.applies()); on
Metal and CUDA the widened plane's affine kernels / the fused decode kernels run. The transient
is the gathered partial sums, (..., R, d / 8, tokens) float32: the token axis is taken in chunks
of unpacked_products.CHUNK_BYTES of them, each evaluated before the next where there are several
(unpacked_products' own chunk loop), so it stops growing with the context.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import unpacked_products
from veloxquant_mlx.errors import QuantizerConfigError

BYTE_VALUES = 256
BITS_PER_BYTE = 8


@lru_cache(maxsize=None)
def byte_bits() -> mx.array:
    """(8, 256) float32: entry [j, v] is bit j of byte value v. Python data, so already there (a
    lazy constant would belong to the stream of the thread that first made it)."""
    return mx.array([[float((v >> j) & 1) for v in range(BYTE_VALUES)] for j in range(BITS_PER_BYTE)])


def _bit_sums(x: mx.array, words: mx.array) -> mx.array:
    """x (..., R, d) float32 against the plane's bits (words (..., T, d / 32)) -> (..., R, T):
    x . b per token."""
    *lead, R, d = x.shape
    per_row = d // BITS_PER_BYTE
    # table[..., r, p, v]: the sum of x[r, 8p + j] over the bits j set in byte value v.
    table = x.reshape(*lead, R, per_row, BITS_PER_BYTE) @ byte_bits()
    # Byte p of a token's row holds coordinates 8p .. 8p + 7, bit j being 8p + j (little-endian
    # words: bit j of word w is coordinate 32w + j, and word w's bytes are 4w .. 4w + 3).
    index = words.view(mx.uint8).swapaxes(-1, -2)[..., None, :, :]  # (..., 1, d / 8, T)
    return mx.take_along_axis(table, index, axis=-1).sum(-2)


def sign_scores(x: mx.array, words: mx.array, mags: mx.array) -> mx.array:
    """x (..., R, d) against a sign plane (words (..., T, d / 32), mags (..., T, 1)) -> (..., R, T)
    float32: x . a (2b - 1) per token (x times the plane read back, sign_plane.sign_values)."""
    d = words.shape[-1] * 32
    if x.shape[-1] != d:
        raise QuantizerConfigError(
            f"sign_lookup: queries of {x.shape[-1]} coordinates against sign rows of {d}; allowed "
            "is queries of the rows' d"
        )
    xf = x.astype(mx.float32)
    # The gathered partial sums per token: R x d / 8 floats for every leading index.
    rows = x.shape[-2] * (d // BITS_PER_BYTE)
    if unpacked_products.one_chunk(words, rows):
        # Traced by mx.compile (unpacked_products._run says why): 158 -> 139 us at SmolLM2's
        # shape and 2048 tokens (session 40).
        return _compiled_scores()(xf, words, mags)

    def part(start: int, stop: int) -> mx.array:
        return _scores(xf, words[..., start:stop, :], mags[..., start:stop, :])

    return unpacked_products._over_chunks(words, rows, part, unpacked_products._joined_scores)


def _scores(xf: mx.array, words: mx.array, mags: mx.array) -> mx.array:
    """float32 x against the plane's tokens: a (2 (x . b) - sum(x)) per token."""
    a = mags.astype(mx.float32).swapaxes(-1, -2)  # (..., 1, T)
    return a * (2 * _bit_sums(xf, words) - xf.sum(-1, keepdims=True))


@lru_cache(maxsize=None)
def _compiled_scores():
    return mx.compile(_scores)
