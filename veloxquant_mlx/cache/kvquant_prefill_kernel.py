"""KVQuant's prefill history decode on MLX's CUDA backend: one kernel per part (keys, values).

A prefill chunk's attention reads the layer's whole history decoded (KVQuantCache.
_prefill_keys_values). As MLX ops that is ~14 launches per piece of at most 4096 tokens and
float32 intermediates (unpacked codes, gathered levels, the product, the sum, the outlier
scatter's copy, the casts). Here one CUDA block per stored block (G tokens of one batch row and
head) reads the block's levels, scales and zeros once into shared memory, its threads each
decode packed uint32 words (looking the codes up, applying the channel's scale and zero for
keys, the token's for values), then, after a barrier, a thread per exact outlier writes it over
its entry, and in the first block the exact sink over token 0, all in a shared-memory tile that
is then copied out in 16-byte vectors (`STAGE_BYTES`; larger blocks write each phase straight
to global memory). The result is stored in the output dtype in the (B, H, history + window, D)
array the fused attention reads, and the grid's last blocks copy the exact window after it
(cast to the output dtype as the ops' astype; until session 16 a slice write after the launch).
Per part and prompt chunk: one launch for the whole history and the window, reading the packed
codes (3 bits per element) and writing 16 bits per element (bf16), no float32 array at all.

Until session 16 a thread per word also looped over all of its block's outliers to find its
own, keeping its decoded values in an array indexed by the outlier's position (local memory):
on the H200 that version's value decode took 0.49 ms at 30K history, the keys' 0.19
(Nsight Compute, results/ncu_prefill_chunk_h200_s14.json), where writing the output alone is
~0.02 ms of DRAM time.

Bit for bit the MLX ops' result (tests/cache/test_kvquant_prefill_kernel_emulated.py under the
CPU emulation; on CUDA test_kvquant_prefill_kernel_cuda in the same file):
  - level * scale then + zero as two float32 roundings, __fmul_rn / __fadd_rn, which nvrtc
    never contracts into an FMA (the MLX ops round twice);
  - then cast to the cache dtype and to the output dtype (vq_cast: round to nearest even, as
    MLX's astype), as `_decode` and the base's prefill do;
  - an outlier or the sink is a value of the cache dtype: widened to float32 and rounded back
    it is unchanged, so writing it cast straight to the output dtype is what the ops give;
    the sink is written last (it overrides an outlier of token 0, as in `_finish`).
The template holds no length, so one compile serves every history length; the capacities and
the output's length come in `meta`.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.errors import QuantizerConfigError

THREADS = 128
# The largest block (G x head_dim outputs, bytes) decoded in shared memory and copied out in
# 16-byte vectors; larger ones write their outputs straight to global memory. 0: every block
# straight, as before session 16's staging (for an A/B: prefill_chunks --alternate
# kvquant_prefill_kernel.STAGE_BYTES=0). With the levels, scales and zeros it stays under
# CUDA's 48 KB of static shared memory per block.
STAGE_BYTES = 32768

_ROUNDING = r"""
#if !defined(__CUDACC__)
// Only for compilers without CUDA's intrinsics (the CPU emulation): plain float ops, which
// round each result once as __fmul_rn / __fadd_rn do.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
#endif
"""

_SOURCE = r"""
  // meta: n_blocks decoded, capacity in blocks, capacity in tokens, output tokens.
  // One CUDA block per (stored block, batch x head): grid (n_blocks * THREADS, B * H).
  // Blocks past n_blocks copy the exact window after the history, G tokens each.
  const int nb = meta[0], cap_blocks = meta[1], cap_tokens = meta[2], out_tokens = meta[3];
  constexpr int PER = 32 / BITS;
  constexpr int W = (G * D + PER - 1) / PER;
  constexpr int SIDE = PER_TOKEN ? G : D;  // one scale and zero per token (values) or channel (keys)
  const int bh = blockIdx.y, blk = blockIdx.x, tid = threadIdx.x;
  if (blk >= nb) {
    const int n_window = out_tokens - nb * G, first = (blk - nb) * G;
    const int count = min(G, n_window - first) * D;
    const WT* src = window + ((size_t)bh * n_window + first) * D;
    OT* to = out + ((size_t)bh * out_tokens + (size_t)nb * G + first) * D;
    for (int c = tid; c < count; c += blockDim.x) to[c] = vq_cast<OT>(vq_f32(src[c]));
    return;
  }
  const size_t row = (size_t)bh * cap_blocks + blk;
  const size_t side0 = PER_TOKEN ? (size_t)bh * cap_tokens + (size_t)blk * G : row * D;
  // The block's levels, scales and zeros read once into shared memory as float32, where each
  // element would otherwise load its scale and zero again (the scale and zero rows are shared by
  // all of a block's G * D elements).
  __shared__ float levels[1 << BITS];
  __shared__ float sc[SIDE];
  __shared__ float zr[SIDE];
  if (tid < (1 << BITS)) levels[tid] = codebook[(size_t)bh * (1 << BITS) + tid];
  for (int s = tid; s < SIDE; s += blockDim.x) {
    sc[s] = vq_f32(scale[side0 + s]);
    zr[s] = vq_f32(zero[side0 + s]);
  }
  OT* dst = out + ((size_t)bh * out_tokens + (size_t)blk * G) * D;  // the block's G tokens
  // The block is decoded into shared memory, its outliers and sink written over it there, then
  // copied out in 16-byte vectors: a thread's PER codes are PER adjacent outputs, so writing them
  // straight to global memory made each warp store touch ~PER x the sectors it filled (on the
  // H200 ~0.15 ms per part at 30K history against ~0.02 ms of DRAM time for the bytes). Blocks
  // too large for it (G * D outputs over STAGE_BYTES) or rows not a multiple of 16 bytes write
  // straight to global memory, each phase after a barrier.
  constexpr bool STAGE = G * D * sizeof(OT) <= STAGE_BYTES && (D * sizeof(OT)) % 16 == 0;
  __shared__ __align__(16) unsigned char tile_bytes[STAGE ? G * D * sizeof(OT) : 16];
  OT* buf = STAGE ? reinterpret_cast<OT*>(tile_bytes) : dst;
  __syncthreads();
  for (int w = tid; w < W; w += blockDim.x) {
    const unsigned word = codes[row * W + w];
    const int c0 = w * PER;
    #pragma unroll
    for (int j = 0; j < PER; ++j) {
      const int c = c0 + j;
      if (c >= G * D) break;
      const int s = PER_TOKEN ? c / D : c % D;
      const unsigned code = (word >> (j * BITS)) & ((1u << BITS) - 1u);
      const float x = __fadd_rn(__fmul_rn(levels[code], sc[s]), zr[s]);
      buf[c] = vq_cast_through<CT, OT>(x);
    }
  }
  // The exact outliers over their entries, then the exact sink over token 0: each after a
  // barrier, so that its write lands after the code's. A thread per entry.
  if (NO > 0) {
    __syncthreads();
    for (int o = tid; o < NO; o += blockDim.x) buf[positions[row * NO + o]] = vq_cast<OT>(vq_f32(exact[row * NO + o]));
  }
  if (SINK && blk == 0) {
    __syncthreads();
    for (int ch = tid; ch < D; ch += blockDim.x) buf[ch] = vq_cast<OT>(vq_f32(sink[(size_t)bh * D + ch]));
  }
  if (STAGE) {
    __syncthreads();
    constexpr int VECTORS = STAGE ? G * D * sizeof(OT) / 16 : 0;
    const uint4* from = reinterpret_cast<const uint4*>(tile_bytes);
    uint4* to = reinterpret_cast<uint4*>(dst);
    for (int i = tid; i < VECTORS; i += blockDim.x) to[i] = from[i];
  }
"""


@lru_cache(maxsize=None)
def _kernel():
    return build_kernel(
        mx.fast.cuda_kernel,
        name="vq_kvquant_history_decode",
        input_names=["codes", "scale", "zero", "codebook", "positions", "exact", "sink", "window", "meta"],
        output_names=["out"],
        source=_SOURCE,
        header=kernel_header.HEADER + _ROUNDING,
    )


def enabled() -> bool:
    """Whether the prefill decode runs through this kernel (MLX's CUDA backend, kernels on:
    fused_decode.kernels_enabled, VELOXQUANT_CUDA_KERNELS)."""
    return fused_decode.kernels_enabled()


def history_decode(codes, scale, zero, codebook, sparse, sink, window, *, n_blocks: int, group: int,
                   dim: int, bits: int, per_token: bool, cache_dtype, out_dtype) -> mx.array:
    """The first n_blocks blocks of one part decoded, then the exact window, into a new
    (B, H, n_blocks * group + window tokens, dim) array of out_dtype.

    codes (B, H, cap_blocks, W) uint32, scale / zero (B, H, cap_blocks, dim) for keys or
    (B, H, cap_tokens) for values (`per_token`), codebook (B, H, 2**bits), sparse None or
    (positions (B, H, cap_blocks, count) uint16, exact values), sink None or (B, H, 1, dim),
    window None or (B, H, w, dim) in the cache's dtype (read row-contiguous: MLX copies a
    strided one for the launch, as a slice write of it would read it)."""
    B, H = codes.shape[:2]
    side = scale.dtype
    positions, exact = sparse if sparse is not None else (
        fused_decode.absent_input(mx.uint16), fused_decode.absent_input(side))
    count = sparse[0].shape[-1] if sparse is not None else 0
    n_window = 0 if window is None else window.shape[2]
    if window is not None and window.dtype != cache_dtype:
        raise QuantizerConfigError(
            f"kvquant history decode: window dtype {window.dtype}; allowed is the cache's {cache_dtype}")
    out_tokens = n_blocks * group + n_window
    cap_tokens = scale.shape[2] if per_token else codes.shape[2] * group
    meta = mx.array([n_blocks, codes.shape[2], cap_tokens, out_tokens], dtype=mx.int32)
    # fit_codebook's levels are float32 already: then no cast op per launch.
    levels = codebook if codebook.dtype == mx.float32 else codebook.astype(mx.float32)
    grid_blocks = n_blocks + -(-n_window // group)
    return _kernel()(
        inputs=[codes, scale, zero, levels, positions, exact,
                sink if sink is not None else fused_decode.absent_input(side),
                window if window is not None else fused_decode.absent_input(cache_dtype), meta],
        template=[("G", group), ("D", dim), ("BITS", bits), ("PER_TOKEN", int(per_token)), ("NO", count),
                  ("SINK", int(sink is not None)), ("STAGE_BYTES", STAGE_BYTES), ("CT", cache_dtype), ("WT", cache_dtype),
                  ("OT", out_dtype)],
        grid=(grid_blocks * THREADS, B * H, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, out_tokens, dim)],
        output_dtypes=[out_dtype],
    )[0]
