"""KVQuant's decode partials kernel's CUDA source (fused_decode_codebook.py launches it; its
docstring describes the layout read, the work split and the constants' measurements), and the
device helpers it adds to the shared header (kernel_header.py).
"""

from __future__ import annotations

# Template constants: D, DV (key / value head dims), R (rows per KV head), G (tokens per block),
# BITS, LPT (lanes per value token), NOK, NOV (outliers per key / value block, 0 for none),
# QT (query and exact-token dtype), ST (side data and outlier values' dtype).
# meta = [n_valid, tokens per grid block, history grid blocks, scale as float bits, n_skip].
PARTIALS = r"""
  constexpr int NW = 4;
  constexpr int TILE = 128;
  constexpr int TPL = 4;                 // tokens per lane when scoring
  constexpr int PER = 32 / BITS;         // codes per word
  constexpr unsigned MASK = (1u << BITS) - 1u;
  constexpr int LEVELS = 1 << BITS;
  constexpr int CPL = DV / LPT;          // value channels per lane
  constexpr int TPR = 32 / LPT;          // value tokens per round
  constexpr int ROUNDS = TILE / TPR;
  constexpr int BATCH = ROUNDS < 8 ? ROUNDS : 8;  // rounds whose loads are issued together
  constexpr bool K_WORDS = D % PER == 0;    // every key token starts on a word
  constexpr bool V_WORDS = CPL % PER == 0;  // every lane's value channels start on a word
  constexpr int DMAX = D > DV ? D : DV;
  constexpr int NOK1 = NOK > 0 ? NOK : 1;
  constexpr int NOV1 = NOV > 0 ? NOV : 1;
  const float neg_inf = __int_as_float(0xff800000);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int tl = lane / LPT;
  const int ch0 = (lane % LPT) * CPL;
  const int bh = blockIdx.y;
  const int n_valid = meta[0];
  const int per_block = meta[1];
  const int n_hist_blocks = meta[2];
  const float scale = __int_as_float(meta[3]);
  const int n_skip = meta[4];
  const bool window = blockIdx.x >= n_hist_blocks;
  // The window's rows per head in wk / wv: all of them its tokens, or with WB (buffers the cache
  // writes in place, fused_decode.window_rows) the first wn_shape[0] (read where the exact
  // block's end is set: kept live from here, it cost gear's kernel 11 registers under nvcc).
  const int n_window = wk_shape[2];
  const int cap_blocks = kc_shape[2];
  const int k_words = kc_shape[3];       // code words per key block
  const int v_words = vc_shape[3];
  const int cap = vs_shape[2];

  __shared__ __align__(16) float qs[D * R];
  // A tile's scores / probabilities, R per token: the scoring lane's token i at slot i * 33 +
  // lane, so that the lanes' R-float stores are consecutive (conflict-free) and the value
  // loop's TPR tokens per read (slots 33 apart) fall in different banks.
  constexpr int SLOTS = TPL * 33;
  __shared__ __align__(16) float ps[NW][(SLOTS > DMAX ? SLOTS : DMAX) * R];
  __shared__ float corr[NW][NOV > 0 ? R * DV : 1];
  // PARK: a lane's R x CPL value sums wait here between tiles (slot (r * CPL + c) * 32 + lane:
  // consecutive lanes, no bank conflicts), not in registers through the scoring.
  __shared__ float accs[NW][PARK ? R * CPL * 32 : 1];
  __shared__ float cbk[LEVELS];
  __shared__ float cbv[LEVELS];
  __shared__ float red_m[NW][R];
  __shared__ float red_l[NW][R];
  for (int i = threadIdx.x; i < R * D; i += 32 * NW) {
    const int r = i / D, d = i % D;
    qs[d * R + r] = scale * vq_f32(q[(size_t)bh * R * D + i]);
  }
  for (int i = threadIdx.x; i < LEVELS; i += 32 * NW) {
    cbk[i] = kcb[(size_t)bh * LEVELS + i];
    cbv[i] = vcb[(size_t)bh * LEVELS + i];
  }
  if (NOV > 0) {
    for (int i = lane; i < R * DV; i += 32) corr[warp][i] = 0.f;
  }
  __syncthreads();

  const uint32_t* kc_bh = kc + (size_t)bh * cap_blocks * k_words;
  const ST* ks_bh = ks + (size_t)bh * cap_blocks * D;
  const ST* kz_bh = kz + (size_t)bh * cap_blocks * D;
  const uint32_t* vc_bh = vc + (size_t)bh * cap_blocks * v_words;
  const ST* vs_bh = vs + (size_t)bh * cap;
  const ST* vz_bh = vz + (size_t)bh * cap;
  const uint16_t* kop_bh = kop + (size_t)bh * cap_blocks * NOK;
  const ST* kov_bh = kov + (size_t)bh * cap_blocks * NOK;
  const uint16_t* vop_bh = vop + (size_t)bh * cap_blocks * NOV;
  const ST* vov_bh = vov + (size_t)bh * cap_blocks * NOV;
  const QT* wk_bh = wk + (size_t)bh * n_window * D;
  const QT* wv_bh = wv + (size_t)bh * n_window * DV;
  float* p_tile = ps[warp];
  // The key outliers' phase keeps token slot `slot`'s score of row r at key_slot(slot, r): with
  // KSL row-major, r * SLOTS + slot, so the atomics of lanes at random tokens spread over the 32
  // banks (p_tile's own layout, slot * R + r, leaves them 32 / R banks at R = 4; GEAR's kernel
  // took ~15 us less per layer at 128K with it, session 29). KEY_SLOTS_BY_ROW.
  const auto key_slot = [&](int slot, int r) { return KSL ? r * SLOTS + slot : slot * R + r; };

  float* acc_park = &accs[warp][PARK ? lane : 0];
  float m[R], l[R], zsum[R], acc[R][CPL];
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = neg_inf;
    l[r] = 0.f;
    zsum[r] = 0.f;
    #pragma unroll
    for (int c = 0; c < CPL; ++c) {
      acc[r][c] = 0.f;
      if (PARK) acc_park[(r * CPL + c) * 32] = 0.f;
    }
  }

  const int first = window ? 0 : blockIdx.x * per_block;
  const int lo = window ? 0 : n_skip;  // tokens before lo are not attended (the sink's placeholder)
  // The exact block: the sink's n_skip tokens (sk, sv), then the window's.
  const int last = window ? n_skip + (WB ? wn_shape[0] : n_window) : min(first + per_block, n_valid);
  for (int base = first + warp * TILE; base < last; base += TILE * NW) {
    const int t0 = base + lane * TPL;
    const int tile_end = min(base + TILE, last);
    float s[TPL][R];
    #pragma unroll
    for (int i = 0; i < TPL; ++i) {
      #pragma unroll
      for (int r = 0; r < R; ++r) s[i][r] = 0.f;
    }
    if (window) {
      #pragma unroll
      for (int i = 0; i < TPL; ++i) {
        const int t = min(t0 + i, last - 1);
        if (t < n_skip) {
          #pragma unroll 4  // one tile per head: fully unrolled it spilled (ptxas, D 64, R 3)
          for (int d = 0; d < D; ++d) {
            const float kv = vq_f32(sk[((size_t)bh * n_skip + t) * D + d]);
            #pragma unroll
            for (int r = 0; r < R; ++r) s[i][r] = fmaf(qs[d * R + r], kv, s[i][r]);
          }
        } else {
          const QT* krow = wk_bh + (size_t)(t - n_skip) * D;
          #pragma unroll 4
          for (int d = 0; d < D; ++d) {
            const float kv = vq_f32(krow[d]);
            #pragma unroll
            for (int r = 0; r < R; ++r) s[i][r] = fmaf(qs[d * R + r], kv, s[i][r]);
          }
        }
      }
    } else {
      // Past-the-end lanes score the last valid group of TPL tokens (dropped below).
      const int tc = min(t0, (last - 1) / TPL * TPL);
      const int g = tc / G;
      const int tt = tc % G;
      const uint32_t* kb = kc_bh + (size_t)g * k_words;
      const ST* sc_b = ks_bh + (size_t)g * D;
      const ST* zp_b = kz_bh + (size_t)g * D;
      if (K_WORDS) {
        constexpr int WT = D / PER;  // words per token
        const uint32_t* tok = kb + tt * WT;
        #pragma unroll 2
        for (int w = 0; w < WT; ++w) {
          unsigned words[TPL];
          #pragma unroll
          for (int i = 0; i < TPL; ++i) words[i] = __ldg(tok + i * WT + w);
          #pragma unroll
          for (int k = 0; k < PER; k += 2) {
            // Two channels' scales and zeros per load (D and PER even: aligned pairs).
            const vq_pair<ST> scp = vq_load_pair(sc_b + w * PER + k);
            const vq_pair<ST> zpp = vq_load_pair(zp_b + w * PER + k);
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int d = w * PER + k + h;
              const float sc = vq_f32(h ? scp.b : scp.a);
              const float zp = vq_f32(h ? zpp.b : zpp.a);
              float qd[R];
              #pragma unroll
              for (int r = 0; r < R; ++r) qd[r] = qs[d * R + r];
              #pragma unroll
              for (int i = 0; i < TPL; ++i) {
                const float kv = fmaf(cbk[(words[i] >> ((k + h) * BITS)) & MASK], sc, zp);
                #pragma unroll
                for (int r = 0; r < R; ++r) s[i][r] = fmaf(qd[r], kv, s[i][r]);
              }
            }
          }
        }
      } else {
        // Codes straddle tokens inside words: token i's codes start at code `ph[i]` of word
        // `w0 + ...`, the same phase for each run of PER channels. Per run, the two words it
        // spans are joined and shifted by the phase once (vq_window), so the run's PER codes
        // are read at compile-time shifts, as in the aligned path.
        const int last_word = k_words - 1;
        int wi[TPL], ph[TPL];
        unsigned lead[TPL];
        #pragma unroll
        for (int i = 0; i < TPL; ++i) {
          const int idx = (tt + i) * D;
          wi[i] = idx / PER;
          ph[i] = (idx % PER) * BITS;
          lead[i] = __ldg(kb + wi[i]);
        }
        constexpr int RUNS = (D + PER - 1) / PER;
        #pragma unroll 2
        for (int g = 0; g < RUNS; ++g) {
          unsigned win[TPL];
          #pragma unroll
          for (int i = 0; i < TPL; ++i) {
            // The word after a token's last one may lie past the block: clamped (not read).
            const unsigned next = __ldg(kb + min(wi[i] + g + 1, last_word));
            win[i] = vq_window<BITS>(lead[i], next, ph[i]);
            lead[i] = next;
          }
          #pragma unroll
          for (int k = 0; k < PER; k += 2) {
            if (D % PER == 0 || g * PER + k < D) {  // D even: both channels of the pair
              const vq_pair<ST> scp = vq_load_pair(sc_b + g * PER + k);
              const vq_pair<ST> zpp = vq_load_pair(zp_b + g * PER + k);
              #pragma unroll
              for (int h = 0; h < 2; ++h) {
                const int d = g * PER + k + h;
                const float sc = vq_f32(h ? scp.b : scp.a);
                const float zp = vq_f32(h ? zpp.b : zpp.a);
                float qd[R];
                #pragma unroll
                for (int r = 0; r < R; ++r) qd[r] = qs[d * R + r];
                #pragma unroll
                for (int i = 0; i < TPL; ++i) {
                  const float kv = fmaf(cbk[(win[i] >> ((k + h) * BITS)) & MASK], sc, zp);
                  #pragma unroll
                  for (int r = 0; r < R; ++r) s[i][r] = fmaf(qd[r], kv, s[i][r]);
                }
              }
            }
          }
        }
      }
      if (NOK > 0) {
        // Outliers: exact - decoded, times the query, added to the token's raw score.
        #pragma unroll
        for (int i = 0; i < TPL; ++i) {
          #pragma unroll
          for (int r = 0; r < R; ++r) p_tile[key_slot(i * 33 + lane, r)] = s[i][r];
        }
        __syncwarp();
        // A lane takes OB entries at a time: their positions and exact values loaded together,
        // then the code words, scales and zeros the positions name, then the sums (OB = 1: one
        // entry at a time, its two dependent loads waited on per entry, as before session 11;
        // OUTLIER_BATCH). Past-the-end entries of a batch repeat the last one, dropped below.
        const int g0 = base / G;
        const int n_entries = ((tile_end - 1) / G - g0 + 1) * NOK1;
        for (int j0 = lane; j0 < n_entries; j0 += 32 * OB) {
          int pos[OB], gbo[OB];
          float ex[OB];
          #pragma unroll
          for (int b = 0; b < OB; ++b) {
            const int j = min(j0 + 32 * b, n_entries - 1);
            gbo[b] = g0 + j / NOK1;
            const int e = gbo[b] * NOK1 + j % NOK1;
            pos[b] = kop_bh[e];
            ex[b] = vq_f32(kov_bh[e]);
          }
          unsigned word[OB];
          float osc[OB], ozp[OB];
          #pragma unroll
          for (int b = 0; b < OB; ++b) {
            const size_t side = (size_t)gbo[b] * D + pos[b] % D;
            word[b] = __ldg(kc_bh + (size_t)gbo[b] * k_words + pos[b] / PER);
            osc[b] = vq_f32(ks_bh[side]);
            ozp[b] = vq_f32(kz_bh[side]);
          }
          #pragma unroll
          for (int b = 0; b < OB; ++b) {
            const int c = pos[b] % D;
            const int t = gbo[b] * G + pos[b] / D;
            if (j0 + 32 * b < n_entries && t >= base && t < tile_end) {
              const unsigned code = (word[b] >> ((pos[b] % PER) * BITS)) & MASK;
              const float delta = ex[b] - fmaf(cbk[code], osc[b], ozp[b]);
              const int slot = ((t - base) % TPL) * 33 + (t - base) / TPL;
              #pragma unroll
              for (int r = 0; r < R; ++r) atomicAdd(&p_tile[key_slot(slot, r)], qs[c * R + r] * delta);
            }
          }
        }
        __syncwarp();
        #pragma unroll
        for (int i = 0; i < TPL; ++i) {
          #pragma unroll
          for (int r = 0; r < R; ++r) s[i][r] = p_tile[key_slot(i * 33 + lane, r)];
        }
        __syncwarp();
      }
    }
    // ---- online softmax over the tile; probabilities (times the value scale) to shared ----
    float vsc[TPL], vzp[TPL], alpha_r[R];
    #pragma unroll
    for (int i = 0; i < TPL; ++i) {
      const int tj = min(t0 + i, last - 1);
      vsc[i] = window ? 1.f : vq_f32(vs_bh[tj]);
      vzp[i] = window ? 0.f : vq_f32(vz_bh[tj]);
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      float tile_max = neg_inf;
      #pragma unroll
      for (int i = 0; i < TPL; ++i) {
        const bool ok = t0 + i < last && t0 + i >= lo;
        tile_max = ok ? fmaxf(tile_max, s[i][r]) : tile_max;
      }
      // Finite: every tile holds a valid token (n_skip < TILE is checked by the caller).
      const float m_new = fmaxf(m[r], vq_warp_max(tile_max));
      const float alpha = expf(m[r] - m_new);
      float sum = 0.f, zs = 0.f;
      #pragma unroll
      for (int i = 0; i < TPL; ++i) {
        const float p = t0 + i < last && t0 + i >= lo ? expf(s[i][r] - m_new) : 0.f;
        s[i][r] = p * vsc[i];  // stored below, all rows of a token at once
        sum += p;
        zs = fmaf(p, vzp[i], zs);
      }
      l[r] = l[r] * alpha + vq_warp_sum(sum);
      zsum[r] = fmaf(zsum[r], alpha, zs);
      alpha_r[r] = alpha;  // parked value sums: rescaled when the value loop takes them
      if (!PARK) {
        #pragma unroll
        for (int c = 0; c < CPL; ++c) acc[r][c] *= alpha;
      }
      if (NOV > 0) {
        for (int c = lane; c < DV; c += 32) corr[warp][r * DV + c] *= alpha;
      }
      m[r] = m_new;
    }
    #pragma unroll
    for (int i = 0; i < TPL; ++i) {
      #pragma unroll
      for (int r = 0; r < R; ++r) p_tile[(i * 33 + lane) * R + r] = s[i][r];
    }
    __syncwarp();
    if (NOV > 0 && !window) {
      // p * scale * ((exact - zero) / scale - level): the outlier's exact value in place of its
      // decoded one, in the folded form the value loop accumulates.
      // OB entries per lane at a time, as for the keys.
      const int g0 = base / G;
      const int n_entries = ((tile_end - 1) / G - g0 + 1) * NOV1;
      for (int j0 = lane; j0 < n_entries; j0 += 32 * OB) {
        int pos[OB], gbo[OB];
        float ex[OB];
        #pragma unroll
        for (int b = 0; b < OB; ++b) {
          const int j = min(j0 + 32 * b, n_entries - 1);
          gbo[b] = g0 + j / NOV1;
          const int e = gbo[b] * NOV1 + j % NOV1;
          pos[b] = vop_bh[e];
          ex[b] = vq_f32(vov_bh[e]);
        }
        unsigned word[OB];
        float osc[OB], ozp[OB];
        #pragma unroll
        for (int b = 0; b < OB; ++b) {
          const int t = gbo[b] * G + pos[b] / DV;
          word[b] = __ldg(vc_bh + (size_t)gbo[b] * v_words + pos[b] / PER);
          osc[b] = vq_f32(vs_bh[t]);
          ozp[b] = vq_f32(vz_bh[t]);
        }
        #pragma unroll
        for (int b = 0; b < OB; ++b) {
          const int c = pos[b] % DV;
          const int t = gbo[b] * G + pos[b] / DV;
          if (j0 + 32 * b < n_entries && t >= max(base, lo) && t < tile_end) {
            const unsigned code = (word[b] >> ((pos[b] % PER) * BITS)) & MASK;
            const float u = (ex[b] - ozp[b]) / osc[b] - cbv[code];
            const int slot = ((t - base) % TPL) * 33 + (t - base) / TPL;
            #pragma unroll
            for (int r = 0; r < R; ++r) atomicAdd(&corr[warp][r * DV + c], p_tile[slot * R + r] * u);
          }
        }
      }
    }
    if (PARK) {
      // The parked value sums, rescaled to the new maxima (they held no registers while the
      // tile was scored).
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int c = 0; c < CPL; ++c) acc[r][c] = acc_park[(r * CPL + c) * 32] * alpha_r[r];
      }
    }
    // ---- values: past-the-end tokens read the last valid token (p = 0 there) ----
    if (window) {
      for (int round = 0; round < ROUNDS; ++round) {
        const int j = round * TPR + tl;
        const int pslot = ((j % TPL) * 33 + j / TPL) * R;
        const int tj = min(base + j, last - 1);
        if (tj < n_skip) {
          #pragma unroll
          for (int c = 0; c < CPL; ++c) {
            const float v = vq_f32(sv[((size_t)bh * n_skip + tj) * DV + ch0 + c]);
            #pragma unroll
            for (int r = 0; r < R; ++r) acc[r][c] = fmaf(p_tile[pslot + r], v, acc[r][c]);
          }
        } else {
          #pragma unroll
          for (int c = 0; c < CPL; ++c) {
            const float v = vq_f32(wv_bh[(size_t)(tj - n_skip) * DV + ch0 + c]);
            #pragma unroll
            for (int r = 0; r < R; ++r) acc[r][c] = fmaf(p_tile[pslot + r], v, acc[r][c]);
          }
        }
      }
    } else if (V_WORDS) {
      constexpr int WPL = (CPL + PER - 1) / PER;  // code words per lane and token (CPL / PER here)
      // Rolled to batches (a batch's rounds unrolled): whole, the history's value loop was
      // thousands of instructions every warp streams through once per tile (session 9).
      #pragma unroll 1
      for (int b0 = 0; b0 < ROUNDS; b0 += BATCH) {
        uint32_t words[BATCH][WPL];
        #pragma unroll
        for (int k = 0; k < BATCH; ++k) {
          const int tj = min(base + (b0 + k) * TPR + tl, last - 1);
          const uint32_t* row = vc_bh + (size_t)(tj / G) * v_words + ((tj % G) * DV + ch0) / PER;
          #pragma unroll
          for (int i = 0; i < WPL; ++i) words[k][i] = __ldg(row + i);
        }
        #pragma unroll
        for (int k = 0; k < BATCH; ++k) {
          const int j = (b0 + k) * TPR + tl;
          float pj[R];
          #pragma unroll
          for (int r = 0; r < R; ++r) pj[r] = p_tile[((j % TPL) * 33 + j / TPL) * R + r];
          #pragma unroll
          for (int c = 0; c < CPL; ++c) {
            const float v = cbv[(words[k][c / PER] >> ((c % PER) * BITS)) & MASK];
            #pragma unroll
            for (int r = 0; r < R; ++r) acc[r][c] = fmaf(pj[r], v, acc[r][c]);
          }
        }
      }
    } else {
      // As for the keys: each lane's CPL codes start at a runtime phase inside a word; per run
      // of PER codes the two words it spans are joined once (vq_window). UB rounds' words are
      // loaded before their arithmetic (UB = 1: one round at a time, each waiting on its own
      // loads, the kernel before session 11; UNALIGNED_VALUE_BATCH).
      constexpr int RUNS = (CPL + PER - 1) / PER;
      constexpr int UBATCH = ROUNDS < UB ? ROUNDS : UB;
      #pragma unroll 1
      for (int b0 = 0; b0 < ROUNDS; b0 += UBATCH) {
        unsigned words[UBATCH][RUNS + 1];
        int phase[UBATCH];
        #pragma unroll
        for (int k = 0; k < UBATCH; ++k) {
          const int tj = min(base + (b0 + k) * TPR + tl, last - 1);
          const int idx = (tj % G) * DV + ch0;
          const uint32_t* vb = vc_bh + (size_t)(tj / G) * v_words;
          const int w0 = idx / PER;
          phase[k] = (idx % PER) * BITS;
          #pragma unroll
          for (int g = 0; g <= RUNS; ++g) words[k][g] = __ldg(vb + min(w0 + g, v_words - 1));
        }
        #pragma unroll
        for (int k = 0; k < UBATCH; ++k) {
          const int j = (b0 + k) * TPR + tl;
          float pj[R];
          #pragma unroll
          for (int r = 0; r < R; ++r) pj[r] = p_tile[((j % TPL) * 33 + j / TPL) * R + r];
          #pragma unroll
          for (int g = 0; g < RUNS; ++g) {
            const unsigned win = vq_window<BITS>(words[k][g], words[k][g + 1], phase[k]);
            #pragma unroll
            for (int e = 0; e < PER && g * PER + e < CPL; ++e) {
              const float v = cbv[(win >> (e * BITS)) & MASK];
              #pragma unroll
              for (int r = 0; r < R; ++r) acc[r][g * PER + e] = fmaf(pj[r], v, acc[r][g * PER + e]);
            }
          }
        }
      }
    }
    if (PARK) {
      #pragma unroll
      for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int c = 0; c < CPL; ++c) acc_park[(r * CPL + c) * 32] = acc[r][c];
      }
    }
    __syncwarp();
  }

  if (PARK) {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      #pragma unroll
      for (int c = 0; c < CPL; ++c) acc[r][c] = acc_park[(r * CPL + c) * 32];
    }
  }
  // Lanes holding the same channels for different tokens: sum them (the lane bits above LPT).
  #pragma unroll
  for (int r = 0; r < R; ++r) {
    zsum[r] = vq_warp_sum(zsum[r]);
    #pragma unroll
    for (int c = 0; c < CPL; ++c) {
      #pragma unroll
      for (int o = LPT; o < 32; o <<= 1) acc[r][c] += __shfl_xor_sync(0xffffffffu, acc[r][c], o);
    }
  }
  float* red_o = ps[warp];  // the warp's probabilities are no longer needed: [r][channel]
  if (tl == 0) {
    #pragma unroll
    for (int r = 0; r < R; ++r) {
      #pragma unroll
      for (int c = 0; c < CPL; ++c) {
        const float fix = NOV > 0 ? corr[warp][r * DV + ch0 + c] : 0.f;
        red_o[r * DV + ch0 + c] = acc[r][c] + zsum[r] + fix;
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
  __syncthreads();
  // The block's four warps merged into one partial.
  const size_t out_row = ((size_t)bh * gridDim.x + blockIdx.x) * R;
  vq_block_partial<R, DV, NW>(&ps[0][0], sizeof(ps[0]) / sizeof(float), &red_m[0][0], &red_l[0][0],
                              part_o, part_m, part_l, out_row);
"""

# Codes of a run that straddles two words (3 bits: 10 codes per word, 2 padding bits on top,
# which pack_codes leaves 0): the used bits of `lo` then `hi` as one stream, shifted right by
# `shift` < the used bits; the run's codes are then its low PER * BITS bits.
WINDOW = r"""
// Two neighbouring side-data entries in one load (the pointer's element offset is even).
template <typename T> struct __align__(2 * sizeof(T)) vq_pair { T a, b; };
template <typename T>
__device__ __forceinline__ vq_pair<T> vq_load_pair(const T* p) {
  return *reinterpret_cast<const vq_pair<T>*>(p);
}

template <int BITS>
__device__ __forceinline__ unsigned vq_window(unsigned lo, unsigned hi, int shift) {
  constexpr int USED = (32 / BITS) * BITS;
  if (USED == 32) return __funnelshift_r(lo, hi, shift);
  return __funnelshift_r(lo | (hi << (USED & 31)), hi >> ((32 - USED) & 31), shift);
}
"""
