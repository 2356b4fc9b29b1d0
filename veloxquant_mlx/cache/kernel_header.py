"""The CUDA header every kernel of ours is built with: shared device functions.

What it holds: float conversions (vq_f32, vq_cast), warp reductions, the staging of a warp's
history tile into shared memory (vq_stage), code unpacking (vq_code_pair and its kin), the
tensor-core fragments of the scores and values loops, and the fused merge of a decode launch's
block partials (vq_block_partial, vq_merge_if_last), whose group size is MERGE_GROUP.

Why one text: the decode kernels (fused_decode*.py), the prefill and encode kernels
(fused_prefill_*.py, fused_encode_*.py, *_kernel.py) read the same packed layouts the same way,
and one copy keeps their arithmetic identical (the emulated tests compare them bit for bit).
Each kernel module prepends it to its own header text; MLX hands it to nvrtc with the source.
"""

from __future__ import annotations

# Blocks per group of the fused merge's first level (vq_merge_if_last, this header's
# VQ_MERGE_GROUP): at most this many blocks per head merge in one level. Measured on the H200 in
# one process against the one-level merge of before (results/merge_ab_h200_s32.json, us per
# layer, two repeats): at 128K gear 244 / 242 against 256 / 254 and kvquant 272 / 266 against
# 279 / 285 (257 blocks per head: 17 groups), kivi 153 / 149 against 151 / 154 (65 blocks); at
# 32K within the repeats (kivi 67.5 / 67.7 against 65.9 / 67.0, gear 91.3 / 88.8 against 88.5 /
# 91.1, kvquant 92.5 / 92.8 against 93.9 / 92.9).
MERGE_GROUP = 16

# CUDA's static shared memory per block: what a kernel may declare as `__shared__` arrays
# without opting in to more (mx.fast.cuda_kernel launches never opt in). Every kernel module's
# `supports` / shared-bytes check compares against this one figure.
STATIC_SHARED_BYTES = 48 * 1024

HEADER = f"constexpr int VQ_MERGE_GROUP = {MERGE_GROUP};\n" + r"""
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
