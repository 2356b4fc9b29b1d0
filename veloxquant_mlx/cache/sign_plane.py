"""A plane of 1-bit sign codes read by the 2- and 4-bit affine kernels of every MLX backend.

A sign plane holds, per token, d sign bits packed 32 to a uint32 word (bit j of word w is
coordinate 32w + j, as `packing.pack_codes(bits, 1)` writes them) and one magnitude a per token:
the token's vector is read back as a * (2b - 1), i.e. the 1-bit affine code b with scale 2a and
bias -a. TurboQuantRVQCache scores queries against such planes and weighs them with attention
probabilities.

Why not `mx.quantized_matmul(bits=1)` / `mx.dequantize(bits=1)`: MLX's CUDA backend has no
1-bit affine kernels (quantized_matmul takes 2, 3, 4, 5, 6 and 8 bits). No supported width can
read the stored words as they are: a w-bit view (w a power of 2, as d is) sees each coordinate's
bit only through a field b_i + 2 b_{i+1} + ..., and the per-coordinate weights a query needs are
not in the span of such fields. So the words are re-expressed per call, not stored twice:

  * `widen(words, bits)` spreads each sign bit into a `bits`-wide code (0 or 1) with a few shifts
    and masks over the words (one fused kernel under mx.compile): exactly MLX's packing of the
    same 0/1 codes at that width, so the dequantized values are a * (2b - 1) bit for bit;
  * the products then run through the ordinary affine kernels, with scale 2a and bias -a per
    group (group = min(d, 128): one group per vector up to d = 128).

The transient is the widened plane of one layer: `bits` times the stored sign plane (2 bits per
element for the scores, 4 for the weighted sum; e.g. 4 MiB and 8 MiB for 16K tokens x 8 heads x
d 128; the compiled widening holds up to ~2x that while it runs), never a float copy of the
history. Past MAX_WIDE_BYTES of widened words (128K tokens of that shape) the tokens are taken
in chunks, each evaluated before the next is widened, so the transient stops growing with the
context (lazy evaluation alone would allocate every chunk up front); shorter histories, the
common case, need no mx.eval inside attention (a sync on a GPU).

Widths were measured on the CPU (one layer, 8 kv heads, 4 query rows each, d 128, float32; CPU
ms at 16K / 4K tokens; the 1-bit kernel for reference): scores 1-bit 38.2 / 9.8, 2-bit 42.1 /
10.8, 4-bit 45.5 / 10.9; weighted sum 1-bit 31.8 / 7.6, 2-bit 33.4 / 7.9, 4-bit 20.9 / 4.6;
widening 3.1-3.4 / 0.7. Hence 2 bits for the scores and 4 for the weighted sum. Expanding the
bits to a +-1 float matrix for a regular matmul ran as fast but needs a tokens x d float
transient (148 MiB at 16K in float32), which lazy evaluation does not free chunk by chunk
without an mx.eval per chunk (a sync per chunk on a GPU).

On the CPU (since session 39) neither product widens: the weighted sum reads the 1-bit codes as
planes for BLAS products (cache/unpacked_products.py), the scores gather per-byte partial sums
of the query (cache/sign_lookup.py, session 40), each in chunks of unpacked_products.CHUNK_BYTES
(max_bytes bounds the widened words where they are made). A widened code is 0 or 1 in a field
whose range is larger, which the planes' centering (cache/code_planes.py) does not expect: read
through them, the weighted sum over 8192 tokens erred by 6e-5 of its largest output (1-bit
planes: 0.0).
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.cache import sign_lookup, unpacked_products
from veloxquant_mlx.cache.split_reduction import quantized_weighted_sum

SCORE_BITS = 2  # width the scores product reads the plane at
SUM_BITS = 4  # width the weighted sum (and a full decode) reads it at
MAX_GROUP = 128  # the largest group the affine kernels take
MAX_WIDE_BYTES = 64 << 20  # widened words one product may hold at a time
CHUNK_ALIGN = 256  # chunks are whole multiples of this many tokens


def _spread2(words, halves):
    # Each 16-bit half of a word -> one word with bit j moved to bit 2j (Morton spread).
    x = mx.right_shift(words[..., None], halves) & 0xFFFF
    x = (x | mx.left_shift(x, 8)) & 0x00FF00FF
    x = (x | mx.left_shift(x, 4)) & 0x0F0F0F0F
    x = (x | mx.left_shift(x, 2)) & 0x33333333
    return (x | mx.left_shift(x, 1)) & 0x55555555


def _spread4(words, quarters):
    # Each byte of a word -> one word with bit j moved to bit 4j.
    x = mx.right_shift(words[..., None], quarters) & 0xFF
    x = (x | mx.left_shift(x, 12)) & 0x000F000F
    x = (x | mx.left_shift(x, 6)) & 0x03030303
    return (x | mx.left_shift(x, 3)) & 0x11111111


_SPREAD = {
    2: (mx.compile(_spread2, shapeless=True), (0, 16)),
    4: (mx.compile(_spread4, shapeless=True), (0, 8, 16, 24)),
}


def widen(words: mx.array, bits: int) -> mx.array:
    """uint32 sign words (..., d / 32) -> the same 0/1 codes packed `bits` wide,
    uint32 (..., d * bits / 32)."""
    spread, offsets = _SPREAD[bits]
    out = spread(words, mx.array(offsets, dtype=mx.uint32))
    return out.reshape(*words.shape[:-1], words.shape[-1] * bits)


def group_size(dim: int) -> int:
    return min(dim, MAX_GROUP)


def affine(mags: mx.array, dim: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array, int]:
    """Per-group (scales, biases, group) of the plane: 2a and -a for each of the d / group
    groups of a vector; mags (..., T, 1)."""
    g = group_size(dim)
    a = mags.astype(dtype)
    if dim // g > 1:
        a = mx.repeat(a, dim // g, axis=-1)
    return 2 * a, -a, g


def compute_dtype(x_dtype: mx.Dtype) -> mx.Dtype:
    """float32 on the CPU (its affine kernels run a bf16/fp16 input ~10x slower), else the
    input's dtype."""
    return mx.float32 if mx.default_device().type == mx.DeviceType.cpu else x_dtype


def token_chunks(words: mx.array, bits: int, max_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) token ranges whose words widened to `bits` fit max_bytes (one range when
    the whole plane does)."""
    tokens = words.shape[-2]
    per_token = words.nbytes // max(tokens, 1) * bits
    size = max(CHUNK_ALIGN, (max_bytes // max(per_token, 1)) // CHUNK_ALIGN * CHUNK_ALIGN)
    return [(start, min(tokens, start + size)) for start in range(0, tokens, size)]


def sign_scores(
    x: mx.array, words: mx.array, mags: mx.array, max_bytes: int = MAX_WIDE_BYTES
) -> mx.array:
    """x (..., R, d) against the plane (words (..., T, d / 32), mags (..., T, 1)) -> (..., R, T):
    x . (a_t (2 b_t - 1)) in x's dtype."""
    if unpacked_products.applies():
        return sign_lookup.sign_scores(x, words, mags).astype(x.dtype)
    dim = words.shape[-1] * 32
    dtype = compute_dtype(x.dtype)
    xc = x.astype(dtype)
    chunks = token_chunks(words, SCORE_BITS, max_bytes)
    parts = []
    for start, stop in chunks:
        scales, biases, g = affine(mags[..., start:stop, :], dim, dtype)
        part = mx.quantized_matmul(
            xc, widen(words[..., start:stop, :], SCORE_BITS), scales, biases,
            transpose=True, group_size=g, bits=SCORE_BITS,
        )
        if len(chunks) > 1:
            mx.eval(part)  # frees this chunk's widened words before the next is made
        parts.append(part)
    out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    return out.astype(x.dtype)


def sign_weighted_sum(
    p: mx.array, words: mx.array, mags: mx.array, max_bytes: int = MAX_WIDE_BYTES
) -> mx.array:
    """p (..., R, T) times the plane's vectors -> (..., R, d): sum_t p_t a_t (2 b_t - 1), in p's
    dtype (long token axes split into chunks by split_reduction)."""
    if unpacked_products.applies():
        return unpacked_products.sign_weighted_sum(p, words, mags).astype(p.dtype)
    dim = words.shape[-1] * 32
    dtype = compute_dtype(p.dtype)
    pc = p.astype(dtype)
    chunks = token_chunks(words, SUM_BITS, max_bytes)
    out = None
    for start, stop in chunks:
        scales, biases, g = affine(mags[..., start:stop, :], dim, dtype)
        part = quantized_weighted_sum(
            pc[..., start:stop], widen(words[..., start:stop, :], SUM_BITS), scales, biases,
            group_size=g, bits=SUM_BITS,
        )
        if len(chunks) > 1:
            part = part.astype(mx.float32)  # partial sums in float32
            mx.eval(part)
        out = part if out is None else out + part
    return out.astype(p.dtype)


def sign_values(words: mx.array, mags: mx.array) -> mx.array:
    """The plane read back in float32: (..., T, d) = a (2b - 1)."""
    scales, biases, g = affine(mags, words.shape[-1] * 32, mx.float32)
    return mx.dequantize(widen(words, SUM_BITS), scales, biases, group_size=g, bits=SUM_BITS)
