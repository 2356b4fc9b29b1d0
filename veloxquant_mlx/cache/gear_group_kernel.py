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
sides, in 30 launches. Here: 2 launches per side, one thread per group, reading the group's
entries from the float32 blocks (L1 keeps a thread's 32 values' line between its two passes),
and a third after mx.quantize in place of 5-6 (bit for bit, on CUDA as well).

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

# One thread per group: `gi` its index in the block (the row `blockIdx.y` of NB x D entries),
# `first` / `STEP` where its G entries lie in the block. Consecutive threads take consecutive
# channels (keys) or channel groups (values), so the keys' loads are coalesced.
_GROUP = r"""
  constexpr int E = NB * D;
  constexpr int NG = E / G;
  const size_t row = blockIdx.y;
  const int gi = blockIdx.x * blockDim.x + threadIdx.x;
  const int tg = PC ? gi / D : gi / (D / G);
  const int c = PC ? gi - tg * D : (gi - tg * (D / G)) * G;
  const int first = PC ? tg * G * D + c : tg * D + c;
  constexpr int STEP = PC ? D : 1;
  const float* x = blocks + row * (size_t)E;
"""

_SCORES_SOURCE = _GROUP + r"""
  if (gi >= NG) return;
  float sum = 0.0f;
  for (int i = 0; i < G; ++i) sum = __fadd_rn(sum, x[first + i * STEP]);
  const float mean = __fdiv_rn(sum, (float)G);
  float* s = scores + row * (size_t)E;
  for (int i = 0; i < G; ++i) {
    const int e = first + i * STEP;
    s[e] = -fabsf(__fsub_rn(x[e], mean));
  }
"""

_DENSE_SOURCE = _GROUP + r"""
  // The block's outliers as a bitmap (every thread of the block helps, then some leave).
  constexpr int WORDS = (E + 31) / 32;
  __shared__ unsigned picked[WORDS];
  for (int w = threadIdx.x; w < WORDS; w += blockDim.x) picked[w] = 0u;
  __syncthreads();
  const unsigned* p = picks + row * (size_t)NO;
  for (int i = threadIdx.x; i < NO; i += blockDim.x) atomicOr(&picked[p[i] >> 5], 1u << (p[i] & 31u));
  __syncthreads();
  if (gi >= NG) return;
  // The mean of the group's entries that are not outliers (0 when all are: the ops' maximum(n, 1)).
  float sum = 0.0f;
  int kept = 0;
  for (int i = 0; i < G; ++i) {
    const int e = first + i * STEP;
    if (!((picked[e >> 5] >> (e & 31)) & 1u)) { sum = __fadd_rn(sum, x[e]); ++kept; }
  }
  const float fill = __fdiv_rn(sum, (float)(kept > 0 ? kept : 1));
  // Keys (PC) into (B*H, D, NBLK * NB): channel c's row, this block's tokens tg * G + i; values
  // into (B*H, NBLK * NB, D), the block's entries where they are.
  const size_t bh = row / NBLK, blk = row - bh * NBLK;
  T* o = PC ? dense + (bh * D + c) * (size_t)(NBLK * NB) + blk * NB + (size_t)tg * G
            : dense + row * (size_t)E + first;
  for (int i = 0; i < G; ++i) {
    const int e = first + i * STEP;
    o[i] = vq_cast<T>(((picked[e >> 5] >> (e & 31)) & 1u) ? fill : x[e]);
  }
"""


# Q(D) and the residual D - Q(D) from mx.quantize's output, one thread per entry of the
# blocks (B*H, NBLK * NB, D) layout both are written in (coalesced), the entry's code read from
# the packed row (keys: channel c's row of tokens; values: token t's row of channels) as a
# little-endian bit stream of KB bits per code (a 3-bit code may straddle two words). As ops:
# two casts of the scales and zeros to float32, mx.dequantize, the keys' transposed copy of it,
# the dense part's cast and the subtraction: 5-6 launches per side. Bit for bit: scale * code
# is exact in float32 (a side-dtype scale of <= 11 significant bits times a code of <= 8 bits),
# so the one rounding of `+ zero` is MLX's whether or not it fuses them; the subtraction is
# the ops' float32 one.
_RESIDUAL_SOURCE = r"""
  constexpr int NTOK = NBLK * NB;
  constexpr unsigned MASK = (1u << KB) - 1u;
  const size_t total = (size_t)BH * NTOK * D;
  const size_t at = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (at >= total) return;
  const int c = (int)(at % D);
  const size_t bt = at / D;
  const int t = (int)(bt % NTOK);
  const size_t bh = bt / NTOK;
  // The code's row and its place along it in mx.quantize's layout.
  const size_t qrow = PC ? bh * D + c : bt;
  const int j = PC ? t : c;
  constexpr int COLS = PC ? NTOK : D;
  const unsigned* row = codes + qrow * (size_t)(COLS * KB / 32);
  const int bit = j * KB;
  const int w = bit >> 5, sh = bit & 31;
  unsigned q = row[w] >> sh;
  if (sh + KB > 32) q |= row[w + 1] << (32 - sh);
  q &= MASK;
  const size_t g = qrow * (size_t)(COLS / G) + j / G;
  const float approx_ = __fadd_rn(__fmul_rn(vq_f32(scales[g]), (float)q), vq_f32(zeros[g]));
  approx[at] = approx_;
  if (RES) residual[at] = __fsub_rn(vq_f32(dense[qrow * (size_t)COLS + j]), approx_);
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
    return enabled() and tiled and nb * d <= MAX_BLOCK_ENTRIES and B * H * n_blocks <= MAX_ROWS


def _launch(kernel, inputs: list, blocks: mx.array, group: int, per_channel: bool, template: list,
            output_shape: tuple, output_dtype: mx.Dtype) -> mx.array:
    B, H, n_blocks, nb, d = blocks.shape
    groups = nb * d // group
    return kernel(
        inputs=inputs,
        template=[("NB", nb), ("D", d), ("G", group), ("PC", int(per_channel)), ("NBLK", n_blocks), *template],
        grid=(-(-groups // THREADS) * THREADS, B * H * n_blocks, 1),
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
    total = B * H * n_blocks * nb * d
    approx, residual = _kernel("residual")(
        inputs=[dense, codes, scales, zeros],
        template=[("BH", B * H), ("NBLK", n_blocks), ("NB", nb), ("D", d), ("G", group), ("KB", bits),
                  ("PC", int(per_channel)), ("RES", int(with_residual))],
        grid=(-(-total // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[blocks_shape, blocks_shape if with_residual else (1,)],
        output_dtypes=[mx.float32, mx.float32],
    )
    return approx, residual if with_residual else None
