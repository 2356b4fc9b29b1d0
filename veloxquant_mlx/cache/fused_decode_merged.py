"""A CUDA decode-step kernel for MiniCache's paired layers (merged directions + magnitudes).

Why: on the H200 minicache decoded at 0.54x the fp16 cache's tokens/s at 32K tokens (issue 5).
Its plain layers already run mx.fast attention (cache/growing_window.py); its paired layers took
the portable path (`_scores` / `_weighted_values` under CompressedKVCache._attend: matmuls over
the directions, the slots and the window, magnitude products, the retained slots scattered over
a materialized (rows x tokens) score array and gathered again for the values, slack masking,
concatenations, softmax: about two dozen MLX ops per layer and step, by reading the code). This
kernel reads the pair's directions, the layer's magnitudes and its retained slots once and
produces flash-decoding partials (m, l, o) per block of tokens; fused_decode's merge kernel
(imported, unchanged) combines them into the output row. Per layer and step: 2 kernels.

What one paired layer reads per KV head (minicache.py's store; MiniCache, arXiv 2405.14366):
  * dk, dv (B, H, cap_pair, D / DV): the pair's merged unit directions, fp16, held by the lower
    layer (the upper layer reads its partner's arrays: the same pointers, no copy); with
    `minicache_bits` B their per-token codes (B, H, cap_pair, D * B / 32) uint32 (mx.quantize's
    layout) plus fp16 scales and biases dks, dkb, dvs, dvb (B, H, cap_pair, D / 32);
  * mk, mv (B, H, cap): this layer's magnitudes ||k||, ||v|| per token (fp16);
  * rk, rv (B, H, cap / 32 * S, D / DV), pk, pv (B, H, cap / 32 * S) int32: per block of 32
    tokens S retained slots, the layer's exact vector and its absolute position (-1: unused);
    keys and values choose their slots separately;
  * wk, wv (B, H, W, D / DV): the exact window (the newest tokens, not merged yet).
Attention over it:
  score_t = ||k_t|| (q . e_k,t), or q . k_t exactly where t is a retained key;
  out = sum_t p_t ||v_t|| e_v,t over the tokens whose value is not retained
        + sum_slots p_pos v_slot  (+ the window's exact tokens, as any softmax term).
The magnitudes are folded in per token, not per channel: into the score after the dot product
(one multiply per row and token) and into the probability before the value sum (p ||v||), so
the per-element work is the fp16 -> float conversion and one FMA per query row, as in fp16
attention; the directions are read exactly as many bytes as fp16 K/V (the bytes a pair saves
are the upper layer's: it holds no K/V of its own), so this kernel has to be as efficient as
mx.fast's attention to reach the fp16 cache's speed.

Work split: blocks of 4 warps per (batch * kv head, range of history tokens), the last block per
head over the exact window. A warp walks tiles of 32 tokens (a tile is one MiniCache block of
32, so its S slots belong to it and the slot positions lie inside it):
  scores: 8 lanes share one token, each lane owning 8-channel chunks interleaved so that one
    load instruction of the warp reads 4 tokens' 128-byte runs (fully used sectors); a lane
    holds partial dot products of 8 tokens (the tile's 32 = 8 iterations x 4 tokens), which a
    transposing butterfly over the 8 lanes sums so that each lane ends owning one token's score
    (7 shuffles per row per 8 tokens instead of 24); the GQA rows (R) share every load. The
    tile's retained key slots: their exact dots the same way (one slot per 8 lanes), written to
    shared memory, and the owning lane's score replaced;
  online softmax over the tile (warp shuffles); per token the value weight p ||v|| (0 for a
    retained value) and per slot its p go to shared memory;
  values: DV / 8 lanes share one token (8 channels = 16 bytes each), 32 * 8 / DV tokens per
    round (one contiguous run of rows per round), loads of up to 8 rounds issued before their
    FMAs; then the tile's retained value rows the same way.
Accumulators per lane: R x 8 value sums, 8 x R partial dots: R <= 8 keeps them in registers.
Quantized directions: a lane's 8-channel chunk lies in one group of 32, so the group's scale
and bias are applied per chunk, not per element: for keys s (sum q c) + b (sum q) with the
query's sums per chunk precomputed in shared memory, for values (p s) c per element and p b
once per row into a bias accumulator; codes become floats by a mantissa trick (vq_u2f), not
the conversion unit. Per element: extract, convert, one FMA per row.

Numerics: everything after the loads is float32 and the output is rounded once to the queries'
dtype; the portable path in fp16 / bf16 rounds its scores, probabilities and sums in that dtype
(the tests compare against it with float32 queries). No other deviation from the portable
path: the same tokens, slots and window, the same softmax.

`supports()` lists what it takes (others: the portable path): fp16 directions or 2, 4, 8-bit
codes (3-bit codes straddle words: refused), head_dim and value dim 64, 128 or 256, slots
0..16, 1..8 query rows per kv head, shared memory under 48 KB.

Checked on the CPU only: tests/cache/test_fused_decode_minicache_emulated.py runs this source
under the thread-level emulation (tests/cache/cuda_emulation.py) through MiniCacheCache's real
decode path, against its portable attention (float32 / fp16 / bf16, GQA and MHA, fp16 and 2/4/8-
bit directions, 0..16 slots, several blocks and tiles per warp, a ragged window);
tests/cache/test_fused_decode_minicache_nvcc.py compiles it with nvcc 13.0 for sm_90 (the 8B
shape: 222 registers with the value prefetch, 170 without, 208 with 4-bit directions, no spills;
fused_decode's kivi kernel takes 184). On the H200 (session 4) 3 of its CUDA tests passed (the
8B shape bf16, fp16 MHA without slots, float32 GQA 8 with 16 slots) and minicache decoded at 1.12x
fp16 at 32K (results/gpu_speed_h200_s4.json); one layer's timing: python -m
veloxquant_mlx.bench.attention --methods fp16,minicache:minicache_start_fraction=0 ...
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.errors import QuantizerConfigError

TILE = 32  # tokens per warp tile = MiniCache's block of 32 (its retained slots are per block)
WARPS_PER_BLOCK = 4
MAX_TILES_PER_WARP = 256
# Target warps of this kernel's launches: fused_decode's 4096 until session 27, kept here when
# fused_decode.TARGET_WARPS (GEAR's and KVQuant's) became 8192; not measured with 8192 (its
# 32-token tiles split otherwise: 8 tiles per warp at 128K).
TARGET_WARPS = 4096
MAX_ROWS = 8
MAX_SLOTS = 16
HEAD_DIMS = (64, 128, 256)  # 8 lanes x 8-channel chunks per key token, 8 channels per value lane
DIRECTION_BITS = (2, 4, 8)  # minicache_bits whose codes never straddle a 32-bit word
# Load a history tile's first 8 value rounds (fp16 directions) before its scores: more bytes in
# flight per warp at no occupancy cost (see PV in the kernel). On in the H200 run of session 4;
# not yet compared against off there.
PREFETCH_FIRST_VALUES = True
PREFETCH_MAX_ROWS = 4  # 8 rows spill with it (1128 bytes at float32, 16 slots; 604 without)

_HEADER = kernel_header.HEADER + r"""
// 16 bytes, loaded as one 128-bit access (a plain struct: CUDA's uint4 is not needed).
struct __align__(16) vq_u32x4 { unsigned x, y, z, w; };

// Element e of 8 consecutive T held as raw 16-byte words (T of 2 or 4 bytes).
template <typename T, int W>
__device__ __forceinline__ float vq_elem(const vq_u32x4 (&raw)[W], int e) {
  return vq_f32(reinterpret_cast<const T*>(raw)[e]);
}

// Partial dot products of J rows (row indices rows[j] of `base`, D channels each) with the R
// scaled query rows, over this lane's channels: 8 lanes (sub 0..7) share a row, lane sub owning
// the 8-channel chunks c * 64 + sub * 8 .. + 8 (c < D / 64), so one load instruction of 8 lanes
// reads 128 contiguous bytes of a 16-bit row. q_sh is laid out [chunk][e][sub][r] (below): the
// 8 lanes of a row read consecutive floats (no bank conflicts), the warp's 4 rows broadcast.
// Loads of JB rows are issued before their FMAs (JB rows x D / 8 channels of T, 128 bytes per
// lane at most: 4 rows of 16-bit D = 128, fewer for D = 256 or float rows), so a warp keeps
// at least 4 KB in flight while its FMAs wait (the register count did not change with 2 or 4
// rows per batch: ptxas schedules the loads as it sees fit).
template <typename T, int D, int R, int J>
__device__ __forceinline__ void vq_partial_dots(const T* base, const int (&rows)[J],
                                                const float* q_sh, int sub, float (&part)[J][R]) {
  constexpr int NC = D / 64;                  // 8-channel chunks per lane
  constexpr int W = 8 * (int)sizeof(T) / 16;  // 16-byte words per chunk
  constexpr int PER_ROW = NC * W;
  constexpr int JB0 = PER_ROW >= 8 ? 1 : 8 / PER_ROW;
  constexpr int JB = JB0 < J ? JB0 : J;
  #pragma unroll
  for (int j = 0; j < J; ++j) {
    #pragma unroll
    for (int r = 0; r < R; ++r) part[j][r] = 0.f;
  }
  #pragma unroll
  for (int j0 = 0; j0 < J; j0 += JB) {
    vq_u32x4 raw[JB][NC][W];
    #pragma unroll
    for (int jj = 0; jj < JB; ++jj) {
      const T* row = base + (size_t)rows[j0 + jj] * D + sub * 8;
      #pragma unroll
      for (int c = 0; c < NC; ++c) {
        #pragma unroll
        for (int w = 0; w < W; ++w) raw[jj][c][w] = reinterpret_cast<const vq_u32x4*>(row + c * 64)[w];
      }
    }
    #pragma unroll
    for (int c = 0; c < NC; ++c) {
      #pragma unroll
      for (int e = 0; e < 8; ++e) {
        float qv[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) qv[r] = q_sh[((c * 8 + e) * 8 + sub) * R + r];
        #pragma unroll
        for (int jj = 0; jj < JB; ++jj) {
          const float x = vq_elem<T, W>(raw[jj][c], e);
          #pragma unroll
          for (int r = 0; r < R; ++r) part[j0 + jj][r] = fmaf(qv[r], x, part[j0 + jj][r]);
        }
      }
    }
  }
}

// The 8 channels from ch0 of N rows (rows[n] of `base`, DV channels each) as raw 16-byte words
// (8 16-bit channels: 4 registers per row), all loads issued before any is used.
template <typename T, int DV, int N>
__device__ __forceinline__ void vq_load_rows(const T* base, const int (&rows)[N], int ch0,
                                             vq_u32x4 (&raw)[N][8 * sizeof(T) / 16]) {
  constexpr int W = 8 * (int)sizeof(T) / 16;
  #pragma unroll
  for (int n = 0; n < N; ++n) {
    #pragma unroll
    for (int w = 0; w < W; ++w) raw[n][w] = reinterpret_cast<const vq_u32x4*>(base + (size_t)rows[n] * DV + ch0)[w];
  }
}

// acc[r][e] += w_sh[wrow[n] * R + r] * row_n[e] over N rows loaded by vq_load_rows.
template <typename T, int R, int N>
__device__ __forceinline__ void vq_fma_rows(const vq_u32x4 (&raw)[N][8 * sizeof(T) / 16], const float* w_sh,
                                            const int (&wrow)[N], float (&acc)[R][8]) {
  constexpr int W = 8 * (int)sizeof(T) / 16;
  #pragma unroll
  for (int n = 0; n < N; ++n) {
    float wj[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) wj[r] = w_sh[wrow[n] * R + r];
    #pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float x = vq_elem<T, W>(raw[n], e);
      #pragma unroll
      for (int r = 0; r < R; ++r) acc[r][e] = fmaf(wj[r], x, acc[r][e]);
    }
  }
}

template <typename T, int DV, int R, int N>
__device__ __forceinline__ void vq_weighted_rows(const T* base, const int (&rows)[N], const float* w_sh,
                                                 const int (&wrow)[N], int ch0, float (&acc)[R][8]) {
  vq_u32x4 raw[N][8 * sizeof(T) / 16];
  vq_load_rows<T, DV, N>(base, rows, ch0, raw);
  vq_fma_rows<T, R, N>(raw, w_sh, wrow, acc);
}

// vq_partial_dots over quantized directions (minicache_bits = B in 2, 4, 8: mx.quantize's
// layout per token, D * B / 32 words of a little-endian bit stream along channels, a scale s
// and bias b per 32 channels). The lane's 8-channel chunk lies in one group, so per chunk
// sum_e q_e (s c_e + b) = s (sum_e q_e c_e) + b (sum_e q_e), the chunk's query sum read from
// qsum_sh [chunk][r]: per element the code's extraction, conversion and one FMA per row; two
// FMAs per chunk and row. B = 2: a chunk is half a word (odd chunks the upper half).
template <int B, int D, int R, int J, typename ST>
__device__ __forceinline__ void vq_partial_dots_q(const uint32_t* codes, const ST* scales, const ST* biases,
                                                  const int (&rows)[J], const float* q_sh, const float* qsum_sh,
                                                  int sub, float (&part)[J][R]) {
  constexpr int NC = D / 64;
  constexpr int WPC = B * 8 / 32 > 0 ? B * 8 / 32 : 1;  // words read per chunk
  constexpr int WROW = D * B / 32;                       // words per token
  constexpr int GROW = D / 32;                           // groups per token
  constexpr int JB = J < 4 ? J : 4;
  constexpr unsigned MASK = (1u << B) - 1u;
  const int sh = B == 2 ? (sub & 1) * 16 : 0;
  #pragma unroll
  for (int j = 0; j < J; ++j) {
    #pragma unroll
    for (int r = 0; r < R; ++r) part[j][r] = 0.f;
  }
  #pragma unroll
  for (int j0 = 0; j0 < J; j0 += JB) {
    uint32_t w[JB][NC][WPC];
    float sc[JB][NC], bs[JB][NC];
    #pragma unroll
    for (int jj = 0; jj < JB; ++jj) {
      const size_t t = (size_t)rows[j0 + jj];
      #pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int chunk = c * 8 + sub;
        #pragma unroll
        for (int i = 0; i < WPC; ++i) w[jj][c][i] = __ldg(codes + t * WROW + ((chunk * 8 * B) >> 5) + i);
        sc[jj][c] = vq_f32(scales[t * GROW + chunk / 4]);
        bs[jj][c] = vq_f32(biases[t * GROW + chunk / 4]);
      }
    }
    #pragma unroll
    for (int c = 0; c < NC; ++c) {
      float dot[JB][R];
      #pragma unroll
      for (int jj = 0; jj < JB; ++jj) {
        #pragma unroll
        for (int r = 0; r < R; ++r) dot[jj][r] = 0.f;
      }
      #pragma unroll
      for (int e = 0; e < 8; ++e) {
        float qv[R];
        #pragma unroll
        for (int r = 0; r < R; ++r) qv[r] = q_sh[((c * 8 + e) * 8 + sub) * R + r];
        #pragma unroll
        for (int jj = 0; jj < JB; ++jj) {
          const float x = vq_u2f((w[jj][c][(e * B) >> 5] >> (((e * B) & 31) + sh)) & MASK);
          #pragma unroll
          for (int r = 0; r < R; ++r) dot[jj][r] = fmaf(qv[r], x, dot[jj][r]);
        }
      }
      #pragma unroll
      for (int jj = 0; jj < JB; ++jj) {
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          const float qsum = qsum_sh[(c * 8 + sub) * R + r];
          part[j0 + jj][r] = fmaf(sc[jj][c], dot[jj][r], fmaf(bs[jj][c], qsum, part[j0 + jj][r]));
        }
      }
    }
  }
}

// vq_weighted_rows over quantized directions: the lane's 8 channels (from ch0) lie in one
// group, so w (s c + b) = (w s) c + w b: the scale folds into the weight (R multiplies per
// row) and the bias term is the same for the lane's 8 channels, summed once per row into
// accb (added to every channel at the end).
template <int B, int DV, int R, int N, typename ST>
__device__ __forceinline__ void vq_weighted_rows_q(const uint32_t* codes, const ST* scales, const ST* biases,
                                                   const int (&rows)[N], const float* w_sh, const int (&wrow)[N],
                                                   int ch0, float (&acc)[R][8], float (&accb)[R]) {
  constexpr int WPC = B * 8 / 32 > 0 ? B * 8 / 32 : 1;
  constexpr int WROW = DV * B / 32;
  constexpr int GROW = DV / 32;
  constexpr unsigned MASK = (1u << B) - 1u;
  const int w0 = (ch0 * B) >> 5;
  const int sh = (ch0 * B) & 31;  // 0, or 16 for B = 2
  uint32_t w[N][WPC];
  float sc[N], bs[N];
  #pragma unroll
  for (int n = 0; n < N; ++n) {
    const size_t t = (size_t)rows[n];
    #pragma unroll
    for (int i = 0; i < WPC; ++i) w[n][i] = __ldg(codes + t * WROW + w0 + i);
    sc[n] = vq_f32(scales[t * GROW + ch0 / 32]);
    bs[n] = vq_f32(biases[t * GROW + ch0 / 32]);
  }
  #pragma unroll
  for (int n = 0; n < N; ++n) {
    float ws[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const float wj = w_sh[wrow[n] * R + r];
      ws[r] = wj * sc[n];
      accb[r] = fmaf(wj, bs[n], accb[r]);
    }
    #pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float x = vq_u2f((w[n][(e * B) >> 5] >> (((e * B) & 31) + sh)) & MASK);
      #pragma unroll
      for (int r = 0; r < R; ++r) acc[r][e] = fmaf(ws[r], x, acc[r][e]);
    }
  }
}

// Sum 8 partial dots over the 8 lanes sharing them (lane bits 0..2 = sub) so that lane sub ends
// holding the whole dot of row j = sub: each step keeps half the rows and sends the other half
// to the partner lane (4 + 2 + 1 shuffles per query row instead of 3 per row and token).
template <int R>
__device__ __forceinline__ void vq_transpose_sum8(const float (&part)[8][R], int sub, float (&out)[R]) {
  const bool b2 = sub & 4, b1 = sub & 2, b0 = sub & 1;
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    float a4[4], a2[2];
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float send = b2 ? part[i][r] : part[i + 4][r];
      a4[i] = (b2 ? part[i + 4][r] : part[i][r]) + __shfl_xor_sync(0xffffffffu, send, 4);
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float send = b1 ? a4[i] : a4[i + 2];
      a2[i] = (b1 ? a4[i + 2] : a4[i]) + __shfl_xor_sync(0xffffffffu, send, 2);
    }
    const float send = b0 ? a2[0] : a2[1];
    out[r] = (b0 ? a2[1] : a2[0]) + __shfl_xor_sync(0xffffffffu, send, 1);
  }
}
"""

# Template constants: D, DV (key / value dims), R (query rows per kv head), PV (1: prefetch the
# first value batch of a tile during its key phase, PREFETCH_FIRST_VALUES), S (retained slots
# per 32 tokens; 0: none, rk..pv are unused dummies), DB (direction bits: 0 = fp16 directions,
# dks..dvb unused dummies; 2, 4, 8 = codes dk / dv (uint32) with scales dks / dvs and biases
# dkb / dvb per 32 channels), QT (queries and window), DT (directions or their codes), ST (the
# codes' scales and biases), MT (magnitudes), RT (retained vectors).
# meta = [n_valid, tokens per block, history blocks, scale as float bits, 0] (FusedDecodeMeta).
_PARTIALS = r"""
  constexpr int NW = 4;                    // warps per block
  constexpr int TILE = 32;                 // tokens per warp tile = one MiniCache block
  constexpr int KJ = 8;                    // key rows per lane and tile (4 rows per iteration)
  constexpr int LPT = DV / 8;              // lanes per value row (8 channels each)
  constexpr int TPR = 32 / LPT;            // value rows per round
  constexpr int ROUNDS = TILE / TPR;
  constexpr int BATCH = ROUNDS < 8 ? ROUNDS : 8;  // rounds whose loads are issued together
  constexpr int SS = S > 0 ? S : 1;        // array sizes
  constexpr int KSI = (S + 3) / 4;         // key iterations over the slots (4 per iteration)
  constexpr int SR = S > 0 ? (S + TPR - 1) / TPR : 1;  // value rounds over the slots (arrays: >= 1)
  constexpr int PW = (TILE + 2 * SS + 1) * R > DV * R ? (TILE + 2 * SS + 1) * R : DV * R;
  constexpr int DBQ = DB > 0 ? DB : 4;     // the quantized helpers' bits (unused when DB = 0)
  constexpr int KROW = DB > 0 ? D * DBQ / 32 : D;    // DT elements per direction row
  constexpr int VROW = DB > 0 ? DV * DBQ / 32 : DV;
  const float neg_inf = __int_as_float(0xff800000);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane >> 3;                 // key phase: the lane's row of an iteration
  const int sub = lane & 7;                // key phase: the lane's channel chunks
  const int tv = lane / LPT;               // value phase: the lane's row of a round
  const int ch0 = (lane % LPT) * 8;        // value phase: the lane's first channel
  const int bh = blockIdx.y;
  const int n_valid = meta[0];
  const int per_block = meta[1];
  const int n_hist_blocks = meta[2];
  const float scale = __int_as_float(meta[3]);
  const bool exact = blockIdx.x >= n_hist_blocks;  // block-uniform
  // The window's rows per head in wk / wv: all of them its tokens, or with WB (buffers the cache
  // writes in place, fused_decode.window_rows) the first wn_shape[0] (read where the exact
  // block's end is set: kept live from here, it cost gear's kernel 11 registers under nvcc).
  const int n_window = wk_shape[2];
  const int cap_dir = dk_shape[2];         // the pair's direction arrays (the lower layer's)
  const int cap = mk_shape[2];             // this layer's own arrays
  const int n_slot_rows = cap / TILE * S;  // retained rows per head

  // Shared: the scaled query [chunk][e][sub][r] (vq_partial_dots); per warp the tile's value
  // weights [token][r], the slots' weights [slot][r] and a row of zeros, the slots' exact key
  // dots [slot][r], later the warp's partial o [r][channel]; per warp and row its max and sum.
  __shared__ __align__(16) float q_sh[D * R];
  __shared__ float qsum_sh[D / 8 * R];     // quantized directions: the query's sum per 8-channel chunk
  __shared__ __align__(16) float ps[NW][PW];
  __shared__ float red_m[NW][R];
  __shared__ float red_l[NW][R];
  for (int i = threadIdx.x; i < R * D; i += 32 * NW) {
    const int r = i / D, d = i % D;
    const int c = d / 64, s8 = (d / 8) % 8, e = d % 8;
    q_sh[((c * 8 + e) * 8 + s8) * R + r] = scale * vq_f32(q[(size_t)bh * R * D + i]);
  }
  __syncthreads();
  if (DB > 0) {
    for (int i = threadIdx.x; i < D / 8 * R; i += 32 * NW) {
      const int chunk = i / R, r = i % R;
      float sum = 0.f;
      #pragma unroll
      for (int e = 0; e < 8; ++e) sum += q_sh[(((chunk / 8) * 8 + e) * 8 + chunk % 8) * R + r];
      qsum_sh[i] = sum;
    }
    __syncthreads();
  }

  const DT* dk_bh = dk + (size_t)bh * cap_dir * KROW;
  const DT* dv_bh = dv + (size_t)bh * cap_dir * VROW;
  const ST* dks_bh = DB > 0 ? dks + (size_t)bh * cap_dir * (D / 32) : dks;
  const ST* dkb_bh = DB > 0 ? dkb + (size_t)bh * cap_dir * (D / 32) : dkb;
  const ST* dvs_bh = DB > 0 ? dvs + (size_t)bh * cap_dir * (DV / 32) : dvs;
  const ST* dvb_bh = DB > 0 ? dvb + (size_t)bh * cap_dir * (DV / 32) : dvb;
  const MT* mk_bh = mk + (size_t)bh * cap;
  const MT* mv_bh = mv + (size_t)bh * cap;
  const RT* rk_bh = rk + (size_t)bh * n_slot_rows * D;
  const RT* rv_bh = rv + (size_t)bh * n_slot_rows * DV;
  const int* pk_bh = pk + (size_t)bh * n_slot_rows;
  const int* pv_bh = pv + (size_t)bh * n_slot_rows;
  const QT* wk_bh = wk + (size_t)bh * n_window * D;
  const QT* wv_bh = wv + (size_t)bh * n_window * DV;
  float* w_tile = ps[warp];                // [TILE][R]
  float* w_slot = ps[warp] + TILE * R;     // [S][R], then one row of zeros
  float* ex_k = w_slot + (SS + 1) * R;     // [S][R]
  if (lane < R) w_slot[SS * R + lane] = 0.f;

  float m[R], l[R], acc[R][8], accb[R];   // accb: quantized values' bias terms (vq_weighted_rows_q)
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = neg_inf;
    l[r] = 0.f;
    accb[r] = 0.f;
    #pragma unroll
    for (int c = 0; c < 8; ++c) acc[r][c] = 0.f;
  }

  // History tiles are whole (n_valid and per_block are multiples of 32); the window's last
  // tile may be ragged: its past-the-end rows read the last token and get p = 0.
  const int first = exact ? 0 : blockIdx.x * per_block;
  const int last = exact ? (WB ? wn_shape[0] : n_window) : min(first + per_block, n_valid);
  for (int base = first + warp * TILE; base < last; base += TILE * NW) {
    // PV: the first value batch of a history tile (fp16 directions) is loaded now: it does not
    // depend on the scores, and its latency then overlaps the key phase (nvcc 13 for sm_90,
    // the 8B shape: 222 registers instead of 170, 2 blocks of 4 warps per SM either way).
    int vrow0[BATCH], vw0[BATCH];
    #pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      vw0[k] = k * TPR + tv;
      vrow0[k] = min(base + vw0[k], last - 1);
    }
    vq_u32x4 vpre[BATCH][8 * sizeof(DT) / 16];
    if (PV && !exact && DB == 0) vq_load_rows<DT, DV, BATCH>(dv_bh, vrow0, ch0, vpre);
    // ---- scores: lane (g, sub) ends owning token tl = 4 sub + g of the tile ----
    const int tl = 4 * sub + g;
    const int t = base + tl;
    const bool live = t < last;
    float s[R];
    {
      int rows[KJ];
      #pragma unroll
      for (int j = 0; j < KJ; ++j) rows[j] = min(base + 4 * j + g, last - 1);
      float part[KJ][R];
      if (exact) vq_partial_dots<QT, D, R, KJ>(wk_bh, rows, q_sh, sub, part);
      else if (DB == 0) vq_partial_dots<DT, D, R, KJ>(dk_bh, rows, q_sh, sub, part);
      else vq_partial_dots_q<DBQ, D, R, KJ, ST>(reinterpret_cast<const uint32_t*>(dk_bh), dks_bh, dkb_bh,
                                                rows, q_sh, qsum_sh, sub, part);
      vq_transpose_sum8<R>(part, sub, s);
    }
    const int blk = base / TILE;           // the MiniCache block (history tiles)
    if (!exact) {
      const float mag = vq_f32(mk_bh[t]);
      #pragma unroll
      for (int r = 0; r < R; ++r) s[r] *= mag;
      if (S > 0) {
        // The tile's retained keys: slot it * 4 + g's exact dot by the 8 lanes of group g.
        #pragma unroll
        for (int it = 0; it < KSI; ++it) {
          const int slot = it * 4 + g;
          const int rows[1] = {blk * S + min(slot, S - 1)};
          float part[1][R];
          vq_partial_dots<RT, D, R, 1>(rk_bh, rows, q_sh, sub, part);
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            float x = part[0][r];
            #pragma unroll
            for (int o = 4; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
            if (sub == 0 && slot < S) ex_k[slot * R + r] = x;
          }
        }
        __syncwarp();
        #pragma unroll
        for (int k = 0; k < S; ++k) {
          if (pk_bh[blk * S + k] == t) {
            #pragma unroll
            for (int r = 0; r < R; ++r) s[r] = ex_k[k * R + r];
          }
        }
      }
    }
    // ---- online softmax over the tile; value weights to shared memory ----
    float p[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const float m_new = fmaxf(m[r], vq_warp_max(live ? s[r] : neg_inf));  // finite: base is valid
      const float alpha = expf(m[r] - m_new);
      p[r] = live ? expf(s[r] - m_new) : 0.f;
      l[r] = l[r] * alpha + vq_warp_sum(p[r]);
      #pragma unroll
      for (int c = 0; c < 8; ++c) acc[r][c] *= alpha;
      accb[r] *= alpha;
      m[r] = m_new;
    }
    if (exact) {
      #pragma unroll
      for (int r = 0; r < R; ++r) w_tile[tl * R + r] = p[r];
    } else {
      // p ||v|| weighs the merged direction; a retained value takes p on its exact row instead
      // (its slot's weight, written by the lane owning the position; unused slots get 0 from
      // lane `slot`, so every slot has exactly one writer).
      float wt = vq_f32(mv_bh[t]);
      #pragma unroll
      for (int k = 0; k < S; ++k) {
        const int pos = pv_bh[blk * S + k];
        if (pos == t) {
          wt = 0.f;
          #pragma unroll
          for (int r = 0; r < R; ++r) w_slot[k * R + r] = p[r];
        }
        if (pos < 0 && lane == k) {
          #pragma unroll
          for (int r = 0; r < R; ++r) w_slot[k * R + r] = 0.f;
        }
      }
      #pragma unroll
      for (int r = 0; r < R; ++r) w_tile[tl * R + r] = p[r] * wt;
    }
    __syncwarp();
    // ---- values: lane (tv, ch0) reads 8 channels of row round * TPR + tv ----
    // Rolled to batches (a batch's rounds unrolled): whole, the history's value loop was
    // thousands of instructions every warp streams through once per tile (session 9).
    #pragma unroll 1
    for (int b0 = 0; b0 < ROUNDS; b0 += BATCH) {
      int rows[BATCH], wrow[BATCH];
      #pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        wrow[k] = (b0 + k) * TPR + tv;
        rows[k] = min(base + wrow[k], last - 1);
      }
      if (exact) vq_weighted_rows<QT, DV, R, BATCH>(wv_bh, rows, w_tile, wrow, ch0, acc);
      else if (PV && DB == 0 && b0 == 0) vq_fma_rows<DT, R, BATCH>(vpre, w_tile, vw0, acc);
      else if (DB == 0) vq_weighted_rows<DT, DV, R, BATCH>(dv_bh, rows, w_tile, wrow, ch0, acc);
      else vq_weighted_rows_q<DBQ, DV, R, BATCH, ST>(reinterpret_cast<const uint32_t*>(dv_bh), dvs_bh,
                                                     dvb_bh, rows, w_tile, wrow, ch0, acc, accb);
    }
    if (!exact && S > 0) {
      // The tile's retained value rows; a round past the last slot (S < TPR) weighs by the
      // zero row.
      int rows[SR], wrow[SR];
      #pragma unroll
      for (int sr = 0; sr < SR; ++sr) {
        const int slot = sr * TPR + tv;
        rows[sr] = blk * S + min(slot, S - 1);
        wrow[sr] = slot < S ? TILE + slot : TILE + SS;
      }
      vq_weighted_rows<RT, DV, R, SR>(rv_bh, rows, w_tile, wrow, ch0, acc);
    }
    __syncwarp();  // the next tile rewrites w_tile / w_slot / ex_k
  }

  // Lanes holding the same channels for different rows: sum them (the lane bits above LPT);
  // first the lane's bias terms join each of its channels.
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int c = 0; c < 8; ++c) {
      if (DB > 0) acc[r][c] += accb[r];
      #pragma unroll
      for (int o = LPT; o < 32; o <<= 1) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], o);
    }
  }
  __syncwarp();
  float* red_o = ps[warp];  // the warp's weights are no longer needed: [r][channel]
  if (tv == 0) {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      #pragma unroll
      for (int c = 0; c < 8; ++c) red_o[r * DV + ch0 + c] = acc[r][c];
    }
  }
  if (lane == 0) {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      red_m[warp][r] = m[r];
      red_l[warp][r] = l[r];
    }
  }
  __syncthreads();
  // The block's warps merged into one partial.
  const size_t out_row = ((size_t)bh * gridDim.x + blockIdx.x) * R;
  vq_block_partial<R, DV, NW>(&ps[0][0], sizeof(ps[0]) / sizeof(float), &red_m[0][0], &red_l[0][0],
                              part_o, part_m, part_l, out_row);
"""

_INPUTS = ["q", "dk", "dv", "dks", "dkb", "dvs", "dvb", "mk", "mv", "rk", "rv", "pk", "pv", "wk", "wv", "meta", "wn"]


@lru_cache(maxsize=None)
def _partials_kernel():
    return fused_decode.PartialsKernel("vq_merged_decode_partials", _INPUTS, _PARTIALS, _HEADER)


def tokens_per_block(n_tokens: int, n_heads: int) -> int:
    """History tokens per block of 4 warps: 32-token tiles, enough warps to fill the GPU
    (TARGET_WARPS over all heads), at most MAX_TILES_PER_WARP tiles per warp."""
    return fused_decode.tokens_per_block(n_tokens, n_heads, TILE, MAX_TILES_PER_WARP, TARGET_WARPS)


def shared_bytes(head_dim: int, value_dim: int, slots: int, rows: int) -> int:
    """Static shared memory of the kernel: the query and its sums per 8 channels, per warp
    max((32 + 2 slots + 1) x R, DV x R) floats, per warp and row a max and a sum."""
    per_warp = max((TILE + 2 * max(slots, 1) + 1) * rows, value_dim * rows)
    return 4 * (head_dim * rows + head_dim // 8 * rows + WARPS_PER_BLOCK * (per_warp + 2 * rows))


def supports(head_dim: int, value_dim: int, slots: int, rows: int, direction_bits) -> bool:
    """The shapes the kernel takes; others take the portable path: fp16 directions
    (direction_bits None) or codes of DIRECTION_BITS bits (3-bit codes straddle words: refused),
    head_dim and value dim in HEAD_DIMS, 0..16 slots, 1..8 query rows per kv head (the lane's
    8 x R partial dots and R x 8 value sums), shared memory <= 48 KB."""
    if direction_bits is not None and direction_bits not in DIRECTION_BITS:
        return False
    if head_dim not in HEAD_DIMS or value_dim not in HEAD_DIMS:
        return False
    if not 0 <= slots <= MAX_SLOTS or not 1 <= rows <= MAX_ROWS:
        return False
    return shared_bytes(head_dim, value_dim, slots, rows) <= 48 * 1024


def decode_step(cache, queries, scale: float):
    """A paired MiniCacheCache layer's decode-step attention through the kernels, or None where
    they are not active (off CUDA, switched off, a plain layer, a shape supports() refuses, a
    partner whose directions no longer cover the history): the portable path then runs."""
    if cache.role == "plain" or not fused_decode.kernels_enabled():
        return None
    # The plan (fused_decode.planned_attend) holds while, where the directions are the lower
    # partner's, that store is unwritten too (store_writes).
    lower = None if cache.owns_directions else cache._peer(cache.layer_index - 1)
    key = (cache.role, cache.owns_directions, None if lower is None else (id(lower), lower.store_writes))

    def launch():
        rows = queries.shape[1] // cache.n_kv_heads
        if not supports(cache.head_dim, cache.value_dim, cache.slots, rows, cache.dir_bits):
            return None
        source = cache._direction_store()
        dk, dv = source["dir_k"], source["dir_v"]
        if dk.shape[2] < cache.n_compressed:
            return None  # a trimmed partner no longer holds these positions' directions
        side = None
        if cache.dir_bits is not None:
            side = tuple(source[n] for n in ("dirscale_k", "dirbias_k", "dirscale_v", "dirbias_v"))
        s = cache.store
        retained = None
        if cache.slots:
            retained = (s["ret_k"], s["ret_v"], s["retpos_k"], s["retpos_v"])
        meta_cache = cache.__dict__.setdefault("_merged_meta", fused_decode.FusedDecodeMeta())
        return merged_launch(
            queries, scale, dk, dv, s["mag_k"], s["mag_v"], retained, cache.window_keys,
            cache.window_values, n_valid=cache.n_compressed, slots=cache.slots,
            n_kv_heads=cache.n_kv_heads, meta_cache=meta_cache, direction_bits=cache.dir_bits,
            direction_side=side,
        )

    return fused_decode.planned_attend(cache, queries, scale, key, launch, _partials_kernel)


def merged_decode_attention(
    queries, scale: float, dir_k, dir_v, mag_k, mag_v, retained, window_keys, window_values, *,
    n_valid: int, slots: int, n_kv_heads: int, meta_cache: fused_decode.FusedDecodeMeta,
    direction_bits=None, direction_side=None,
):
    """The attention of merged_launch's launch, (B, Hq, 1, DV) in the queries' dtype, in one call
    (decode_step keeps the launch in a plan instead)."""
    inputs, shape, _ = merged_launch(
        queries, scale, dir_k, dir_v, mag_k, mag_v, retained, window_keys, window_values,
        n_valid=n_valid, slots=slots, n_kv_heads=n_kv_heads, meta_cache=meta_cache,
        direction_bits=direction_bits, direction_side=direction_side)
    return _partials_kernel().attend(queries, inputs=inputs, **shape)


# Where merged_launch's input list holds the window (keys, values).
WINDOW_INPUTS = (_INPUTS.index("wk"), _INPUTS.index("wv"), _INPUTS.index("wn"))


def merged_launch(
    queries, scale: float, dir_k, dir_v, mag_k, mag_v, retained, window_keys, window_values, *,
    n_valid: int, slots: int, n_kv_heads: int, meta_cache: fused_decode.FusedDecodeMeta,
    direction_bits=None, direction_side=None,
):
    """softmax(q K^T * scale) V for one query row per head, queries (B, Hq, 1, D), over the
    merged history [0, n_valid) (directions (B, H, cap_pair, D) fp16, or with direction_bits
    their codes (B, H, cap_pair, D * bits / 32) and direction_side = (key scales, key biases,
    value scales, value biases) (B, H, cap_pair, D / 32); magnitudes (B, H, cap); retained =
    (ret_k, ret_v, retpos_k, retpos_v) or None for 0 slots) and the exact window (B, H, W, D),
    W >= 1 -> (B, Hq, 1, DV) in the queries' dtype: the launch's (inputs, {template, n_blocks,
    heads, value_dim}, the window's input slots) for fused_decode.planned_attend. Only call when
    kernels_enabled() and supports(...): decode_step checks."""
    B, n_q_heads, _, D = queries.shape
    R = n_q_heads // n_kv_heads
    BH = B * n_kv_heads
    DV = window_values.shape[-1]
    if n_valid % TILE or not 0 < n_valid <= min(dir_k.shape[2], mag_k.shape[2]):
        raise QuantizerConfigError(
            f"merged fused decode: n_valid={n_valid} with directions of {dir_k.shape[2]} and "
            f"magnitudes of {mag_k.shape[2]} tokens; allowed is a positive multiple of {TILE} "
            "within both"
        )
    if (retained is None) != (slots == 0):
        raise QuantizerConfigError(
            f"merged fused decode: slots={slots} but retained arrays "
            f"{'missing' if retained is None else 'given'}; allowed is retained arrays exactly when slots > 0"
        )
    if (direction_side is None) != (direction_bits is None):
        raise QuantizerConfigError(
            f"merged fused decode: direction_bits={direction_bits} but scales and biases "
            f"{'missing' if direction_side is None else 'given'}; allowed is both or neither"
        )
    if retained is None:
        absent = fused_decode.absent_input
        retained = (absent(mx.float16), absent(mx.float16), absent(mx.int32), absent(mx.int32))
    if direction_side is None:
        direction_side = (fused_decode.absent_input(mx.float16),) * 4
    per_block, n_hist_blocks, n_blocks = fused_decode.history_blocks(
        n_valid, BH, "merged fused decode", tokens_per_block)
    meta = meta_cache.get(n_valid, per_block, n_hist_blocks, float(scale))
    dtype = queries.dtype
    inputs = [queries, dir_k, dir_v, *direction_side, mag_k, mag_v, *retained,
              window_keys.astype(dtype), window_values.astype(dtype), meta,
              fused_decode.window_rows(window_keys.shape[2])]
    template = [("D", D), ("DV", DV), ("R", R), ("PV", int(PREFETCH_FIRST_VALUES and R <= PREFETCH_MAX_ROWS)),
                ("S", slots), ("DB", direction_bits or 0), ("QT", dtype), ("DT", dir_k.dtype),
                ("ST", direction_side[0].dtype), ("MT", mag_k.dtype), ("RT", retained[0].dtype), ("WB", 0)]
    return inputs, {"template": template, "n_blocks": n_blocks, "heads": BH, "value_dim": DV}, WINDOW_INPUTS
