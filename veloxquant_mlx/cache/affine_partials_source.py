"""The affine decode partials kernel's CUDA source (KIVI's layout: kivi, xquant; GEAR's builds
on it through its hook lines): fused_decode.py launches it, its docstring describes the layout
read and the work split.

Kernel 1: partials. Template constants: D, DV (key / value head dims), R (query rows per kv
head), G (group), KB, VB (bits), LPT (lanes per value token, lanes_per_token), QT (query
dtype: also the window's), ST (side-data dtype).
meta = [n_valid, tokens per block, blocks over the history, scale as float bits, n_skip,
n_sink]: history tokens [0, n_skip) are ignored (a cache that reads them exactly, e.g. KIVI's
attention sink, hands them in as sk / sv); sk, sv (B, H, n_sink, D / DV) in the queries' dtype
are exact tokens the last block attends before the window (1-element dummies at n_sink = 0).
Blocks [0, n_hist_blocks) read the compressed history, the last block the exact sink + window.
Why the sink is an input of its own: concatenated to the window it cost two copy kernels per
layer and step, 0.017 ms on the H200 (bench.kernel_probe's step at 2K tokens,
results/kernel_probe_step_h200_s4.json; this kernel 0.037 ms there, 0.086 ms at 32K); here it
costs a select per exact token a lane reads (the exact block only). Not yet timed on a GPU.
A warp takes tiles of 128 tokens: scoring, lane i holds tokens 4i..4i+3 (one code word slice
per channel: the warp's 32 lanes read one contiguous run of each channel's codes); weighing
values, LPT lanes share a token (whole code words each, or a half / quarter word at many
rows) and TPR tokens go per round, reading the tile's probabilities from shared memory.
The tile's probabilities: token t's R floats at p_tile[tile_slot(t) * R], tile_slot(t) =
(t % 4) * 33 + t / 4 (scoring lane i's token k at slot k * 33 + i). The R floats of a token
are contiguous, so each lane stores and loads them as one vector (128-bit at R = 4, as the
value loop already loaded them); the scoring lanes' stores of one k then hit 32 consecutive
slots (8 lanes per 128-bit phase: 8 distinct bank quads), and the value loop's TPR consecutive
tokens fall 33 slots apart when they share a scoring lane (distinct bank quads) or are one
token broadcast to its LPT lanes. Before, token t sat at t * R with one store per row: a
16-float lane stride at R = 4, 16-way bank conflicts on each of a tile's 16 stores per lane.
Conflict-free at R = 1, 2, 4; at R = 8 (two 128-bit stores per token) stores are 2-way.
"""

from __future__ import annotations

import re

PARTIALS_TEMPLATE = r"""
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
HOOK_LINE = re.compile(r"^[ ]*//@(\w+)\n", re.M)
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
    return HOOK_LINE.sub(lambda m: hooks.get(m.group(1), ""), PARTIALS_TEMPLATE)


PARTIALS = partials_source()
