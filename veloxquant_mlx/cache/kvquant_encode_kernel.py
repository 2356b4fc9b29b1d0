"""KVQuant's block encode on MLX's CUDA backend: the order-free part of a chunk's encode in one kernel.

KVQuantCache._encode (kvquant.py) turns each block of G tokens x D channels of one KV head into
packed codebook indices, a zero and a scale per vector (a channel over the block's tokens for
keys, a token for values) and `count` exact outliers. As MLX ops that is ~29 launches per part
(keys, values) and prompt chunk on a GPU (`python -m tests.cache.bench_kvquant_encode`): casts,
five reductions, an argpartition, a scatter of the outliers' holes, a gather of their values,
min / max, the normalization, the nearest level and the packing (a concatenation, a shifted sum).

What must stay MLX ops to keep the stored bits: the float32 sums (a vector's mean, variance
and the sum of its kept entries round differently in another order, and the order is that of
MLX's reduce kernels) and the argpartition (which entries it picks among ties, and the order it
stores them in, are its own). Everything else is order-free and is done here, per block by one
CUDA thread block:
  - `masked_blocks`: the block's entries as float32 times 0 at the outliers' positions and 1
    elsewhere (the ops' `x * keep.astype(float32)`, the same products); MLX then sums it along
    the vector (the ops' `kept`): one launch instead of the scatter's three (two fills and the
    scatter) and the product's one;
  - `encode_blocks`: each vector's kept count (an integer: exact in any order), its fill (kept
    sum / max(count, 1), one IEEE division), its min and max over the dense entries (outliers
    replaced by the fill), zero = (hi + lo) * 0.5 and scale = max((hi - lo) * 0.5, MIN_SCALE)
    rounded to the cache dtype, then every entry normalized ((x - zero) / scale in float32),
    compared with the codebook's midpoints ((l[k+1] + l[k]) * 0.5) and packed 32 // bits codes
    to a uint32 word in the block's row-major order, padding codes 0; and the outliers' exact
    values. Every float op is the ops' op in the same order, written with CUDA's
    round-to-nearest intrinsics (__fadd_rn, __fsub_rn, __fmul_rn, __fdiv_rn), which nvrtc never
    contracts into an FMA, so the result does not depend on --fmad.
The outlier selection is sparse_outliers.outlier_ranking, compiled as before: a cast to float32
(bf16 / fp16 caches), the mean's and the variance's sums, two fused kernels, the argpartition; the
kernels read the argpartition's output in place (its first `count` entries per block are the
positions) and write the uint16 positions themselves (the ops' slice and cast: a launch).
Counted for one layer of 8 KV heads x 128, a 2048-token chunk, 1% outliers (`python -m
tests.cache.bench_kvquant_encode`, results/kvquant_encode_s6.json against main 4954451 in
kvquant_encode_s6_main.json; a primitive of the lazy graph ~ a launch on a GPU): a later
chunk's encode 60 -> 18 primitives in bf16 (58 -> 16 in float32), the layer's whole later
prefill chunk (append, history decode, attention, encode) 104 -> 62; host syncs 0 before and
after. Not timed on a GPU.

Where the ops' answer depends on an order the kernel cannot know, it takes a fixed rule: min and
max treat -0.0 as below +0.0 (only the sign of a stored zero of an all-zero vector can depend on
it), and NaN entries are not handled (K/V entries are finite). A cache's first chunk keeps the
MLX ops (its codebooks are fitted on the normalized values, which this kernel never writes out).

Bit for bit the ops' encode on the CPU through tests/cache/cuda_emulation.py
(tests/cache/test_kvquant_encode_kernel.py); on CUDA its `@cuda_test` case compares with the ops
there; nvcc -arch=sm_90 compiles it without spills (its slow test). Not yet compiled by nvrtc
nor timed on a GPU (no device time this session).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.kernel_name import build_kernel

# False: the MLX ops instead, whatever the backend (for an A/B on the GPU: the measurement
# modules' `--set kvquant_encode_kernel.ENABLED=0`).
ENABLED = True
THREADS = 128
# The block's hole flags are one byte per entry of static shared memory (48 KB per block):
# larger blocks (G * D over this) keep the MLX ops.
MAX_BLOCK_ENTRIES = 32768

_ROUNDING = r"""
#if !defined(__CUDACC__)
// Only for compilers without CUDA's intrinsics (the CPU emulation): plain float ops, which
// round each result once as the _rn intrinsics do (x86-64 without FMA contraction).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
#endif
"""

# One CUDA block per (batch, head, block): blockIdx.x. Hole flags of the block's entries in
# shared memory, set from its outliers' positions (read by both kernels).
_HOLES = r"""
  constexpr int E = G * D;
  const size_t blk = blockIdx.x;
  const int tid = threadIdx.x;
  __shared__ unsigned char hole[E];
  for (int e = tid; e < E; e += blockDim.x) hole[e] = 0;
  __syncthreads();
  // ranking: RS entries per block whose first NO are the outliers' positions: the block's
  // argpartition read in place (RS = E: sparse_outliers.outlier_ranking) or the selection
  // kernel's picks (RS = NO: outlier_select_kernel.py).
  if (NO > 0) {
    for (int o = tid; o < NO; o += blockDim.x) hole[ranking[blk * RS + o]] = 1;
  }
  __syncthreads();
  const CT* x = blocks + blk * E;
"""

_MASKED_SOURCE = _HOLES + r"""
  for (int e = tid; e < E; e += blockDim.x) masked[blk * E + e] = __fmul_rn(vq_f32(x[e]), hole[e] ? 0.0f : 1.0f);
"""

_ENCODE_SOURCE = _HOLES + r"""
  // PER_CHANNEL: a vector is a channel over the block's G tokens (keys), else a token (values).
  constexpr int NV = PER_CHANNEL ? D : G;
  constexpr int L = PER_CHANNEL ? G : D;
  constexpr int K = 1 << BITS;
  constexpr int PER = 32 / BITS;
  constexpr int W = (E + PER - 1) / PER;
  const size_t bh = blk / (size_t)meta[0];
  __shared__ float fill[NV], z32[NV], s32[NV], mids[K - 1];
  if (tid < K - 1) {
    const float* levels = codebook + bh * K;
    mids[tid] = __fmul_rn(__fadd_rn(levels[tid + 1], levels[tid]), 0.5f);
  }
  if (NO > 0) {
    for (int o = tid; o < NO; o += blockDim.x) {
      const unsigned p = ranking[blk * RS + o];
      positions[blk * NO + o] = (unsigned short)p;
      exact[blk * NO + o] = x[p];
    }
  }
  for (int v = tid; v < NV; v += blockDim.x) {
    float f = 0.0f;
    if (NO > 0) {
      int n = 0;
      for (int i = 0; i < L; ++i) n += hole[PER_CHANNEL ? i * D + v : v * D + i] ? 0 : 1;
      f = __fdiv_rn(kept[blk * NV + v], (float)(n > 0 ? n : 1));
    }
    float lo = 0.0f, hi = 0.0f;
    for (int i = 0; i < L; ++i) {
      const int e = PER_CHANNEL ? i * D + v : v * D + i;
      const float d = hole[e] ? f : vq_f32(x[e]);
      if (i == 0) { lo = d; hi = d; continue; }
      // -0.0 below +0.0 (the ops' min / max leave that tie to their order; see the docstring).
      const bool negative = (__float_as_uint(d) >> 31) != 0u;
      if (d < lo || (d == lo && negative)) lo = d;
      if (d > hi || (d == hi && !negative)) hi = d;
    }
    const CT zero_c = vq_cast<CT>(__fmul_rn(__fadd_rn(hi, lo), 0.5f));
    const float half_range = __fmul_rn(__fsub_rn(hi, lo), 0.5f);
    const CT scale_c = vq_cast<CT>(half_range > MIN_SCALE ? half_range : MIN_SCALE);
    zero[blk * NV + v] = zero_c;
    scale[blk * NV + v] = scale_c;
    fill[v] = f;
    z32[v] = vq_f32(zero_c);
    s32[v] = vq_f32(scale_c);
  }
  __syncthreads();
  for (int w = tid; w < W; w += blockDim.x) {
    unsigned word = 0u;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int c = w * PER + j;
      if (c >= E) break;
      const int v = PER_CHANNEL ? c % D : c / D;
      const float d = hole[c] ? fill[v] : vq_f32(x[c]);
      const float normalized = __fdiv_rn(__fsub_rn(d, z32[v]), s32[v]);
      unsigned code = 0u;
      #pragma unroll
      for (int k = 0; k < K - 1; ++k) code += normalized > mids[k] ? 1u : 0u;
      word |= code << (j * BITS);
    }
    codes[blk * W + w] = word;
  }
"""


@lru_cache(maxsize=None)
def _masked_kernel():
    return build_kernel(
        mx.fast.cuda_kernel,
        name="vq_kvquant_encode_masked",
        input_names=["blocks", "ranking"],
        output_names=["masked"],
        source=_MASKED_SOURCE,
        header=kernel_header.HEADER + _ROUNDING,
    )


@lru_cache(maxsize=None)
def _encode_kernel(min_scale: float):
    # The smallest scale as an exact hexadecimal float literal (template values are integers
    # and types only).
    constant = f"  constexpr float MIN_SCALE = {float(min_scale).hex()}f;\n"
    return build_kernel(
        mx.fast.cuda_kernel,
        name="vq_kvquant_block_encode",
        input_names=["blocks", "ranking", "kept", "codebook", "meta"],
        output_names=["codes", "zero", "scale", "positions", "exact"],
        source=constant + _ENCODE_SOURCE,
        header=kernel_header.HEADER + _ROUNDING,
    )


def enabled() -> bool:
    """Whether a later chunk's encode runs through these kernels (MLX's CUDA backend, kernels
    on: fused_decode.kernels_enabled, VELOXQUANT_CUDA_KERNELS) and ENABLED."""
    return ENABLED and fused_decode.kernels_enabled()


def fits(group: int, dim: int) -> bool:
    """Whether a (group, dim) block fits the kernels' shared hole flags."""
    return group * dim <= MAX_BLOCK_ENTRIES


def _launch(kernel, blocks: mx.array, inputs: list, template: list, shapes: list, dtypes: list) -> list:
    B, H, nb = blocks.shape[:3]
    n = B * H * nb
    return kernel(
        inputs=[blocks, *inputs],
        template=template,
        grid=(n * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=shapes,
        output_dtypes=dtypes,
    )


def masked_blocks(blocks: mx.array, ranking: mx.array, count: int) -> mx.array:
    """blocks (B, H, nb, G, D) in the cache dtype, ranking (B, H, nb, G * D) uint32 (the
    outliers' positions first: sparse_outliers.outlier_ranking) or (B, H, nb, count) (just
    them: outlier_select_kernel.smallest) -> float32 blocks with the `count` outliers' entries
    multiplied by 0 and the others by 1."""
    G, D = blocks.shape[3:]
    template = [("G", G), ("D", D), ("NO", count), ("RS", ranking.shape[-1]), ("CT", blocks.dtype)]
    return _launch(_masked_kernel(), blocks, [ranking], template, [blocks.shape], [mx.float32])[0]


def encode_blocks(blocks: mx.array, codebook: mx.array, bits: int, per_channel: bool, min_scale: float,
                  count: int = 0, ranking: mx.array | None = None, kept: mx.array | None = None) -> tuple:
    """One part's blocks encoded -> (codes (B, H, nb, words) uint32, zero, scale (B, H, nb,
    vectors) in the blocks' dtype, outlier positions (B, H, nb, count) uint16 and exact values
    in the blocks' dtype, or None, None without outliers).

    blocks (B, H, nb, G, D) in the cache dtype; codebook (B, H, 2**bits) sorted levels;
    `per_channel`: the vectors are channels (keys) else tokens (values); with `count`
    outliers, ranking (B, H, nb, G * D) or (B, H, nb, count) uint32 (`masked_blocks`) and kept
    (B, H, nb, vectors) float32, the sums of the vectors' kept entries (`masked_blocks` summed
    along the vector by MLX)."""
    B, H, nb, G, D = blocks.shape
    dtype = blocks.dtype
    vectors = D if per_channel else G
    per = 32 // bits
    words = (G * D + per - 1) // per
    if not count:
        ranking, kept = fused_decode.absent_input(mx.uint32), fused_decode.absent_input(mx.float32)
    stride = ranking.shape[-1] if count else 0
    template = [("G", G), ("D", D), ("BITS", bits), ("PER_CHANNEL", int(per_channel)), ("NO", count), ("RS", stride),
                ("CT", dtype)]
    meta = mx.array([nb], dtype=mx.int32)
    sparse_shape = (B, H, nb, count) if count else (1,)
    codes, zero, scale, positions, exact = _launch(
        _encode_kernel(min_scale), blocks, [ranking, kept, codebook.astype(mx.float32), meta], template,
        [(B, H, nb, words), (B, H, nb, vectors), (B, H, nb, vectors), sparse_shape, sparse_shape],
        [mx.uint32, dtype, dtype, mx.uint16, dtype],
    )
    return (codes, zero, scale, positions, exact) if count else (codes, zero, scale, None, None)
