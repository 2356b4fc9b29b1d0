"""Two CUDA kernels for a decode step over affine-quantized K/V (KIVI's layout), split over tokens.

Why: on MLX's CUDA backend a decode step over the compressed history ran as ~15 small ops per
layer (quantized_matmul for the scores, masking, softmax, a split quantized_matmul for the values,
the window, concatenations); on the H200 that made KIVI decode at 0.59x the fp16 cache's speed at
32K tokens although it reads 5x fewer bytes (results/gpu_speed_h200.json). These kernels read the
packed codes once: the first produces, per block of consecutive history tokens (and one block
for the exact tokens: an optional exact sink, then the window) and per query row, the
flash-decoding partials
  m = max score, l = sum exp(score - m), o = sum exp(score - m) * value,
and the second merges them into the output row (weights exp(m - max m)), in float32.

Layout read (the one KIVICache and XQuantCache store, MLX's mx.quantize stream):
  keys   K^T per channel: codes (B, H, D, capacity * KB / 32) uint32, a little-endian bit stream
         along tokens; scales/zeros (B, H, D, capacity / G): element = scale * code + zero;
  values per token: codes (B, H, capacity, DV * VB / 32), stream along channels;
         scales/zeros (B, H, capacity, DV / G).
Exact tokens: the window (B, H, W, D / DV) and a sink (B, H, S, D / DV, e.g. KIVI's first token,
whose codes in the history are a placeholder the kernel skips), both in the queries' dtype; the
sink is an input of its own (sk, sv), so a step with a sink launches the two kernels and no copy.
Blocks of 4 warps per (batch*kv-head, range of tokens); GQA query rows share the codes they read;
each warp copies its tile's history (codes, scales, zeros of keys, then of values) into a stage in
shared memory, all its loads issued before the first store (vq_stage), and computes from there
(with 16-bit queries and 2-bit codes both products on tensor cores: MMA_SCORES, MMA_VALUES);
the work split, the inputs and the shared-memory layout are described above _PARTIALS. GEARCache's store is this layout plus a low-rank
and a sparse term: fused_decode_gear.py builds its kernel from this one's source with code at
its hook lines (partials_source), and launches it through affine_partials and merge_partials.

The portable path (base CompressedKVCache._attend over mx.quantized_matmul) stays the fallback:
it runs on the CPU and Metal, and wherever this kernel is not active. tests/cache/test_fused_decode.py
checks the kernels against it on CUDA, and their algorithm (tests/cache/split_softmax_reference.py)
against it on the CPU.

`VELOXQUANT_CUDA_KERNELS=0` turns the kernel off (for A/B measurements); any value other than
0 or 1 is an error.
"""

from __future__ import annotations

import contextvars
import re
from functools import lru_cache

import mlx.core as mx
import numpy as np

from veloxquant_mlx.cache import environment_switch, window_buffer
from veloxquant_mlx.cache.compiled_launch import COUNTED_EPILOGUE, COUNTED_PROLOGUE, CompiledLaunch, window_count
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.cache.replay_step import ReplayStep
from veloxquant_mlx.errors import QuantizerConfigError

ENV_SWITCH = "VELOXQUANT_CUDA_KERNELS"
SUPPORTED_BITS = (2, 4, 8)
# Blocks per group of the fused merge's first level (vq_merge_if_last, the header's
# VQ_MERGE_GROUP): at most this many blocks per head merge in one level. Measured on the H200 in
# one process against the one-level merge of before (results/merge_ab_h200_s32.json, us per
# layer, two repeats): at 128K gear 244 / 242 against 256 / 254 and kvquant 272 / 266 against
# 279 / 285 (257 blocks per head: 17 groups), kivi 153 / 149 against 151 / 154 (65 blocks); at
# 32K within the repeats (kivi 67.5 / 67.7 against 65.9 / 67.0, gear 91.3 / 88.8 against 88.5 /
# 91.1, kvquant 92.5 / 92.8 against 93.9 / 92.9).
MERGE_GROUP = 16

_HEADER = f"constexpr int VQ_MERGE_GROUP = {MERGE_GROUP};\n" + r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

__device__ __forceinline__ float vq_f32(float x) { return x; }
__device__ __forceinline__ float vq_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float vq_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T vq_cast(float x);
template <> __device__ __forceinline__ float vq_cast<float>(float x) { return x; }
template <> __device__ __forceinline__ __half vq_cast<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 vq_cast<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

template <typename A, typename B> struct vq_same_type { static constexpr bool value = false; };
template <typename A> struct vq_same_type<A, A> { static constexpr bool value = true; };

// A float32 element rounded to the cache's dtype CT, then to the output's OT, as the portable
// paths cast a decoded history (one rounding where CT and OT are the same type: the second is
// then exact). Shared by the prefill kernels that build a history's K/V.
template <typename CT, typename OT>
__device__ __forceinline__ OT vq_cast_through(float x) {
  return vq_same_type<CT, OT>::value ? vq_cast<OT>(x) : vq_cast<OT>(vq_f32(vq_cast<CT>(x)));
}

// The codes of channels c and c + 1 (c even) of one token's row of BITS-bit codes packed in a
// little-endian uint32 stream (MLX's affine layout), unmasked: the caller masks to BITS bits.
// Shared by the prefill kernels that decode values per token (fused_prefill_affine,
// gear_prefill_kernel); GLOBAL false: `row` is in shared memory (plain loads, not __ldg).
template <int BITS, bool GLOBAL = true>
__device__ __forceinline__ void vq_code_pair(const uint32_t* row, int c, unsigned& c0, unsigned& c1) {
  const auto load = [row](int i) { return GLOBAL ? __ldg(row + i) : row[i]; };
  if (32 % BITS == 0) {
    // Both codes in one word (2 * BITS divides 32 and the pair's first bit).
    const int bit = c * BITS;
    const unsigned word = load(bit >> 5);
    c0 = word >> (bit & 31);
    c1 = word >> ((bit & 31) + BITS);
  } else {
    // 3 bits: either code may straddle two words.
    const int b0 = c * BITS, b1 = b0 + BITS;
    c0 = load(b0 >> 5) >> (b0 & 31);
    if ((b0 & 31) + BITS > 32) c0 |= load((b0 >> 5) + 1) << (32 - (b0 & 31));
    c1 = load(b1 >> 5) >> (b1 & 31);
    if ((b1 & 31) + BITS > 32) c1 |= load((b1 >> 5) + 1) << (32 - (b1 & 31));
  }
}

// The codes of key channels d and d + 1 (d even) at tile position tl from a tile's code words
// staged channel-major in shared memory (word w of channel c at stage[w * row + c], row even),
// unmasked: the caller masks to KB bits. Shared by the prefill kernels that stage keys so
// (fused_prefill_affine, gear_prefill_kernel).
template <int KB>
__device__ __forceinline__ void vq_staged_key_pair(const uint32_t* stage, int row, int tl, int d,
                                                   unsigned& c0, unsigned& c1) {
  const int bit = tl * KB;
  const int w = bit >> 5, sh = bit & 31;
  const uint2 word = *reinterpret_cast<const uint2*>(stage + w * row + d);
  c0 = word.x >> sh;
  c1 = word.y >> sh;
  if (32 % KB != 0 && sh + KB > 32) {  // a 3-bit code continues in the next word
    const uint2 next = *reinterpret_cast<const uint2*>(stage + (w + 1) * row + d);
    c0 |= next.x << (32 - sh);
    c1 |= next.y << (32 - sh);
  }
}

// A warp's copy of ROWS rows of ROW_BYTES bytes each from global memory (row r at src + r *
// stride bytes) into shared memory (row r at dst + r * ROW_BYTES), in VEC-byte vectors (the
// largest power of two up to 16 dividing ROW_BYTES; the callers' rows and strides are multiples
// of it). load() issues every load of the lane into registers, store() writes them: a caller
// issues the loads of all its arrays before the first store, so the warp waits on memory once
// per stage, where loads issued beside their arithmetic kept only a few in flight per warp
// (ptxas scheduled each channel's loads a channel or two ahead of their use; SASS, sm_90).
template <int VEC> struct vq_vec_of;
template <> struct vq_vec_of<16> { using type = uint4; };
template <> struct vq_vec_of<8> { using type = uint2; };
template <> struct vq_vec_of<4> { using type = unsigned int; };
template <> struct vq_vec_of<2> { using type = unsigned short; };
template <int ROWS, int ROW_BYTES>
struct vq_stage {
  static constexpr int VEC = ROW_BYTES % 16 == 0 ? 16 : ROW_BYTES % 8 == 0 ? 8 : ROW_BYTES % 4 == 0 ? 4 : 2;
  using V = typename vq_vec_of<VEC>::type;
  static constexpr int PER_ROW = ROW_BYTES / VEC;
  static constexpr int TOTAL = ROWS * PER_ROW;
  static constexpr int N = (TOTAL + 31) / 32;
  V v[N];
  __device__ __forceinline__ void load(const void* src, size_t stride, int lane) {
    #pragma unroll
    for (int i = 0; i < N; ++i) {
      const int e = lane + 32 * i;
      if (TOTAL % 32 == 0 || e < TOTAL)
        v[i] = __ldg(reinterpret_cast<const V*>(static_cast<const unsigned char*>(src) + (size_t)(e / PER_ROW) * stride) + e % PER_ROW);
    }
  }
  __device__ __forceinline__ void store(void* dst, int lane) const {
    #pragma unroll
    for (int i = 0; i < N; ++i) {
      const int e = lane + 32 * i;
      if (TOTAL % 32 == 0 || e < TOTAL) reinterpret_cast<V*>(dst)[e] = v[i];
    }
  }
};

// N elements of type T from shared memory at p as floats, in the widest loads that N * sizeof(T)
// bytes allow (p aligned to that width: row i of a run of N-element rows from an aligned base).
// Why: the tensor-core values' scales and zeros of a token, GV 16-bit values, loaded one at a
// time were 32 of the 44 shared loads per 16 tokens (sm_90 SASS, the 8B shape).
template <int N, typename T>
__device__ __forceinline__ void vq_shared_row(const T* p, float (&out)[N]) {
  constexpr int BYTES = N * (int)sizeof(T);
  constexpr int VEC = BYTES % 16 == 0 ? 16 : BYTES % 8 == 0 ? 8 : BYTES % 4 == 0 ? 4 : 2;
  constexpr int EV = VEC / (int)sizeof(T);
  using V = typename vq_vec_of<VEC>::type;
  #pragma unroll
  for (int v = 0; v < BYTES / VEC; ++v) {
    const V raw = reinterpret_cast<const V*>(p)[v];
    const T* e = reinterpret_cast<const T*>(&raw);
    #pragma unroll
    for (int k = 0; k < EV; ++k) out[v * EV + k] = vq_f32(e[k]);
  }
}

// N elements of a row as floats, 16 bytes a load (`row` 16-byte aligned, N * sizeof(T) a
// multiple of 16; N below one vector loads nothing: the callers' WRV path excludes it).
template <int N, typename T>
__device__ __forceinline__ void vq_row_vectors(const T* row, float* out) {
  constexpr int EV = 16 / (int)sizeof(T);
  #pragma unroll
  for (int v = 0; v < N / EV; ++v) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row) + v);
    const T* e = reinterpret_cast<const T*>(&raw);
    #pragma unroll
    for (int j = 0; j < EV; ++j) out[v * EV + j] = vq_f32(e[j]);
  }
}

__device__ __forceinline__ float vq_warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float vq_warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Tensor-core scores (template MMA, fused_decode.MMA_SCORES): one warp's
// mma.sync.m16n8k16 (A 16 x 16 row-major and B 16 x 8 column-major in fp16, C float32 16 x 8,
// C += A B). Fragments as PTX defines them, lane = 4 g + t: a[0] = A[g][2t, 2t + 1], a[1] =
// A[g + 8][2t, 2t + 1], a[2] / a[3] the same at columns 2t + 8, 2t + 9 (the low half the first
// column); b0 = B[2t, 2t + 1][g], b1 = B[2t + 8, 2t + 9][g]; c[0], c[1] = C[g][2t, 2t + 1],
// c[2], c[3] = C[g + 8][2t, 2t + 1]. Defined for sm_80 and later; earlier GPUs never call it
// (VQ_HAS_MMA 0 keeps MMA's branch dead) and the CPU emulation brings its own.
#if defined(VQ_EMULATED_MMA) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800)
#define VQ_HAS_MMA 1
#else
#define VQ_HAS_MMA 0
#endif
#ifndef VQ_EMULATED_MMA
__device__ __forceinline__ void vq_mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}
#endif

// Two floats rounded to fp16, packed as an mma fragment register (lo in the low half).
__device__ __forceinline__ uint32_t vq_half2_bits(float lo, float hi) {
  const __half a = __float2half(lo), b = __float2half(hi);
  return (uint32_t)*reinterpret_cast<const unsigned short*>(&a)
         | ((uint32_t)*reinterpret_cast<const unsigned short*>(&b) << 16);
}

// The same in bfloat16 (the tensor-core values' B where the cache's side data is bf16). On the
// GPU one cvt.rn.bf16x2.f32 (the same rounding): ptxas made the two conversions two F2F and a
// byte permute (sm_90 SASS), where it makes fp16's pair one F2FP by itself.
__device__ __forceinline__ uint32_t vq_bf162_bits(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  const __nv_bfloat16 a = __float2bfloat16(lo), b = __float2bfloat16(hi);
  return (uint32_t)*reinterpret_cast<const unsigned short*>(&a)
         | ((uint32_t)*reinterpret_cast<const unsigned short*>(&b) << 16);
#endif
}

// (x & mask) | one as one logic op (lop3, the constants in registers). Why: written in C++,
// ptxas made it two LOP3 with immediates, and the tensor-core loops make one such register per
// 2 codes (sm_90 SASS: 64 of kivi's 211 instructions per 16 tokens of scores were LOP3).
__device__ __forceinline__ uint32_t vq_and_or(uint32_t x, uint32_t mask, uint32_t one) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "r"(one));
  return r;
#else
  return (x & mask) | one;
#endif
}

// mma.sync.m16n8k16 with bf16 A and B (fragments laid out as vq_mma_f16's), float32 C.
#ifndef VQ_EMULATED_MMA
__device__ __forceinline__ void vq_mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
               "{%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}
#endif

// The tensor-core values' pieces in the 16-bit type T of the cache's side data (fp16 or bf16;
// the primary template is fp16's, never instantiated for a float cache: MMAV is 0 there).
// mma: the warp's mma in T. pack: two floats as a B register in T; lo / hi: its halves back.
// vq_code_pair16: the 2-bit codes at bits 2g and 16 + 2g of x (g = 0..7, `rot` = (2 g - POS) &
// 31) as the A register (1 + code / 4, 1 + code' / 4) in T, exact: each code or-ed into the
// mantissa of 1.0 (fp16's bits 8-9 under 0x3C00, bf16's bits 5-6 under 0x3F80) by a rotation
// and one logic op.
template <typename T> struct vq_mma_type {
  static constexpr int POS = 8;
  static constexpr uint32_t MASK = 0x03000300u, ONE = 0x3C003C00u;
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    vq_mma_f16(c, a, b0, b1);
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return vq_half2_bits(lo, hi); }
  static __device__ __forceinline__ float lo(uint32_t x) { const unsigned short h = x; return vq_f32(*reinterpret_cast<const __half*>(&h)); }
  static __device__ __forceinline__ float hi(uint32_t x) { const unsigned short h = x >> 16; return vq_f32(*reinterpret_cast<const __half*>(&h)); }
};
template <> struct vq_mma_type<__nv_bfloat16> {
  static constexpr int POS = 5;
  static constexpr uint32_t MASK = 0x00600060u, ONE = 0x3F803F80u;
  static __device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    vq_mma_bf16(c, a, b0, b1);
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return vq_bf162_bits(lo, hi); }
  static __device__ __forceinline__ float lo(uint32_t x) { return __uint_as_float(x << 16); }
  static __device__ __forceinline__ float hi(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }
};
template <typename T>
__device__ __forceinline__ uint32_t vq_code_pair16(uint32_t x, int rot) {
  return vq_and_or(__funnelshift_r(x, x, rot), vq_mma_type<T>::MASK, vq_mma_type<T>::ONE);
}

// A hint that the 32-byte sector at p is read soon: fetched into L2, no register, no wait (a no-op
// off the GPU: the CPU emulation). vq_prefetch_run: the sectors of `bytes` bytes from p, over
// the warp's lanes.
__device__ __forceinline__ void vq_prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
#endif
}
__device__ __forceinline__ void vq_prefetch_run(const void* p, int bytes, int lane) {
  for (int off = 32 * lane; off < bytes; off += 32 * 32) vq_prefetch_l2(static_cast<const char*>(p) + off);
}

// A small unsigned integer (< 2^23) as a float without the int-to-float conversion unit (a
// slower path on Hopper): or it into the mantissa of 2^23 and subtract 2^23.
__device__ __forceinline__ float vq_u2f(unsigned small) {
  return __uint_as_float(small | 0x4B000000u) - 8388608.f;
}

// The merge of one (batch*kv-head)'s block partials into its R output rows (flash-decoding's
// second pass), done inside the partials kernel by the blocks that finish last: every block,
// its partial written, fences it and counts itself in; the block that brings a count to its
// total sets it back to zero (for the next launch: the counters outlive the launch,
// FusedLaunchState), reads the partials counted (__ldcg: from L2, never a stale L1 line) and
// merges them. Up to VQ_MERGE_GROUP blocks per head: one level, counts[bh], the last block
// writes out[(bh * R + r) * DV + c] = sum_b e_b o_b / sum_b e_b l_b, e_b = exp(m_b - max m).
// More: two levels. Blocks count in per group of VQ_MERGE_GROUP (counts[heads + bh * NG + g]);
// each group's last block merges its group's partials into one partial of the group (o, m, l
// as a block's, in `groups`: [heads][NG][R][DV] then m and l [heads][NG][R]) and counts the
// group in (counts[bh]); the last group's block merges the NG group partials into out.
// Why two levels: the merge runs alone at the end of the launch (the tail of every layer's
// decode step) and a lane's loads of a row's partials are a chain of L2 round trips, 32
// partials a run; cut out of the launch (session 32, results/tail_h200_s32.json) the one-level
// merge was ~6 us of kivi's layer at 32K (33 blocks per head) and 15-24 us of GEAR's and
// KVQuant's at 128K (257 blocks per head). Groups of 16 merge in one run each while the other
// blocks still work, and the last merge reads NG partials instead of n_blocks.
// Called by every thread of the block, after its last write of the partials.
// A warp per row (vq_merge_row): its lanes take 32 partials' m and l at a time (each lane one
// partial's weight, broadcast by shuffles) and 32 consecutive channels of each partial, so a
// lane's loads of a run of partials are independent and in flight together. Why: as 128 threads
// each walking all the blocks for 4 outputs, one load after another, kivi's attention took
// 0.208 ms per layer at 128K tokens on the H200 and 0.177 / 0.178 with this merge (32K: 0.094 ->
// 0.073 / 0.078; results/kernel_probe_h200_s10.json, kernel_probe_h200_s10_merge*.json).
// vq_merge_row: row r's merge of `count` partials, partial b's row at o_first + b R DV, m_first +
// b R, l_first + b R: o[j] = sum_b e_b o_b[lane + 32 j], den = sum_b e_b l_b; returns max m.
template <int R, int DV>
__device__ __forceinline__ float vq_merge_row(const float* o_first, const float* m_first, const float* l_first,
                                              int count, int lane, float (&o)[(DV + 31) / 32], float& den) {
  constexpr int CJ = (DV + 31) / 32;  // channels per lane: lane + 32 j
  const float neg_inf = __int_as_float(0xff800000);
  float top = neg_inf;
  #pragma unroll 4
  for (int b = lane; b < count; b += 32) top = fmaxf(top, __ldcg(m_first + (size_t)b * R));
  top = vq_warp_max(top);
  den = 0.f;
  #pragma unroll
  for (int j = 0; j < CJ; ++j) o[j] = 0.f;
  for (int b0 = 0; b0 < count; b0 += 32) {
    const int b = b0 + lane;
    float e = 0.f;
    if (b < count) {
      const float mb = __ldcg(m_first + (size_t)b * R);
      e = mb == neg_inf ? 0.f : expf(mb - top);
      den = fmaf(e, __ldcg(l_first + (size_t)b * R), den);
    }
    const int run = min(32, count - b0);
    const float* po = o_first + (size_t)b0 * R * DV + lane;
    #pragma unroll 8
    for (int k = 0; k < run; ++k) {
      const float ek = __shfl_sync(0xffffffffu, e, k);
      #pragma unroll
      for (int j = 0; j < CJ; ++j)
        if (lane + 32 * j < DV) o[j] = fmaf(ek, __ldcg(po + (size_t)k * R * DV + 32 * j), o[j]);
    }
  }
  den = vq_warp_sum(den);
  return top;
}

// Whether this block's count brings counts[at] to `total` (then set back to zero); every
// thread of the block calls it and gets the answer.
__device__ __forceinline__ bool vq_counted_last(int* counts, int at, int total) {
  __shared__ int vq_last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    vq_last = atomicAdd(counts + at, 1) == total - 1;
    if (vq_last) counts[at] = 0;  // every other block has counted in
  }
  __syncthreads();
  const bool last = vq_last;
  __syncthreads();  // read by all before a later call writes it
  if (last) __threadfence();
  return last;
}

template <int R, int DV, typename OT>
__device__ __noinline__ void vq_merge_if_last(const float* part_o, const float* part_m,
                                                 const float* part_l, float* groups, int* counts, OT* out,
                                                 int bh, int n_blocks) {
  constexpr int CJ = (DV + 31) / 32;
  const int lane = threadIdx.x & 31;
  const int heads = gridDim.y;
  const int NG = n_blocks > VQ_MERGE_GROUP ? (n_blocks + VQ_MERGE_GROUP - 1) / VQ_MERGE_GROUP : 1;
  float* group_o = groups;
  float* group_m = groups + (size_t)heads * NG * R * DV;
  float* group_l = group_m + (size_t)heads * NG * R;
  if (NG > 1) {
    const int g = blockIdx.x / VQ_MERGE_GROUP, g_first = g * VQ_MERGE_GROUP;
    if (!vq_counted_last(counts, heads + bh * NG + g, min(VQ_MERGE_GROUP, n_blocks - g_first))) return;
    const size_t first = ((size_t)bh * n_blocks + g_first) * R, at = ((size_t)bh * NG + g) * R;
    for (int r = threadIdx.x >> 5; r < R; r += blockDim.x >> 5) {
      float o[CJ], den;
      const float top = vq_merge_row<R, DV>(part_o + (first + r) * DV, part_m + first + r, part_l + first + r,
                                            min(VQ_MERGE_GROUP, n_blocks - g_first), lane, o, den);
      #pragma unroll
      for (int j = 0; j < CJ; ++j)
        if (lane + 32 * j < DV) group_o[(at + r) * DV + lane + 32 * j] = o[j];
      if (lane == 0) {
        group_m[at + r] = top;
        group_l[at + r] = den;
      }
    }
  }
  const int count = NG > 1 ? NG : n_blocks;  // partials per head, each counted in once
  if (!vq_counted_last(counts, bh, count)) return;
  const float* src_o = NG > 1 ? group_o : part_o;
  const float* src_m = NG > 1 ? group_m : part_m;
  const float* src_l = NG > 1 ? group_l : part_l;
  const size_t first = (size_t)bh * count * R;
  for (int r = threadIdx.x >> 5; r < R; r += blockDim.x >> 5) {
    float o[CJ], den;
    vq_merge_row<R, DV>(src_o + (first + r) * DV, src_m + first + r, src_l + first + r, count, lane, o, den);
    #pragma unroll
    for (int j = 0; j < CJ; ++j)
      if (lane + 32 * j < DV) out[((size_t)bh * R + r) * DV + lane + 32 * j] = vq_cast<OT>(o[j] / den);
  }
}

// The block's NW warps' partials merged into the block's one (flash-decoding's merge inside a
// block): warp w left its unnormalised sums for rows x channels in ps_w = ps + w * ps_stride
// ([r * DV + c]) and its running max and sum per row in red_m / red_l ([w * R + r]). Called by
// every thread of the block after a __syncthreads; writes part_o / part_m / part_l at out_row.
template <int R, int DV, int NW>
__device__ __forceinline__ void vq_block_partial(const float* ps, int ps_stride, const float* red_m,
                                                 const float* red_l, float* part_o, float* part_m,
                                                 float* part_l, size_t out_row) {
  const float neg_inf = __int_as_float(0xff800000);
  for (int i = threadIdx.x; i < R * DV; i += 32 * NW) {
    const int r = i / DV;
    float top = neg_inf;
    #pragma unroll
    for (int w = 0; w < NW; ++w) top = fmaxf(top, red_m[w * R + r]);
    float o = 0.f, den = 0.f;
    if (top != neg_inf) {
      #pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float e = red_m[w * R + r] == neg_inf ? 0.f : expf(red_m[w * R + r] - top);
        o = fmaf(e, ps[(size_t)w * ps_stride + i], o);
        den = fmaf(e, red_l[w * R + r], den);
      }
    }
    part_o[out_row * DV + i] = o;
    if (i % DV == 0) {
      part_m[out_row + r] = top;
      part_l[out_row + r] = den;
    }
  }
}
"""

# Kernel 1: partials. Template constants: D, DV (key / value head dims), R (query rows per kv
# head), G (group), KB, VB (bits), LPT (lanes per value token, lanes_per_token), QT (query
# dtype: also the window's), ST (side-data dtype).
# meta = [n_valid, tokens per block, blocks over the history, scale as float bits, n_skip,
# n_sink]: history tokens [0, n_skip) are ignored (a cache that reads them exactly, e.g. KIVI's
# attention sink, hands them in as sk / sv); sk, sv (B, H, n_sink, D / DV) in the queries' dtype
# are exact tokens the last block attends before the window (1-element dummies at n_sink = 0).
# Blocks [0, n_hist_blocks) read the compressed history, the last block the exact sink + window.
# Why the sink is an input of its own: concatenated to the window it cost two copy kernels per
# layer and step, 0.017 ms on the H200 (bench.kernel_probe's step at 2K tokens,
# results/kernel_probe_step_h200_s4.json; this kernel 0.037 ms there, 0.086 ms at 32K); here it
# costs a select per exact token a lane reads (the exact block only). Not yet timed on a GPU.
# A warp takes tiles of 128 tokens: scoring, lane i holds tokens 4i..4i+3 (one code word slice
# per channel: the warp's 32 lanes read one contiguous run of each channel's codes); weighing
# values, LPT lanes share a token (whole code words each, or a half / quarter word at many
# rows) and TPR tokens go per round, reading the tile's probabilities from shared memory.
# The tile's probabilities: token t's R floats at p_tile[tile_slot(t) * R], tile_slot(t) =
# (t % 4) * 33 + t / 4 (scoring lane i's token k at slot k * 33 + i). The R floats of a token
# are contiguous, so each lane stores and loads them as one vector (128-bit at R = 4, as the
# value loop already loaded them); the scoring lanes' stores of one k then hit 32 consecutive
# slots (8 lanes per 128-bit phase: 8 distinct bank quads), and the value loop's TPR consecutive
# tokens fall 33 slots apart when they share a scoring lane (distinct bank quads) or are one
# token broadcast to its LPT lanes. Before, token t sat at t * R with one store per row: a
# 16-float lane stride at R = 4, 16-way bank conflicts on each of a tile's 16 stores per lane.
# Conflict-free at R = 1, 2, 4; at R = 8 (two 128-bit stores per token) stores are 2-way.
TILE = 128
TILE_SLOTS = TILE // 32 * 33  # p_tile's slots per warp (tile_slot: 4 runs of 32, one spare each)
WARPS_PER_BLOCK = 4
# The target of GEAR's and KVQuant's launches (and the emulation tests' knob for every kernel
# that takes it). Why 8192 and not 4096 (until session 27): tokens_per_block's ceil makes a
# warp's tiles jump from 2 to 3 just past 128K tokens (8 KV heads), and the grid then falls from
# 1024 blocks to ~690, 1.3 waves of the H200's resident blocks (132 SMs x 4: under nvrtc gear's
# kernel takes 103 registers and 44 KB of shared memory, kvquant's 119 and 36 KB, Nsight in
# session 28, results/ncu_raw_s28_*_128k.csv; nvcc's 96 would allow 5). One layer's chained
# attention on the H200 (bench.launch_bounds_probe --warps, results/lb_h200_s27_split_*.json),
# us at 4096 / 8192 target warps: at 131584 tokens gear 316 / 267, kvquant 337 / 299; at 131072
# gear 268 / 278, kvquant 295 / 279. Through the model at 128K (results/gpu_speed_h200_s27_128k_split.json)
# kvquant's GPU-bound steps took 3.75 ms with 8192 against 4.26 with 4096. Below 64K tokens
# (4096 tiles at 8 heads) both targets give one tile per warp: the same launches.
TARGET_WARPS = 8192
# The affine kernel's own launches (kivi, xquant: affine_launch's default split; GEAR's launch of
# the same source keeps TARGET_WARPS) aim at fewer warps, so each walks more tiles: on the H200
# one layer's whole chained attention (bench.launch_bounds_probe --set fused_decode.TARGET_WARPS=,
# which set both then) took at 32K kivi 62-66 us with 1024 warps against 74-79 with 4096, xquant
# 62-63 against 73-77, and at 128K kivi 160-171 (2048) / 170-171 (1024) against 173-178; 512
# was slower (~96 us at 32K, ~300 at 128K), and GEAR slower with 1024 (108-110 us at 32K
# against 95-96), hence its own target (results/lb_h200_s22*_tw*.json, session 22). Why fewer
# warps help: a model's layers run one after another, so a launch's ramp, its slowest SM and the
# merge of every block's partial are each layer's wait; half as many blocks halve the partials
# the last block merges, and a warp's second tile overlaps other warps' waits on memory.
AFFINE_TARGET_WARPS = 1024
# ... and twice as many where each warp would walk at least AFFINE_LONG_TILES_PER_WARP tiles at
# AFFINE_TARGET_WARPS (at 8 KV heads: from 96K tokens on). Why: since session 31's tensor-core
# loops kivi's kernel takes 134 registers, so an SM holds 3 of its blocks, and 2048 target warps
# (~520 blocks) keep more warps per scheduler than 1024 (~264 blocks, 2 per SM) where the
# history is long. One layer on the H200 (bench.launch_bounds_probe --warps 1024,2048,1024,2048,
# results/lb_h200_s31_tw_*.log, us): at 128K kivi 153.8 / 152.3 with 1024 against 140.5 / 146.6
# with 2048, xquant 143.1 / 146.0 against 133.9 / 134.0; at 96K kivi 118.4 / 117.7 against
# 112.7 / 112.5, xquant 117.6 / 118.0 against 112.0 / 110.6; at 64K (4 tiles per warp) 2048
# was slower: kivi 91.3 / 95.0 against 97.8 / 105.0, xquant 84.7 / 85.1 against 91.7 / 89.6.
AFFINE_LONG_TILES_PER_WARP = 6
_PARTIALS_TEMPLATE = r"""
  constexpr int NW = 4;               // warps per block
  constexpr int TILE = 128;           // tokens per warp tile
  constexpr int TPL = TILE / 32;      // tokens per lane when scoring
  constexpr int CPL = DV / LPT;       // value channels per lane
  constexpr int TPR = 32 / LPT;       // tokens per round when weighing values
  constexpr int ROUNDS = TILE / TPR;
  constexpr int BATCH = VST / TPR < 8 ? VST / TPR : 8;  // rounds whose loads are issued together
  constexpr int LANE_BITS = CPL * VB;  // code bits per lane and token: 32k, or 8 / 16 (part of a word)
  constexpr int WPL = LANE_BITS >= 32 ? LANE_BITS / 32 : 1;  // code words per lane and token
  constexpr int WV = DV * VB / 32;    // code words per value token
  constexpr int GV = DV / G;          // value groups per token
  constexpr int DMAX = D > DV ? D : DV;
  constexpr int SLOTS = TPL * 33;     // tile_slot's range: 4 runs of 32 slots, one spare each
  // The history's stages (a warp's buffer of STAGE_WORDS words, kstage): the keys of KSC
  // channels x the tile's tokens (codes, then scales, then zeros), or the values of VST tokens.
  constexpr int NGK = TILE / G > 0 ? TILE / G : 1;   // key groups in a tile (G <= TILE)
  constexpr int KCODE_ROW = TILE * KB / 8;           // bytes of one channel's codes in a tile
  constexpr int KSIDE_ROW = NGK * (int)sizeof(ST);   // bytes of one channel's scales in a tile
  constexpr int WR = KCODE_ROW / 4;                  // code words of a channel in a tile
  static_assert(D % KSC == 0 && KSC * (KCODE_ROW + 2 * KSIDE_ROW) <= 4 * STAGE_WORDS, "key stage");
  static_assert(TILE % VST == 0 && VST * (4 * WV + 2 * GV * (int)sizeof(ST)) <= 4 * STAGE_WORDS
                && VST * 4 * WV % 16 == 0 && VST * GV * (int)sizeof(ST) % 16 == 0, "value stage");
  constexpr int PS = (SLOTS > DMAX ? SLOTS : DMAX) * R;  // a warp's probabilities, later its partial
  // MMA (fused_decode.MMA_SCORES): the history's scores on tensor cores, where the GPU has them.
  constexpr bool USE_MMA = MMA && VQ_HAS_MMA;
  // A warp's B fragments of one key group: the lanes of B's columns 0 .. R - 1 (lanes 4 R on hold
  // columns past the query rows: zeros, never stored).
  constexpr int MMA_WORDS = MMA ? D / 16 * 8 * R : 1;
  static_assert(!MMA || (KB == 2 && KSC == D && D % 16 == 0 && G % 16 == 0 && R <= 8 && 32 % R == 0), "MMA");
  // MMAV (fused_decode.MMA_VALUES): the history's values weighed on tensor cores, where the GPU
  // has them: O^T += V^T P^T per 16 tokens, the warp's C fragments NMT m-tiles of 16 channels
  // x 8 query rows (lane 4 g + t: channels 16 mt + g and + 8, rows 2 t and 2 t + 1).
  constexpr bool USE_MMAV = MMAV && VQ_HAS_MMA;
  constexpr int NMT = MMAV ? DV / 16 : 1;
  static_assert(!MMAV || (VB == 2 && sizeof(ST) == 2 && DV % 16 == 0 && G % 16 == 0 && VST % 16 == 0
                          && R <= 8), "MMAV");
  const float neg_inf = __int_as_float(0xff800000);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int tl = lane / LPT;
  const int ch0 = (lane % LPT) * CPL;
  // An mma fragment's lane 4 g8 + t4 (the tensor-core scores' and values' layouts).
  const int g8 = lane >> 2, t4 = lane & 3;
  // Where the lane's value bits start in its first word: 0 unless lanes share a word.
  const int sub = LANE_BITS >= 32 ? 0 : (ch0 * VB) & 31;
  const int bh = blockIdx.y;
  const int n_valid = meta[0];
  const int per_block = meta[1];
  const int n_hist_blocks = meta[2];
  const float scale = __int_as_float(meta[3]);
  const int n_skip = meta[4];
  const int n_sink = meta[5];
  const bool window = blockIdx.x >= n_hist_blocks;
  // The window's rows per head in wk / wv: all of them its tokens, or with WB (buffers the cache
  // writes in place, fused_decode.window_rows) the first wn_shape[0] (read where the exact
  // block's end is set: kept live from here, it cost gear's kernel 11 registers under nvcc).
  const int n_window = wk_shape[2];
  const int cap = vc_shape[2];
  const int wk_words = kc_shape[3];
  const int gk = ks_shape[3];
  // A tile token's slot in p_tile (see above): one constant per unrolled round plus one per lane.
  const auto tile_slot = [](int t) { return (t % TPL) * 33 + t / TPL; };
  // The value loop's token C + tl (C a multiple of TPR, a power of two; tl < TPR) is at
  // tile_slot(C) + tile_slot(tl): C and tl never carry into each other's part of the slot.
  const int slot_tl = tile_slot(tl);

  // Shared: queries [d][r] (scaled), each warp's tile probabilities [tile_slot(token)][r], and
  // at the end the warps' partials (reusing the probabilities' space).
  __shared__ __align__(16) float qs[D * R];
  __shared__ __align__(16) float ps[NW][PS];
  __shared__ float red_m[NW][R];
  __shared__ float red_l[NW][R];
  __shared__ __align__(16) uint32_t kstage[NW][STAGE_WORDS];
  __shared__ __align__(16) uint32_t bfrag[NW][MMA_WORDS];
  for (int i = threadIdx.x; i < R * D; i += 32 * NW) {
    const int r = i / D, d = i % D;
    qs[d * R + r] = scale * vq_f32(q[(size_t)bh * R * D + i]);
  }
  __syncthreads();
  // MMA: the lane's pairs of the scores' B (query row h = i % R, channels c = i / R * 2 and
  // c + 1, for i = lane + 32 k), times 4, in registers for the whole launch. Why: every key
  // group rebuilt B from shared memory, its indices and the factor 4 recomputed (sm_90 SASS:
  // 122 instructions per 4 pairs, ~1,000 of a tile's ~5,800).
  constexpr int BPL = MMA ? (D / 2 * R + 31) / 32 : 1;  // B pairs per lane
  float q4[BPL][2];
  #pragma unroll
  for (int k = 0; k < BPL; ++k) {
    const int i = lane + 32 * k, h = i % R, c = i / R * 2;
    const bool in = (D / 2 * R) % 32 == 0 || i < D / 2 * R;
    q4[k][0] = in ? 4.f * qs[c * R + h] : 0.f;
    q4[k][1] = in ? 4.f * qs[(c + 1) * R + h] : 0.f;
  }

  const uint32_t* kc_bh = kc + (size_t)bh * D * wk_words;
  const ST* ks_bh = ks + (size_t)bh * D * gk;
  const ST* kz_bh = kz + (size_t)bh * D * gk;
  const uint32_t* vc_bh = vc + (size_t)bh * cap * WV;
  const ST* vs_bh = vs + (size_t)bh * cap * GV;
  const ST* vz_bh = vz + (size_t)bh * cap * GV;
  const QT* wk_bh = wk + (size_t)bh * n_window * D;
  const QT* wv_bh = wv + (size_t)bh * n_window * DV;
  // The exact block's token t: sink row t below n_sink, else window row t - n_sink; at R = 4
  // written as a base chosen per token plus t rows (the window's base moved back by n_sink rows,
  // never read there), at other R as whole row pointers selected. Why: ptxas's register counts
  // (sm_90, nvcc 13.0), which the two forms move by up to 14 with no other change: at R = 4 (the
  // 8B shape) 96 registers in 16-bit (5 blocks per SM) where row pointers take 104-112 (4
  // blocks; 106 before the sink was an input); at R = 8 and 1 row pointers keep the counts from
  // before (168, 72) where the based form takes 178, 80.
  const QT* sk_bh = sk + (size_t)bh * n_sink * D;
  const QT* sv_bh = sv + (size_t)bh * n_sink * DV;
  const QT* wk_exact = wk_bh - (size_t)n_sink * D;
  const QT* wv_exact = wv_bh - (size_t)n_sink * DV;
  // WRV (WINDOW_ROW_VECTORS): the exact block reads its rows 16 bytes a load where every row it
  // reads starts 16-byte aligned (rows are whole vectors, WRV's condition; the bases checked
  // here, the sink's only where it has rows: its dummy may sit in MLX's 8-byte pool).
  const bool rows_aligned = WRV && ((reinterpret_cast<size_t>(wk) | reinterpret_cast<size_t>(wv)
      | (n_sink ? reinterpret_cast<size_t>(sk) | reinterpret_cast<size_t>(sv) : 0)) & 15) == 0;
  // The exact block's key row of token t (sink or window), as both of its key loops read it.
  const auto exact_key_row = [&](int t) -> const QT* {
    return R == 4 ? (t < n_sink ? sk_bh : wk_exact) + (size_t)t * D
                  : t < n_sink ? sk_bh + (size_t)t * D : wk_bh + (size_t)(t - n_sink) * D;
  };
  float* p_tile = ps[warp];
  // The warp's stage of the keys of the tile at `base`, KSC channels from c0 (codes, then scales,
  // then zeros; every load issued before the first store): the FMA and MMA score loops' one
  // copy of the history's keys into shared memory.
  const auto stage_keys = [&](int base, int c0) {
    vq_stage<KSC, KCODE_ROW> codes;
    vq_stage<KSC, KSIDE_ROW> scales, zeros;
    codes.load(kc_bh + (size_t)c0 * wk_words + (base * KB >> 5), (size_t)wk_words * 4, lane);
    scales.load(ks_bh + (size_t)c0 * gk + base / G, (size_t)gk * sizeof(ST), lane);
    zeros.load(kz_bh + (size_t)c0 * gk + base / G, (size_t)gk * sizeof(ST), lane);
    codes.store(kstage[warp], lane);
    scales.store(kstage[warp] + KSC * WR, lane);
    zeros.store(reinterpret_cast<ST*>(kstage[warp] + KSC * WR) + KSC * NGK, lane);
  };
  // The warp's stage of VST value tokens from tile position v0 of the tile at `base` (codes,
  // scales, zeros: contiguous runs; every load issued before the first store): the FMA and MMA
  // value loops' one copy of the history's values into shared memory.
  const auto stage_values = [&](int base, int v0) {
    vq_stage<VST * 4 * WV / 16, 16> codes;
    vq_stage<VST * GV * (int)sizeof(ST) / 16, 16> scales, zeros;
    codes.load(vc_bh + (size_t)(base + v0) * WV, 16, lane);
    scales.load(vs_bh + (size_t)(base + v0) * GV, 16, lane);
    zeros.load(vz_bh + (size_t)(base + v0) * GV, 16, lane);
    codes.store(kstage[warp], lane);
    scales.store(kstage[warp] + VST * WV, lane);
    zeros.store(reinterpret_cast<ST*>(kstage[warp] + VST * WV) + VST * GV, lane);
  };
  //@declare

  float m[R], l[R], acc[R][CPL];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = neg_inf;
    l[r] = 0.f;
    #pragma unroll
    for (int c = 0; c < CPL; ++c) acc[r][c] = 0.f;
  }
  // MMAV's accumulators: the C fragments (see the value loop); per value group, the lane's
  // part of its row's zeros' sum_t p zero (row g of lane 4 g + t) and the fragment of
  // sum_t B (cones: the same for every channel, the rows those of cv's fragments). The fragments share
  // acc's registers where acc is as large (a block weighs either the history, by MMA, or the
  // exact rows, by the FMA loop into acc): apart, they cost kivi's kernel 32 registers (nvcc,
  // sm_90, the 8B shape: 160 against 128).
  constexpr bool CV_IN_ACC = R * CPL >= NMT * 4;
  float cv_own[CV_IN_ACC ? 1 : NMT][4], vbias[GV], cones[GV][4];
  float (&cv)[NMT][4] = *reinterpret_cast<float (*)[NMT][4]>(CV_IN_ACC ? &acc[0][0] : &cv_own[0][0]);
  #pragma unroll
  for (int mt = 0; mt < NMT; ++mt) cv[mt][0] = cv[mt][1] = cv[mt][2] = cv[mt][3] = 0.f;
  #pragma unroll
  for (int j = 0; j < GV; ++j) vbias[j] = cones[j][0] = cones[j][1] = cones[j][2] = cones[j][3] = 0.f;

  const int first = window ? 0 : blockIdx.x * per_block;
  const int lo = window ? 0 : n_skip;  // tokens before lo are not attended
  // The exact block: the sink's n_sink tokens (sk, sv), then the window's.
  const int last = window ? n_sink + (WB ? wn_shape[0] : n_window) : min(first + per_block, n_valid);
  for (int base = first + warp * TILE; base < last; base += TILE * NW) {
    if (PF && !window) {
      // L2_PREFETCH: the warp's next tile's keys (a row per channel, rows a capacity apart) and
      // this tile's values, asked into L2 before this tile's key stage waits on memory.
      const int next = base + TILE * NW;
      if (next < last) {
        for (int c = lane; c < D; c += 32) {
          const uint32_t* row = kc_bh + (size_t)c * wk_words + (next * KB >> 5);
          for (int off = 0; off < KCODE_ROW; off += 32) vq_prefetch_l2(reinterpret_cast<const char*>(row) + off);
          vq_prefetch_l2(ks_bh + (size_t)c * gk + next / G);
          vq_prefetch_l2(kz_bh + (size_t)c * gk + next / G);
        }
      }
      vq_prefetch_run(vc_bh + (size_t)base * WV, TILE * WV * 4, lane);
      vq_prefetch_run(vs_bh + (size_t)base * GV, TILE * GV * (int)sizeof(ST), lane);
      vq_prefetch_run(vz_bh + (size_t)base * GV, TILE * GV * (int)sizeof(ST), lane);
    }
    //@tile
    // ---- scores of the lane's TPL tokens t0 .. t0 + TPL - 1 ----
    const int t0 = base + lane * TPL;
    float s[TPL][R];
    #pragma unroll
    for (int i = 0; i < TPL; ++i) {
      #pragma unroll
      for (int r = 0; r < R; ++r) s[i][r] = 0.f;
    }
    //@score_init
    if (window && rows_aligned) {
      // 16 bytes a load (WRV): the lane's TPL token rows advance together, one vector of each
      // in flight per step (a lane's 4 x D / EV loads wait D / EV times).
      constexpr int EV = 16 / (int)sizeof(QT);  // elements per 16-byte load
      const QT* krow[TPL];
      #pragma unroll
      for (int i = 0; i < TPL; ++i) {
        krow[i] = exact_key_row(min(t0 + i, last - 1));
      }
      #pragma unroll 1
      for (int d0 = 0; d0 < D; d0 += EV) {
        uint4 raw[TPL];
        #pragma unroll
        for (int i = 0; i < TPL; ++i) raw[i] = __ldg(reinterpret_cast<const uint4*>(krow[i] + d0));
        #pragma unroll
        for (int j = 0; j < EV; ++j) {
          #pragma unroll
          for (int i = 0; i < TPL; ++i) {
            const float kv = vq_f32(reinterpret_cast<const QT*>(&raw[i])[j]);
            #pragma unroll
            for (int r = 0; r < R; ++r) s[i][r] = fmaf(qs[(d0 + j) * R + r], kv, s[i][r]);
          }
        }
      }
    } else if (window) {
      // The window block is one per head and little else runs beside it at short contexts:
      // unrolled, so a lane's loads along its token rows are in flight together.
      #pragma unroll
      for (int i = 0; i < TPL; ++i) {
        const QT* krow = exact_key_row(min(t0 + i, last - 1));
        #pragma unroll 16
        for (int d = 0; d < D; ++d) {
          const float kv = vq_f32(krow[d]);
          #pragma unroll
          for (int r = 0; r < R; ++r) s[i][r] = fmaf(qs[d * R + r], kv, s[i][r]);
        }
      }
    } else if (USE_MMA) {
      // Tensor cores: per key group, scores[t][r] = sum_d A[t][d] B[d][r] + bias[r] with
      // A = 1 + code / 4, exact in fp16 (the code's two bits put into the mantissa of 1.0),
      // B = fp16(4 q[d][r] scale[d]): A B = sum_d B + sum_d (B / 4) code, whose first sum an
      // mma of ones over the same B takes off, and bias[r] = sum_d q[d][r] zero[d] (float32).
      // Why tried: the FMA loop below spends ~2 instructions per multiply-add of the scores
      // (dequantizing, converting each code); here a warp's m16n8k16 does 16 tokens x 16
      // channels x 8 rows, and a code costs ~1 bit operation. Alone no faster on the H200;
      // with the values on tensor cores too, on as shipped since session 30 (MMA_SCORES' note).
      // The whole tile is staged at once (KSC == D); the tile's scores go through p_tile into
      // the lanes' s[i][r].
      const ST* kss = reinterpret_cast<const ST*>(kstage[warp] + KSC * WR);
      const ST* kzs = kss + KSC * NGK;
      __syncwarp();  // the stage's and p_tile's last readers are done
      stage_keys(base, 0);
      __syncwarp();
      // vq_code_pair16's rotation: the code at bit 2 g8 of each half of a permuted register (a
      // token's code in one channel's word of the m-tile) to bits 8, 9 and 24, 25.
      const int rot = (2 * g8 - 8) & 31;
      uint32_t* bf = bfrag[warp];
      float* sbuf = p_tile;  // the tile's scores [token][r] (p_tile is free until the softmax)
      constexpr int MPG = G / 16 < TILE / 16 ? G / 16 : TILE / 16;  // m-tiles per group in a tile
      const uint32_t ones[4] = {0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u};
      #pragma unroll 1
      for (int gi = 0; gi < NGK; ++gi) {
        // The group's B (lane's pairs of channels of query row h = lane % R) and bias partial.
        // bz summed from 4 q: 4 times the sum of q zero, exactly (a power of two), taken off below.
        float bz = 0.f;
        #pragma unroll
        for (int k = 0; k < BPL; ++k) {
          const int i = lane + 32 * k, h = i % R, c = i / R * 2, cc = c % 16;
          if ((D / 2 * R) % 32 == 0 || i < D / 2 * R) {
            bf[((c / 16) * 4 * R + h * 4 + (cc % 8) / 2) * 2 + cc / 8] = vq_half2_bits(
                q4[k][0] * vq_f32(kss[c * NGK + gi]), q4[k][1] * vq_f32(kss[(c + 1) * NGK + gi]));
            bz = fmaf(q4[k][0], vq_f32(kzs[c * NGK + gi]), fmaf(q4[k][1], vq_f32(kzs[(c + 1) * NGK + gi]), bz));
          }
        }
        #pragma unroll
        for (int o = R; o < 32; o <<= 1) bz += __shfl_xor_sync(0xffffffffu, bz, o);
        bz *= 0.25f;
        // The lane's C columns are rows 2 t4 and 2 t4 + 1 (those from R on are not used).
        const float bz0 = __shfl_sync(0xffffffffu, bz, (2 * t4) % R);
        const float bz1 = __shfl_sync(0xffffffffu, bz, (2 * t4 + 1) % R);
        __syncwarp();  // the group's B fragments are written
        // Lane's B fragment of k-tile kt (zeros past the query rows).
        const auto b_frag = [&](int kt) {
          return g8 < R ? *reinterpret_cast<const uint2*>(bf + (kt * 4 * R + lane) * 2) : make_uint2(0u, 0u);
        };
        float off[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int kt = 0; kt < D / 16; ++kt) {
          const uint2 b = b_frag(kt);
          vq_mma_f16(off, ones, b.x, b.y);
        }
        // MP m-tiles at a time: a channel's words of the two are adjacent (one 64-bit load), they
        // share each k-tile's B fragment, and their mma chains are independent. Why: one m-tile
        // at a time, a warp's 8 mma per m-tile each waited on the one before (the same C), and
        // its words and B came one 32-bit load each (sm_90 SASS: 211 instructions per m-tile).
        constexpr int MP = MPG % 2 == 0 ? 2 : 1;
        #pragma unroll 1
        for (int mt = gi * MPG; mt < (gi + 1) * MPG; mt += MP) {
          float c[MP][4];
          #pragma unroll
          for (int j = 0; j < MP; ++j) {
            c[j][0] = bz0 - off[0];
            c[j][1] = bz1 - off[1];
            c[j][2] = bz0 - off[2];
            c[j][3] = bz1 - off[3];
          }
          #pragma unroll
          for (int kt = 0; kt < D / 16; ++kt) {
            // Channels kt * 16 + 2 t4 (+ 1, + 8, + 9): their words of the m-tiles' 16 tokens each
            // (word mt of a channel's row, WR even and mt a multiple of MP: aligned).
            const uint32_t* w = kstage[warp] + (kt * 16 + 2 * t4) * WR + mt;
            uint32_t x[4][MP];
            const int rows[4] = {0, WR, 8 * WR, 9 * WR};
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
              if (MP == 2) {
                const uint2 pair = *reinterpret_cast<const uint2*>(w + rows[i]);
                x[i][0] = pair.x;
                x[i][MP - 1] = pair.y;
              } else {
                x[i][0] = w[rows[i]];
              }
            }
            const uint2 b = b_frag(kt);
            #pragma unroll
            for (int j = 0; j < MP; ++j) {
              // Tokens g8 (low halves) and g8 + 8 (high halves) of channels 2 t4 and 2 t4 + 1
              // (+ 8, + 9), as the values' A registers are made (fp16 here: B is fp16).
              const uint32_t a[4] = {vq_code_pair16<__half>(__byte_perm(x[0][j], x[1][j], 0x5410), rot),
                                     vq_code_pair16<__half>(__byte_perm(x[0][j], x[1][j], 0x7632), rot),
                                     vq_code_pair16<__half>(__byte_perm(x[2][j], x[3][j], 0x5410), rot),
                                     vq_code_pair16<__half>(__byte_perm(x[2][j], x[3][j], 0x7632), rot)};
              vq_mma_f16(c[j], a, b.x, b.y);
            }
          }
          if (2 * t4 < R) {
            #pragma unroll
            for (int j = 0; j < MP; ++j) {
              const int tok = (mt + j) * 16 + g8;
              sbuf[tok * R + 2 * t4] = c[j][0];
              sbuf[(tok + 8) * R + 2 * t4] = c[j][2];
              if (2 * t4 + 1 < R) {
                sbuf[tok * R + 2 * t4 + 1] = c[j][1];
                sbuf[(tok + 8) * R + 2 * t4 + 1] = c[j][3];
              }
            }
          }
        }
        __syncwarp();  // the group's B fragments are read before the next group's are written
      }
      #pragma unroll
      for (int i = 0; i < TPL; ++i) {
        #pragma unroll
        for (int r = 0; r < R; ++r) s[i][r] += sbuf[(lane * TPL + i) * R + r];
      }
      __syncwarp();  // read before the softmax writes the probabilities there
    } else {
      // Past-the-end lanes read the last valid slice (their scores are dropped below).
      const int tc = min(t0, (last - 1) / TPL * TPL) - base;  // in the tile
      const int lane_word = (tc * KB) >> 5;
      const int shift = (tc * KB) & 31;
      const int g = tc / G;
      const ST* kss = reinterpret_cast<const ST*>(kstage[warp] + KSC * WR);
      const ST* kzs = kss + KSC * NGK;
      // The tile's keys staged KSC channels at a time (the whole tile's tokens; base + TILE <=
      // capacity, a multiple of TILE: the loads never leave the arrays).
      #pragma unroll 1
      for (int c0 = 0; c0 < D; c0 += KSC) {
        __syncwarp();  // the stage's last readers are done
        stage_keys(base, c0);
        __syncwarp();
        #pragma unroll 16
        for (int dd = 0; dd < KSC; ++dd) {
          const int d = c0 + dd;
          const unsigned w = kstage[warp][dd * WR + lane_word] >> shift;
          const float sc = vq_f32(kss[dd * NGK + g]);
          const float zp = vq_f32(kzs[dd * NGK + g]);
          float qd[R];
          #pragma unroll
          for (int r = 0; r < R; ++r) qd[r] = qs[d * R + r];
          #pragma unroll
          for (int i = 0; i < TPL; ++i) {
            const float kv = fmaf(sc, (float)((w >> (i * KB)) & ((1u << KB) - 1u)), zp);
            #pragma unroll
            for (int r = 0; r < R; ++r) s[i][r] = fmaf(qd[r], kv, s[i][r]);
          }
        }
      }
    }
    // ---- online softmax over the tile; probabilities to shared memory ----
    // A row at a time (its warp max and sum); s[i][r] becomes the probability, stored after
    // the last row so that a token's R floats go out as vector stores (one 128-bit store at
    // R = 4; one store per row instead: 106 registers against 96 at the 8B shape, ptxas sm_90).
    float alpha_r[R];  // the rows' rescale of this tile (MMAV's fragments take it after the loop)
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      float tile_max = neg_inf;
      #pragma unroll
      for (int i = 0; i < TPL; ++i) {
        const bool ok = t0 + i < last && t0 + i >= lo;
        tile_max = ok ? fmaxf(tile_max, s[i][r]) : tile_max;
      }
      // Finite: every tile holds a valid token (n_skip < n_valid and n_skip < TILE, checked
      // by the caller, so the first tile keeps tokens n_skip..; the others start at valid ones).
      const float m_new = fmaxf(m[r], vq_warp_max(tile_max));
      const float alpha = expf(m[r] - m_new);
      float sum = 0.f;
      #pragma unroll
      for (int i = 0; i < TPL; ++i) {
        const float p = t0 + i < last && t0 + i >= lo ? expf(s[i][r] - m_new) : 0.f;
        s[i][r] = p;
        sum += p;
      }
      l[r] = l[r] * alpha + vq_warp_sum(sum);
      if (!USE_MMAV || window) {  // the exact block weighs its rows by the FMA loop
        #pragma unroll
        for (int c = 0; c < CPL; ++c) acc[r][c] *= alpha;
      }
      alpha_r[r] = alpha;
      m[r] = m_new;
      //@rescaled
    }
    if (USE_MMAV && !window) {
      // The lane's rows: 2 t and 2 t + 1 in its C fragments, g in its bias parts (rows past R
      // hold zeros and keep a factor of 1).
      float a_lo = 1.f, a_hi = 1.f, a_b = 1.f;
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        a_lo = 2 * t4 == r ? alpha_r[r] : a_lo;
        a_hi = 2 * t4 + 1 == r ? alpha_r[r] : a_hi;
        a_b = g8 == r ? alpha_r[r] : a_b;
      }
      #pragma unroll
      for (int mt = 0; mt < NMT; ++mt) {
        cv[mt][0] *= a_lo;
        cv[mt][1] *= a_hi;
        cv[mt][2] *= a_lo;
        cv[mt][3] *= a_hi;
      }
      #pragma unroll
      for (int j = 0; j < GV; ++j) {
        vbias[j] *= a_b;
        cones[j][0] *= a_lo;
        cones[j][1] *= a_hi;
        cones[j][2] *= a_lo;
        cones[j][3] *= a_hi;
      }
    }
    #pragma unroll
    for (int i = 0; i < TPL; ++i) {
      #pragma unroll
      for (int r = 0; r < R; ++r) p_tile[(i * 33 + lane) * R + r] = s[i][r];  // tile_slot(lane * TPL + i)
    }
    __syncwarp();
    //@probs
    // ---- values: past-the-end tokens read the last valid token (p = 0 there) ----
    if (window) {
      // WBATCH rounds' loads issued before their arithmetic (one round at a time waited on
      // global memory ROUNDS times in a row).
      constexpr int WBATCH = CPL <= 8 ? 4 : 2;
      for (int b0 = 0; b0 < ROUNDS; b0 += WBATCH) {
        float v[WBATCH][CPL];
        #pragma unroll
        for (int k = 0; k < WBATCH; ++k) {
          const int tj = min(base + (b0 + k) * TPR + tl, last - 1);
          const QT* vrow = R == 4 ? (tj < n_sink ? sv_bh : wv_exact) + (size_t)tj * DV
                     : tj < n_sink ? sv_bh + (size_t)tj * DV : wv_bh + (size_t)(tj - n_sink) * DV;
          if (rows_aligned) {
            vq_row_vectors<CPL>(vrow + ch0, v[k]);
          } else {
            #pragma unroll
            for (int c = 0; c < CPL; ++c) v[k][c] = vq_f32(vrow[ch0 + c]);
          }
        }
        #pragma unroll
        for (int k = 0; k < WBATCH; ++k) {
          const int pslot = (tile_slot((b0 + k) * TPR) + slot_tl) * R;
          #pragma unroll
          for (int c = 0; c < CPL; ++c) {
            #pragma unroll
            for (int r = 0; r < R; ++r) acc[r][c] = fmaf(p_tile[pslot + r], v[k][c], acc[r][c]);
          }
        }
      }
    } else {
      // The tile's values staged VST tokens at a time (codes, scales, zeros: contiguous runs),
      // weighed on tensor cores (MMAV) or by the FMA loop.
      const ST* vss = reinterpret_cast<const ST*>(kstage[warp] + VST * WV);
      const ST* vzs = vss + VST * GV;
      const int t_last = last - 1 - base;  // the tile's last valid token
      using MT = vq_mma_type<ST>;
      const int rot = (2 * g8 - MT::POS) & 31;  // MMAV: code g8's bits to the mantissa's
      #pragma unroll 1
      for (int v0 = 0; v0 < TILE; v0 += VST) {
        if (v0 > t_last) break;  // the rest of the tile is past the end (warp-uniform)
        __syncwarp();  // the stage's last readers (the keys' or the previous values') are done
        stage_values(base, v0);
        __syncwarp();
        if (USE_MMAV) {
          // Tensor cores: per 16 tokens, C[ch][r] += sum_t A[ch][t] B[t][r] with A = 1 + code / 4
          // (exact in T, the side data's 16-bit type: the code put into the mantissa of 1.0)
          // and B = T(p[t][r] scale[t]) of the channel's group, so that
          //   sum_t p (scale code + zero) = 4 C - 4 sum_t B + sum_t p zero,
          // sum_t B (B as rounded) by one more mma per group with A = 1 (cones), the zeros' sum
          // per row and group in float32 (vbias). Why: the
          // FMA loop below spends ~8 instructions per code (its extraction, conversion,
          // dequantization and one FMA per query row); here a code costs ~2 (its load shared by
          // two, a byte permute, a rotation, a mask) and an mma does 16 tokens x 16 channels x
          // 8 rows. T's rounding of p * scale (bf16: 2^-9 relative) is the portable path's own
          // rounding of a dequantized value.
          #pragma unroll 1
          for (int k0 = v0; k0 < v0 + VST && k0 <= t_last; k0 += 16) {
            // The lane's tokens of the 16: k0 + 2 t + {0, 1, 8, 9} (B's rows, A's columns); past
            // the end they read the last valid token's codes and scales, with p = 0.
            int tj[4];
            float p[4];
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int tok = k0 + 2 * t4 + (i & 1) + 8 * (i >> 1);
              tj[i] = min(tok, t_last) - v0;
              p[i] = g8 < R ? p_tile[tile_slot(tok) * R + g8] : 0.f;
            }
            float sc[4][GV], zp[4][GV];  // the tokens' scales and zeros, a row per token
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
              vq_shared_row<GV>(vss + tj[i] * GV, sc[i]);
              vq_shared_row<GV>(vzs + tj[i] * GV, zp[i]);
            }
            uint32_t b[GV][2];
            #pragma unroll
            for (int j = 0; j < GV; ++j) {
              float pb[4];
              #pragma unroll
              for (int i = 0; i < 4; ++i) {
                pb[i] = p[i] * sc[i][j];
                vbias[j] = fmaf(p[i], zp[i][j], vbias[j]);
              }
              b[j][0] = MT::pack(pb[0], pb[1]);
              b[j][1] = MT::pack(pb[2], pb[3]);
              // The "1" of A = 1 + code / 4, to take off with B as the mma rounded it: only the
              // code's part keeps T's rounding (as a dequantized value's would). An mma, not
              // B's halves unpacked and added (8 instructions per group and 16 tokens).
              const uint32_t ones[4] = {MT::ONE, MT::ONE, MT::ONE, MT::ONE};
              MT::mma(cones[j], ones, b[j][0], b[j][1]);
            }
            #pragma unroll
            for (int mt = 0; mt < NMT; ++mt) {
              // Word mt of a token holds channels 16 mt .. 16 mt + 15 (2 bits each).
              const uint32_t w0 = kstage[warp][tj[0] * WV + mt], w1 = kstage[warp][tj[1] * WV + mt];
              const uint32_t w2 = kstage[warp][tj[2] * WV + mt], w3 = kstage[warp][tj[3] * WV + mt];
              const uint32_t a[4] = {vq_code_pair16<ST>(__byte_perm(w0, w1, 0x5410), rot),
                                     vq_code_pair16<ST>(__byte_perm(w0, w1, 0x7632), rot),
                                     vq_code_pair16<ST>(__byte_perm(w2, w3, 0x5410), rot),
                                     vq_code_pair16<ST>(__byte_perm(w2, w3, 0x7632), rot)};
              MT::mma(cv[mt], a, b[16 * mt / G][0], b[16 * mt / G][1]);
            }
          }
          continue;  // the FMA loop below is the other path
        }
        // v0 is a multiple of TPL (VST >= 8), so its slot adds to the rounds' without carrying.
        const int slot_v0 = tile_slot(v0) + slot_tl;
        // Not unrolled beyond a batch: unrolled whole (64 rounds at the 8B shape) the loop was
        // ~4,600 instructions, ~74 KB of code that every warp streams through once per tile.
        #pragma unroll 1
        for (int b0 = 0; b0 < VST / TPR; b0 += BATCH) {
          // The batch's first token b0 * TPR is a multiple of TPL (BATCH * TPR >= 8): no carry.
          const int slot_b0 = slot_v0 + tile_slot(b0 * TPR);
          uint32_t words[BATCH][WPL];
          float sc[BATCH], zp[BATCH];
          #pragma unroll
          for (int k = 0; k < BATCH; ++k) {
            // Past-the-end tokens read the tile's last valid one (p = 0 there).
            const int tj = min(v0 + (b0 + k) * TPR + tl, t_last) - v0;
            const uint32_t* row = kstage[warp] + tj * WV + ch0 * VB / 32;
            #pragma unroll
            for (int i = 0; i < WPL; ++i) words[k][i] = row[i];
            sc[k] = vq_f32(vss[tj * GV + ch0 / G]);
            zp[k] = vq_f32(vzs[tj * GV + ch0 / G]);
          }
          #pragma unroll
          for (int k = 0; k < BATCH; ++k) {
            // Token v0 + (b0 + k) * TPR + tl: the batch's slot + a constant (unrolled) + the lane's.
            const int pslot = (slot_b0 + tile_slot(k * TPR)) * R;
            float pj[R];
            #pragma unroll
            for (int r = 0; r < R; ++r) pj[r] = p_tile[pslot + r];
            #pragma unroll
            for (int c = 0; c < CPL; ++c) {
              const unsigned code = (words[k][(c * VB) >> 5] >> (((c * VB) & 31) + sub)) & ((1u << VB) - 1u);
              const float v = fmaf(sc[k], (float)code, zp[k]);
              #pragma unroll
              for (int r = 0; r < R; ++r) acc[r][c] = fmaf(pj[r], v, acc[r][c]);
            }
          }
        }
      }
    }
    __syncwarp();
  }

  float* red_o = ps[warp];  // the warp's probabilities are no longer needed: [r][channel]
  if (USE_MMAV && !window) {
    // Row g's bias parts summed over its lanes 4 g .. 4 g + 3, then fetched by the lanes whose
    // C fragments hold rows 2 t and 2 t + 1; each (row, channel) is one lane's.
    float b_lo[GV], b_hi[GV];
    #pragma unroll
    for (int j = 0; j < GV; ++j) {
      float bsum = vbias[j];
      bsum += __shfl_xor_sync(0xffffffffu, bsum, 1);
      bsum += __shfl_xor_sync(0xffffffffu, bsum, 2);
      b_lo[j] = __shfl_sync(0xffffffffu, bsum, 8 * t4);
      b_hi[j] = __shfl_sync(0xffffffffu, bsum, (8 * t4 + 4) & 31);
    }
    #pragma unroll
    for (int mt = 0; mt < NMT; ++mt) {
      const int ch = 16 * mt + g8;
      const float* one = cones[16 * mt / G];
      if (2 * t4 < R) {
        red_o[2 * t4 * DV + ch] = fmaf(4.f, cv[mt][0] - one[0], b_lo[16 * mt / G]);
        red_o[2 * t4 * DV + ch + 8] = fmaf(4.f, cv[mt][2] - one[2], b_lo[16 * mt / G]);
      }
      if (2 * t4 + 1 < R) {
        red_o[(2 * t4 + 1) * DV + ch] = fmaf(4.f, cv[mt][1] - one[1], b_hi[16 * mt / G]);
        red_o[(2 * t4 + 1) * DV + ch + 8] = fmaf(4.f, cv[mt][3] - one[3], b_hi[16 * mt / G]);
      }
    }
  } else {
  // Lanes holding the same channels for different tokens: sum them (the lane bits above LPT).
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int c = 0; c < CPL; ++c) {
      #pragma unroll
      for (int o = LPT; o < 32; o <<= 1) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], o);
    }
  }
  if (tl == 0) {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      #pragma unroll
      for (int c = 0; c < CPL; ++c) red_o[r * DV + ch0 + c] = acc[r][c];
    }
  }
  }
  if (lane == 0) {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      red_m[warp][r] = m[r];
      red_l[warp][r] = l[r];
    }
  }
  //@partial
  __syncthreads();
  // The block's four warps merged into one partial.
  const size_t out_row = ((size_t)bh * gridDim.x + blockIdx.x) * R;
  vq_block_partial<R, DV, NW>(&ps[0][0], sizeof(ps[0]) / sizeof(float), &red_m[0][0], &red_l[0][0],
                              part_o, part_m, part_l, out_row);
"""

# Hook lines (`//@name`) mark where a kernel built on this one (fused_decode_gear.py: GEAR's
# store is this layout plus a low-rank and a sparse term) adds its code; partials_source()
# fills them, and removes them for the kernel above, whose text is then the plain kernel.
_HOOK_LINE = re.compile(r"^[ ]*//@(\w+)\n", re.M)
HOOKS = ("declare", "tile", "score_init", "rescaled", "probs", "partial")


def partials_source(hooks: dict[str, str] | None = None) -> str:
    """The partials kernel's source with code at its hook lines: `hooks` maps a hook name
    (HOOKS: after the per-block setup, at the start of a tile, after its scores are zeroed,
    after a row's rescale in the online softmax, once the tile's probabilities are in shared
    memory, before the warps' partials are merged) to source text; hooks not given are dropped."""
    hooks = dict(hooks or {})
    unknown = sorted(set(hooks) - set(HOOKS))
    if unknown:
        raise ValueError(f"partials_source: unknown hooks {unknown}; allowed are {', '.join(HOOKS)}")
    return _HOOK_LINE.sub(lambda m: hooks.get(m.group(1), ""), _PARTIALS_TEMPLATE)


_PARTIALS = partials_source()

# Kernel 2: merge the blocks' partials of one (batch*kv-head, row) into the output row. One
# block of DV threads per row: the block weights exp(m_b - M) are computed once, spread over the
# threads, then each thread sums its channel over the blocks (loads independent, coalesced).
MAX_BLOCKS = 2048
_MERGE = r"""
  __shared__ float weight[MAX_BLOCKS];
  __shared__ float red[32];
  const float neg_inf = __int_as_float(0xff800000);
  const int c = threadIdx.x;
  const int row = blockIdx.y;                 // bh * R + r
  const int n_blocks = part_m_shape[1];
  const int R = part_m_shape[2];
  const int bh = row / R, r = row % R;
  const float* pm = part_m + (size_t)bh * n_blocks * R + r;
  const float* pl = part_l + (size_t)bh * n_blocks * R + r;
  const float* po = part_o + ((size_t)bh * n_blocks * R + r) * DV + c;

  float top = neg_inf;
  for (int b = c; b < n_blocks; b += DV) top = fmaxf(top, pm[(size_t)b * R]);
  top = vq_warp_max(top);
  if (c % 32 == 0) red[c / 32] = top;
  __syncthreads();
  top = neg_inf;
  for (int w = 0; w < DV / 32; ++w) top = fmaxf(top, red[w]);
  __syncthreads();

  float den = 0.f;
  for (int b = c; b < n_blocks; b += DV) {
    const float mb = pm[(size_t)b * R];
    const float e = mb == neg_inf ? 0.f : expf(mb - top);
    weight[b] = e;
    den = fmaf(e, pl[(size_t)b * R], den);
  }
  den = vq_warp_sum(den);
  if (c % 32 == 0) red[c / 32] = den;
  __syncthreads();
  den = 0.f;
  for (int w = 0; w < DV / 32; ++w) den += red[w];

  float o = 0.f;
  #pragma unroll 8
  for (int b = 0; b < n_blocks; ++b) o = fmaf(weight[b], po[(size_t)b * R * DV], o);
  out[(size_t)row * DV + c] = vq_cast<QT>(o / den);
"""


# One launch per decode step: the partials kernel's last block per (batch*kv-head) merges the
# blocks' partials (vq_merge_if_last) where a second kernel (_MERGE) did. Why: on the H200 the
# decode step is bound by the host, not the GPU (each token's host time, graph built and handed
# to async_eval, is its whole interval: fp16 1.67 ms, kivi 1.91 ms per 8-layer step at 32K,
# results/gpu_speed_h200_s7_32k_host.json), and one mx.fast.cuda_kernel call costs the host
# ~23 us there (12 us to build, 11 us to launch; a built-in op ~4.5 us: mx.add 1.1 + 3.5; the
# README's H200 section, session 7), so the merge kernel cost every layer ~23 us of each step.
# The partials live in a float32 scratch and the per-head counters in inputs that outlive the
# launch (FusedLaunchState), not in outputs: MLX fills every output of a launch given
# init_value, one more kernel each (results/launch_cost_h200_s8.json: a call's launch 11.9 us,
# 23.8 us with init_value), and each output costs the host ~5 us. False: the two kernels.
MERGE_IN_KERNEL = True

# Put before / after a partials kernel's source to fuse the merge in: the source writes part_o /
# part_m / part_l (BH, n_blocks, R, DV) / (BH, n_blocks, R) as before, now slices of `scratch`
# (grid: x = n_blocks blocks, y = BH), and ends with its block partial written.
# Macros, not pointer variables: computed where used (the end), so no register holds them
# through the kernel's loops (as variables: 106 registers against 96, ptxas sm_90, kivi's 8B shape).
# `counts` and `scratch` are inputs (MLX declares them const): the kernel counts in the one and
# leaves it at zero, and writes the partials to the other, read back within the same launch.
_FUSED_PROLOGUE = r"""
#define part_o (const_cast<float*>(scratch))
#define part_m (const_cast<float*>(scratch) + (size_t)gridDim.y * gridDim.x * R * DV)
#define part_l (const_cast<float*>(scratch) + (size_t)gridDim.y * gridDim.x * R * (DV + 1))
"""
_FUSED_EPILOGUE = r"""
  vq_merge_if_last<R, DV>(part_o, part_m, part_l, part_l + (size_t)gridDim.y * gridDim.x * R,
                          const_cast<int*>(counts), out, blockIdx.y, gridDim.x);
#undef part_o
#undef part_m
#undef part_l
"""

# Where set, a fused decode launch passes MLX no template: its constants are written into the
# kernel's source instead (PartialsKernel.baked: one kernel object per set of constants), as the
# lines MLX itself writes for them, so the compiled kernel is the same. Why: on the H200 the
# Python function making a decode launch took 26-28 us of own time per layer and step under
# cProfile (session 33, results/host_profile_h200_s33_decode.json: the mx.fast.cuda_kernel call
# inside it), against ~3 us for mlx-lm's attention, and MLX converts, hashes and formats every
# template constant at every call (a decode launch has up to 27). Off until the H200 times it:
# bench.launch_cost's constant cases, and the `<method>-baked` ablations (a cache's own
# `baked_constants` attribute) in gpu_speed --interleave.
BAKED_CONSTANTS = False

# Where set (as shipped since session 36), a cache's fused decode launches go through mx.compile
# (cache/compiled_launch.py: MLX replays the traced kernel call, none of the call's host work is
# done again), the window's filled rows passed as data; a cache whose decode kernels run then
# writes its decode window in place (base.py, window_buffer.py): a window concatenated each step
# changes shape each step, and each new shape is a new trace. Why on: the H200's decode step
# waits on the host, and in one interleaved 32K run (results/gpu_speed_h200_s36_32k_compact_
# compiled.json) the compiled launch's paired ratio to fp16 was 0.89-0.93 against 0.87-0.89
# for the uncompiled one, per method (0-0.04 in session 35's two runs). A cache's own
# `compiled_launch` decides instead where set (the `<method>-uncompiled` ablations: False).
COMPILED_LAUNCH = True

# MLX's CUDA type name per dtype (its dtype_to_cuda_type), for constants written into a source.
_CUDA_TYPE_NAMES = {
    mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float",
}


def constants_source(template) -> str:
    """The lines MLX's CUDA backend writes into a kernel's body for its template constants
    (custom_kernel.cpp, build_kernel), in their order, and the blank line after them:
    `constexpr int N = 3;`, `constexpr bool F = true;`, `using T = __nv_bfloat16;`."""
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, (int, np.integer)):
            lines.append(f"  constexpr int {name} = {int(value)};\n")
        elif isinstance(value, mx.Dtype) and value in _CUDA_TYPE_NAMES:
            lines.append(f"  using {name} = {_CUDA_TYPE_NAMES[value]};\n")
        else:
            raise QuantizerConfigError(
                f"decode kernel template constant {name}={value!r}: allowed is an int, a bool or one "
                f"of the dtypes {sorted(map(str, _CUDA_TYPE_NAMES))}"
            )
    return "".join(lines) + "\n" if lines else ""


# The fused build's inputs beyond the partials kernel's own: the counters, the partials'
# scratch, and the launch this one must follow (FusedLaunchState.after), which the kernel never
# reads.
FUSED_EXTRA_INPUTS = ("counts", "scratch", "after")

# Floats the scratch grows by (64 K floats, 256 KB): a longer history needs more blocks, and a
# scratch a little larger than needed spares a new one at each such step.
SCRATCH_STEP = 1 << 16


class FusedLaunchState:
    """What successive fused launches of one cache share: the per-head counters (int32, left at
    zero by every launch), the partials' scratch (float32) and the last launch's output.
    Why the scratch is an input, not an output: each output of a launch costs the host ~2.5 us
    to build and ~2.5 us to launch (results/launch_cost_h200_s10.json: one output 5.8 + 5.0 us,
    three 10.9 + 10.1), every layer and step; kept here it is allocated once per size.
    Why the output: two launches sharing counters and scratch must not overlap. A later launch
    takes the last one's output as an input it never reads (`after`), so MLX orders the two
    within one evaluated graph as it orders any producer and consumer (its CUDA graphs run nodes
    without a path between them concurrently); launches in different evaluations run in stream
    order."""

    def __init__(self):
        self.counts = None
        self.scratch = None
        self.last_out = None
        self.compiled = CompiledLaunch()  # the cache's compiled launch, where it has one

    def inputs(self, queries, scratch_size: int, counters: int) -> list:
        """[counts, scratch, after] for a launch whose partials take `scratch_size` floats and
        whose merge counts in `counters` int32 (merge_counters). Counters are kept while enough:
        every launch leaves them all at zero, so a launch of fewer heads or groups finds its own
        at zero too."""
        if self.counts is None or self.counts.shape[0] < counters:
            self.counts = mx.zeros((counters,), dtype=mx.int32)
        if self.scratch is None or self.scratch.shape[0] < scratch_size:
            self.scratch = mx.zeros((-(-scratch_size // SCRATCH_STEP) * SCRATCH_STEP,), dtype=mx.float32)
        return [self.counts, self.scratch, self.after(queries)]

    def after(self, queries):
        """What the next launch follows: the last launch's output where it has the queries'
        dtype, else the queries (nothing to follow: an input already there, of the same dtype)."""
        after = self.last_out
        return queries if after is None or after.dtype != queries.dtype else after


def group_partials(n_blocks: int) -> int:
    """Partials per head of the fused merge's groups (the kernel's NG where it merges in two
    levels, past MERGE_GROUP blocks; 0 at one level, where it keeps none)."""
    return -(-n_blocks // MERGE_GROUP) if n_blocks > MERGE_GROUP else 0


def scratch_floats(heads: int, n_blocks: int, rows: int, value_dim: int) -> int:
    """Floats of the fused kernel's scratch: the blocks' partials (o, m, l), then the groups'
    (vq_merge_if_last's two levels)."""
    return heads * (n_blocks + group_partials(n_blocks)) * rows * (value_dim + 2)


def merge_counters(heads: int, n_blocks: int) -> int:
    """Counters of the fused merge: one per head, then one per head and group at two levels."""
    return heads * (1 + group_partials(n_blocks))


class PartialsKernel:
    """A flash-decoding partials kernel in its two builds: as written (outputs part_o, part_m,
    part_l, merged by merge_partials' kernel) and with the merge fused in (outputs the attention
    `out`; the partials go to FusedLaunchState's scratch), built on first use. Every partials
    kernel of ours launches blocks of WARPS_PER_BLOCK warps on a grid of (n_blocks, batch * kv
    heads) and has R and DV among its template constants."""

    def __init__(self, name: str, input_names, source: str, header: str):
        self.name, self.input_names, self.source, self.header = name, list(input_names), source, header
        self._split = self._fused = self._counted = self._verbatim = None
        self._baked = {}  # template constants (a tuple) -> the fused build with them in its source

    @property
    def split(self):
        if self._split is None:
            self._split = build_kernel(
                mx.fast.cuda_kernel,
                name=self.name, input_names=self.input_names,
                output_names=["part_o", "part_m", "part_l"], source=self.source, header=self.header)
        return self._split

    def fused_source(self, before: str = "", after: str = "") -> str:
        """The source with the merge fused in, as written (`before` / `after`: lines written
        before and after it: template constants, compiled_launch's counted window)."""
        return before + _FUSED_PROLOGUE + self.source + _FUSED_EPILOGUE + after

    def _fused_build(self, suffix: str = "", before: str = "", after: str = "", compact: bool = True):
        """fused_source(before, after) built under this kernel's name + "_merged" + `suffix`;
        `compact`: build_kernel's."""
        return build_kernel(
            mx.fast.cuda_kernel,
            name=self.name + "_merged" + suffix, input_names=[*self.input_names, *FUSED_EXTRA_INPUTS],
            output_names=["out"], source=self.fused_source(before, after), header=self.header,
            compact=compact)

    @property
    def fused(self):
        if self._fused is None:
            self._fused = self._fused_build()
        return self._fused

    @property
    def verbatim(self):
        """The fused build with its header and source as written, comments and indentation in
        (kernel_text): the `<method>-verbatim` ablations' launch, for what compacting is worth."""
        if self._verbatim is None:
            self._verbatim = self._fused_build("_verbatim", compact=False)
        return self._verbatim

    @property
    def counted(self):
        """The fused build reading the window's filled rows as data (wn[0], an int32 count:
        compiled_launch.window_count) instead of wn's length: the compiled launch's kernel."""
        if self._counted is None:
            self._counted = self._fused_build("_counted", COUNTED_PROLOGUE, COUNTED_EPILOGUE)
        return self._counted

    def baked(self, template):
        """The fused build with `template`'s constants written into its source (BAKED_CONSTANTS),
        launched with no template; built once per set of constants."""
        key = tuple(template)
        kernel = self._baked.get(key)
        if kernel is None:
            kernel = self._baked[key] = self._fused_build("_baked", constants_source(key))
        return kernel

    def partials(self, queries, *, inputs, template, n_blocks: int, heads: int, value_dim: int):
        """The split build's launch -> (part_o, part_m, part_l)."""
        return split_launch(self.split, queries, inputs=inputs, template=template, n_blocks=n_blocks,
                            heads=heads, value_dim=value_dim)

    def attend(self, queries, *, inputs, template, n_blocks: int, heads: int, value_dim: int,
               state: FusedLaunchState | None = None, baked: bool | None = None, compiled: bool = False,
               verbatim: bool = False):
        """The attention output (B, Hq, 1, DV) in the queries' dtype: one fused launch
        (MERGE_IN_KERNEL), else the split build and merge_partials. `state`: the cache's
        FusedLaunchState (None: one for this launch alone); `baked`: the fused launch's
        constants written into its source (None: BAKED_CONSTANTS); `compiled`: the counted
        build through the state's CompiledLaunch (mx.compile), `inputs` holding the window's
        count (compiled_launch.window_count) as wn; `verbatim`: the fused build with its text
        as written (PartialsKernel.verbatim), for the bench's ablation."""
        in_source = BAKED_CONSTANTS if baked is None else baked
        if verbatim and (in_source or compiled or not MERGE_IN_KERNEL):
            raise QuantizerConfigError(
                "decode kernels: the text-as-written build (a cache's kernel_text_as_written) is "
                "the plain fused launch's; it takes no constants in the source (BAKED_CONSTANTS or "
                "baked_constants), no compiled launch (COMPILED_LAUNCH or compiled_launch) and "
                "needs MERGE_IN_KERNEL: set one of them"
            )
        if in_source and compiled:
            raise QuantizerConfigError(
                "decode kernels: a compiled launch (COMPILED_LAUNCH or a cache's compiled_launch) "
                "handles its template constants at its trace only; constants in the source "
                "(BAKED_CONSTANTS or baked_constants) are for the uncompiled launch: set one of the two"
            )
        if not MERGE_IN_KERNEL:
            if in_source or compiled:
                raise QuantizerConfigError(
                    "decode kernels: constants in the source (BAKED_CONSTANTS or a cache's "
                    "baked_constants) and compiled launches (COMPILED_LAUNCH or compiled_launch) "
                    "apply to the fused launch only; MERGE_IN_KERNEL is off"
                )
            return merge_partials(*self.partials(queries, inputs=inputs, template=template, n_blocks=n_blocks,
                                                 heads=heads, value_dim=value_dim), queries)
        B, n_q_heads = queries.shape[:2]
        rows = n_q_heads * B // heads
        state = FusedLaunchState() if state is None else state
        scratch_size = scratch_floats(heads, n_blocks, rows, value_dim)
        arrays = [*inputs, *state.inputs(queries, scratch_size, merge_counters(heads, n_blocks))]
        launch = dict(grid=(32 * WARPS_PER_BLOCK * n_blocks, heads, 1), threadgroup=(32 * WARPS_PER_BLOCK, 1, 1))
        if compiled:
            out = state.compiled(self.counted, arrays, template=template, output_shape=(B, n_q_heads, 1, value_dim),
                                 output_dtype=queries.dtype, **launch)
        else:
            kernel, constants = (self.baked(template), []) if in_source else (
                self.verbatim if verbatim else self.fused, template)
            out = kernel(inputs=arrays, template=constants, output_shapes=[(B, n_q_heads, 1, value_dim)],
                         output_dtypes=[queries.dtype], **launch)[0]
        state.last_out = out
        return out


def split_launch(kernel, queries, *, inputs, template, n_blocks: int, heads: int, value_dim: int):
    """A partials kernel as written (the shipped split build, or a variant of its source that
    bench.kernel_probe times) on its grid of (n_blocks, heads) blocks -> (part_o, part_m,
    part_l) (heads, n_blocks, rows, DV) / (heads, n_blocks, rows) in float32."""
    rows = queries.shape[0] * queries.shape[1] // heads
    return kernel(
        inputs=inputs, template=template, grid=(32 * WARPS_PER_BLOCK * n_blocks, heads, 1),
        threadgroup=(32 * WARPS_PER_BLOCK, 1, 1),
        output_shapes=[(heads, n_blocks, rows, value_dim), (heads, n_blocks, rows), (heads, n_blocks, rows)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )


def kernels_enabled() -> bool:
    """True when the CUDA kernel should run: MLX's CUDA backend is the default GPU device and
    VELOXQUANT_CUDA_KERNELS is not 0. The variable is read at every call (environment_switch:
    the switch may be set while the process runs)."""
    switch = environment_switch.value(ENV_SWITCH, "1")
    if switch not in ("0", "1"):
        raise QuantizerConfigError(
            f"environment variable {ENV_SWITCH}={switch!r} is invalid: allowed is 0 (portable "
            "ops only) or 1 (CUDA kernel where MLX runs on CUDA, the default)"
        )
    return switch == "1" and _on_cuda()


def _on_cuda() -> bool:
    return _cuda_available() and mx.default_device() == mx.gpu


@lru_cache(maxsize=None)
def _cuda_available() -> bool:
    """Whether MLX has its CUDA backend here: fixed for the process, asked once (the question
    cost ~2.5 us of host time at every layer and decode step on the H200, where it asks the
    driver; the default device, which a caller may change, is read at each call)."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available()


# Kernel 1's inputs, in launch order (a kernel built on it by partials_source appends its own).
PARTIALS_INPUTS = ("q", "kc", "ks", "kz", "vc", "vs", "vz", "wk", "wv", "sk", "sv", "meta", "wn")


@lru_cache(maxsize=None)
def _kernels():
    partials = PartialsKernel("vq_affine_decode_partials", PARTIALS_INPUTS, _PARTIALS, _HEADER)
    merge = build_kernel(
        mx.fast.cuda_kernel,
        name="vq_affine_decode_merge",
        input_names=["part_o", "part_m", "part_l"],
        output_names=["out"],
        source=_MERGE,
        header=_HEADER,
    )
    return partials, merge


def affine_tokens_per_block(n_valid: int, n_heads: int) -> int:
    """History tokens per block of the affine kernel's own launches: AFFINE_TARGET_WARPS, twice
    that where each warp would walk AFFINE_LONG_TILES_PER_WARP tiles or more."""
    tiles = -(-n_valid // TILE) * n_heads
    long = tiles >= AFFINE_LONG_TILES_PER_WARP * AFFINE_TARGET_WARPS
    return tokens_per_block(n_valid, n_heads, target_warps=AFFINE_TARGET_WARPS * (2 if long else 1))


# The target warps of the cache whose launch plan is being built, where it has its own
# (CompressedKVCache.decode_target_warps, set by the `<method>-tw<N>` bench ablations): taken by
# tokens_per_block over every kernel's own target while planned_attend builds that plan.
_PLAN_TARGET_WARPS: contextvars.ContextVar = contextvars.ContextVar("plan_target_warps", default=None)


def tokens_per_block(n_valid: int, n_heads: int, tile: int = TILE, max_tiles: int = 64,
                     target_warps: int | None = None) -> int:
    """History tokens per block of 4 warps: tiles of `tile` tokens, enough warps to fill the GPU
    (`target_warps`, default TARGET_WARPS, over all heads; a cache's own while its launch plan
    is built) and at most `max_tiles` tiles per warp. The other partials kernels call it with
    their own tile, bound and target."""
    own = _PLAN_TARGET_WARPS.get()
    warps = own if own is not None else TARGET_WARPS if target_warps is None else target_warps
    tiles = -(-n_valid // tile) * n_heads
    tiles_per_warp = min(max_tiles, max(1, -(-tiles // warps)))
    return tile * WARPS_PER_BLOCK * tiles_per_warp


# Value accumulators per lane (rows x channels) above which a token is split over more lanes
# (at most MAX_LANES_PER_TOKEN). At 8 query rows per KV head 16 channels per lane made 128
# accumulators and the kernel spilled (ptxas for sm_90: 255 registers + 72 bytes of stack;
# tests/cache/test_kernels_nvcc.py); at 4 rows, 8 channels per lane instead of 16 take 104
# registers instead of 184 (more warps per SM) and the partials ran 0.086 ms instead of 0.092 at
# 32K tokens on the H200 (bench.kernel_probe, results/kernel_probe_decode_h200_s4.json; 32 lanes
# of 4 channels: 0.090).
MAX_LANE_ACCUMULATORS = 32
MAX_LANES_PER_TOKEN = 16

# The exact block (sink and window, one block per head) reads its rows 16 bytes a load instead
# of one element a load (template WRV). Why: Nsight on the H200 (results/ncu_full_s21_kivi_
# decode.csv, kivi at 32K) finds the launch's SMs active 73 K of 125 K cycles on average, the
# busiest 38% above the average as if one of its blocks cost ~2.4 history blocks: the exact
# block's lanes each read a token row as D two-byte loads, a warp load touching 32 rows. Off
# (0): measured on the H200 (session 22, results/kernel_probe_h200_s22_rowvec.json) it is no
# faster: kivi's partials 0.0530 against 0.0537 ms at 32K, 0.149 against 0.141 at 128K; the
# exact block is no tail either (the partials without its tokens 0.0503 ms at 32K, with only
# them 0.0179). Correct on the GPU (results/cuda_tests_h200_s22_rowvec.txt).
WINDOW_ROW_VECTORS = 0


def window_row_vectors(head_dim: int, lane_channels: int, dtype) -> int:
    """WRV for a launch: 1 where WINDOW_ROW_VECTORS is set and a key row and a lane's value
    channels are whole 16-byte vectors of the queries' dtype, else 0."""
    size = dtype.size
    return int(bool(WINDOW_ROW_VECTORS) and head_dim * size % 16 == 0 and lane_channels * size % 16 == 0)


# The history's scores on tensor cores (template MMA: one mma.sync.m16n8k16 per 16 tokens x 16
# channels x 8 query rows, the codes turned into fp16 by bit operations, the scales folded into
# the queries in fp16). Why: Nsight on the H200 (results/ncu_full_s21_kivi_decode.csv) finds the
# decode kernel issuing instructions 61% of its active cycles, ~11 K instructions per warp and
# 128-token tile; the FMA loop spends ~2 instructions per multiply-add of the scores (a code's
# extraction, conversion and dequantization, then one FMA per query row). Taken where
# mma_scores() allows it (16-bit queries: the fp16 rounding of the scaled queries stays below
# the queries' own; 2-bit keys; the whole tile's keys staged at once); elsewhere, and on GPUs
# before sm_80, the FMA loop. Alone, measured on the H200 (session 22) it is no faster, so the
# scores' instructions are not what bounds the kernel: one kivi layer's partials at 32K 0.0587
# ms against 0.0581, at 128K 0.146 against 0.144 (results/kernel_probe_h200_s22_mma.json); the
# whole chained attention (launch_bounds_probe) kivi 177 against 180 us at 128K, gear 272
# against 271, at 32K within the runs' +-10 us (results/lb_h200_s22_*.json). Its values'
# loads issued before the scores (registers 166: 3 blocks per SM) were slower still (kivi 184,
# gear 318 us at 128K). Correct on the GPU (tests/cache/test_fused_decode.py -m cuda).
# On (1) since session 30, with the tensor-core values (MMA_VALUES): together they are faster
# where either alone is not (bench.batch_probe, one kivi layer at 128K on the H200, two
# machines: shipped 170 / 170 us, scores alone 181 / -, values alone 166 / 170, both 163 / 159;
# results/batch_probe_h200_s30_kivi.json, ..._kivi_b.json), and through the 8-layer model in
# one interleaved run per context (`kivi-tc` against `kivi` then, results/gpu_speed_h200_s30_*):
# paired to fp16 at 128K 1.63x against 1.54x, and 1.23x / 1.20x (0.93x / 0.90x in fp16's
# host-bound rounds); at 32K 1.13x / 1.12x and 0.94x / 0.91x. GEAR's build keeps its FMA scores
# (fused_decode_gear.MMA_SCORES: not measured with its terms since session 22).
MMA_SCORES = 1


# The history's values weighed on tensor cores (template MMAV: per 16 tokens one
# mma.sync.m16n8k16 per 16 channels, C = channels x query rows, A = 1 + code / 4 from the staged
# 2-bit codes by a byte permute, a rotation and a mask, B = p x scale in the side data's 16-bit
# type, the zeros' term in float32). Why: session 30's arithmetic for kivi at 128K (2-bit, 4
# rows, ~75 M warp instructions per layer at ~50% issue efficiency, ~165 us on the H200) puts
# ~8 instructions on each value code in the FMA loop (extraction, conversion, dequantization,
# one FMA per query row), ~2 here. Taken by the affine kernel's own launches (kivi, xquant; GEAR's
# build adds its own terms to the FMA loop's accumulators and passes value_mma=False) for
# 16-bit queries and side data (a float32 model's kivi keeps fp16 scales: its float32 FMA loop
# stays), 2-bit values, channels and groups multiples of 16, at most 8 query rows and
# a value stage of whole 16-token steps. On since session 30, with the tensor-core scores
# (MMA_SCORES' note has the figures).
MMA_VALUES = 1

# Each history tile asks L2 for the warp's next tile's keys and its own values before staging
# its keys (template PF; every kernel built on this source, GEAR's too). Why tried: bench.
# batch_probe on the H200 (session 30, results/batch_probe_h200_s30_kivi.json), one kivi layer
# at 128K: 170 us as shipped, 103 with the key loop cut (stage and scores), 175 with the value
# loop cut: the keys' stage (a 32-byte run of each of 128 channel rows, rows a capacity apart)
# and its scores cost ~67 us, the values (contiguous) nothing that shows. Off: measured slower
# (batch_probe's `pf`, results/batch_probe_h200_s30_kivi_b.json, us per layer): kivi 183
# against 170 at 128K, 70.9 against 69.0 at 32K; GEAR's build 268 against 256 at 128K (90.8
# against 94.6 at 32K). The same run split the keys' cost: staged but never scored 120 us,
# scored from a stage never filled 164, neither 99: the scores' arithmetic, not the stage's
# loads, is the ~65 us (what the tensor-core scores and values, on since, take from).
L2_PREFETCH = 0


def mma_values(value_dim: int, rows: int, group_size: int, value_bits: int, dtype, side, stage,
               switch: bool | None = None) -> int:
    """MMAV of a launch: 1 where MMA_VALUES is set (or `switch`, where not None: a cache's own
    `mma_values`, the bench ablation `<method>-mmav`) and the launch is one it takes (above),
    else 0. `dtype`: the queries'; `side`: the scales' and zeros'; `stage`: the launch's stage
    template (its VST)."""
    on = MMA_VALUES if switch is None else switch
    ok = (on and dtype in (mx.float16, mx.bfloat16) and side in (mx.float16, mx.bfloat16)
          and value_bits == 2 and value_dim % 16 == 0
          and group_size % 16 == 0 and rows <= 8 and stage is not None and dict(stage)["VST"] % 16 == 0)
    return int(bool(ok))


def mma_shared_bytes(head_dim: int, rows: int) -> int:
    """Static shared memory MMA adds: per warp one key group's B fragments (fp16 pairs of the
    lanes holding B's columns 0 .. rows - 1: 8 words per row and 16 channels)."""
    return WARPS_PER_BLOCK * head_dim // 16 * 8 * rows * 4


def mma_plan(head_dim: int, value_dim: int, rows: int, group_size: int, key_bits: int,
             value_bits: int, side_bytes: int, extra_shared: int, dtype, switch: bool | None = None):
    """(MMA, stage template) of a launch: MMA 1 where MMA_SCORES is set (or `switch`, where not
    None: a cache's own `mma_scores`, the bench ablation `<method>-tc`), the queries are 16-bit,
    the keys 2-bit, head_dim and the group multiples of 16, at most 8 query rows (the mma's
    8 columns) dividing 32, and the whole tile's keys fit one stage beside the B fragments;
    else 0 and the stage without them (None where no stage fits: supports() refuses)."""
    on = MMA_SCORES if switch is None else switch
    if (on and dtype in (mx.float16, mx.bfloat16) and key_bits == 2 and head_dim % 16 == 0
            and group_size % 16 == 0 and rows <= 8 and 32 % rows == 0):
        stage = stage_template(head_dim, value_dim, rows, group_size, key_bits, value_bits, side_bytes,
                               extra_shared + mma_shared_bytes(head_dim, rows))
        if stage is not None and dict(stage)["KSC"] == head_dim:
            return 1, stage
    return 0, stage_template(head_dim, value_dim, rows, group_size, key_bits, value_bits, side_bytes,
                             extra_shared)


def history_blocks(tokens: int, n_heads: int, label: str, split=None) -> tuple[int, int, int]:
    """(tokens per block, history blocks, all blocks) of a partials launch over `tokens` history
    tokens per head: `split`'s tokens per block (a kernel's own tokens_per_block; default this
    module's) plus the one block of exact tokens, checked against the merge kernel's MAX_BLOCKS
    (beyond millions of tokens per head: not reached in practice). `label` names the kernel in
    the error."""
    per_block = (split or tokens_per_block)(tokens, n_heads)
    n_hist_blocks = -(-tokens // per_block)
    n_blocks = n_hist_blocks + 1
    if n_blocks > MAX_BLOCKS:
        raise QuantizerConfigError(
            f"{label}: {tokens} history tokens need {n_blocks} blocks, more than the merge "
            f"kernel's {MAX_BLOCKS}; set {ENV_SWITCH}=0 to use the portable path"
        )
    return per_block, n_hist_blocks, n_blocks


def lanes_per_token(value_dim: int, value_bits: int, rows: int = 4) -> int | None:
    """Lanes that share one value token, or None when a token is not whole words. Each lane
    reads whole code words (the largest power of two up to 8 dividing the token's words); with
    many query rows the lanes double (up to 32) while rows x channels per lane exceeds
    MAX_LANE_ACCUMULATORS, down to a half or a quarter word per lane (a lane's bits never
    straddle a word): the configurations run on the H200."""
    if (value_dim * value_bits) % 32:
        return None
    words = value_dim * value_bits // 32
    lanes = next(n for n in (8, 4, 2, 1) if words % n == 0)
    while rows * value_dim // lanes > MAX_LANE_ACCUMULATORS and lanes < MAX_LANES_PER_TOKEN:
        bits = value_dim // (2 * lanes) * value_bits
        if value_dim % (2 * lanes) or not (bits % 32 == 0 or 32 % bits == 0):
            break
        lanes *= 2
    return lanes


def supports(head_dim: int, value_dim: int, group_size: int, key_bits: int, value_bits: int,
             rows: int = 4) -> bool:
    """The shapes the kernel handles; others take the portable path. Bits dividing 32 (codes
    never straddle words), groups of whole 32-token tiles, a lane's value channels inside one
    group."""
    if key_bits not in SUPPORTED_BITS or value_bits not in SUPPORTED_BITS or group_size % 32:
        return False
    lanes = lanes_per_token(value_dim, value_bits, rows)
    if lanes is None or group_size % (value_dim // lanes) or value_dim % 32:
        return False  # the merge kernel reduces over whole warps of value channels
    # Scales of 4 bytes (float32 queries) need the most stage.
    return 1 <= head_dim <= 256 and stage_template(head_dim, value_dim, rows, group_size, key_bits,
                                                   value_bits, 4) is not None


def shared_bytes(head_dim: int, value_dim: int, rows: int) -> int:
    """The partials kernel's static shared memory besides the history's stages (4-byte floats):
    the queries, per warp a tile's probabilities in TILE_SLOTS slots of `rows` floats (later the
    warp's partial), and per warp and row its max and sum (red_m, red_l)."""
    widest = max(head_dim, value_dim, TILE_SLOTS)
    # + bfrag's one word per warp where MMA is off (mma_shared_bytes where it is on)
    return 4 * rows * (head_dim + WARPS_PER_BLOCK * widest + 2 * WARPS_PER_BLOCK) + 4 * WARPS_PER_BLOCK


# Static shared memory a kernel may declare (CUDA's limit without opting in), and a margin for
# the fused merge's flag and the compiler's own.
SHARED_LIMIT = 48 * 1024
SHARED_MARGIN = 64
# Each warp's stage of the history (kstage): up to this many bytes. 6 KB holds a whole tile of
# 2-bit keys or values with bf16 scales (128 x (32 + 16) bytes); 4 warps take 24 KB, so a block
# of the 8B shape (10.6 KB besides) still leaves 6 blocks per SM on an H200.
STAGE_BYTES = 6144


def stage_words(head_dim: int, value_dim: int, rows: int, extra_shared: int = 0,
                stage_bytes: int | None = None) -> int:
    """32-bit words of each warp's stage: `stage_bytes` (default STAGE_BYTES), or what the
    static shared limit leaves beside the kernel's other arrays (`extra_shared`: a kernel built
    on this one adds its own, GEAR's sparse sums), a multiple of 16 bytes."""
    stage_bytes = STAGE_BYTES if stage_bytes is None else stage_bytes
    free = SHARED_LIMIT - SHARED_MARGIN - shared_bytes(head_dim, value_dim, rows) - extra_shared
    return max(0, min(stage_bytes, free // WARPS_PER_BLOCK) // 16 * 4)


def key_stage_channels(head_dim: int, key_bits: int, group_size: int, side_bytes: int, words: int):
    """Key channels per stage (template KSC): the most dividing head_dim whose codes, scales and
    zeros over a tile fit `words`, or None (not even one fits)."""
    per_channel = TILE * key_bits // 8 + 2 * max(TILE // group_size, 1) * side_bytes
    fits = [c for c in range(1, head_dim + 1) if head_dim % c == 0 and c * per_channel <= 4 * words]
    return max(fits) if fits else None


def value_stage_tokens(value_dim: int, value_bits: int, group_size: int, side_bytes: int, words: int):
    """Value tokens per stage (template VST): the most of 8, 16, ..., TILE whose codes, scales
    and zeros fit `words`, each a whole number of 16-byte vectors, or None."""
    code_bytes, side = value_dim * value_bits // 8, value_dim // group_size * side_bytes
    fits = [t for t in (8, 16, 32, 64, 128) if t <= TILE and t * (code_bytes + 2 * side) <= 4 * words
            and t * code_bytes % 16 == 0 and t * side % 16 == 0]
    return max(fits) if fits else None


def stage_template(head_dim: int, value_dim: int, rows: int, group_size: int, key_bits: int,
                   value_bits: int, side_bytes: int, extra_shared: int = 0):
    """(("STAGE_WORDS", w), ("KSC", c), ("VST", t)) of a launch, or None where no stage fits."""
    return _stage_template(head_dim, value_dim, rows, group_size, key_bits, value_bits, side_bytes,
                           extra_shared, STAGE_BYTES)


@lru_cache(maxsize=None)
def _stage_template(head_dim, value_dim, rows, group_size, key_bits, value_bits, side_bytes,
                    extra_shared, stage_bytes):
    """stage_template's result for one STAGE_BYTES, cached: a launch plan is rebuilt at every
    block flush (a tuple: the cached entries cannot be changed by a caller)."""
    words = stage_words(head_dim, value_dim, rows, extra_shared, stage_bytes)
    channels = key_stage_channels(head_dim, key_bits, group_size, side_bytes, words)
    tokens = value_stage_tokens(value_dim, value_bits, group_size, side_bytes, words)
    if channels is None or tokens is None:
        return None
    return (("STAGE_WORDS", words), ("KSC", channels), ("VST", tokens))


def _meta(n_valid: int, per_block: int, n_hist_blocks: int, scale: float, n_skip: int,
          n_sink: int | None) -> mx.array:
    scale_bits = int(np.array([scale], dtype=np.float32).view(np.int32)[0])
    tail = [] if n_sink is None else [n_sink]
    return mx.array([n_valid, per_block, n_hist_blocks, scale_bits, n_skip, *tail], dtype=mx.int32)


class FusedDecodeMeta:
    """The small int32 argument array of one cache, rebuilt only when the history or the scale
    changes (every block flush), not at every decode step. Five entries; a sixth (n_sink) where
    given: this module's partials kernel reads it, the other kernels sharing the class do not."""

    def __init__(self):
        self._key = None
        self._value = None

    def get(self, n_valid: int, per_block: int, n_hist_blocks: int, scale: float,
            n_skip: int = 0, n_sink: int | None = None) -> mx.array:
        key = (n_valid, per_block, n_hist_blocks, scale, n_skip, n_sink)
        if key != self._key:
            self._key, self._value = key, _meta(*key)
        return self._value


def side_dtype(key_scales, key_zeros, value_scales, value_zeros, what: str):
    """The one dtype of a KIVI-layout cache's scales and zeros (the kernels' ST), refusing
    arrays that do not share it."""
    side = key_scales.dtype
    if {value_scales.dtype, key_zeros.dtype, value_zeros.dtype} != {side}:
        raise QuantizerConfigError(
            f"{what}: scales and zeros must share one dtype, got {key_scales.dtype}, "
            f"{key_zeros.dtype}, {value_scales.dtype}, {value_zeros.dtype}"
        )
    return side


def decode_step(cache, queries, scale: float, arrays, *, group_size: int, key_bits: int,
                value_bits: int, skip: int = 0, exact_prefix=None, plan_key=()):
    """A KIVI-layout cache's decode-step attention through the kernels, or None where they are
    not active (off CUDA, switched off, a shape supports() refuses): the cache then takes the
    portable path. `arrays()` gives (key codes, scales, zeros, value codes, scales, zeros); it is
    only called when the kernels run. The window, history length and heads come from `cache`.
    `skip`: leading compressed tokens to ignore; `exact_prefix`: (keys, values) (B, H, S, D /
    DV) attended exactly before the window (a cache holding its first tokens exactly passes
    both): kernel inputs of their own (sk, sv), not concatenated to the window, so the step
    launches the kernel(s) and nothing else. `plan_key`: what else the arrays depend on (a
    cache reading another layer's store passes that store's state)."""
    if not kernels_enabled():
        return None
    key = (skip, group_size, key_bits, value_bits, plan_key,
           None if exact_prefix is None else (id(exact_prefix[0]), id(exact_prefix[1])))

    def launch():
        rows = queries.shape[1] // cache.n_kv_heads
        if not supports(cache.head_dim, cache.value_dim, group_size, key_bits, value_bits, rows):
            return None
        # The meta array belongs to the cache (it changes with its history), made on first use.
        meta_cache = cache.__dict__.setdefault("_fused_meta", FusedDecodeMeta())
        _, inputs, shape = affine_launch(
            queries, scale, *arrays(), cache.window_keys, cache.window_values,
            n_valid=cache.n_compressed, group_size=group_size, key_bits=key_bits,
            value_bits=value_bits, n_kv_heads=cache.n_kv_heads, meta_cache=meta_cache, skip=skip,
            sink=exact_prefix, score_mma=cache.__dict__.get("mma_scores"),
            value_mma=cache.__dict__.get("mma_values"),
        )
        return inputs, shape, WINDOW_INPUTS

    return planned_attend(cache, queries, scale, key, launch, lambda: _kernels()[0])


# Zero bytes a window_rows view is cut from, grown to the next power of two a window needs.
_ROWS_BASE = [mx.zeros((256,), dtype=mx.uint8)]


@lru_cache(maxsize=None)
def window_rows(n: int) -> mx.array:
    """The decode kernels' `wn` input: an (n,) view of one zero array, whose length is the
    window's filled rows (the kernels read wn_shape[0]; its bytes are never read). Why an input
    and not the meta: the window grows by a token each step, the meta is kept per launch plan,
    and a view costs no launch. With it the window inputs may be the cache's in-place buffers,
    whose rows beyond n are slack (wk_shape[2] is then their row count per head).
    Not evaluated here: its first step's graph evaluates it (a slice: a view, no launch), and
    later steps reuse the evaluated array (lru_cache). Until session 24 it was evaluated here,
    and mx.eval waits for every launch queued before it: on the H200 each window length's first
    step in a process waited for the previous step's GPU work, ~1.3 ms per step for GEAR's first
    255 decode tokens (its window cycles through 1..255; results/host_first_steps_h200_s24*.json),
    which slowed its figures in every gpu_speed run until its window had seen every length once."""
    if n < 1:
        raise QuantizerConfigError(f"decode kernels: a window of {n} rows; allowed is at least 1 (the step's token)")
    base = _ROWS_BASE[0]
    if base.shape[0] < n:
        base = mx.zeros((1 << (n - 1).bit_length(),), dtype=mx.uint8)
        _ROWS_BASE[0] = base
    return base[:n]


def window_inputs(cache, dtype, held, counted: bool = False) -> tuple:
    """(keys, values, rows) for a decode kernel's wk, wv, wn: `held` = cache.window_buffers(),
    the window's buffers when the cache keeps them in place (window_buffer.py: rows beyond the
    filled ones are slack, so the kernel reads the buffers as they are, without the copy a
    sliced view would cost), else None: the cache's window. `counted`: the rows as data
    (compiled_launch.window_count, for the counted build), else as a view's length."""
    keys, values, n = held if held is not None else (cache.window_keys, cache.window_values, cache.window_keys.shape[2])
    # astype makes a new array (a graph node) even to the same dtype: skipped when it is.
    keys = keys if keys.dtype == dtype else keys.astype(dtype)
    values = values if values.dtype == dtype else values.astype(dtype)
    return keys, values, window_count(n) if counted else window_rows(n)


def wants_compiled_launch(cache) -> bool:
    """Whether the cache's fused decode launches go through mx.compile where its kernels run:
    its own compiled_launch where set, else COMPILED_LAUNCH."""
    own = cache.__dict__.get("compiled_launch")
    return COMPILED_LAUNCH if own is None else own


def writes_window_in_place(cache) -> bool:
    """Whether a decode step writes the cache's window into its buffers in place because its
    launches are compiled (base.update_and_fetch): where its decode kernels run and it wants the
    compiled launch. Off the kernels (the CPU) the window grows by concatenation as shipped."""
    return wants_compiled_launch(cache) and kernels_enabled()


def compiles_launches(cache, buffered: bool) -> bool:
    """Whether this step's fused decode launch goes through mx.compile: where the cache wants it
    (wants_compiled_launch) and its window is the in-place buffers (`buffered`); a step whose
    window is not in place (the first token after a flush emptied it, or a prefill chunk's
    concatenation) launches uncompiled."""
    return buffered and wants_compiled_launch(cache)


def planned_attend(cache, queries, scale: float, key, launch, kernel):
    """A decode step through a launch plan kept on `cache` while its store writes, history
    length and capacity, the queries' shape and dtype, the scale and the caller's `key` (what
    else its launch depends on) are unchanged: `launch()` -> (inputs, {template,
    n_blocks, heads, value_dim}, window slots) or None (the kernel does not take this shape:
    the portable path, None here too), called when the key changed; each step swaps its queries
    (slot 0) and the cache's window (its slots, in the queries' dtype) into the plan's inputs.
    Why: the H200's decode step is host-bound (MERGE_IN_KERNEL's note), and rebuilding the
    checks, split, meta and constants at every step cost ~10 us of Python per layer on this
    machine's CPU (kivi 29 -> 18 us per layer-step with the kernels stubbed). `kernel()` gives
    the PartialsKernel, looked up at each step (not kept in the plan): a factory emptied or a
    constant set between two steps (the CUDA emulation, bench --set) takes effect.
    A plan's compiled steps after its first replay the traced launch on the step's arrays
    (replay_step.py; kivi's step census on this CPU 25.5 -> 20.9 us per layer and step,
    results/step_census_cpu_s37_replay_*.json), while the kernel, the launch state and the
    window's dtype stay those it holds."""
    # The window as in-place buffers (window_buffer.py) or None: the template's WB, the inputs.
    whole = window_buffer.held(cache)
    buffered = whole is not None
    own_warps = cache.decode_target_warps
    key = (cache.store_writes, cache.n_compressed, cache.capacity, queries.shape, queries.dtype, scale, buffered,
           own_warps, key)
    plan = cache.__dict__.get("_fused_plan")
    if plan is None or plan[0] != key:
        token = _PLAN_TARGET_WARPS.set(own_warps)
        try:
            built = launch()
        finally:
            _PLAN_TARGET_WARPS.reset(token)
        if built is not None:
            # The plan keeps no step's own arrays (the queries, the window): they would stay
            # alive until the next plan.
            inputs, shape, slots = built
            inputs = [None if i in (0, *slots) else a for i, a in enumerate(inputs)]
            if buffered:
                shape = {**shape, "template": [(k, 1 if k == "WB" else v) for k, v in shape["template"]]}
            built = (inputs, shape, slots)
        plan = (key, built)
        cache.__dict__["_fused_plan"] = plan
        # The old plan's replay holds its store arrays: they go with it, not a step later.
        cache.__dict__.pop("_fused_replay", None)
    if plan[1] is None:
        return None
    state = cache.__dict__.get("_fused_launch")
    if state is None:  # not setdefault: its argument, a new FusedLaunchState, was built every step
        state = cache.__dict__["_fused_launch"] = FusedLaunchState()
    compiled = compiles_launches(cache, buffered)
    replayable = compiled and not _other_fused_build(cache)
    partials = kernel()
    if replayable:
        # The plan's later compiled steps (replay_step.py); None where anything it holds moved.
        replay = cache.__dict__.get("_fused_replay")
        if replay is not None and replay.plan is plan:
            out = replay.run(partials, state, queries, whole)
            if out is not None:
                return out
    plan_inputs, shape, slots = plan[1]
    inputs = list(plan_inputs)
    inputs[0] = queries
    held = None if whole is None else (whole[0], whole[1], whole[4])
    inputs[slots[0]], inputs[slots[1]], inputs[slots[2]] = window_inputs(cache, queries.dtype, held, compiled)
    out = partials.attend(queries, inputs=inputs, state=state, baked=cache.__dict__.get("baked_constants"),
                          compiled=compiled, verbatim=cache.__dict__.get("kernel_text_as_written", False), **shape)
    if replayable and whole[6] == whole[7] == queries.dtype:
        cache.__dict__["_fused_replay"] = ReplayStep(plan, partials, state, plan_inputs, slots, queries.dtype)
    return out


def _other_fused_build(cache) -> bool:
    """Whether the cache's decode launch is set to a build other than the compiled fused one:
    constants in the source, the text as written, or the merge out of the kernel (with a compiled
    launch attend refuses each, and the replay must not run it in their place)."""
    own = cache.__dict__
    baked = own.get("baked_constants")
    return bool((BAKED_CONSTANTS if baked is None else baked) or own.get("kernel_text_as_written", False)
                or not MERGE_IN_KERNEL)


def affine_decode_attention(
    queries, scale: float, key_codes, key_scales, key_zeros, value_codes, value_scales,
    value_zeros, window_keys, window_values, *, n_valid: int, group_size: int, key_bits: int,
    value_bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta, skip: int = 0, sink=None,
):
    """softmax(q K^T * scale) V for one query row per head, queries (B, Hq, 1, D), over the
    compressed tokens [skip, n_valid), the exact sink `sink` = (keys, values) (B, H, S, D / DV;
    None: none) and the exact window (B, H, W, D), W >= 1 -> (B, Hq, 1, DV) in the queries'
    dtype. Only call when kernels_enabled() and supports(...): decode_step checks."""
    return affine_partials(
        queries, scale, key_codes, key_scales, key_zeros, value_codes,
        value_scales, value_zeros, window_keys, window_values, n_valid=n_valid,
        group_size=group_size, key_bits=key_bits, value_bits=value_bits, n_kv_heads=n_kv_heads,
        meta_cache=meta_cache, skip=skip, sink=sink, merged=True,
    )


def affine_partials(
    queries, scale: float, key_codes, key_scales, key_zeros, value_codes, value_scales,
    value_zeros, window_keys, window_values, *, n_valid: int, group_size: int, key_bits: int,
    value_bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta, skip: int = 0, sink=None,
    kernel=None, extra_inputs=(), extra_template=(), merged: bool = False,
    state: FusedLaunchState | None = None, score_mma: bool | None = None, value_mma: bool | None = None,
):
    """Kernel 1's launch (the checks, block split, meta and template) -> (part_o, part_m,
    part_l), or with `merged` the attention output (B, Hq, 1, DV) (PartialsKernel.attend: the
    merge fused in, MERGE_IN_KERNEL, with `state`'s counters and scratch; None: new ones); `sink`: (keys, values) (B, H, S, D / DV) the exact block
    attends before the window (None: dummies, S = 0); `kernel`: the shipped PartialsKernel when
    None, else one built on this source by partials_source (GEAR's), or a raw variant kernel
    of its source (bench.kernel_probe times some; not with `merged`), taken after the checks;
    `extra_inputs` / `extra_template`: what such a kernel takes beyond this one's inputs (after
    `meta`) and template constants; `score_mma` / `value_mma`: affine_launch's."""
    launch = affine_launch(
        queries, scale, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
        window_keys, window_values, n_valid=n_valid, group_size=group_size, key_bits=key_bits,
        value_bits=value_bits, n_kv_heads=n_kv_heads, meta_cache=meta_cache, skip=skip, sink=sink,
        kernel=kernel, extra_inputs=extra_inputs, extra_template=extra_template, score_mma=score_mma,
        value_mma=value_mma)
    partials, inputs, shape = launch
    if merged:
        return partials.attend(queries, inputs=inputs, state=state, **shape)
    if isinstance(partials, PartialsKernel):
        return partials.partials(queries, inputs=inputs, **shape)
    return split_launch(partials, queries, inputs=inputs, **shape)


# Where affine_launch's input list holds the window (keys, values): a step plan swaps them in.
WINDOW_INPUTS = (PARTIALS_INPUTS.index("wk"), PARTIALS_INPUTS.index("wv"), PARTIALS_INPUTS.index("wn"))


def affine_launch(
    queries, scale: float, key_codes, key_scales, key_zeros, value_codes, value_scales,
    value_zeros, window_keys, window_values, *, n_valid: int, group_size: int, key_bits: int,
    value_bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta, skip: int = 0, sink=None,
    kernel=None, extra_inputs=(), extra_template=(), extra_shared: int = 0, split=None,
    score_mma: bool | None = None, value_mma: bool | None = None,
):
    """The checks, block split, meta and template of kernel 1's launch (affine_partials) ->
    (kernel, inputs, {template, n_blocks, heads, value_dim}). `extra_shared`: the static
    shared bytes a kernel built on this one adds (the stages get what is left); `split`:
    (tokens, heads) -> history tokens per block (default affine_tokens_per_block);
    `score_mma` / `value_mma`: the tensor-core scores / values on or off for this launch (None:
    MMA_SCORES / MMA_VALUES)."""
    B, n_q_heads, _, D = queries.shape
    R = n_q_heads // n_kv_heads
    BH = B * n_kv_heads
    DV = value_codes.shape[-1] * 32 // value_bits
    side = side_dtype(key_scales, key_zeros, value_scales, value_zeros, "fused decode")
    check_skip(skip, n_valid, "fused decode")
    if value_codes.shape[2] % TILE:
        # The stages read whole tiles: the store's capacity grows in steps of 256 tokens.
        raise QuantizerConfigError(
            f"fused decode: the store's capacity {value_codes.shape[2]} is not a multiple of "
            f"the kernel's tile of {TILE} tokens")
    mma, stage = mma_plan(D, DV, R, group_size, key_bits, value_bits, side.size, extra_shared, queries.dtype,
                          score_mma)
    if stage is None:
        raise QuantizerConfigError(
            f"fused decode: no stage of the history fits the shared memory at head_dim {D}, "
            f"value_dim {DV}, {R} rows, {key_bits}/{value_bits} bits (supports() refuses it)")
    per_block, n_hist_blocks, n_blocks = history_blocks(n_valid, BH, "fused decode", split or affine_tokens_per_block)
    dtype = queries.dtype
    sink_keys, sink_values, n_sink = _sink_inputs(sink, queries, window_keys, window_values, DV)
    meta = meta_cache.get(n_valid, per_block, n_hist_blocks, float(scale), skip, n_sink)
    inputs = [queries, key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
              window_keys.astype(dtype), window_values.astype(dtype), sink_keys, sink_values,
              meta, window_rows(window_keys.shape[2]), *extra_inputs]
    lanes = lanes_per_token(DV, value_bits, R)
    # A kernel built on this source that adds its own value terms to the FMA loop's accumulators
    # (GEAR's) passes value_mma=False.
    mmav = mma_values(DV, R, group_size, value_bits, dtype, side, stage, value_mma)
    template = [("D", D), ("DV", DV), ("R", R), ("G", group_size), ("KB", key_bits),
                ("VB", value_bits), ("LPT", lanes), ("QT", dtype),
                ("ST", side), *stage, ("WB", 0), ("WRV", window_row_vectors(D, DV // lanes, dtype)),
                ("MMA", mma), ("MMAV", mmav), ("PF", int(bool(L2_PREFETCH))), *extra_template]
    kernel = _kernels()[0] if kernel is None else kernel
    return kernel, inputs, {"template": template, "n_blocks": n_blocks, "heads": BH, "value_dim": DV}


MAX_MIN_BLOCKS = 16  # an SM holds at most 2048 threads: 16 blocks of 128


def launch_bounds_header(min_blocks: int) -> str:
    """Header text that gives the kernel MLX generates after it `__launch_bounds__(128,
    min_blocks)` (0: none): ptxas then keeps the kernel's registers low enough for `min_blocks`
    blocks of WARPS_PER_BLOCK warps per SM (65536 registers: 5 blocks of 128 threads need <= 96 per
    thread, 6 need <= 80), spilling to local memory where it cannot.
    Why a redefinition: mx.fast.cuda_kernel writes the kernel's signature itself (`__global__
    void name(...)` after the header) and takes no launch bounds or register limit, and every
    decode kernel of ours sits at 4 blocks per SM, bound by registers (Nsight Compute on the H200,
    results/ncu_h200_s12.json: 102-128 registers, 25% theoretical occupancy, ~1 eligible warp per
    scheduler). The macro is redefined only under a CUDA compiler (nvrtc defines __CUDACC_RTC__,
    nvcc __CUDACC__; the CPU emulation's g++ neither), as CUDA's own headers define it
    (`__location__(global)`), and only the kernel's declaration follows this header."""
    if not isinstance(min_blocks, int) or isinstance(min_blocks, bool) or not 0 <= min_blocks <= MAX_MIN_BLOCKS:
        raise QuantizerConfigError(
            f"launch bounds: min_blocks={min_blocks!r} is invalid: allowed is an integer in 0..{MAX_MIN_BLOCKS} "
            "(0: no bounds)")
    if min_blocks == 0:
        return ""
    return kernel_declaration_header(f"__launch_bounds__({32 * WARPS_PER_BLOCK}, {min_blocks})")


def kernel_declaration_header(attributes: str) -> str:
    """Header text after which MLX's `__global__` kernel declaration carries `attributes` (none:
    CUDA's own definition back), under a CUDA compiler only (launch_bounds_header's why)."""
    return f"""
// The kernel MLX declares after this header: __global__ with {attributes or 'no attributes'}.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#undef __global__
#define __global__ __location__(global){' ' + attributes if attributes else ''}
#endif
"""


@lru_cache(maxsize=None)
def absent_input(dtype) -> mx.array:
    """A one-element stand-in for a kernel input the launch does not have (an absent sink,
    outliers, retained slots): the kernels read none of it, their meta or template says so.
    One per dtype, made once (not an allocation per decode step)."""
    return mx.zeros((1,), dtype=dtype)


def check_skip(skip: int, n_valid: int, label: str) -> None:
    """Leading history tokens a partials kernel ignores (read exactly elsewhere, e.g. the
    attention sink): the kernels keep every tile non-empty only for skips inside the first
    tile. `label` names the kernel in the error."""
    if not 0 <= skip < min(n_valid, TILE):
        raise QuantizerConfigError(
            f"{label}: skip={skip} leading tokens of {n_valid}; allowed is 0 <= skip < "
            f"min(history, {TILE})"
        )


def _sink_inputs(sink, queries, window_keys, window_values, value_dim: int):
    """(sk, sv, n_sink) for the partials kernel: the sink in the queries' dtype (the kernel
    reads it through the window's pointer type; astype is free when the dtypes agree, as they
    do for a model's caches), or dummies and 0."""
    dtype = queries.dtype
    if sink is None:
        return absent_input(dtype), absent_input(dtype), 0
    keys, values = sink
    B, H, _, D = window_keys.shape
    S = keys.shape[2] if keys.ndim == 4 else 0
    if S < 1 or keys.shape != (B, H, S, D) or values.shape != (B, H, S, value_dim):
        raise QuantizerConfigError(
            f"fused decode: sink keys {keys.shape} / values {values.shape} do not fit the window "
            f"{window_keys.shape} / {window_values.shape}; allowed are (B, H, S, D) / (B, H, S, DV) "
            f"= ({B}, {H}, S, {D}) / ({B}, {H}, S, {value_dim}) with S >= 1"
        )
    return keys.astype(dtype), values.astype(dtype), S


def merge_partials(part_o, part_m, part_l, queries):
    """Kernel 2: the blocks' partials (BH, n_blocks, R, DV) -> the output row per query head,
    (B, Hq, 1, DV) in the queries' dtype. Serves every partials kernel of this shape (also
    fused_decode_rotated's)."""
    B, n_q_heads = queries.shape[:2]
    BH, _, R, DV = part_o.shape
    dtype = queries.dtype
    (out,) = _kernels()[1](
        inputs=[part_o, part_m, part_l],
        template=[("DV", DV), ("MAX_BLOCKS", MAX_BLOCKS), ("QT", dtype)],
        grid=(DV, BH * R, 1),
        threadgroup=(DV, 1, 1),
        output_shapes=[(B, n_q_heads, 1, DV)],
        output_dtypes=[dtype],
    )
    return out
