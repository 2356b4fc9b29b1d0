"""GEAR's per-group passes of a chunk's encode on MLX's CUDA backend: three launches per side.

Around the outlier selection (outlier_select_kernel.py) GEAR's encode works per quantization
group (keys: `group` tokens of one channel; values: `group` channels of one token):
  - before it, each entry's score -|x - mean of its group| (gear_outliers.outlier_scores);
  - after it, the dense part: the picked outliers replaced by the mean of the rest of their
    group, cast to the side dtype, keys transposed to (channel, token) for mx.quantize;
  - after mx.quantize, Q(D) and the residual D - Q(D) the low rank fits (see _RESIDUAL_SOURCE).
As MLX ops those were, per side of one 8 x 128 layer's 2048-token chunk on the H200 (Nsight
Compute, results/ncu_prefill_chunk_h200_s17_gear.csv, us): the scores a reduction (keys 10,
values 22: a 32-entry row per 32-thread block), its scaling (2), a copy of the broadcast mean
(7) and the distance (8); the dense part a zero-filled bool mask (19) and its scatter (8), its
negation as weights (4), a product (8), two reductions (keys 10 + 10, values 10 + 22), the
division (3), another broadcast copy (7), the select (9), the cast (5) and, for keys, the
transposing copy mx.quantize needs (12): about 200 us of the chunk's ~600 us of encode for both
sides, in 30 launches. Here: 2 launches per side, and a third after mx.quantize in place of 5-6
(bit for bit, on CUDA as well).

Session 42 moved the work from one thread per group to tiles staged in shared memory (see
_TILE): one thread per group read its own 32 entries (values: 128 contiguous bytes per thread,
a warp's loads 32 lines apart) and the keys' dense part was written 2 bytes at a time along
32 channel rows; Nsight Compute on an H100 put the values' scores at 48 us, the dense parts at
38 / 43 us and the keys' residual at 38 us per 2048-token chunk, against 8 and 11 us for the
keys' scores and the values' residual, whose accesses were coalesced
(results/ncu_prefill_chunk_h100_s42.json: ~170 us of gear's ~450 us of encode per layer and
chunk, which decides its 32K prefill against kivi's).

The scores and the dense part are not bit for bit the ops on CUDA: a group's sums run here in
token / channel order (MLX's CUDA reduce kernels have their own; its CPU ones sum these groups
in this order, so on the CPU emulation they are bit for bit), so a mean may differ in its last
bits; a score then differs by as much, which can swap two outliers whose scores lie within that
of each other, and a hole's fill by as much, below the side dtype's rounding almost always.
Every other entry of the dense part is the block's own value cast once, as the ops cast it. The
CUDA test of the encoder against the frozen one (tests/cache/test_gear_encode_kernel.py) runs
with these off; their own tests (tests/cache/test_gear_group_kernel.py) bound the difference on
CUDA and pin the bits on the CPU emulation.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.gear_encode_kernel import _ROUNDING
from veloxquant_mlx.cache.kernel_name import build_kernel

# False: the MLX ops instead, whatever the backend (for an A/B on the GPU: the measurement
# modules' `--set gear_group_kernel.ENABLED=0`).
ENABLED = True
THREADS = 256
# The dense kernel keeps a block's outlier mask as a bitmap in static shared memory (48 KB a block):
# blocks of up to this many entries (the 256 x 128 default: 32768, 4 KB).
MAX_BLOCK_ENTRIES = 1 << 17
# Launch grids' y (one per block of every head and batch row) are at most 65535 on CUDA.
MAX_ROWS = 65535
# Entries of the scores and dense kernels' tile where the groups allow (tile_shape): 16 KB of
# float32 in shared memory, with the dense kernel's bitmap (up to 16 KB) within the 48 KB.
TILE_ENTRIES = 4096

# A block per tile of a row (one block of NB x D entries, token-major): TT tokens x CB channels
# holding whole quantization groups (values, PC = 0: G consecutive channels of a token, CB = D;
# keys, PC = 1: G consecutive tokens of a channel, TT = G; tile_shape). The tile is loaded in
# runs of CB consecutive entries (coalesced) into shared memory, group by group: each group's G
# entries then one spare word (GS = G + 1), so the threads that each walk one group read
# different banks. The sums of a group run over its entries in order, as before.
_TILE = r"""
  constexpr int E = NB * D;
  constexpr int TE = TT * CB;         // entries of the tile
  constexpr int NGT = TE / G;         // its groups
  constexpr int GS = G + 1;
  constexpr int NCB = D / CB;         // tiles across the channels
  const size_t row = blockIdx.y;
  const int t0 = (blockIdx.x / NCB) * TT, c0 = (blockIdx.x % NCB) * CB;
  const float* x = blocks + row * (size_t)E;
  __shared__ float xs[NGT * GS];
  __shared__ float centre[NGT];
  // Tile entry (tt, cl) <-> (its group, its place in the group).
  const auto slot = [](int tt, int cl) {
    return PC ? ((tt / G) * CB + cl) * GS + tt % G : (tt * (CB / G) + cl / G) * GS + cl % G;
  };
  const auto token_of = [](int g, int i) { return PC ? (g / CB) * G + i : g / (CB / G); };
  const auto channel_of = [](int g, int i) { return PC ? g % CB : (g % (CB / G)) * G + i; };
  const auto entry = [&](int tt, int cl) { return (t0 + tt) * D + c0 + cl; };
#pragma unroll 4
  for (int j = threadIdx.x; j < TE; j += NT) {
    const int tt = j / CB, cl = j - tt * CB;
    xs[slot(tt, cl)] = x[entry(tt, cl)];
  }
  __syncthreads();
"""

_SCORES_SOURCE = _TILE + r"""
  // Each group's mean, its entries summed in order from 0 (MLX's CPU reduction's order).
  for (int g = threadIdx.x; g < NGT; g += NT) {
    float sum = 0.0f;
    for (int i = 0; i < G; ++i) sum = __fadd_rn(sum, xs[g * GS + i]);
    centre[g] = __fdiv_rn(sum, (float)G);
  }
  __syncthreads();
  float* s = scores + row * (size_t)E;
#pragma unroll 4
  for (int j = threadIdx.x; j < TE; j += NT) {
    const int tt = j / CB, cl = j - tt * CB;
    const int at = slot(tt, cl);
    s[entry(tt, cl)] = -fabsf(__fsub_rn(xs[at], centre[at / GS]));
  }
"""

_DENSE_SOURCE = _TILE + r"""
  // The row's outliers as a bitmap (every thread of the block helps).
  constexpr int WORDS = (E + 31) / 32;
  __shared__ unsigned picked[WORDS];
  for (int w = threadIdx.x; w < WORDS; w += NT) picked[w] = 0u;
  __syncthreads();
  const unsigned* p = picks + row * (size_t)NO;
  for (int i = threadIdx.x; i < NO; i += NT) atomicOr(&picked[p[i] >> 5], 1u << (p[i] & 31u));
  __syncthreads();
  // Each group's outliers replaced in the tile by the mean of its other entries (summed in
  // order; 0 when all are outliers: the ops' maximum(n, 1)).
  for (int g = threadIdx.x; g < NGT; g += NT) {
    float sum = 0.0f;
    int kept = 0;
    for (int i = 0; i < G; ++i) {
      const int e = entry(token_of(g, i), channel_of(g, i));
      if ((picked[e >> 5] >> (e & 31)) & 1u) continue;
      sum = __fadd_rn(sum, xs[g * GS + i]);
      ++kept;
    }
    const float fill = __fdiv_rn(sum, (float)(kept > 0 ? kept : 1));
    for (int i = 0; i < G; ++i) {
      const int e = entry(token_of(g, i), channel_of(g, i));
      if ((picked[e >> 5] >> (e & 31)) & 1u) xs[g * GS + i] = fill;
    }
  }
  __syncthreads();
  if (PC) {
    // Keys into (B*H, D, NBLK * NB), what mx.quantize takes: channel rows, written in runs of
    // TT consecutive tokens.
    const size_t bh = row / NBLK, blk = row - bh * NBLK;
#pragma unroll 4
    for (int j = threadIdx.x; j < TE; j += NT) {
      const int cl = j / TT, tt = j - cl * TT;
      dense[(bh * D + c0 + cl) * (size_t)(NBLK * NB) + blk * NB + t0 + tt] = vq_cast<T>(xs[slot(tt, cl)]);
    }
  } else {
    // Values into (B*H, NBLK * NB, D): the blocks' own layout.
    T* o = dense + row * (size_t)E;
#pragma unroll 4
    for (int j = threadIdx.x; j < TE; j += NT) {
      const int tt = j / CB, cl = j - tt * CB;
      o[entry(tt, cl)] = vq_cast<T>(xs[slot(tt, cl)]);
    }
  }
"""


# Q(D) and the residual D - Q(D) from mx.quantize's output, both written in the blocks' layout
# (B*H, NBLK * NB, D), each entry's code read from the packed row (keys: channel c's row of
# tokens; values: token t's row of channels) as a little-endian bit stream of KB bits per code
# (a 3-bit code may straddle two words). Values: one thread per entry, rows read and written
# along channels. Keys: their rows run along tokens, the outputs along channels, so a block
# takes a tile of 32 tokens x 32 channels, reads it token-fastest into shared memory (a row
# padded to 33 words) and writes it channel-fastest: both coalesced (one thread per entry in the
# output's order read the keys' dense part and codes 2 bytes at a time, one row per channel:
# 38 us against the values' 11 on the H100, results/ncu_prefill_chunk_h100_s42.json). As ops:
# two casts of the scales and zeros to float32, mx.dequantize, the keys' transposed copy of it,
# the dense part's cast and the subtraction: 5-6 launches per side. Bit for bit: scale * code
# is exact in float32 (a side-dtype scale of <= 11 significant bits times a code of <= 8 bits),
# so the one rounding of `+ zero` is MLX's whether or not it fuses them; the subtraction is
# the ops' float32 one.
_RESIDUAL_SOURCE = r"""
  constexpr int NTOK = NBLK * NB;
  constexpr unsigned MASK = (1u << KB) - 1u;
  constexpr int COLS = PC ? NTOK : D;
  // Q(D) at token t, channel c of head row bh, and the dense part there (as float).
  const auto entry = [&](size_t bh, int t, int c, float& dense_) {
    // The code's row and its place along it in mx.quantize's layout.
    const size_t qrow = PC ? bh * D + c : bh * NTOK + t;
    const int j = PC ? t : c;
    const unsigned* row = codes + qrow * (size_t)(COLS * KB / 32);
    const int bit = j * KB;
    const int w = bit >> 5, sh = bit & 31;
    unsigned q = row[w] >> sh;
    if (sh + KB > 32) q |= row[w + 1] << (32 - sh);
    q &= MASK;
    const size_t g = qrow * (size_t)(COLS / G) + j / G;
    dense_ = RES ? vq_f32(dense[qrow * (size_t)COLS + j]) : 0.0f;  // read only where a residual is made
    return __fadd_rn(__fmul_rn(vq_f32(scales[g]), (float)q), vq_f32(zeros[g]));
  };
  if (PC) {
    __shared__ float ta[PC ? 32 * 33 : 1], tr[PC ? 32 * 33 : 1];
    constexpr int TILES_C = (D + 31) / 32;
    const size_t bh = blockIdx.y;
    const int t0 = (blockIdx.x / TILES_C) * 32, c0 = (blockIdx.x % TILES_C) * 32;
    for (int k = threadIdx.x; k < 32 * 32; k += NT) {
      const int cl = k >> 5, tt = k & 31;  // tokens fastest: along the code and dense rows
      if (t0 + tt < NTOK && c0 + cl < D) {
        float dense_;
        const float approx_ = entry(bh, t0 + tt, c0 + cl, dense_);
        ta[cl * 33 + tt] = approx_;
        if (RES) tr[cl * 33 + tt] = __fsub_rn(dense_, approx_);
      }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < 32 * 32; k += NT) {
      const int tt = k >> 5, cl = k & 31;  // channels fastest: along the output rows
      if (t0 + tt < NTOK && c0 + cl < D) {
        const size_t at = (bh * NTOK + t0 + tt) * (size_t)D + c0 + cl;
        approx[at] = ta[cl * 33 + tt];
        if (RES) residual[at] = tr[cl * 33 + tt];
      }
    }
  } else {
    const size_t total = (size_t)BH * NTOK * D;
    const size_t at = (size_t)blockIdx.x * NT + threadIdx.x;
    if (at >= total) return;
    const int c = (int)(at % D);
    const size_t bt = at / D;
    float dense_;
    const float approx_ = entry(bt / NTOK, (int)(bt % NTOK), c, dense_);
    approx[at] = approx_;
    if (RES) residual[at] = __fsub_rn(dense_, approx_);
  }
"""


# Each kernel's inputs and outputs, by the part it computes (its source: _<PART>_SOURCE, looked up
# when built, so a test may change it).
_SIGNATURES = {
    "scores": (["blocks"], ["scores"]),
    "dense": (["blocks", "picks"], ["dense"]),
    "residual": (["dense", "codes", "scales", "zeros"], ["approx", "residual"]),
}


@lru_cache(maxsize=None)
def _kernel(part: str):
    inputs, outputs = _SIGNATURES[part]
    return build_kernel(
        mx.fast.cuda_kernel,
        name=f"vq_gear_group_{part}",
        input_names=inputs,
        output_names=outputs,
        source=globals()[f"_{part.upper()}_SOURCE"],
        header=kernel_header.HEADER + _ROUNDING,
    )


def enabled() -> bool:
    """Whether GEAR's per-group passes run through these kernels: MLX's CUDA backend, kernels on
    (fused_decode.kernels_enabled, VELOXQUANT_CUDA_KERNELS), and ENABLED."""
    return ENABLED and fused_decode.kernels_enabled()


def applies(blocks_shape: tuple, group: int, per_channel: bool) -> bool:
    """`enabled`, and blocks (B, H, n_blocks, nb, d) this launch takes: groups that tile the
    block along their axis (GEARCache checks the same), its bitmap in shared memory, its rows
    within a grid's y."""
    B, H, n_blocks, nb, d = blocks_shape
    tiled = (nb if per_channel else d) % group == 0
    return (enabled() and tiled and nb * d <= MAX_BLOCK_ENTRIES and B * H * n_blocks <= MAX_ROWS
            and _dense_shared_bytes(nb, d, group, per_channel) <= kernel_header.STATIC_SHARED_BYTES)


def _dense_shared_bytes(nb: int, d: int, group: int, per_channel: bool) -> int:
    """The dense kernel's static shared memory (the scores kernel's less the bitmap): the tile's
    groups with their spare words, one float per group, the row's bitmap."""
    tt, cb = tile_shape(nb, d, group, per_channel)
    groups = tt * cb // group
    return 4 * (groups * (group + 1) + groups + (nb * d + 31) // 32)


def tile_shape(nb: int, d: int, group: int, per_channel: bool) -> tuple[int, int]:
    """(TT tokens, CB channels) of the scores and dense kernels' tile: whole groups, at most
    TILE_ENTRIES entries where the groups allow (values: whole rows of d channels, as many
    tokens as fit; keys: `group` tokens, as many channels as fit, dividing d)."""
    if per_channel:
        return group, _largest_divisor(d, max(1, TILE_ENTRIES // group))
    return _largest_divisor(nb, max(1, TILE_ENTRIES // d)), d


def _largest_divisor(n: int, at_most: int) -> int:
    return max(k for k in range(1, min(n, at_most) + 1) if n % k == 0)


def _launch(kernel, inputs: list, blocks: mx.array, group: int, per_channel: bool, template: list,
            output_shape: tuple, output_dtype: mx.Dtype) -> mx.array:
    B, H, n_blocks, nb, d = blocks.shape
    tt, cb = tile_shape(nb, d, group, per_channel)
    tiles = (nb // tt) * (d // cb)
    return kernel(
        inputs=inputs,
        template=[("NB", nb), ("D", d), ("G", group), ("PC", int(per_channel)), ("NBLK", n_blocks), ("TT", tt),
                  ("CB", cb), ("NT", THREADS), *template],
        grid=(tiles * THREADS, B * H * n_blocks, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[output_shape],
        output_dtypes=[output_dtype],
    )[0]


def scores(blocks: mx.array, group: int, per_channel: bool) -> mx.array:
    """blocks (B, H, n_blocks, nb, d) float32 -> (B, H, n_blocks, nb * d): each entry's
    -|x - its group's mean| (gear_outliers.outlier_scores with gear_encoder.group_means)."""
    B, H, n_blocks, nb, d = blocks.shape
    return _launch(_kernel("scores"), [blocks], blocks, group, per_channel, [], (B, H, n_blocks, nb * d), mx.float32)


def dense(blocks: mx.array, picks: mx.array, group: int, per_channel: bool, side_dtype: mx.Dtype) -> mx.array:
    """blocks (B, H, n_blocks, nb, d) float32, picks (B, H, n_blocks, count) uint32 positions over
    nb * d (distinct) -> the dense part in side_dtype: each pick replaced by the mean of the other
    entries of its group; keys (per_channel) as (B, H, d, n_blocks * nb), what mx.quantize takes,
    values as (B, H, n_blocks * nb, d)."""
    B, H, n_blocks, nb, d = blocks.shape
    n = n_blocks * nb
    shape = (B, H, d, n) if per_channel else (B, H, n, d)
    return _launch(_kernel("dense"), [blocks, picks.astype(mx.uint32)], blocks, group, per_channel,
                   [("NO", picks.shape[-1]), ("T", side_dtype)], shape, side_dtype)


def approx_and_residual(dense: mx.array, codes: mx.array, scales: mx.array, zeros: mx.array, bits: int,
                        group: int, per_channel: bool, blocks_shape: tuple,
                        with_residual: bool = True) -> tuple[mx.array, mx.array | None]:
    """dense in the side dtype as mx.quantize took it (keys (B, H, d, n), values (B, H, n, d)) and
    mx.quantize's codes, scales and zeros for it (bits 2, 3, 4 or 8) -> (Q(D), D - Q(D)), both
    blocks_shape (B, H, n_blocks, nb, d) float32: bit for bit gear_encoder.quantized's ops.
    Not `with_residual` (no low rank to fit it): Q(D) and None, the residual not written."""
    B, H, n_blocks, nb, d = blocks_shape
    if per_channel:  # a block per 32 x 32 tile of each head row
        grid = (-(-n_blocks * nb // 32) * -(-d // 32) * THREADS, B * H, 1)
    else:  # a thread per entry
        grid = (-(-(B * H * n_blocks * nb * d) // THREADS) * THREADS, 1, 1)
    approx, residual = _kernel("residual")(
        inputs=[dense, codes, scales, zeros],
        template=[("BH", B * H), ("NBLK", n_blocks), ("NB", nb), ("D", d), ("G", group), ("KB", bits),
                  ("PC", int(per_channel)), ("RES", int(with_residual)), ("NT", THREADS)],
        grid=grid,
        threadgroup=(THREADS, 1, 1),
        output_shapes=[blocks_shape, blocks_shape if with_residual else (1,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return approx, residual if with_residual else None
