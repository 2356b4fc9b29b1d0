"""KVQuant's prefill history decode on MLX's CUDA backend: one kernel per part (keys, values).

A prefill chunk's attention reads the layer's whole history decoded (KVQuantCache.
_prefill_keys_values). As MLX ops that is ~14 launches per piece of at most 4096 tokens and
float32 intermediates (unpacked codes, gathered levels, the product, the sum, the outlier
scatter's copy, the casts). Here one thread per packed uint32 word of a block reads the word,
looks its codes up in the head's codebook, applies the block's channel scale and zero (keys)
or the token's (values), writes the block's exact outliers and the exact sink over their
entries, and stores the result in the output dtype, straight into the (B, H, history + window,
D) array the fused attention reads; the window is then written after it (one slice update).
Per part and prompt chunk: one launch for the whole history, reading the packed codes (3 bits
per element) and writing 16 bits per element (bf16), no float32 array at all.

Bit for bit the MLX ops' result (tests/cache/test_kvquant_prefill_kernel_emulated.py under the
CPU emulation; on CUDA test_kvquant_prefill_kernel_cuda in the same file):
  - level * scale then + zero as two float32 roundings, __fmul_rn / __fadd_rn, which nvrtc
    never contracts into an FMA (the MLX ops round twice);
  - then cast to the cache dtype and to the output dtype (vq_cast: round to nearest even, as
    MLX's astype), as `_decode` and the base's prefill do;
  - an outlier or the sink is a value of the cache dtype: widened to float32 and rounded back
    it is unchanged, so writing it cast straight to the output dtype is what the ops give;
    the sink is written last (it overrides an outlier of token 0, as in `_finish`).
Not yet compiled by nvrtc nor timed on a GPU (no device time this session; nvcc -arch=sm_90
compiles it: test_kvquant_prefill_kernel_emulated.py's nvcc test). The template holds no
length, so one compile serves every history length; n_blocks etc. come in `meta`.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.cache.kernel_name import build_kernel

THREADS = 256

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
  const int nb = meta[0], cap_blocks = meta[1], cap_tokens = meta[2], out_tokens = meta[3];
  constexpr int PER = 32 / BITS;
  constexpr int W = (G * D + PER - 1) / PER;
  const int bh = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= nb * W) return;
  const int blk = i / W, w = i % W, c0 = w * PER;
  const size_t row = (size_t)bh * cap_blocks + blk;
  const unsigned word = codes[row * W + w];
  const float* levels = codebook + (size_t)bh * (1 << BITS);
  OT vals[PER];
  #pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int c = c0 + j;
    if (c >= G * D) break;
    const int t = c / D, ch = c % D;
    const size_t side = PER_TOKEN ? (size_t)bh * cap_tokens + (size_t)blk * G + t : row * D + ch;
    const unsigned code = (word >> (j * BITS)) & ((1u << BITS) - 1u);
    const float x = __fadd_rn(__fmul_rn(levels[code], vq_f32(scale[side])), vq_f32(zero[side]));
    vals[j] = vq_cast<OT>(vq_f32(vq_cast<CT>(x)));
  }
  if (NO > 0) {
    for (int o = 0; o < NO; ++o) {
      const int p = (int)positions[row * NO + o] - c0;
      if (p >= 0 && p < PER) vals[p] = vq_cast<OT>(vq_f32(exact[row * NO + o]));
    }
  }
  #pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int c = c0 + j;
    if (c >= G * D) break;
    const int t = c / D, ch = c % D;
    const size_t token = (size_t)blk * G + t;
    if (SINK && token == 0) vals[j] = vq_cast<OT>(vq_f32(sink[(size_t)bh * D + ch]));
    out[((size_t)bh * out_tokens + token) * D + ch] = vals[j];
  }
"""


@lru_cache(maxsize=None)
def _kernel():
    return build_kernel(
        mx.fast.cuda_kernel,
        name="vq_kvquant_history_decode",
        input_names=["codes", "scale", "zero", "codebook", "positions", "exact", "sink", "meta"],
        output_names=["out"],
        source=_SOURCE,
        header=fused_decode._HEADER + _ROUNDING,
    )


def enabled() -> bool:
    """Whether the prefill decode runs through this kernel (MLX's CUDA backend, kernels on:
    fused_decode.kernels_enabled, VELOXQUANT_CUDA_KERNELS)."""
    return fused_decode.kernels_enabled()


def history_decode(codes, scale, zero, codebook, sparse, sink, *, n_blocks: int, out_tokens: int,
                   group: int, dim: int, bits: int, per_token: bool, cache_dtype, out_dtype) -> mx.array:
    """The first n_blocks blocks of one part decoded into a new (B, H, out_tokens, dim) array of
    out_dtype (tokens past n_blocks * group left for the caller to write: the window).

    codes (B, H, cap_blocks, W) uint32, scale / zero (B, H, cap_blocks, dim) for keys or
    (B, H, cap_tokens) for values (`per_token`), codebook (B, H, 2**bits), sparse None or
    (positions (B, H, cap_blocks, count) uint16, exact values), sink None or (B, H, 1, dim)."""
    B, H = codes.shape[:2]
    per = 32 // bits
    words = (group * dim + per - 1) // per
    side = scale.dtype
    positions, exact = sparse if sparse is not None else (
        fused_decode.absent_input(mx.uint16), fused_decode.absent_input(side))
    count = sparse[0].shape[-1] if sparse is not None else 0
    cap_tokens = scale.shape[2] if per_token else codes.shape[2] * group
    meta = mx.array([n_blocks, codes.shape[2], cap_tokens, out_tokens], dtype=mx.int32)
    threads = n_blocks * words
    return _kernel()(
        inputs=[codes, scale, zero, codebook.astype(mx.float32), positions, exact,
                sink if sink is not None else fused_decode.absent_input(side), meta],
        template=[("G", group), ("D", dim), ("BITS", bits), ("PER_TOKEN", int(per_token)), ("NO", count),
                  ("SINK", int(sink is not None)), ("CT", cache_dtype), ("OT", out_dtype)],
        grid=((threads + THREADS - 1) // THREADS * THREADS, B * H, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, out_tokens, dim)],
        output_dtypes=[out_dtype],
    )[0]
