"""turboquant_rvq's decode partials kernel's CUDA source (fused_decode_rotated.py launches it;
its docstring describes the layout read and the work split).
"""

from __future__ import annotations

# Template constants: D, DV (key / value dims), R (query rows per kv head), KB1, VB1 (stage-1
# bits, 0..3: see the module docstring), KG, VG (stage-1 groups of the uniform codes), QT
# (query / window dtype).
# meta = [n_valid, tokens per block, history blocks, scale as float bits, sink tokens].
# Inputs: q (B, Hq, 1, D); ksg (D,), vsg (DV,) float32 rotation signs; kmean (B, H, 1, D);
# kc1/ks1/kz1 key stage 1 (codes (B, H, cap, D*KB1/32), scales/zeros (B, H, cap, D/KG); for
# KB1 = 1 ks1 holds the magnitudes (B, H, cap, 1); for KB1 = 0 all three are unused dummies);
# kc2 (B, H, cap, D/32) sign words, km2 (B, H, cap, 1) magnitudes; the same for values (vc1,
# vs1, vz1, vc2, vm2); wk (B, H, W, D), wv (B, H, W, DV) the exact window; sk (B, H, S, D), sv
# (B, H, S, DV) the exact sink (float32; unused dummies when S = 0).
PARTIALS = r"""
  constexpr int NW = 4;                       // warps per block
  constexpr int TILE = 32;                    // tokens per warp tile
  constexpr int CPL = R * 16 <= VQ_MAX_VALUE_SUMS ? 16 : 8;  // value channels per lane
  constexpr int LPT = DV / CPL;               // lanes per value token
  constexpr int TPR = 32 / LPT;               // value tokens per round
  constexpr int ROUNDS = TILE / TPR;
  // Rounds whose loads are issued together: 4 at 16 channels per lane, 8 at 8, so a warp has
  // the same value tokens' loads in flight (16 at DV = 128) whatever the rows.
  constexpr int BATCH = ROUNDS < 64 / CPL ? ROUNDS : 64 / CPL;
  constexpr int KW1 = D * KB1 / 32;           // stage-1 words per key token
  constexpr int VW1 = DV * VB1 / 32;          // stage-1 words per value token
  constexpr int KWS = D / 32;                 // sign words per key token
  constexpr int VWS = DV / 32;
  constexpr int KG1 = KB1 == 1 ? D : KG;      // stage-1 group (a sign stage: the whole vector)
  constexpr int VG1 = VB1 == 1 ? DV : VG;
  constexpr int KGN = D / KG1;                // stage-1 groups per key token
  static_assert(KG1 % 32 == 0, "a 32-channel key chunk lies in one stage-1 group");
  constexpr int VGN = VB1 == 1 ? 1 : DV / VG1;  // stage-1 side values per value token
  constexpr int KGS = KB1 == 1 ? 1 : KGN;     // side values per key token in ks1 / kz1
  constexpr int KBW = KB1 > 0 ? KB1 : 1;      // register words of one key chunk (32 channels)
  constexpr int NA = VB1 > 0 ? (CPL * VB1 + 31) / 32 : 1;  // a lane's aligned stage-1 words
  // A lane's CPL * VB1 stage-1 bits cross a word boundary only when they neither fill whole
  // words nor divide one: 3-bit codes (48 bits at 16 channels, 24 at 8); then one more word is
  // read and a funnel shift re-aligns them, else a plain shift does.
  constexpr int LANE_BITS1 = CPL * VB1;
  constexpr bool STRADDLE = VB1 > 0 && LANE_BITS1 % 32 != 0 && 32 % LANE_BITS1 != 0;
  constexpr int NL = STRADDLE ? NA + 1 : NA;  // stage-1 words loaded per lane and token
  constexpr int DMAX = D > DV ? D : DV;
  const float neg_inf = __int_as_float(0xff800000);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int tl = lane / LPT;                  // the lane's token within a value round
  const int ch0 = (lane % LPT) * CPL;         // the lane's first value channel
  const int bh = blockIdx.y;
  const int n_valid = meta[0];
  const int per_block = meta[1];
  const int n_hist_blocks = meta[2];
  const float scale = __int_as_float(meta[3]);
  const int n_sink = meta[4];
  const bool exact = blockIdx.x >= n_hist_blocks;  // block-uniform
  // The window's rows per head in wk / wv: all of them its tokens, or with WB (buffers the cache
  // writes in place, fused_decode.window_rows) the first wn_shape[0] (read where the exact
  // block's end is set: kept live from here, it cost gear's kernel 11 registers under nvcc).
  const int n_window = wk_shape[2];
  const int cap = kc2_shape[2];

  // Shared: the scaled query unrotated (exact tokens) and rotated (codes), [d][r]; the bias;
  // per warp a tile's probabilities, later the warp's partial o.
  __shared__ __align__(16) float qx[D * R];
  __shared__ __align__(16) float qr[D * R];
  __shared__ float bias[R];
  __shared__ __align__(16) float ps[NW][(TILE > DV ? TILE : DV) * R];
  __shared__ float red_m[NW][R];
  __shared__ float red_l[NW][R];

  for (int i = threadIdx.x; i < R * D; i += 32 * NW) {
    const int r = i / D, d = i % D;
    const float x = scale * vq_f32(q[(size_t)bh * R * D + i]);
    qx[d * R + r] = x;
    qr[d * R + r] = x * ksg[d];
  }
  __syncthreads();
  // Walsh-Hadamard butterflies (a + b, a - b over pairs h apart): Sylvester order, as
  // mx.hadamard_transform; scaled by 1 / sqrt(D) below.
  for (int h = 1; h < D; h <<= 1) {
    for (int i = threadIdx.x; i < R * D / 2; i += 32 * NW) {
      const int r = i % R, pair = i / R;
      const int lo = (pair / h) * 2 * h + pair % h;
      const float a = qr[lo * R + r], b = qr[(lo + h) * R + r];
      qr[lo * R + r] = a + b;
      qr[(lo + h) * R + r] = a - b;
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < R * D; i += 32 * NW) qr[i] *= rsqrtf((float)D);
  __syncthreads();
  // The bias q . key_mean per row (one warp per row, lanes over channels).
  for (int r = warp; r < R; r += NW) {
    float b = 0.f;
    for (int d = lane; d < D; d += 32) b = fmaf(qx[d * R + r], vq_f32(kmean[(size_t)bh * D + d]), b);
    b = vq_warp_sum(b);
    if (lane == 0) bias[r] = b;
  }
  __syncthreads();

  const size_t tok0 = (size_t)bh * cap;       // this head's first token in the store
  float* p_tile = ps[warp];
  float m[R], l[R], acc[R][CPL];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = neg_inf;
    l[r] = 0.f;
    #pragma unroll
    for (int c = 0; c < CPL; ++c) acc[r][c] = 0.f;
  }

  // Compressed blocks cover tokens [n_sink, n_valid) (the sink's codes are skipped: it is an
  // exact token); the exact block covers [0, n_sink + n_window): sink tokens, then the window.
  const int first = exact ? 0 : n_sink + blockIdx.x * per_block;
  const int last = exact ? n_sink + (WB ? wn_shape[0] : n_window) : min(first + per_block, n_valid);
  for (int base = first + warp * TILE; base < last; base += TILE * NW) {
    // ---- the lane's token's scores; past-the-end lanes score the last valid token ----
    const int t = min(base + lane, last - 1);
    const bool live = base + lane < last;
    float s[R];
    #pragma unroll
    for (int r = 0; r < R; ++r) s[r] = 0.f;
    if (exact) {
      if (t < n_sink) {
        const float* krow = sk + ((size_t)bh * n_sink + t) * D;
        #pragma unroll 16
        for (int d = 0; d < D; ++d) {
          const float kv = krow[d];
          #pragma unroll
          for (int r = 0; r < R; ++r) s[r] = fmaf(qx[d * R + r], kv, s[r]);
        }
      } else {
        const QT* krow = wk + ((size_t)bh * n_window + (t - n_sink)) * D;
        #pragma unroll 16  // loads in flight: the exact block is one per head, little else hides latency
        for (int d = 0; d < D; ++d) {
          const float kv = vq_f32(krow[d]);
          #pragma unroll
          for (int r = 0; r < R; ++r) s[r] = fmaf(qx[d * R + r], kv, s[r]);
        }
      }
    } else {
      // Per channel the token's rotated key y_d = scale * code_d + zero + a (2 bit_d - 1): the
      // sign folds into the zero (two candidates per group), the code converts without the
      // conversion unit (vq_u2f), then one FMA per query row.
      const uint32_t* c1 = kc1 + (tok0 + t) * KW1;
      const uint32_t* c2 = kc2 + (tok0 + t) * KWS;
      const float a2 = vq_f32(km2[tok0 + t]);
      #pragma unroll 1
      for (int chunk = 0; chunk < D / 32; ++chunk) {
        const unsigned sw = __ldg(c2 + chunk);
        uint32_t w1[KBW];
        #pragma unroll
        for (int i = 0; i < KBW; ++i) w1[i] = KB1 > 0 ? __ldg(c1 + chunk * KB1 + i) : 0u;
        float sc = 0.f, zp = 0.f;  // the chunk's stage-1 group (chunks never straddle groups)
        if (KB1 == 1) {
          const float a = vq_f32(ks1[tok0 + t]);
          sc = 2.f * a;
          zp = -a;
        } else if (KB1 > 1) {
          const int g = chunk * 32 / KG1;
          sc = vq_f32(ks1[(tok0 + t) * KGS + g]);
          zp = vq_f32(kz1[(tok0 + t) * KGS + g]);
        }
        const float zpos = zp + a2, zneg = zp - a2;
        #pragma unroll
        for (int j = 0; j < 32; ++j) {
          const float z = (sw >> j) & 1u ? zpos : zneg;
          // vq_code<bits, words>: a 32-channel chunk of B-bit codes is exactly B words.
          const float y = KB1 > 0 ? fmaf(sc, vq_u2f(vq_code<KBW, KBW>(w1, j)), z) : z;
          const float* qd = qr + (chunk * 32 + j) * R;
          #pragma unroll
          for (int r = 0; r < R; ++r) s[r] = fmaf(qd[r], y, s[r]);
        }
      }
      #pragma unroll
      for (int r = 0; r < R; ++r) s[r] += bias[r];
    }
    // ---- online softmax over the tile; probabilities to shared memory ----
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      const float m_new = fmaxf(m[r], vq_warp_max(live ? s[r] : neg_inf));  // finite: base is valid
      const float alpha = expf(m[r] - m_new);
      const float p = live ? expf(s[r] - m_new) : 0.f;
      p_tile[lane * R + r] = p;
      l[r] = l[r] * alpha + vq_warp_sum(p);
      #pragma unroll
      for (int c = 0; c < CPL; ++c) acc[r][c] *= alpha;
      m[r] = m_new;
    }
    __syncwarp();
    // ---- values: past-the-end tokens read the last valid token (p = 0 there) ----
    if (exact) {
      for (int round = 0; round < ROUNDS; ++round) {
        const int j = round * TPR + tl;
        const int tj = min(base + j, last - 1);
        float v[CPL];
        if (tj < n_sink) {
          const float* vrow = sv + ((size_t)bh * n_sink + tj) * DV + ch0;
          #pragma unroll
          for (int c = 0; c < CPL; ++c) v[c] = vrow[c];
        } else {
          const QT* vrow = wv + ((size_t)bh * n_window + (tj - n_sink)) * DV + ch0;
          #pragma unroll
          for (int c = 0; c < CPL; ++c) v[c] = vq_f32(vrow[c]);
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          const float pj = p_tile[j * R + r];
          #pragma unroll
          for (int c = 0; c < CPL; ++c) acc[r][c] = fmaf(pj, v[c], acc[r][c]);
        }
      }
    } else {
      // The lane's stage-1 bits start at bit ch0 * VB1 of the token's stream: on a word for
      // whole-word lanes (16 channels at 2 bits), inside one otherwise (STRADDLE above).
      const int bit0 = ch0 * VB1;
      const int w0 = bit0 >> 5;
      const int sh = bit0 & 31;
      const int g = VB1 == 1 ? 0 : ch0 / VG1;
      // Rolled to batches (a batch's rounds unrolled): whole, the history's value loop was
      // thousands of instructions every warp streams through once per tile (session 9).
      #pragma unroll 1
      for (int b0 = 0; b0 < ROUNDS; b0 += BATCH) {
        uint32_t words[BATCH][NL];
        unsigned signs[BATCH];
        float sc[BATCH], zp[BATCH], a2[BATCH];
        #pragma unroll
        for (int k = 0; k < BATCH; ++k) {
          const size_t tj = tok0 + min(base + (b0 + k) * TPR + tl, last - 1);
          if (VB1 > 0) {
            const uint32_t* row = vc1 + tj * VW1;
            #pragma unroll
            for (int i = 0; i < NL; ++i) words[k][i] = __ldg(row + min(w0 + i, VW1 - 1));
            if (VB1 == 1) {
              const float a = vq_f32(vs1[tj]);
              sc[k] = 2.f * a;
              zp[k] = -a;
            } else {
              sc[k] = vq_f32(vs1[tj * VGN + g]);
              zp[k] = vq_f32(vz1[tj * VGN + g]);
            }
          }
          signs[k] = __ldg(vc2 + tj * VWS + (ch0 >> 5)) >> (ch0 & 31);
          a2[k] = vq_f32(vm2[tj]);
        }
        #pragma unroll
        for (int k = 0; k < BATCH; ++k) {
          const int j = (b0 + k) * TPR + tl;
          uint32_t aligned[NA];
          #pragma unroll
          for (int i = 0; i < NA; ++i) {
            aligned[i] = VB1 == 0 ? 0u
                       : STRADDLE ? __funnelshift_r(words[k][i], words[k][i + 1 < NL ? i + 1 : i], sh)
                       : words[k][i] >> sh;
          }
          float pj[R];
          #pragma unroll
          for (int r = 0; r < R; ++r) pj[r] = p_tile[j * R + r];
          const float zpos = (VB1 > 0 ? zp[k] : 0.f) + a2[k], zneg = (VB1 > 0 ? zp[k] : 0.f) - a2[k];
          #pragma unroll
          for (int c = 0; c < CPL; ++c) {
            const float z = (signs[k] >> c) & 1u ? zpos : zneg;
            const float v = VB1 > 0 ? fmaf(sc[k], vq_u2f(vq_code<(VB1 > 0 ? VB1 : 1), NA>(aligned, c)), z) : z;
            #pragma unroll
            for (int r = 0; r < R; ++r) acc[r][c] = fmaf(pj[r], v, acc[r][c]);
          }
        }
      }
    }
    __syncwarp();
  }

  // Lanes holding the same channels for different tokens: sum them (the lane bits above LPT).
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    #pragma unroll
    for (int c = 0; c < CPL; ++c) {
      #pragma unroll
      for (int o = LPT; o < 32; o <<= 1) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], o);
    }
  }
  __syncwarp();
  float* red_o = ps[warp];  // the warp's probabilities are no longer needed: [r][channel]
  if (tl == 0) {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      #pragma unroll
      for (int c = 0; c < CPL; ++c) red_o[r * DV + ch0 + c] = acc[r][c];
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
  // The block's warps merged into one partial, written in place into ps[0] (each element is
  // read and written by one thread only).
  const size_t out_row = ((size_t)bh * gridDim.x + blockIdx.x) * R;
  for (int i = threadIdx.x; i < R * DV; i += 32 * NW) {
    const int r = i / DV;
    float top = neg_inf;
    #pragma unroll
    for (int w = 0; w < NW; ++w) top = fmaxf(top, red_m[w][r]);
    float o = 0.f, den = 0.f;
    if (top != neg_inf) {
      #pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float e = red_m[w][r] == neg_inf ? 0.f : expf(red_m[w][r] - top);
        o = fmaf(e, ps[w][i], o);
        den = fmaf(e, red_l[w][r], den);
      }
    }
    ps[0][i] = o;
    if (i % DV == 0) {
      part_m[out_row + r] = top;
      part_l[out_row + r] = den;
    }
  }
  if (!exact) {
    // A history block's o is in the values' rotated basis: rotate it back, s * (H o) / sqrt(DV)
    // (the merge is linear in o, so every partial can be unrotated before it; the merge then
    // writes the final row, and the exact block's o is already in the original basis).
    __syncthreads();
    for (int h = 1; h < DV; h <<= 1) {
      for (int i = threadIdx.x; i < R * DV / 2; i += 32 * NW) {
        const int r = i / (DV / 2), pair = i % (DV / 2);
        const int lo = r * DV + (pair / h) * 2 * h + pair % h;
        const float a = ps[0][lo], b = ps[0][lo + h];
        ps[0][lo] = a + b;
        ps[0][lo + h] = a - b;
      }
      __syncthreads();
    }
    for (int i = threadIdx.x; i < R * DV; i += 32 * NW) ps[0][i] *= vsg[i % DV] * rsqrtf((float)DV);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < R * DV; i += 32 * NW) part_o[out_row * DV + i] = ps[0][i];
"""
