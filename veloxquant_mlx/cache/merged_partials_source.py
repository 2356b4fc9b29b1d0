"""minicache's paired-layer decode partials kernel's CUDA source and the device helpers it adds to
the shared header (kernel_header.py); fused_decode_merged.py launches it, its docstring describes
the layout read and the work split.
"""

from __future__ import annotations

HELPERS = r"""
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
PARTIALS = r"""
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
