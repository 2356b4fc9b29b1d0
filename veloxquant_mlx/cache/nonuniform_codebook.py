"""Non-uniform scalar codebooks for normalized values, fitted online by Lloyd's algorithm.

KVQuant (Hooper et al. 2024, arXiv 2401.18079, section 3.3 "nuqX") quantizes each normalized
element to one of 2**bits levels of a non-uniform datatype derived per layer by k-means on
calibration data. We have no calibration pass inside a cache, so the levels are fitted on the
first block the cache encodes (normally the prefill) and then reused for every later block.

All functions work on a leading batch of independent codebooks (e.g. one per batch element and
KV head): samples (..., N) and codebooks (..., K) with the same leading shape.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import kvquant_fit_kernel

# Enough samples for 16 levels to settle; more only costs time at the first flush.
MAX_FIT_SAMPLES = 16384


def fit_codebook(samples: mx.array, n_levels: int, iterations: int = 20) -> mx.array:
    """Lloyd / 1-D k-means: samples (..., N) float -> sorted levels (..., n_levels) float32.

    Starts from the samples' quantiles (each level begins with an equal share of samples), which
    for 1-D data converges in a few iterations. A level that loses all its samples keeps its
    previous value, so the result always has n_levels finite entries.

    On the CPU it runs through mx.compile (one trace per setting and shape): the 20 unrolled
    iterations' compares, one-hot and products fuse into a few kernels each instead of ~10 ops
    per iteration. On MLX's CUDA backend with our kernels on (VELOXQUANT_CUDA_KERNELS) the
    iterations run through kvquant_fit_kernel.py: 3 launches each (two kernels and MLX's sum
    of hits * x) instead of the eager ops' ~13, the same levels; 2 JIT compiles on first use.
    Elsewhere it runs as eager ops: a fit runs once per layer (the first
    encoded block), so fusion saves a few hundred launches once (~ms on a GPU), while each of
    the fit's distinct fused kernels is a JIT compile on a GPU's first use (MLX's CUDA backend
    compiles every fused kernel with nvrtc, ~seconds each cold; kvquant's untimed 2K warm-up
    took 69.7 s on the H200 against kivi's 5.2 s). Counted on the CPU (`python -m
    tests.cache.bench_kvquant_prefill --warmup [--as-gpu]`): the compiled fit builds 6, the
    eager one none of its own (nearest_level stays compiled: its 2 kernels are also those of
    kvquant's codes function, kernels being named by their ops, not shapes); a 2K prompt's
    first use 17 -> 13. The reductions and sorts are the same ops on the same arrays either
    way, and no product feeds an add inside a fused kernel (no FMA to contract), so the levels
    are bit-identical (tests/cache/test_encoder_identity.py, test_kvquant_prefill_warmup.py).
    """
    x = samples.astype(mx.float32)
    n = x.shape[-1]
    if n > MAX_FIT_SAMPLES:  # a strided subsample keeps every part of the block represented
        x = x[..., :: (n + MAX_FIT_SAMPLES - 1) // MAX_FIT_SAMPLES]
    if _fit_compiled():
        return _compiled_lloyd(n_levels, iterations)(x)
    if _fit_kernels_apply(n_levels):
        return kvquant_fit_kernel.lloyd_iterations(x, _initial_levels(x, n_levels), iterations)
    return _lloyd(x, n_levels, iterations)


def _fit_kernels_apply(n_levels: int) -> bool:
    """Whether the Lloyd iterations run through kvquant_fit_kernel.py: on MLX's CUDA backend
    with our kernels on, for 4, 8 or 16 levels (the kernels' templates); there ~3 launches an
    iteration instead of the eager ops' ~13, the same levels."""
    return n_levels in (4, 8, 16) and kvquant_fit_kernel.enabled()


def _fit_compiled() -> bool:
    """Whether fit_codebook runs through mx.compile: on the CPU, where a fused kernel costs a
    g++ build once per machine (MLX keeps them on disk), not on a GPU (see fit_codebook)."""
    return mx.default_device() == mx.cpu


@lru_cache(maxsize=None)
def _compiled_lloyd(n_levels: int, iterations: int):
    return mx.compile(lambda x: _lloyd(x, n_levels, iterations))


def _initial_levels(x: mx.array, n_levels: int) -> mx.array:
    """The samples' quantiles: level k starts at the sample of rank (k + 0.5) * N / K."""
    n = x.shape[-1]
    ordered = mx.sort(x, axis=-1)
    picks = ((mx.arange(n_levels) + 0.5) * n / n_levels).astype(mx.int32)
    return mx.take(ordered, mx.minimum(picks, n - 1), axis=-1)


def _lloyd(x: mx.array, n_levels: int, iterations: int) -> mx.array:
    levels = _initial_levels(x, n_levels)
    one = mx.arange(n_levels)
    for _ in range(iterations):
        codes = nearest_level(x, levels)
        hits = (codes[..., None] == one).astype(mx.float32)  # (..., N, K)
        counts = hits.sum(axis=-2)
        # The same (..., N, K) product reduced over N as ever: a sum in another order (a
        # masked row sum per level) could differ in the last bit and move a level.
        sums = (hits * x[..., None]).sum(axis=-2)
        levels = mx.where(counts > 0, sums / mx.maximum(counts, 1.0), levels)
        levels = mx.sort(levels, axis=-1)
    return levels


def nearest_level(x: mx.array, levels: mx.array) -> mx.array:
    """Index of the nearest level for each element: x (..., N), sorted levels (..., K) -> uint8.

    For sorted levels the nearest one is the number of midpoints below x, which needs K - 1
    comparisons per element and no gather. They are counted one midpoint at a time into uint8
    inside mx.compile, one fused elementwise pass over x; the former form, a (..., N, K - 1)
    bool array summed over its last axis, wrote and re-read K - 1 bytes per element (measured
    on the CPU, 8 heads x 2048 tokens x 128, 3 bits: 16.7 ms). Same counts, same codes.
    """
    return _count_midpoints_below(x, levels)


@mx.compile
def _count_midpoints_below(x: mx.array, levels: mx.array) -> mx.array:
    mids = (levels[..., 1:] + levels[..., :-1]) * 0.5  # (..., K-1)
    # (..., 1, ..., 1, K-1): one midpoint per leading index, broadcast over x's trailing axes.
    expand = mids.reshape(*mids.shape[:-1], *([1] * (x.ndim - mids.ndim + 1)), mids.shape[-1])
    count = (x > expand[..., 0]).astype(mx.uint8)
    for k in range(1, mids.shape[-1]):
        count = count + (x > expand[..., k]).astype(mx.uint8)
    return count


def lookup(levels: mx.array, codes: mx.array) -> mx.array:
    """levels (B, H, K), codes (B, H, ...) integer -> float32 level values of codes' shape."""
    B, H = codes.shape[:2]
    flat = codes.reshape(B, H, -1).astype(mx.uint32)
    return mx.take_along_axis(levels.astype(mx.float32), flat, axis=-1).reshape(codes.shape)


def unpack_indices(words: mx.array, bits: int, n_codes: int, codes_per_index: int = 1) -> mx.array:
    """uint32 words (..., W) packed by `packing.pack_codes` -> uint8 indices (..., n_codes //
    codes_per_index); with codes_per_index 2 each index is a pair of neighbouring codes,
    first + 2**bits * second (a word's codes pair up when 32 // bits is even).

    uint8 rather than uint32 indices: inside mx.compile the shift, mask and cast fuse into one
    kernel, and the gather that follows reads a quarter of the bytes (measured on the CPU: the
    uint32 unpack cost as much as the gather). When the codes do not fill the last word the
    result is a slice (a view): a gather reads it in place, no copy."""
    width = bits * codes_per_index
    per = 32 // width
    shifts = mx.arange(per, dtype=mx.uint32) * width
    codes = mx.bitwise_and(mx.right_shift(words[..., None], shifts), mx.array((1 << width) - 1, mx.uint32))
    codes = codes.astype(mx.uint8).reshape(*words.shape[:-1], words.shape[-1] * per)
    n = n_codes // codes_per_index
    return codes if codes.shape[-1] == n else codes[..., :n]


def _pairs_apply(bits: int, n_codes: int) -> bool:
    return (32 // bits) % 2 == 0 and n_codes % 2 == 0


def lookup_table(levels: mx.array, bits: int, n_codes: int) -> mx.array:
    """What `lookup_packed` gathers from, (B, H, K * K) uint64 level pairs or (B, H, K)
    float32 levels; build it once per attention call and pass it to every chunk's lookup."""
    K = levels.shape[-1]
    levels = levels.astype(mx.float32)
    if not _pairs_apply(bits, n_codes):
        return levels
    pair = mx.arange(K * K)
    table = mx.stack([mx.take(levels, pair % K, axis=-1), mx.take(levels, pair // K, axis=-1)], axis=-1)
    return mx.view(table, mx.uint64).reshape(*levels.shape[:-1], K * K)


def lookup_packed(levels: mx.array, words: mx.array, bits: int, n_codes: int, table: mx.array | None = None) -> mx.array:
    """Level values of codes packed by `packing.pack_codes` along the last axis.

    levels (B, H, K); words (B, H, ..., W) uint32 -> float32 (B, H, ..., n_codes). Same result as
    `lookup(levels, unpack_codes(words, bits, n_codes))`, computed with half the gathers: codes
    are read two at a time as an index into a table of the K * K level pairs, each pair stored
    as one 8-byte element (mx.view), and the result is viewed back as float32. The padding is
    dropped from the uint8 indices, so the gathered floats need no copy. Measured on the CPU
    (8 heads x 1024 tokens x 128 codes): 35% faster than one gather per code, itself ~2x faster
    than gathering with uint32 indices and slicing the floats. `table`: lookup_table's result,
    if already built.
    """
    if table is None:
        table = lookup_table(levels, bits, n_codes)
    B, H = table.shape[:2]
    table = table.reshape(B, H, *([1] * (words.ndim - 3)), table.shape[-1])
    if table.dtype == mx.uint64:
        return mx.view(mx.take_along_axis(table, unpack_indices(words, bits, n_codes, 2), axis=-1), mx.float32)
    return mx.take_along_axis(table, unpack_indices(words, bits, n_codes), axis=-1)
