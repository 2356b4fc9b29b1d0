"""One CUDA kernel that encodes a block of KIVI's K/V into its store layout.

Why: on the H200 (8B-shaped llama, 8 layers, bf16, 32K prompt in 2048-token chunks,
results/gpu_speed_h200_s4.json) kivi-2's prefill took 1.46x the fp16 KVCache's time (0.59 s vs
0.41 s) against a target of <= 1.2x: ~1.4 ms too many per layer and chunk. One of the two pieces
is the encode of the 2048 tokens that leave the window (KIVICache._encode ->
kivi.compiled_affine_quantize, once for K^T and once for V): min/max reductions, rounding and
the bit-stream packing sum of kivi.pack_stream. Through mx.compile these are still several
kernels (reductions and the packing sum do not fuse with the elementwise work), plus the copy of
K^T's swapaxes; unfused they measured 0.72 ms per chunk on the H200 (session 3). This module
encodes keys and values in ONE launch that reads the block (B, H, T, D) in the model dtype once
and writes the six arrays of KIVICache._store_layout directly.

Layout written (exactly kivi.affine_quantize's output, mx.quantize's stream layout):
  keys   K^T quantized per channel in groups of G tokens: codes (B, H, D, T * KB / 32) uint32,
         token t's code at bit KB * t of channel d's little-endian bit stream (a 3-bit code may
         straddle two words); scales and biases (B, H, D, T / G) in the side dtype;
  values per token in groups of G channels: codes (B, H, T, DV * VB / 32), channel c's code at
         bit VB * c of token t's stream; scales and biases (B, H, T, DV / G).
The block is what _encode is given (the exact sink already set aside and replaced by its
placeholder, KIVICache._set_sink_aside): the kernel does not know about the sink.

Arithmetic: the same operations as the portable kivi.affine_quantize, each an IEEE operation
with one defined rounding, so both compute the same bits (tests check it against
compiled_affine_quantize under the CPU emulation, for every width, group, dtype):
  x      the input widened to float32 (exact: vq_f32);
  lo, hi the group's minimum and maximum in float32 (exact; a sequential `v < lo ? v : lo`, which
         keeps the first of equal values as MLX's CPU reduction does for -0.0 / +0.0);
  scale  side(__fdiv_rn(hi - lo, levels)): float32 subtraction, IEEE division (round to nearest),
         then one rounding to the side dtype (__float2half_rn / __float2bfloat16_rn): the
         portable ((high - low) / levels).astype(side);
  bias   side(lo) (low.astype(side));
  code   clip(rint(__fdiv_rn(x - bias32, safe)), 0, levels) with bias32 / scale32 the stored
         side values widened back to float32 and safe = scale32 > 0 ? scale32 : 1: the
         portable clip(round((groups - biases.astype(f32)) / safe), 0, levels); rintf rounds half
         to even as mx.round does; the float -> uint32 cast of an integer in [0, levels] is exact.
  words  codes OR-ed into their bit positions (the portable packing sums disjoint bit fields:
         the same words).
Why __fdiv_rn and not `/`: a compile flag (nvrtc's fast math, -prec-div=false) may turn `/`
into an approximate division; the intrinsic is the IEEE division whatever the flags. The
rounding to the side dtype must happen before the codes are computed (the codes are measured
against the stored, rounded scale and bias), as in the portable path; a test corrupts that.
Not reproduced: NaN inputs (the portable path's codes are then a NaN cast to uint32, undefined);
and whether MLX's own compiled CUDA kernels divide exactly (if MLX compiles the portable path
with fast math on the GPU, the two may differ there by one code for elements within an ulp of a
rounding boundary: the @cuda_test measures it).

Work split: a block of THREADS = 128 threads per (group of G tokens, batch x kv head); the grid
covers the T / G groups. Keys: a thread per channel (looping when D > 128) reduces its channel's
G tokens serially, consecutive threads on consecutive channels of a token row, so every load of a
warp reads 32 neighbouring channels (one 64-byte run in bf16, coalesced); a second pass over the
same elements (from L1) computes and packs the codes, the finished words go to shared memory
(word major, rows of D + 1 words: conflict free both ways) and leave it with consecutive threads
on consecutive words of a channel's row. Values: a thread per (token, group of G channels), the
G channels read in order, its words written to the token's row (consecutive threads: consecutive
groups, so a warp's stores cover a contiguous stretch of the rows); scales and biases of values
are stored fully coalesced. The reductions are serial in token (channel) order on purpose: a
group whose minimum is 0 with both -0.0 and +0.0 stores the sign of the first, as MLX's CPU
reduction does (a test checks it); a shuffle tree would pick by another order. Shared memory: G * KB / 32 * (D + 1) words (1 KB at G 32, KB 2,
D 128; 32 KB at G 128, KB 8, D 256).

What the next GPU session must measure (no GPU figure could be taken when this was written; no
speedup is claimed), each also with VELOXQUANT_CUDA_KERNELS=0 (fused_decode.kernels_enabled:
the portable path for the A/B; it switches the decode and prefill kernels off too):
  pytest -m cuda tests/cache/test_fused_encode_affine.py  (the kernel against the compiled
      portable encoder on the GPU: bit for bit unless MLX divides approximately there)
  python -m veloxquant_mlx.bench.kernel_probe --parts prefill --methods kivi --out X.json
  python -m veloxquant_mlx.bench.gpu_speed --methods fp16,kivi --contexts 32768 --repeats 2 --out Y.json
      (kivi-2's prefill: 1.46x fp16 before; the target is <= 1.2x).
What it should do: one launch per layer and chunk instead of the compiled path's several (two
reductions, the elementwise code computation and the packing sum, for K^T and V each, plus the
K^T transpose copy), the block read once per pass and every output written once. Not known until
measured: whether the serial per-thread reductions (G dependent loads per thread, 64 blocks per
head at T = 2048, G = 32) keep enough loads in flight to reach the copy bandwidth; wider (16-byte)
loads for the values' runs and two channels per thread for the keys are the next steps if the
probe shows it far below. Not removed: mx.fast.cuda_kernel's copy of a block that is not row
contiguous (ensure_row_contiguous: a leading slice of the window when B * H > 1), ~2 x 4 MB per
layer and chunk at the 8B shape; reading through the inputs' strides would remove it.

The portable path (compiled_affine_quantize) stays the fallback: on the CPU and Metal, with the
kernels switched off, and for shapes `supports` refuses. The switch is fused_decode's, bound at
import (`_kernels_enabled`): the attention kernels' CPU emulation (cuda_emulation.
emulated_kernels) replaces fused_decode.kernels_enabled and does not switch this kernel on; its
own tests do (tests/cache/test_fused_encode_affine.py).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.errors import QuantizerConfigError

SUPPORTED_BITS = (2, 3, 4, 8)
THREADS = 128
INPUT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
SIDE_DTYPES = (mx.float16, mx.bfloat16)

# The kernels' switch (CUDA and VELOXQUANT_CUDA_KERNELS), bound when this module is imported.
# tests/cache/cuda_emulation.emulated_kernels() stands `lambda: True` in for
# fused_decode.kernels_enabled so that the attention kernels run emulated on the CPU; this kernel
# changes how the store is written, not how attention reads it, and the emulated attention tests
# count the kernels their steps launch: they keep the portable encoder. This module's tests switch
# it on explicitly (monkeypatching this name); a test that patches fused_decode._on_cuda (as
# tests/bench/test_kernel_probe.py does) gets it emulated too.
_kernels_enabled = fused_decode.kernels_enabled

OUTPUTS = ("key_codes", "key_scales", "key_biases", "value_codes", "value_scales", "value_biases")

# The header's own additions to fused_decode's: the side dtype's explicit round-to-nearest cast.
# Where the source is compiled as plain C++ (no __CUDACC__: nvcc and nvrtc define it), i.e. by
# the CPU emulation in tests/cache/cuda_emulation.py, whose shim has no __fdiv_rn and no *_rn
# conversions, they are defined as what they compute: the IEEE division (g++ without fast math)
# and the shim's round-to-nearest-even conversions.
_HEADER = kernel_header.HEADER + r"""
#ifndef __CUDACC__
inline float __fdiv_rn(float a, float b) { return a / b; }
inline __half __float2half_rn(float x) { return __float2half(x); }
inline __nv_bfloat16 __float2bfloat16_rn(float x) { return __float2bfloat16(x); }
#endif
template <typename T> __device__ __forceinline__ T vq_side_rn(float x);
template <> __device__ __forceinline__ __half vq_side_rn<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 vq_side_rn<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
"""

# Template constants: D, DV (key / value head dims), G (group), KB, VB (bits), IT (the block's
# dtype: the model's), ST (the side dtype of scales and biases). The block length T comes from
# the keys' shape.
_SOURCE = r"""
  constexpr int KW = G * KB / 32;            // key code words per channel and group
  constexpr int VW = G * VB / 32;            // value code words per group of channels
  constexpr int GV = DV / G;                 // value groups per token
  constexpr int WV = DV * VB / 32;           // value code words per token
  constexpr int DP = D + 1;                  // shared row stride: odd, so both the staging
                                             // (consecutive channels) and the write-out
                                             // (consecutive words) are free of bank conflicts
  __shared__ uint32_t kw_s[KW * DP];

  const int T = keys_shape[2];
  const int n_groups = T / G;
  const int g = blockIdx.x;                  // this block's group of G tokens
  const int bh = blockIdx.y;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const size_t t0 = (size_t)g * G;

  // affine_quantize's group parameters from the exact minimum and maximum: the scale and bias
  // rounded to the side dtype first, the codes computed against those stored values.
  struct vq_group { ST scale, bias; float bias32, safe; };
  const auto params = [](float lo, float hi, float levels) {
    vq_group p;
    p.scale = vq_side_rn<ST>(__fdiv_rn(hi - lo, levels));
    p.bias = vq_side_rn<ST>(lo);
    p.bias32 = vq_f32(p.bias);
    const float scale32 = vq_f32(p.scale);
    p.safe = scale32 > 0.f ? scale32 : 1.f;
    return p;
  };
  // A group's exact minimum and maximum, its G elements `stride` apart, in order (a serial
  // scan keeps the sign of the first of -0.0 / +0.0 as MLX's CPU reduction does).
  const auto range = [](const IT* x, size_t stride, float& lo, float& hi) {
    lo = vq_f32(x[0]);
    hi = lo;
    #pragma unroll 8
    for (int j = 1; j < G; ++j) {
      const float v = vq_f32(x[(size_t)j * stride]);
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
    }
  };
  const auto code = [](float x, const vq_group& p, float levels) {
    return (unsigned)fminf(fmaxf(rintf(__fdiv_rn(x - p.bias32, p.safe)), 0.f), levels);
  };

  // ---- keys: a thread per channel, the group's G tokens of the channel ----
  const IT* k_tile = keys + ((size_t)bh * T + t0) * D;
  for (int d = tid; d < D; d += nthreads) {
    const IT* x = k_tile + d;
    float lo, hi;
    range(x, (size_t)D, lo, hi);
    const vq_group p = params(lo, hi, (float)((1 << KB) - 1));
    const size_t side_at = ((size_t)bh * D + d) * n_groups + g;
    key_scales[side_at] = p.scale;
    key_biases[side_at] = p.bias;
    // Pack: token j's code at bit KB * j of the group's stream; a word is staged when full,
    // and a code that straddles (3 bits) carries its high bits into the next word.
    uint32_t word = 0u;
    #pragma unroll 8
    for (int j = 0; j < G; ++j) {
      const unsigned c = code(vq_f32(x[(size_t)j * D]), p, (float)((1 << KB) - 1));
      const int bit = j * KB, sh = bit & 31;
      word |= c << sh;
      if (sh + KB >= 32) {
        kw_s[(bit >> 5) * DP + d] = word;
        word = sh + KB > 32 ? c >> (32 - sh) : 0u;
      }
    }
  }
  __syncthreads();
  // Staged words out: consecutive threads on consecutive words of a channel's row.
  const int row_words = T * KB / 32;
  for (int i = tid; i < D * KW; i += nthreads) {
    const int d = i / KW, w = i % KW;
    key_codes[((size_t)bh * D + d) * row_words + (size_t)g * KW + w] = kw_s[w * DP + d];
  }

  // ---- values: a thread per (token, group of G channels) ----
  for (int i = tid; i < G * GV; i += nthreads) {
    const int tl = i / GV, gv = i % GV;
    const size_t t = t0 + tl;
    const IT* x = values + ((size_t)bh * T + t) * DV + gv * G;
    float lo, hi;
    range(x, (size_t)1, lo, hi);
    const vq_group p = params(lo, hi, (float)((1 << VB) - 1));
    const size_t side_at = ((size_t)bh * T + t) * GV + gv;
    value_scales[side_at] = p.scale;
    value_biases[side_at] = p.bias;
    uint32_t* out = value_codes + ((size_t)bh * T + t) * WV + gv * VW;
    uint32_t word = 0u;
    #pragma unroll 8
    for (int j = 0; j < G; ++j) {
      const unsigned c = code(vq_f32(x[j]), p, (float)((1 << VB) - 1));
      const int bit = j * VB, sh = bit & 31;
      word |= c << sh;
      if (sh + VB >= 32) {
        out[bit >> 5] = word;
        word = sh + VB > 32 ? c >> (32 - sh) : 0u;
      }
    }
  }
"""


def _kernel():
    """The kernel, built once per kernel factory: keyed by mx.fast.cuda_kernel itself, so a
    kernel built while a test stands the CPU emulation in for it is never served after the
    real factory is back, nor the other way round (as fused_prefill_affine._kernel)."""
    return _kernel_for(mx.fast.cuda_kernel)


@lru_cache(maxsize=None)
def _kernel_for(factory):
    return build_kernel(
        factory,
        name="vq_affine_encode_kv",
        input_names=["keys", "values"],
        output_names=list(OUTPUTS),
        source=_SOURCE,
        header=_HEADER,
    )


def shared_bytes(head_dim: int, group_size: int, key_bits: int) -> int:
    """The kernel's static shared memory: one group's key code words of every channel, word
    major over head_dim + 1 channels (DP)."""
    return 4 * (group_size * key_bits // 32) * (head_dim + 1)


def supports(head_dim: int, value_dim: int, group_size: int, key_bits: int, value_bits: int) -> bool:
    """The shapes the kernel handles; others take the portable path: the widths MLX's affine
    layout packs (2, 3, 4, 8), groups of whole 32-code runs (whole words at every width), value
    tokens of whole groups, and the shared memory within CUDA's static 48 KB."""
    if key_bits not in SUPPORTED_BITS or value_bits not in SUPPORTED_BITS:
        return False
    if group_size < 32 or group_size % 32:
        return False
    if head_dim < 1 or value_dim < 1 or value_dim % group_size:
        return False
    return shared_bytes(head_dim, group_size, key_bits) <= kernel_header.STATIC_SHARED_BYTES


def encode_step(cache, keys: mx.array, values: mx.array):
    """KIVICache's encoded block (the dict _encode returns) from the kernel, or None where it is
    not active (off CUDA, switched off, a shape `supports` refuses, an input dtype without a
    kernel variant): the cache then takes the portable compiled path."""
    if not _kernels_enabled():
        return None
    if not supports(cache.head_dim, cache.value_dim, cache.group_size, cache.key_bits, cache.value_bits):
        return None
    if keys.dtype not in INPUT_DTYPES or values.dtype != keys.dtype:
        return None
    arrays = affine_encode_kv(keys, values, group_size=cache.group_size, key_bits=cache.key_bits,
                              value_bits=cache.value_bits, side_dtype=cache._side_dtype())
    return dict(zip(OUTPUTS, arrays))


def affine_encode_kv(keys: mx.array, values: mx.array, *, group_size: int, key_bits: int,
                     value_bits: int, side_dtype):
    """The kernel's launch: keys (B, H, T, D) and values (B, H, T, DV), one dtype, T whole
    groups -> (key codes (B, H, D, T * KB / 32), key scales, key biases (B, H, D, T / G), value
    codes (B, H, T, DV * VB / 32), value scales, value biases (B, H, T, DV / G)), exactly
    kivi.affine_quantize(keys.swapaxes(-1, -2)) and affine_quantize(values)."""
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
        raise QuantizerConfigError(
            f"fused encode: keys {keys.shape} and values {values.shape} must be (B, H, T, D) and "
            f"(B, H, T, DV) with the same B, H, T"
        )
    B, H, T, D = keys.shape
    DV = values.shape[3]
    if not supports(D, DV, group_size, key_bits, value_bits):
        raise QuantizerConfigError(
            f"fused encode: head_dim={D}, value_dim={DV}, group_size={group_size}, key_bits="
            f"{key_bits}, value_bits={value_bits} are not supported: allowed are bits in "
            f"{SUPPORTED_BITS}, a group that is a multiple of 32 and divides value_dim, and "
            f"{kernel_header.STATIC_SHARED_BYTES} bytes of shared memory at most (see supports)"
        )
    if T < 1 or T % group_size:
        raise QuantizerConfigError(
            f"fused encode: a block of T={T} tokens; allowed are whole groups of {group_size}, >= 1"
        )
    if keys.dtype not in INPUT_DTYPES or values.dtype != keys.dtype:
        raise QuantizerConfigError(
            f"fused encode: keys {keys.dtype} and values {values.dtype}; allowed is one dtype of "
            f"{[str(d) for d in INPUT_DTYPES]}"
        )
    if side_dtype not in SIDE_DTYPES:
        raise QuantizerConfigError(
            f"fused encode: side_dtype={side_dtype}; allowed is one of {[str(d) for d in SIDE_DTYPES]}"
        )
    n_groups = T // group_size
    return _kernel()(
        inputs=[keys, values],
        template=[("D", D), ("DV", DV), ("G", group_size), ("KB", key_bits), ("VB", value_bits),
                  ("IT", keys.dtype), ("ST", side_dtype)],
        grid=(THREADS * n_groups, B * H, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, D, T * key_bits // 32), (B, H, D, n_groups), (B, H, D, n_groups),
                       (B, H, T, DV * value_bits // 32), (B, H, T, DV // group_size),
                       (B, H, T, DV // group_size)],
        output_dtypes=[mx.uint32, side_dtype, side_dtype, mx.uint32, side_dtype, side_dtype],
    )
