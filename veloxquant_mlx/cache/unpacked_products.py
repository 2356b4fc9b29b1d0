"""On the CPU, a decode step's products with per-token affine codes and sign planes as float
matmuls: the codes read as planes (cache/code_planes.py), one BLAS product per plane.

Why: MLX's CPU affine kernels are slow at the shapes a decode step makes (a few query rows
against thousands of tokens): TurboQuantRVQCache, the policy's default, decoded at 0.40x the fp16
cache's speed on this project's CPU at 2048 tokens (README, "Speed on the CPU"), its two stages
(3-bit codes and a 1-bit sign plane, read 2 or 4 bits wide) each through mx.quantized_matmul:
at one layer of SmolLM2's shape and 2048 tokens its scores took 2293 us and its weighted values
2245 us, against 229 / 62 us for the float32 products of the same K / V and 980 / 306 us for
mlx-lm's 4-bit pair (same run; MLX's 3-bit weighted sum is its slowest).
- Session 38 unpacked each row whole (scale * code + bias in float32, then one BLAS product):
  2293 -> 1484 us and 2245 -> 1235 us (`python -m veloxquant_mlx.bench.ops --methods
  turboquant_rvq --baseline 4948944 ...`, results/ops_cpu_s38_unpacked_2048.json). That
  unpacking broadcast a vector of shifts against each word, which MLX's compiled CPU kernels
  run ~5x slower than a contiguous pass (cache/code_planes.py).
- Now each plane is one contiguous pass and the scale and bias stay out of the unpacking:
  scores = sum over groups of s * (x_g . codes_g) + b * sum(x_g), with x split into one row
  block per group so that one product per plane gives every group's partial sums apart; the
  weighted sum folds the scale into the probabilities (one row block per group) and adds the
  bias as p @ b. Numbers: results/README.md, session 39's ops rows.
- Session 40: a sign plane's scores gather per-byte partial sums instead (cache/sign_lookup.py,
  3.3x faster there); its weighted sum stays here. And a product of one chunk runs traced by
  mx.compile (`_run`): the small ops around the BLAS calls fuse, 1.07x-1.16x at that shape.
The outputs differ from MLX's kernels by the products' summation order only (a relative 4e-6
of the largest output at most in tests/cache/test_unpacked_products.py's shapes).

Where: the CPU only (`applies`; `serves` adds the widths read). On Metal MLX's affine kernels are
the fast path and on CUDA the fused decode kernels run; neither is routed here. The transient is
the unpacked tokens in float32: the token axis is taken in chunks of at most CHUNK_BYTES of them
(4 MiB), each product evaluated before the next chunk is unpacked where there are several (on
the CPU a sync costs nothing a GPU would wait for), so it stops growing with the context. Not
for a caller inside mx.compile where a product may take several chunks (the evaluation).

Layouts (MLX's mx.quantize stream, as the caches store it): `words` (..., T, W) uint32 codes of T
rows, each quantized along its last axis in groups of `group_size` with `scales` / `biases`
(..., T, d / group_size); `bits` 2, 4, 8 pack 32 / bits codes per word from the low bits up, 3
packs 8 codes per 3 bytes (a little-endian 24-bit field). A sign plane's words (..., T, d / 32)
hold one bit per coordinate (bit j of word w is coordinate 32w + j) and `mags` (..., T, 1) its
magnitude a: the row reads back as a * (2b - 1) (cache/sign_plane.py), a 1-bit affine code with
scale 2a and bias -a over the whole row.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import code_planes
from veloxquant_mlx.errors import QuantizerConfigError

SUPPORTED_BITS = (2, 3, 4, 8)
# Float32 bytes of unpacked tokens one product holds at a time (1024 tokens of 8 KV heads x d 128).
# Why 4 MiB: a chunk the CPU's caches still hold between its unpacking and its product. The
# A/B against 16 MiB through the bench, the cache's two products at the 8B attention shape and
# 8192 tokens on this project's VM (results/ops_cpu_s38_chunk4mib_8192_8b.json, interleaved
# rounds): scores 31.6 -> 28.4 ms, values 31.0 -> 25.5 ms. In a session script not kept, 1-8 MiB
# chunks ran alike and one 64 MiB chunk about twice as slow as 4 MiB ones; at SmolLM2's shape and
# 2048 tokens (1.5 MiB in all) the products are one chunk either way. Measured with session 38's
# whole-row unpacking; the planes (session 39) were not tuned again.
CHUNK_BYTES = 4 << 20


def applies() -> bool:
    """Whether this path serves the products: MLX's default device is the CPU."""
    return mx.default_device().type == mx.DeviceType.cpu


def serves(bits: int) -> bool:
    """Whether this path serves an affine product of `bits`-wide codes here (applies, and a
    width the planes read)."""
    return bits in SUPPORTED_BITS and applies()


def token_chunks(tokens: int, row_floats: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of the token axis whose unpacked float32 rows (`row_floats` floats per
    token, over every leading axis) fit CHUNK_BYTES (one range where they all do)."""
    size = max(1, CHUNK_BYTES // max(4 * row_floats, 1))
    # An empty axis is one empty range, so that a product of no tokens is an empty array.
    return [(start, min(tokens, start + size)) for start in range(0, max(tokens, 1), size)]


def _rows(words: mx.array, d: int) -> int:
    """Float32 values per token of `words` (..., T, W) unpacked to d per row, over the leading axes."""
    lead = 1
    for n in words.shape[:-2]:
        lead *= n
    return lead * d


def one_chunk(words: mx.array, row_floats: int) -> bool:
    """Whether the tokens of `words` take one chunk with `row_floats` float32 values per token
    and leading index (no evaluation between chunks: a product that mx.compile may trace)."""
    return len(token_chunks(words.shape[-2], _rows(words, row_floats))) == 1


def _checked(words: mx.array, scales: mx.array, group_size: int, bits: int) -> None:
    """Refuses bits and groups the products do not read."""
    if bits not in SUPPORTED_BITS:
        raise QuantizerConfigError(
            f"unpacked_products: bits={bits!r}; allowed are {', '.join(map(str, SUPPORTED_BITS))}"
        )
    d = words.shape[-1] * 32 // bits
    if d % group_size or scales.shape[-1] != d // group_size:
        raise QuantizerConfigError(
            f"unpacked_products: rows of {d} codes in groups of {group_size} with {scales.shape[-1]} "
            "scales per row; allowed is one scale and bias per group"
        )


@lru_cache(maxsize=None)
def _group_mask(groups: int, per_plane: int, group_units: int) -> mx.array:
    """(groups, 1, per_plane) float32: 1 where a plane's column belongs to the group. Python
    data, so already there (a lazy constant would belong to the thread that first made it)."""
    return mx.array([[[1.0 if u // group_units == g else 0.0 for u in range(per_plane)]] for g in range(groups)])


def _by_plane(x: mx.array, k: int, group_size: int) -> list[mx.array]:
    """x (..., R, d) -> k arrays (..., G R, d / k): plane j's coordinates (k u + j) of x, row
    block g holding group g's and zeros elsewhere (G = d / group_size), so that one product
    with a plane gives every group's partial sum apart."""
    *lead, R, d = x.shape
    groups, per_plane = d // group_size, d // k
    split = x.reshape(*lead, R, per_plane, k)
    if groups == 1:
        return [split[..., j] for j in range(k)]
    mask = _group_mask(groups, per_plane, group_size // k)
    return [(split[..., None, :, :, j] * mask).reshape(*lead, groups * R, per_plane) for j in range(k)]


def _centered(scales: mx.array, biases: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """float32 (scales, biases) for the planes' centered codes: s c + b = s (c - m) + (b + s m)."""
    s = scales.astype(mx.float32)
    return s, biases.astype(mx.float32) + s * code_planes.midpoint(bits)


def _affine_scores(x, words, scales, biases, group_size: int, bits: int) -> mx.array:
    # scores = sum over groups of s * (x_g . codes_g) + b * sum(x_g): the codes' products per
    # plane (one BLAS product each), the scale and bias applied once per group and token (the
    # codes centered, the bias the group's middle value: see code_planes).
    d = words.shape[-1] * 32 // bits
    k, groups = code_planes.per_unit(bits), d // group_size
    *lead, R, _ = x.shape
    by_plane = _by_plane(x, k, group_size)
    sums = x.reshape(*lead, R, groups, group_size).sum(-1).swapaxes(-1, -2)[..., None]  # (..., G, R, 1)

    def part(start, stop):
        parts = code_planes.planes(words[..., start:stop, :], bits)
        codes = by_plane[0] @ parts[0].swapaxes(-1, -2)
        for xj, plane in zip(by_plane[1:], parts[1:]):
            codes = codes + xj @ plane.swapaxes(-1, -2)
        codes = codes.reshape(*lead, groups, R, stop - start)
        s, b = _centered(scales[..., start:stop, :], biases[..., start:stop, :], bits)
        s, b = s.swapaxes(-1, -2)[..., None, :], b.swapaxes(-1, -2)[..., None, :]
        return (codes * s + b * sums).sum(-3)

    return _over_chunks(words, d, part, _joined_scores)


def _affine_weighted_sum(p, words, scales, biases, group_size: int, bits: int) -> mx.array:
    # out_d = sum_t (p_t s_tg) code_td + sum_t p_t b_tg: the scale folds into the probabilities
    # (one row block per group), the codes' products per plane, the bias one small product.
    d = words.shape[-1] * 32 // bits
    k, groups = code_planes.per_unit(bits), d // group_size
    *lead, R, _ = p.shape

    def part(start, stop):
        pc = p[..., start:stop]
        s, b = _centered(scales[..., start:stop, :], biases[..., start:stop, :], bits)
        weights = (pc[..., None, :, :] * s.swapaxes(-1, -2)[..., None, :]).reshape(*lead, groups * R, stop - start)
        planes = [weights @ plane for plane in code_planes.planes(words[..., start:stop, :], bits)]
        return planes + [pc @ b]

    sums = _over_chunks(words, d, part, _summed_lists)
    per_plane = d // k
    if groups == 1:
        columns = sums[:-1]
    else:
        mask = _group_mask(groups, per_plane, group_size // k)
        columns = [(s.reshape(*lead, groups, R, per_plane) * mask).sum(-3) for s in sums[:-1]]
    out = mx.stack(columns, axis=-1).reshape(*lead, R, d)
    return out + mx.repeat(sums[-1], group_size, axis=-1)


def affine_scores(x, words, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """x (..., R, d) against the rows (..., T, W) -> (..., R, T) float32: x @ dequantized^T (what
    mx.quantized_matmul(transpose=True) gives)."""
    _checked(words, scales, group_size, bits)
    return _run(_affine_scores, (x, words, scales, biases), group_size, bits)


def affine_weighted_sum(p, words, scales, biases, *, group_size: int, bits: int) -> mx.array:
    """p (..., R, T) times the rows (..., T, W) -> (..., R, d) float32: p @ dequantized (what
    mx.quantized_matmul(transpose=False) gives)."""
    _checked(words, scales, group_size, bits)
    return _run(_affine_weighted_sum, (p, words, scales, biases), group_size, bits)


def _sign_weighted_sum(p, words, mags, group_size: int, bits: int) -> mx.array:
    # A sign plane as a 1-bit affine code over the whole row: a (2b - 1) = (2a) b + (-a).
    a = mags.astype(mx.float32)
    return _affine_weighted_sum(p, words, 2 * a, -a, group_size, bits)


def sign_weighted_sum(p, words, mags) -> mx.array:
    """p (..., R, T) times a sign plane's rows -> (..., R, d) float32: sum_t p_t a_t (2b_t - 1)."""
    return _run(_sign_weighted_sum, (p, words, mags), words.shape[-1] * 32, 1)


def _run(product, arrays: tuple, group_size: int, bits: int) -> mx.array:
    """product(x in float32, words, *side data, group_size, bits) for arrays = (x, words, *side
    data), through mx.compile where the tokens are one chunk (several chunks evaluate each
    before the next: not traceable).
    Why compiled: at a decode step's sizes each of MLX's CPU ops costs a few us of its own, and
    the products are ~15 small ops around their BLAS calls; fused, the same values bit for bit
    (session 40's scripts on the Xeon VM, SmolLM2's shape, 2048 tokens, one core: 3-bit scores
    540 -> 432 us, weighted sum 372 -> 329, a sign plane's weighted sum 304 -> 265; rerunnable
    through the caches: `python -m veloxquant_mlx.bench.ops --baseline 472e7cf ...`,
    results/ops_cpu_s40_compiled_2048.json: 1.10x-1.20x a product). A new token count (the
    store grows a block at a time) traces again, ~2-3 ms; a process's first trace of each builds
    MLX's fused CPU kernels (~1 s, kept on disk for later processes)."""
    x, words, *side = arrays
    x = x.astype(mx.float32)
    if one_chunk(words, words.shape[-1] * 32 // bits):
        return _compiled(product, group_size, bits)(x, words, *side)
    return product(x, words, *side, group_size, bits)


@lru_cache(maxsize=None)
def _compiled(product, group_size: int, bits: int):
    """product traced by mx.compile for one group size and width (its arrays' shapes pick MLX's
    trace within it)."""
    return mx.compile(lambda *arrays: product(*arrays, group_size, bits))


def _over_chunks(words: mx.array, d: int, part, join) -> mx.array:
    """join([part(start, stop) for each token chunk of `words` unpacked to d floats per row]),
    each part evaluated where there are several (_evaluated)."""
    chunks = token_chunks(words.shape[-2], _rows(words, d))
    return join([_evaluated(part(start, stop), len(chunks)) for start, stop in chunks])


def _joined_scores(parts: list) -> mx.array:
    """Chunks' scores side by side along the token axis."""
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def _summed_lists(parts: list) -> list:
    """Chunks' partial sums (a list of arrays each) added up array by array, in chunk order."""
    out = parts[0]
    for part in parts[1:]:
        out = [a + b for a, b in zip(out, part)]
    return out


def _evaluated(part: mx.array, n_chunks: int) -> mx.array:
    """`part`, evaluated where the product has several chunks (its unpacked rows are freed
    before the next chunk's are made; lazily, every chunk's could be allocated at once)."""
    if n_chunks > 1:
        mx.eval(part)
    return part
