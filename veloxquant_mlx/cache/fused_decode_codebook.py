"""A CUDA partials kernel for a decode step over KVQuant's layout (non-uniform codebooks, per-channel
key / per-token value normalization, sparse exact outliers, exact first-token sink).

Why: on the H200 KVQuant decoded at ~0.1x the fp16 cache's speed at 32K tokens through its
portable path (kvquant_attention.py: compiled chunked codebook lookups, several kernels and
a chunk of float32 levels per step). This kernel reads the packed codes once and produces the
flash-decoding partials (m, l, o) per block of history tokens plus one block for the exact part
(the sink and the window), which fused_decode.merge_partials merges, as kivi's kernels do
(fused_decode.py: its block split, tiles and merge are reused unchanged).

Layout read (what KVQuantCache stores, per block of G tokens and KV head):
  key_codes / value_codes (B, H, cap/G, W) uint32: the block's G*D codes, token-major (index
      t*D + c), packed by packing.pack_codes: 32 // bits codes per word, low bits first; for 3
      bits a word holds 10 codes (2 bits unused), so a token's codes need not start on a word;
  key_scale / key_zero (B, H, cap/G, D): per channel per block; value_scale / value_zero
      (B, H, cap): per token; element = level[code] * scale + zero;
  key_codebook / value_codebook (B, H, 2**bits) float32 levels;
  *_outlier_position (B, H, cap/G, N) uint16 (t*D + c in the block) and *_outlier_value
      (cache dtype): the exact entry replaces the element there (N may be 0: no arrays);
  token 0's codes are a placeholder: the kernel skips it (meta n_skip = 1) and attends the exact
      sink (sink_keys / sink_values, inputs of their own) in the exact block, before the window.

Work split (as fused_decode's kernel 1): blocks of 4 warps per (batch*KV head, range of history
tokens, a multiple of 512), one more block per head for the exact tokens; a warp walks tiles of
128 tokens.
  scores: lane i holds tokens 4i..4i+3 of the tile (one block of G, since G % 4 == 0), all R
      GQA rows at once: per pair of channels the lane reads its block's two scales and zeros
      in one load each (broadcast to the 8 lanes of the block), per channel the query's R
      entries from shared memory in one vector load, then per
      token extract + codebook lookup (shared) + one FMA to the key element + R FMAs. The key
      scale is not folded into the query: with 4 tokens per lane, folding (R products per
      channel for q*scale, R more for the zero sum) costs 2 operations per element at R = 4,
      the unfolded element FMA 1.
  key outliers: the raw scores go to the warp's shared tile, the lanes spread the tile's blocks'
      outliers over themselves and add q[c] * (exact - decoded) with shared atomics (several
      outliers may hit one token), then read the scores back. A lane takes OUTLIER_BATCH entries
      at a time, their loads issued together (session 11: at 128K on the H200 the outliers took
      0.17 of the kernel's 0.41 ms one entry at a time, 0.07 of 0.30 in batches of 4).
  probabilities: per token R floats in the warp's shared tile at slot i * 33 + lane (the lane's
      i-th token), one vector store per token without bank conflicts; the value loop's TPR
      (= 32 / LPT) tokens per read (slots 33 apart) fall in different banks.
  values: LPT = DV / CPL lanes share a token, CPL channels each (channels_per_lane: 16 halved
      while R x CPL exceeds MAX_LANE_ACCUMULATORS = 32: 8 at R = 3..4, 4 at R = 5..8; the old
      setting 64 gave 16 up to 4 rows, 8 above); the value scale is folded into the probability
      (p * scale, stored once per token) and the zero into one sum per row (sum p * zero,
      added to every channel at the end), so per element: extract + lookup + R FMAs.
  parked value sums (PARK_ACCUMULATORS, where parks()): a lane's R x CPL sums wait in shared
      memory (accs, slot (r * CPL + c) * 32 + lane: conflict-free) from the end of one tile's
      value loop to the start of the next's, rescaled by the tile's alpha as they are taken, so
      they hold no registers while a tile is scored (scores s[4][R], the 3-bit key path's words
      and phases, the side data in flight: the kernel's peak). Cost per tile and lane: 2 R CPL
      shared accesses (64 at R = 4) against the value loop's 128 / TPR rounds of R CPL FMAs,
      CPL lookups and R probability loads (~3500 instructions at R = 4): ~2% more instructions.
  value outliers: the lanes spread them as for the keys (in batches too) and add p * scale *
      ((exact - zero) / scale - level) into a per-warp (R, DV) correction buffer in shared memory (atomics),
      rescaled with the accumulators at every tile and added to the warp's partial at the end.
Codes: for 2 and 4 bits with D % (32 // bits) == 0 a token's codes are whole words and the
shifts are compile-time constants. For 3 bits (10 codes per word, 2 padding bits) a token's
codes (a lane's CPL value channels) start at a runtime phase inside a word, the same for each
run of 10 channels: per run the two words it spans are joined and shifted by the phase once
(vq_window: 4 integer operations per run and token), then its 10 codes are read at
compile-time shifts as in the aligned case.

Shared memory (4-byte floats): queries R*D, per warp a tile of R*max(132, D, DV) (scores, then
probabilities, then the warp's partial), with value outliers per warp R*DV corrections, parked
per warp R*CPL*32 value sums, two codebooks, per warp and row m and l. supports() counts it
against 48 KB unparked, parks() parked (35264 bytes for the default on the 8B shape, as ptxas
reports; unparked shared_bytes counts 16 bytes of stand-in that ptxas drops).

Registers per thread (ptxas of nvcc 13.0 for sm_90, -Xptxas -v; no spills anywhere; the shapes of
tests/cache/test_kernels_nvcc.py, default config: 3 bits, 1% outliers, G 32):
                       before session 5   MAX_LANE_ACCUMULATORS 32   32 + parked (default)
                       (64, unparked)     unparked
  bf16 R 4 d 128 (8B)        168                 128                        96
  fp16 R 8 d 128             219                 168                 168 (not parked: 54 KB)
  fp32 R 1 d 128             128                 128                        96
  bf16 R 3 d 64 (SmolLM2)    166                 141                        96
  8B shape at 2 / 4 bits   168 / 168          130 / 142                  80 / 80
The old split is MAX_LANE_ACCUMULATORS = 64 with PARK_ACCUMULATORS = False (those columns are
that setting compiled now). Without parking the 8B shape's peak is the 3-bit key path with the
R x 8 value sums live across it (ablations: 106 registers with that path cut). With 128 threads
per block an SM's 65536 registers hold 3 blocks (12 warps) at 168, 4 (16) at <= 128, 5 (20) at
<= 102; shared memory allows 5 at 35 KB. The 8B shape's grid at 32K tokens is 520 blocks (one
128-token tile per warp; ~3.9 per SM on 132 SMs: one wave from 4 resident blocks on, 1.3 at 3);
at 128K 2056 (one tile per warp, fused_decode.TARGET_WARPS 8192 since session 27; with 4096,
1032 blocks of two tiles, and past 128K ~690 of three: one wave at 5 blocks per SM plus a tail,
337 us a layer at 131584 tokens against 299 with 8192, results/lb_h200_s27_split_131584.json).
Timed on the H200 since (each run's command in results/README.md): the variants of session
11 (`kernel_probe_h200_s11_kvquant.json`, now `python -m veloxquant_mlx.bench.batch_probe`:
parking, value batches, outliers in batches), Nsight Compute at 128K in session 12
(`ncu_h200_s12.json`: 102 registers, 25% theoretical occupancy, ~7 cycles per issued
instruction), and the whole decode step against fp16's in every gpu_speed run since (session 19:
0.89x at 32K, 0.58x at 128K on a machine whose host bounds fp16's step,
`gpu_speed_h200_s19_*_all.json`). More resident warps per SM hide more of the code and
side-data loads' latency (kivi's kernel went 184 -> 104 registers and 0.092 -> 0.086 ms per
layer at 32K); against it, 16 lanes per value token (was 8) double the value loop's per-token
work per element (probability loads, code-word loads) and parking adds ~2%.

tests/cache/test_fused_decode_kvquant_emulated.py runs this source on the CPU under
tests/cache/cuda_emulation.py through KVQuantCache's decode path (each setting of the constants);
test_fused_decode_kvquant.py has the wiring test and the CUDA tests; test_fused_decode_kvquant_nvcc.py
(slow, nvcc) bounds the 8B shape's registers in each setting.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.cache.fused_decode import (
    PartialsKernel,
    WARPS_PER_BLOCK,
    FusedDecodeMeta,
)
from veloxquant_mlx.cache.kernel_header import HEADER as _HEADER
from veloxquant_mlx.errors import QuantizerConfigError

SUPPORTED_BITS = (2, 3, 4)
TOKENS_PER_LANE = 4  # scoring: a lane's tokens, all inside one block of G
# values: a lane's channels of one token (lanes_per_token): MAX_CHANNELS_PER_LANE, halved while
# rows x channels exceeds MAX_LANE_ACCUMULATORS (the value sums a lane holds in registers).
# Session 5: 32 (8 channels at 3-4 rows; 168 -> 128 registers on the 8B shape, 96 parked). The old
# setting, 64 (16 channels up to 4 rows, 8 above: CHANNELS_PER_LANE {rows <= 4: 16, else 8}),
# is MAX_LANE_ACCUMULATORS = 64: set it to time both (the launch's LPT follows it).
MAX_LANE_ACCUMULATORS = 32
MAX_CHANNELS_PER_LANE = 16
MIN_CHANNELS_PER_LANE = 4
# PARK_ACCUMULATORS: a lane's value sums wait in shared memory (R x CPL floats per lane) while a
# tile is scored instead of holding registers across the whole tile loop, where shared memory
# allows (parks(): 48 KB with them). Session 5: on; before, off (the sums stayed in registers).
PARK_ACCUMULATORS = True
# UNALIGNED_VALUE_BATCH: where a lane's value codes start inside a word (3 bits: 10 codes per
# word), the value loop loads this many rounds' words before their arithmetic (a power of two;
# the template's UB). Before session 11 the loop took one round at a time (1): each round's two
# loads were waited on before its lookups and FMAs, 64 rounds per tile at the 8B shape.
UNALIGNED_VALUE_BATCH = 8
# OUTLIER_BATCH: outlier entries a lane takes at a time (the template's OB): their positions and
# exact values loaded together, then what the positions name (code word, scale, zero). Before
# session 11 (1) one entry at a time, two dependent loads waited on per entry; on the H200 the
# outliers then took 0.17 of kvquant's 0.41 ms per layer at 128K (results/kernel_probe_h200_s11_kvquant.json).
# 8 since session 12 (4 in session 11): in all three runs timing both on one machine, 8 took
# less at 32K tokens (0.0980 / 0.0878 / 0.0834 ms against 0.0997 / 0.0957 / 0.0970) and no more
# at 128K (0.296 / 0.297 / 0.299 against 0.304 / 0.302 / 0.300; results/kernel_probe_h200_s11_batches.json,
# results/batch_probe_h200_s12*.json). Registers (nvcc 13, the 8B shape): 96 -> 122, but the
# H200's nvrtc build of 4 already took 102 (Nsight Compute, results/ncu_h200_s12.json), i.e. 4
# blocks per SM, which 122 keeps.
OUTLIER_BATCH = 8
# KEY_SLOTS_BY_ROW: the key outliers' atomics on a row-major copy of the tile's scores (template
# KSL; key_slot in the source) instead of p_tile's token-major slots. Off: prepared in session 29
# after GEAR's kernel gained from the same layout, not yet timed on the H200 (batch_probe's
# kvquant variant `ksl`); emulated and nvcc-compiled both ways.
KEY_SLOTS_BY_ROW = False
MAX_ROWS = 8  # GQA rows per KV head
MAX_HEAD_DIM = 256
SHARED_BYTES = 48 * 1024

# Template constants: D, DV (key / value head dims), R (rows per KV head), G (tokens per block),
# BITS, LPT (lanes per value token), NOK, NOV (outliers per key / value block, 0 for none),
# QT (query and exact-token dtype), ST (side data and outlier values' dtype).
# meta = [n_valid, tokens per grid block, history grid blocks, scale as float bits, n_skip].
_PARTIALS = r"""
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
_WINDOW = r"""
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

_INPUTS = ["q", "kc", "ks", "kz", "kcb", "vc", "vs", "vz", "vcb", "kop", "kov", "vop", "vov", "wk", "wv", "sk", "sv", "meta", "wn"]


@lru_cache(maxsize=None)
def _partials_kernel(lane_accumulators: int, park: bool, batches: tuple):
    """The partials kernel for a MAX_LANE_ACCUMULATORS / PARK_ACCUMULATORS / (UNALIGNED_VALUE_BATCH,
    OUTLIER_BATCH, KEY_SLOTS_BY_ROW) setting. The source does not read them (the lane split, the
    parking, the batches and the slots are the template's LPT, PARK, UB, OB and KSL, and MLX
    compiles one kernel per template),
    but a probe that changes a constant gets a kernel object of its own, never one built for the
    other setting."""
    return PartialsKernel("vq_codebook_decode_partials", _INPUTS, _PARTIALS, _HEADER + _WINDOW)


def channels_per_lane(rows: int) -> int:
    """A lane's value channels of one token: MAX_CHANNELS_PER_LANE, halved (down to
    MIN_CHANNELS_PER_LANE) while rows x channels exceeds MAX_LANE_ACCUMULATORS. At 32: 16
    channels for 1-2 rows, 8 for 3-4, 4 for 5-8; at 64 (the old setting): 16 up to 4 rows, 8
    above."""
    channels = MAX_CHANNELS_PER_LANE
    while rows * channels > MAX_LANE_ACCUMULATORS and channels > MIN_CHANNELS_PER_LANE:
        channels //= 2
    return channels


def lanes_per_token(value_dim: int, rows: int) -> int | None:
    """Lanes sharing one value token (channels_per_lane(rows) channels each), or None when
    that does not split the value head dim into a power of two up to 32 lanes."""
    channels = channels_per_lane(rows)
    lanes = value_dim // channels
    if value_dim % channels or lanes not in (1, 2, 4, 8, 16, 32):
        return None
    return lanes


def shared_bytes(head_dim: int, value_dim: int, rows: int, bits: int, value_outliers: bool,
                 parked: bool = False) -> int:
    """The kernel's static shared memory (4-byte floats), as declared in _PARTIALS; `parked`: with
    the lanes' value sums parked (accs: R x CPL floats per lane)."""
    widest = max(TOKENS_PER_LANE * 33, head_dim, value_dim)  # ps: SLOTS = 4 * 33 tokens' rows
    floats = rows * head_dim + WARPS_PER_BLOCK * widest * rows
    floats += WARPS_PER_BLOCK * (rows * value_dim if value_outliers else 1)
    floats += WARPS_PER_BLOCK * (rows * channels_per_lane(rows) * 32 if parked else 1)
    floats += 2 * (1 << bits) + 2 * WARPS_PER_BLOCK * rows
    return 4 * floats


def supports(head_dim: int, value_dim: int, group_size: int, bits: int, rows: int,
             value_outliers: bool = True) -> bool:
    """The shapes the kernel handles; others take the portable path: bits 2, 3, 4; groups of
    a multiple of 4 tokens (the config allows 32, 64, 128); 1..8 GQA rows; key head dims
    8..256, a multiple of 8 (channel pairs of side data per load), the value head dim 32, 64, 128 or 256 (the merge kernel reduces whole warps of
    channels), at most 4 rows above head dim 128; shared memory under 48 KB (the 8B shape,
    R = 4, D = DV = 128: 18.4 KB)."""
    if bits not in SUPPORTED_BITS or group_size % 4 or not 1 <= rows <= MAX_ROWS:
        return False
    if not 8 <= head_dim <= MAX_HEAD_DIM or head_dim % 8 or value_dim % 32 or lanes_per_token(value_dim, rows) is None:
        return False
    if max(head_dim, value_dim) > 128 and rows > 4:
        return False  # ptxas (sm_90) spilled at head dim 256 with 7 or 8 rows
    return shared_bytes(head_dim, value_dim, rows, bits, value_outliers) <= SHARED_BYTES


def parks(head_dim: int, value_dim: int, rows: int, bits: int, value_outliers: bool) -> bool:
    """Whether the launch parks the value sums in shared memory: PARK_ACCUMULATORS and the
    kernel's shared memory with them under 48 KB (the 8B shape: 35 KB; not at 8 rows with value
    outliers: 54 KB, nor at head dim 256 with them)."""
    return PARK_ACCUMULATORS and shared_bytes(head_dim, value_dim, rows, bits, value_outliers, True) <= SHARED_BYTES


def _as(x: mx.array, dtype) -> mx.array:
    """x in dtype; x itself when it already is (no op in the step's graph)."""
    return x if x.dtype == dtype else x.astype(dtype)


def decode_step(cache, queries, scale: float):
    """A KVQuantCache decode step's attention through the kernel, or None where it is not active
    (off CUDA, switched off, a shape supports() refuses): the cache then takes the portable
    path. Token 0 of the history is the exact sink: skipped in the codes, attended from
    sink_keys / sink_values with the window."""
    if not fused_decode.kernels_enabled():
        return None
    # Read at each call (probes set them).
    batches = (UNALIGNED_VALUE_BATCH, OUTLIER_BATCH, KEY_SLOTS_BY_ROW)
    accumulators, park = MAX_LANE_ACCUMULATORS, PARK_ACCUMULATORS
    key = (accumulators, park, batches)  # beside planned_attend's own (the store's writes, the history...)

    def launch():
        rows = queries.shape[1] // cache.n_kv_heads
        s = cache.store
        value_outliers = "value_outlier_position" in s
        if not supports(cache.head_dim, cache.value_dim, cache.group_size, cache.code_bits, rows, value_outliers):
            return None
        # The sink goes in as its own inputs, not concatenated with the window: two copies (two
        # more launches per layer and step) saved.
        sink = (s["sink_keys"], s["sink_values"]) if "sink_keys" in s else None
        meta_cache = cache.__dict__.setdefault("_codebook_meta", FusedDecodeMeta())
        _, inputs, shape = codebook_launch(
            queries, scale, s, cache.window_keys, cache.window_values, sink, n_valid=cache.n_compressed,
            group_size=cache.group_size, bits=cache.code_bits, n_kv_heads=cache.n_kv_heads,
            meta_cache=meta_cache, batches=batches,
        )
        return inputs, shape, WINDOW_INPUTS

    return fused_decode.planned_attend(cache, queries, scale, key, launch, lambda: _partials_kernel(accumulators, park, batches))


def codebook_decode_attention(
    queries, scale: float, store, window_keys, window_values, sink, *, n_valid: int,
    group_size: int, bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta,
):
    """softmax(q K^T * scale) V for one query row per head, queries (B, Hq, 1, D), over the
    compressed tokens [S, n_valid) read from `store` (KVQuantCache's arrays by name), the exact
    sink `sink` = (keys, values) (B, H, S, D) standing for tokens [0, S) (None: S = 0) and the
    exact window (B, H, W, D), W >= 1 -> (B, Hq, 1, DV) in the queries' dtype. Only call when
    kernels_enabled() and supports(...): decode_step checks."""
    return codebook_partials(
        queries, scale, store, window_keys, window_values, sink, n_valid=n_valid,
        group_size=group_size, bits=bits, n_kv_heads=n_kv_heads, meta_cache=meta_cache, merged=True,
    )


def codebook_partials(
    queries, scale: float, store, window_keys, window_values, sink, *, n_valid: int,
    group_size: int, bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta, merged: bool = False,
):
    """The partials kernel's launch (checks, block split, meta, template) -> (part_o, part_m,
    part_l) for fused_decode.merge_partials, or with `merged` the attention output
    (PartialsKernel.attend: one launch, the merge fused in)."""
    kernel, inputs, shape = codebook_launch(
        queries, scale, store, window_keys, window_values, sink, n_valid=n_valid, group_size=group_size,
        bits=bits, n_kv_heads=n_kv_heads, meta_cache=meta_cache)
    if merged:
        return kernel.attend(queries, inputs=inputs, **shape)
    return kernel.partials(queries, inputs=inputs, **shape)


# Where codebook_launch's input list holds the window (keys, values).
WINDOW_INPUTS = (_INPUTS.index("wk"), _INPUTS.index("wv"), _INPUTS.index("wn"))


def codebook_launch(
    queries, scale: float, store, window_keys, window_values, sink, *, n_valid: int,
    group_size: int, bits: int, n_kv_heads: int, meta_cache: FusedDecodeMeta, batches: tuple | None = None,
):
    """The checks, block split, meta and template of the partials kernel's launch ->
    (kernel, inputs, {template, n_blocks, heads, value_dim}). `batches`: (UNALIGNED_VALUE_BATCH,
    OUTLIER_BATCH, KEY_SLOTS_BY_ROW) as the caller read them for its launch plan's key (None:
    read here), so the
    plan, the kernel object and the template take one reading."""
    B, n_q_heads, _, D = queries.shape
    R = n_q_heads // n_kv_heads
    BH = B * n_kv_heads
    DV = window_values.shape[-1]
    side = store["key_scale"].dtype
    skip = 0 if sink is None else sink[0].shape[2]
    sink_keys, sink_values = (fused_decode.absent_input(side), fused_decode.absent_input(side)) if sink is None else sink
    if n_valid % group_size:
        raise QuantizerConfigError(
            f"codebook fused decode: {n_valid} history tokens is invalid: allowed is a multiple "
            f"of the group size {group_size} (whole blocks)"
        )
    fused_decode.check_skip(skip, n_valid, "codebook fused decode")
    per_block, n_hist_blocks, n_blocks = fused_decode.history_blocks(n_valid, BH, "codebook fused decode")
    outliers = []
    counts = []
    for prefix in ("key", "value"):
        if f"{prefix}_outlier_position" in store:
            outliers += [store[f"{prefix}_outlier_position"], store[f"{prefix}_outlier_value"]]
            counts.append(store[f"{prefix}_outlier_position"].shape[-1])
        else:
            outliers += [fused_decode.absent_input(mx.uint16), fused_decode.absent_input(side)]
            counts.append(0)
    meta = meta_cache.get(n_valid, per_block, n_hist_blocks, float(scale), skip)
    dtype = queries.dtype
    park = parks(D, DV, R, bits, counts[1] > 0)
    ub, ob, ksl = (UNALIGNED_VALUE_BATCH, OUTLIER_BATCH, KEY_SLOTS_BY_ROW) if batches is None else batches
    kernel = _partials_kernel(MAX_LANE_ACCUMULATORS, PARK_ACCUMULATORS, (ub, ob, ksl))
    inputs = [queries, store["key_codes"], store["key_scale"], store["key_zero"],
              _as(store["key_codebook"], mx.float32), store["value_codes"], store["value_scale"],
              store["value_zero"], _as(store["value_codebook"], mx.float32), *outliers,
              _as(window_keys, dtype), _as(window_values, dtype), sink_keys, sink_values, meta,
              fused_decode.window_rows(window_keys.shape[2])]
    template = [("D", D), ("DV", DV), ("R", R), ("G", group_size), ("BITS", bits),
                ("LPT", lanes_per_token(DV, R)), ("NOK", counts[0]), ("NOV", counts[1]), ("PARK", park),
                ("UB", ub), ("OB", ob), ("KSL", int(ksl)),
                ("QT", dtype), ("ST", side), ("WB", 0)]
    return kernel, inputs, {"template": template, "n_blocks": n_blocks, "heads": BH, "value_dim": DV}
