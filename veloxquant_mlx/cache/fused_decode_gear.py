"""A CUDA decode-step kernel for GEARCache: fused_decode's partials kernel plus GEAR's two terms.

Why: on MLX's CUDA backend a GEAR decode step ran as ~15 ops per layer (quantized_matmul for the
scores, the low-rank products per 256-token block, the sparse gather / scatter, softmax, a split
quantized_matmul for the values, the same two terms again, the window) and decoded at ~0.1x the
fp16 cache's tokens/s at 32K tokens on the H200 (issue 5). Its store is KIVI's layout (the codes
fused_decode's kernel reads) plus, per block of BLK = 256 tokens per head (gear.py):
  low rank  A (tokens x r, `*_lr_tokens`, per token) and B (d x r, `*_lr_channels`, per block):
            keys' scores gain (q B_k) A_k^T, values' output gains (p A_v) B_v^T;
  sparse    `count` (value, index) pairs per block, index = token_in_block * d + channel,
            values that ADD (gear.py, deviation 3): scores gain q[c] * value at (t, c), the
            output gains p_t * value at channel c.
So this kernel is fused_decode's partials kernel (partials_source: its text, with GEAR's code at
the hook lines) followed by its merge kernel, both unchanged for KIVI / XQuant; per layer and
step: 2 launches instead of ~15 ops.

Where each term goes (per warp tile of 128 tokens, which lies inside one 256-token block; all
of it before or after the loops over the codes, so those stay as they are):
  * q B_k: once the tile's scores are zeroed, lane i multiplies the scaled queries (shared
    memory) with rows i, i + 32, ... of the block's B_k (r contiguous values each: the warp
    reads B_k in one coalesced sweep), a butterfly over the warp sums the R x r products, and
    each lane starts the scores of its 4 tokens at sum_j (q B_k)[r][j] A_k[t][j] (their A_k
    rows: 4 r contiguous values). Recomputed by both tiles of a block: 64 FMAs and 80 shuffles
    per lane per tile at R = r = 4, against ~4,000 FMAs over the tile's key and value codes.
    Why not one MLX product outside: a third launch per layer and step, which is what this
    kernel removes.
  * sparse keys: the tile's score slots in shared memory (its probability buffer, not yet
    used) are zeroed, the warp's lanes scan the tile's run of the block's `count` pairs (328 at
    d = 128, 1%; stored in ascending index) and add q[c] * value into the slot of each pair
    inside the tile (shared-memory atomics where two lanes of a step name one token, plain
    adds elsewhere), and each lane adds its tokens' slots to their scores.
  * A_v: once the tile's probabilities are in shared memory, each lane sums p_t A_v[t] (R x r)
    over its 4 scoring tokens, the warp sums that by a butterfly, and the value lanes add
    u B_v^T to their channel accumulators (lane group tl takes ranks tl, tl + TPR, ...: the
    groups are summed at the end like the codes' part). Per tile, so the tile's
    probabilities and the accumulators share the running max.
  * sparse values: a per-warp (R x DV) float buffer in shared memory, rescaled with the
    accumulators at every tile (alpha per row), gains p_t * value at (r, c) by atomics; added
    to the warp's partial before the block's four warps merge.
The exact window block has none of these terms. Shared memory beyond fused_decode's kernel:
R x DV floats per warp (8 KB at R = 4, DV = 128); supports() counts it.

Taken (supports()): fused_decode's shapes (bits 2, 4, 8; groups of whole 32-token tiles; value
dims whose lanes stay inside one group), head_dim a multiple of 32 (the q B_k sweep), rank
0..8 with rows x max(rank, 1) <= 32 (the R x r sums per lane), 1..8 query rows per kv head,
blocks of whole 128-token tiles, shared memory under 48 KB. Rank 0 and outlier fraction 0 drop
their code at compile time (template constants RANK, KCNT, VCNT = 0; dummies in place of the
missing arrays): the kernel is then fused_decode's over GEAR's arrays. GEAR's 3-bit codes
straddle words: the portable path.

The portable path (gear_attention.py) stays the fallback and the reference:
tests/cache/test_fused_decode_gear_emulated.py runs this kernel's source under the thread-level
CUDA emulation (tests/cache/cuda_emulation.py) through GEARCache.attention against it;
tests/cache/test_fused_decode_gear.py holds the wiring test and the CUDA tests, which pass on the
H200 (results/cuda_tests_h200_s18.txt: 39 passed with the encode and prefill kernels' tests).

What its terms cost (session 23, bench.gear_terms_probe: the launch with a term dropped from its
template, one layer of the 8B shape chained; results/gear_terms_h200_s23.json), us per layer at
32K with TARGET_WARPS' 4096 warps: 90.8 as shipped, 86.0 without the low rank, 89.0 without the
key outliers, 85.7 without the value outliers, 64.8 without all three (fp16's mx.fast attention
~46). The outlier scans grow with the tiles a warp walks: at 1024 warps 106.8 shipped against
87.9 without the key outliers, and at 128K 355 against 257 (164 without all three), which is why
this launch keeps TARGET_WARPS (4096, 8192 since session 27: past 128K tokens 4096 split the
history into ~690 blocks of 3 tiles a warp, one wave plus a tail, 316 us a layer at 131584
tokens against 267 with 8192; results/lb_h200_s27_split_*.json) where kivi's aims at 1024.
A tile's scan reads its whole block's
entries and adds its own through shared-memory atomicAdd, a compare-and-swap loop on sm_90
(ATOMS.CAST.SPIN); plain adds where a round's target is unique in the warp were faster only at
1024 warps and were reverted (fccc141). With two terms dropped (session 24,
results/gear_terms_h200_s24.json) the savings do not add up (low rank and key outliers together
21 us at 32K, alone 8 and 4), and at 128K the two outlier scans are 77 of the terms' 103 us.
Through the model GEAR decodes at 0.87x-0.94x fp16's at 32K and 0.81x at 128K (session 24,
once a host sync of window_rows was gone: results/gpu_speed_h200_s24_*.json). A tile's outlier
entries loaded up front into registers (session 24-25's PREFETCH_OUTLIERS: 128 registers) cost
23 us more at 32K and 27 at 128K (results/gear_terms_h200_s25_pfo.json) and were taken out.
Nor did an L2 prefetch of a tile's side arrays (low-rank rows and factors, outlier entries; one
`prefetch.L2` per 128-byte line by the warp's lanes, as the tile starts or a tile ahead) help:
us per layer at 32K 92.1 without, 95.7 / 91.5 with; at 128K 267.3 / 283.6 / 278.9; through the
model at 128K 0.83x / 0.82x / 0.82x fp16's (session 27, results/gear_terms_h200_s27_pf.json,
gear_prefetch_gpu_speed_h200_s27_128k.json): the terms' loads are not waiting on HBM. Taken out.
Session 29 changed the scans (vq_gear_tile_entries): a block's pairs are stored in ascending
index (gear_encoder), so a tile's are one run, which the warp reads from the block's nearer end,
OB consecutive entries a lane, stopping past the run (SORTED_SCAN; it had read all 328); the key
sums sit row-major in p_tile, their atomics over 32 banks instead of 8 (KEY_SLOTS_BY_ROW); and a
step of the key scan whose lanes name distinct tokens adds without atomics (PLAIN_KEY_ADDS). One
layer at 8192 warps, the code before and after in one process on one H200: 32K 88.8 -> 82.9 us,
128K 284.8 -> 260.1, the outliers' cost there 83 -> 60 us (results/gear_terms_h200_s29_before.json,
..._after.json); the plain key adds took 252-253 us against 259-263 all atomic at 128K on two
machines (gear_terms_h200_s29_plain*.json). Through the model at 128K gear's step took 3.43 ms
against 3.58 with the full scan (the `gear-fullscan` ablation, results/gpu_speed_h200_s29_128k_scan.json).
The value sums stay atomic: a __match_any_sync check per step made them slower (264-273 us).
The full scan gains nothing from sorted pairs (287 us over them on one machine, the old code 285
over the selection's order on another): sorted, neighbouring lanes' atomics meet on one token.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import affine_partials_source, fused_decode, kernel_header

MAX_RANK = 8
MAX_ROWS = 8
MAX_ROW_RANKS = 32  # rows x max(rank, 1): the per-lane (q B_k) and (p A_v) sums, in registers
# Sparse (outlier) entries a lane takes at a time (the template's OB): their indices and values
# loaded together before the sums. Before session 11 one at a time (1), each entry's loads waited
# on; a 128-token tile walks its 256-token block's entries (the 8B shape at 1%: 328, ~11 per lane).
OUTLIER_BATCH = 4
# A tile reads only its own run of its block's sparse entries (template OSORT; the encoder
# stores them sorted by index, gear_encoder.encode_side) instead of all of them.
SORTED_SCAN = True

# GEAR's build of the affine kernel scores the history on tensor cores (fused_decode.MMA_SCORES'
# path, template MMA) where this is set. Off: the plain kernel (kivi, xquant) takes them since
# session 30, with its tensor-core values; in GEAR's build they measured no faster in session 22
# (272 against 271 us per layer at 128K, results/lb_h200_s22_*.json) and GEAR's terms add to the
# FMA loop's value accumulators (no tensor-core values here).
MMA_SCORES = False
# The key outliers' sums in p_tile row-major (template KSL: bank-conflict-free atomics).
KEY_SLOTS_BY_ROW = True
# With SORTED_SCAN, a step of the key scan whose lanes name distinct tokens adds without atomics
# (template KPLAIN; vq_gear_tile_entries).
PLAIN_KEY_ADDS = True
GEAR_INPUTS = ("kat", "kbc", "koi", "kov", "vat", "vbc", "voi", "vov")

# Template constants beyond fused_decode's: RANK, BLK (tokens per low-rank / outlier block),
# KCNT, VCNT (outlier pairs per block of keys / values; 0: none), KIT, VIT (their index dtypes).
# Inputs beyond fused_decode's: kat (B, H, cap, RANK) A_k, kbc (B, H, cap / BLK, D, RANK) B_k,
# koi / kov (B, H, cap / BLK, KCNT) outlier indices / values; vat, vbc, voi, vov for values.
_DECLARE = r"""
  // GEAR: the warp's sparse value sums [r][channel], kept at the running max like acc.
  constexpr int RK = RANK > 0 ? RANK : 1;
  __shared__ __align__(16) float vsp[NW][VCNT > 0 ? R * DV : 1];
  float* vsp_w = vsp[warp];
  if (VCNT > 0) {
    for (int i = lane; i < R * DV; i += 32) vsp_w[i] = 0.f;
  }
  const int n_gblk = cap / BLK;
  const ST* kat_bh = kat + (size_t)bh * cap * RANK;
  const ST* kbc_bh = kbc + (size_t)bh * n_gblk * D * RANK;
  const KIT* koi_bh = koi + (size_t)bh * n_gblk * KCNT;
  const ST* kov_bh = kov + (size_t)bh * n_gblk * KCNT;
  const ST* vat_bh = vat + (size_t)bh * cap * RANK;
  const ST* vbc_bh = vbc + (size_t)bh * n_gblk * DV * RANK;
  const VIT* voi_bh = voi + (size_t)bh * n_gblk * VCNT;
  const ST* vov_bh = vov + (size_t)bh * n_gblk * VCNT;
  // The key outliers' sums of token t and row r in p_tile (free until the softmax): with KSL
  // row-major, r * SLOTS + tile_slot(t), so the atomics of lanes at random tokens spread over
  // the 32 banks; else p_tile's own layout, tile_slot(t) * R + r, whose R-float stride leaves
  // them 32 / R banks at R = 4 (session 28's Nsight: 5.0 M bank conflicts on 10.2 M shared
  // loads). A lane's own tokens lane * TPL + i sit at i * 33 + lane either way: conflict-free.
  const auto key_slot = [&](int t, int r) { return KSL ? r * SLOTS + tile_slot(t) : tile_slot(t) * R + r; };
"""

# GEAR's helper beside the shared header (kernel_header.py): the sparse entries of a tile (both scans).
_HEADER = kernel_header.HEADER + r"""
// The sparse entries (index = token_in_block * DIM + channel, value) of one block of BLK
// tokens that fall in the TILE tokens at offset toff: add(t, c, value, plain) for each, t in the
// tile. SORTED (the encoder stores a block's entries in ascending index): the tile's entries are
// one run, so the warp walks from the block's end nearer to it, OB consecutive entries per lane
// and 32 OB a round, and stops after the first round that reaches past the run (a tile reads
// about its own share of the block's entries where it read all of them). Otherwise every entry
// of the block is read, lane i taking entries i, i + 32, ... (OB at a time), as before session
// 29. Past-the-end entries of a round repeat the last one and are dropped.
// PLAIN (with SORTED; the key sums, whose target is the token): `plain` tells add that no two
// lanes of this step (the lanes' b-th entries) name one token, so plain read-add-writes may
// replace the shared-memory atomics (a compare-and-swap loop on sm_90); the steps are then
// ordered by __syncwarp. The lanes' tokens are monotone in the lane (the entries are sorted), so
// a clash is two neighbours. (The value sums' target is the channel: a check by
// __match_any_sync made them slower, session 29, and they stay atomic.)
template <int CNT, int DIM, int TILE, int BLK, int OB, int SORTED, int PLAIN, typename IT, typename VT,
          typename F>
__device__ __forceinline__ void vq_gear_tile_entries(const IT* oi, const VT* ov, int toff, int lane, F&& add) {
  constexpr bool CHECKED = SORTED && PLAIN;
  const bool forward = 2 * toff + TILE <= BLK;
  const int first = toff * DIM, end = (toff + TILE) * DIM;
  for (int e0 = 0; e0 < CNT; e0 += 32 * OB) {
    int oix[OB];
    float oval[OB];
    #pragma unroll
    for (int b = 0; b < OB; ++b) {
      const int k = min(SORTED ? e0 + lane * OB + b : e0 + lane + 32 * b, CNT - 1);
      const int e = SORTED && !forward ? CNT - 1 - k : k;
      oix[b] = (int)oi[e];
      oval[b] = vq_f32(ov[e]);
    }
    bool past = false;
    #pragma unroll
    for (int b = 0; b < OB; ++b) {
      const int idx = oix[b];
      const bool valid = (SORTED ? e0 + lane * OB + b : e0 + lane + 32 * b) < CNT;
      const bool mine = valid && idx >= first && idx < end;
      const int t = idx / DIM - toff, c = idx % DIM;
      bool plain = false;
      if (CHECKED) {
        const int target = mine ? t : -1 - lane;  // lanes without an entry: no clash
        const int before = __shfl_up_sync(0xffffffffu, target, 1);  // every lane: a full-warp shuffle
        plain = !__any_sync(0xffffffffu, lane > 0 && before == target);
      }
      if (mine) add(t, c, oval[b], plain);
      if (CHECKED) __syncwarp();
      past |= valid && (forward ? idx >= end : idx < first);
    }
    if (SORTED && __any_sync(0xffffffffu, past)) break;
  }
}
"""

_TILE = r"""
    // GEAR: the tile's block (BLK % TILE == 0: a tile lies in one) and its offset in it.
    const int gb = base / BLK;
    const int toff = base - gb * BLK;
    float al[R];  // the rows' rescale factors of this tile (the online softmax's alpha)
"""

# Right after the tile's scores are zeroed: GEAR's key terms go in first, so that none of their
# registers stay live through the loop over the key codes.
_SCORE_INIT = r"""
    if (!window) {
      if (RANK > 0) {
        // q B_k of the block: lane takes channels lane, lane + 32, ...; summed over the warp.
        float qb[R][RK];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          #pragma unroll
          for (int j = 0; j < RK; ++j) qb[r][j] = 0.f;
        }
        const ST* bk = kbc_bh + (size_t)gb * D * RANK;
        #pragma unroll
        for (int k = 0; k < D / 32; ++k) {
          const int d = k * 32 + lane;
          #pragma unroll
          for (int j = 0; j < RK; ++j) {
            const float b = vq_f32(bk[d * RANK + j]);
            #pragma unroll
            for (int r = 0; r < R; ++r) qb[r][j] = fmaf(qs[d * R + r], b, qb[r][j]);
          }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          #pragma unroll
          for (int j = 0; j < RK; ++j) qb[r][j] = vq_warp_sum(qb[r][j]);
        }
        // (q B_k) A_k^T for the lane's tokens (past-the-end lanes: the last valid slice).
        const int ta = min(base + lane * TPL, (last - 1) / TPL * TPL);
        #pragma unroll
        for (int i = 0; i < TPL; ++i) {
          #pragma unroll
          for (int j = 0; j < RK; ++j) {
            const float a = vq_f32(kat_bh[(size_t)(ta + i) * RANK + j]);
            #pragma unroll
            for (int r = 0; r < R; ++r) s[i][r] = fmaf(qb[r][j], a, s[i][r]);
          }
        }
      }
      if (KCNT > 0) {
        // Sparse key terms q[c] * value into the tile's score slots (the probability buffer,
        // free until the softmax writes it; each lane zeroes its own tokens' slots).
        #pragma unroll
        for (int i = 0; i < TPL; ++i) {
          #pragma unroll
          for (int r = 0; r < R; ++r) p_tile[key_slot(lane * TPL + i, r)] = 0.f;
        }
        __syncwarp();
        vq_gear_tile_entries<KCNT, D, TILE, BLK, OB, OSORT, KPLAIN>(
            koi_bh + (size_t)gb * KCNT, kov_bh + (size_t)gb * KCNT, toff, lane, [&](int t, int c, float val, bool plain) {
              #pragma unroll
              for (int r = 0; r < R; ++r) {
                float* sum = &p_tile[key_slot(t, r)];
                if (plain) *sum += qs[c * R + r] * val;
                else atomicAdd(sum, qs[c * R + r] * val);
              }
            });
        __syncwarp();
        #pragma unroll
        for (int i = 0; i < TPL; ++i) {
          #pragma unroll
          for (int r = 0; r < R; ++r) s[i][r] += p_tile[key_slot(lane * TPL + i, r)];
        }
      }
    }
"""

_RESCALED = r"""
      al[r] = alpha;
"""

_PROBS = r"""
    if (!window) {
      if (RANK > 0) {
        // u = sum over the tile of p_t A_v[t] (each lane over its scoring tokens, whose
        // probabilities it wrote, then over the warp); the value lanes add u B_v^T to their
        // channels, lane group tl taking ranks tl, tl + TPR, ... (the groups are summed at the
        // end, like the codes' part). Here, not in the softmax: s is dead by now.
        float u[R][RK];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          #pragma unroll
          for (int j = 0; j < RK; ++j) u[r][j] = 0.f;
        }
        const int ta = min(base + lane * TPL, (last - 1) / TPL * TPL);
        #pragma unroll
        for (int i = 0; i < TPL; ++i) {
          #pragma unroll
          for (int j = 0; j < RK; ++j) {
            const float a = vq_f32(vat_bh[(size_t)(ta + i) * RANK + j]);
            #pragma unroll
            for (int r = 0; r < R; ++r) u[r][j] = fmaf(p_tile[(i * 33 + lane) * R + r], a, u[r][j]);
          }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
          #pragma unroll
          for (int j = 0; j < RK; ++j) u[r][j] = vq_warp_sum(u[r][j]);
        }
        const ST* bv = vbc_bh + (size_t)gb * DV * RANK;
        #pragma unroll
        for (int j0 = 0; j0 < RK; j0 += TPR) {
          float uj[R];
          #pragma unroll
          for (int r = 0; r < R; ++r) uj[r] = 0.f;
          #pragma unroll
          for (int jj = j0; jj < (j0 + TPR < RK ? j0 + TPR : RK); ++jj) {
            if (jj - j0 == tl) {  // a predicated copy: no register array indexed at run time
              #pragma unroll
              for (int r = 0; r < R; ++r) uj[r] = u[r][jj];
            }
          }
          const int j = j0 + tl;
          if (j < RANK) {
            #pragma unroll
            for (int c = 0; c < CPL; ++c) {
              const float b = vq_f32(bv[(ch0 + c) * RANK + j]);
              #pragma unroll
              for (int r = 0; r < R; ++r) acc[r][c] = fmaf(uj[r], b, acc[r][c]);
            }
          }
        }
      }
      if (VCNT > 0) {
        // The rows' alphas are the same in every lane (warp maxima), and 1 once the running
        // max settles: the rescale is skipped by the whole warp then.
        bool moved = false;
        #pragma unroll
        for (int r = 0; r < R; ++r) moved |= al[r] != 1.f;
        if (moved) {
          #pragma unroll
          for (int r = 0; r < R; ++r) {
            for (int c = lane; c < DV; c += 32) vsp_w[r * DV + c] *= al[r];
          }
        }
        __syncwarp();
        vq_gear_tile_entries<VCNT, DV, TILE, BLK, OB, OSORT, 0>(
            voi_bh + (size_t)gb * VCNT, vov_bh + (size_t)gb * VCNT, toff, lane, [&](int t, int c, float val, bool) {
              #pragma unroll
              for (int r = 0; r < R; ++r) atomicAdd(&vsp_w[r * DV + c], p_tile[tile_slot(t) * R + r] * val);
            });
      }
    }
"""

_PARTIAL = r"""
  if (VCNT > 0 && !window) {
    __syncwarp();
    for (int i = lane; i < R * DV; i += 32) red_o[i] += vsp_w[i];
  }
"""

PARTIALS_SOURCE = affine_partials_source.partials_source({
    hook: text.lstrip("\n") for hook, text in (
        ("declare", _DECLARE), ("tile", _TILE), ("score_init", _SCORE_INIT),
        ("rescaled", _RESCALED), ("probs", _PROBS), ("partial", _PARTIAL),
    )
})


@lru_cache(maxsize=None)
def _partials_kernel():
    return fused_decode.PartialsKernel("vq_gear_decode_partials", [*fused_decode.PARTIALS_INPUTS, *GEAR_INPUTS],
                                       PARTIALS_SOURCE, _HEADER)


def sparse_shared_bytes(value_dim: int, rows: int, value_outliers: bool) -> int:
    """Static shared memory the kernel adds to fused_decode's: the sparse value sums."""
    return 4 * fused_decode.WARPS_PER_BLOCK * (rows * value_dim if value_outliers else 1)


def shared_bytes(head_dim: int, value_dim: int, rows: int, value_outliers: bool) -> int:
    """Static shared memory of the kernel besides the history's stages: fused_decode's
    (queries, per warp a tile's probabilities or partial, per warp and row max and sum) plus
    the sparse value sums."""
    return fused_decode.shared_bytes(head_dim, value_dim, rows) + sparse_shared_bytes(
        value_dim, rows, value_outliers)


def supports(head_dim: int, value_dim: int, group_size: int, bits: int, rank: int,
             block_tokens: int, rows: int, value_outliers: bool = True) -> bool:
    """The shapes the kernel takes (see the module docstring); others take the portable path."""
    if not fused_decode.supports(head_dim, value_dim, group_size, bits, bits, rows):
        return False
    if not 1 <= rows <= MAX_ROWS or not 0 <= rank <= MAX_RANK or rows * max(rank, 1) > MAX_ROW_RANKS:
        return False
    if head_dim % 32 or block_tokens % fused_decode.TILE:
        return False
    # The stages take what the sums leave (scales of 4 bytes: float32 queries, the most).
    return fused_decode.stage_template(head_dim, value_dim, rows, group_size, bits, bits, 4,
                                       sparse_shared_bytes(value_dim, rows, value_outliers)) is not None


def sorted_scan(cache) -> bool:
    """Whether the cache's launches scan a tile's run of the sparse entries: SORTED_SCAN, or the
    cache's own `sorted_scan` where it has one (bench ablation `gear-fullscan`, an A/B of the
    scan through a model's decode in one run)."""
    return bool(cache.__dict__.get("sorted_scan", SORTED_SCAN))


def store_arrays(cache) -> tuple[list[mx.array], list[mx.array], list[tuple]]:
    """(fused_decode's six arrays, GEAR's eight in GEAR_INPUTS order, GEAR's template constants)
    from the cache's store: key codes as one bit stream per channel (B, H, D, words); absent
    terms (rank 0, no outliers) as 1-element dummies the kernel never reads."""
    st, B, H, D = cache.store, cache.batch_size, cache.n_kv_heads, cache.head_dim
    side = cache.side_dtype
    words = cache.capacity * cache.code_bits // 32
    base = [st["k_codes"].reshape(B, H, D, words), st["k_scales"], st["k_zeros"],
            st["v_codes"], st["v_scales"], st["v_zeros"]]
    extra, counts, index_dtypes = [], [], []
    for s in ("k", "v"):
        if cache.rank:
            extra += [st[f"{s}_lr_tokens"], st[f"{s}_lr_channels"]]
        else:
            extra += [fused_decode.absent_input(side)] * 2
        if f"{s}_out_values" in st:
            index, values = st[f"{s}_out_index"], st[f"{s}_out_values"]
            extra += [index, values]
            counts.append(values.shape[-1])
            index_dtypes.append(index.dtype)
        else:
            extra += [fused_decode.absent_input(mx.uint16), fused_decode.absent_input(side)]
            counts.append(0)
            index_dtypes.append(mx.uint16)
    template = [("RANK", cache.rank), ("BLK", cache.block_tokens), ("KCNT", counts[0]),
                ("VCNT", counts[1]), ("KIT", index_dtypes[0]), ("VIT", index_dtypes[1]),
                ("OB", OUTLIER_BATCH), ("OSORT", int(sorted_scan(cache))),
                ("KSL", int(KEY_SLOTS_BY_ROW)), ("KPLAIN", int(PLAIN_KEY_ADDS))]
    return base, extra, template


def decode_step(cache, queries, scale: float):
    """A GEARCache decode step's attention (queries (B, Hq, 1, D), a compressed history and a
    non-empty window) through the two kernels, or None where they are not active (off CUDA,
    switched off, a shape supports() refuses): the cache then takes the portable path."""
    if not fused_decode.kernels_enabled():
        return None

    def launch():
        rows = queries.shape[1] // cache.n_kv_heads
        if not supports(cache.head_dim, cache.value_dim, cache.code_group, cache.code_bits, cache.rank,
                        cache.block_tokens, rows, "v_out_values" in cache.store):
            return None
        base, extra, template = store_arrays(cache)
        meta_cache = cache.__dict__.setdefault("_fused_meta", fused_decode.FusedDecodeMeta())
        _, inputs, shape = fused_decode.affine_launch(
            queries, scale, *base, cache.window_keys, cache.window_values,
            n_valid=cache.n_compressed, group_size=cache.code_group, key_bits=cache.code_bits,
            value_bits=cache.code_bits, n_kv_heads=cache.n_kv_heads, meta_cache=meta_cache,
            kernel=_partials_kernel(), extra_inputs=extra, extra_template=template,
            # TARGET_WARPS, not the affine kernel's own target (fused_decode.AFFINE_TARGET_WARPS)
            split=fused_decode.tokens_per_block,
            extra_shared=sparse_shared_bytes(cache.value_dim, rows, "v_out_values" in cache.store),
            score_mma=bool(MMA_SCORES), value_mma=False,  # its terms add to the FMA loop's accumulators
        )
        return inputs, shape, fused_decode.WINDOW_INPUTS

    # Planned on the store's writes and the history (fused_decode.planned_attend), and the
    # outlier batch and the scan's switches (a probe sets them between steps).
    switches = (OUTLIER_BATCH, SORTED_SCAN, KEY_SLOTS_BY_ROW, PLAIN_KEY_ADDS, MMA_SCORES)
    return fused_decode.planned_attend(cache, queries, scale, switches, launch, _partials_kernel)
