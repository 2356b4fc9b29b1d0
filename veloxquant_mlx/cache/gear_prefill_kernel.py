"""One CUDA kernel that builds GEARCache's whole K/V for a prefill chunk's attention.

Why: a prefill chunk's attention (base CompressedKVCache._attend_prefill) reads everything cached
as plain K/V, so per layer and chunk GEAR's portable path (GEARCache._prefill_keys_values)
decodes the whole history: per piece of 8192 tokens and side a compiled decode (mx.dequantize,
the low-rank product per 256-token block, the in-place scatter of the sparse part, casts: ~16
primitives on a GPU), a slice update into the result, and the window's copy. On the H200
(8B-shaped llama, 8 layers, bf16, 32K prompt in 2048-token chunks; session 6) gear's prefill took
4.03x the fp16 KVCache's time, ~10 ms per layer and chunk above fp16, and session 5's portable
path also made 2 x pieces - 1 host syncs per layer and chunk beyond 8192 tokens (gone since
session 6: gear.PREFILL_HOST_SYNCS). This kernel reads each stored array once and writes the
(B, H, n + W, D) keys and (B, H, n + W, DV) values in the queries' dtype: one launch per layer
and chunk, no float32 intermediates of the history (the portable path holds one piece's), the
window appended in place.

Layout read (gear.py's store, MLX's mx.quantize stream: KIVI's layout, the one
fused_prefill_affine reads, plus GEAR's two terms):
  keys    codes kc (B, H, D, row_words) uint32 (the store's (B, H, D, cap / 32, bits) viewed as
          rows), token t's code at bit KB * t of channel d's stream; scales / zeros ks, kz
          (B, H, D, cap / G);
  values  codes vc (B, H, cap, DV * KB / 32), channel c's code at bit KB * c of token t's
          stream; scales / zeros vs, vz (B, H, cap, DV / G);
  low rank (RANK > 0) A: kat / vat (B, H, cap, RANK) per token; B: kbc / vbc
          (B, H, cap / NB, D or DV, RANK) per block of NB tokens;
  sparse (KCNT / VCNT > 0 pairs per block) koi / voi (B, H, cap / NB, count) indices
          token_in_block * d + channel (KIT / VIT: uint16 or uint32), kov / vov their additive
          values (gear.py, deviation 3); one block's pairs are distinct entries.
  Only tokens [0, n) are read (the arrays carry growth slack; n is whole blocks); the window
  wk / wv (B, H, W, D / DV) in the cache's dtype follows.

Arithmetic: each history element as gear.decode_side computes it in float32, then rounded to
the cache's dtype CT (the portable `_decode`'s astype) and to the queries' dtype OT:
  x = scale * code + zero        (the product is exact in float32: <= 11 + 8 bits, so an fma
                                  and MLX's dequantize, fused or not, give the same sum);
  x = x + sum_r A[t][r] B[d][r]  (each product exact, <= 2 x 11 bits; summed r = 0, 1, ...
                                  from 0 as BLAS's sgemm accumulates a K = RANK product: checked
                                  bit for bit against the CPU's matmul by the emulated test);
  x = (x + 0) + s                (s the entry's sparse value, 0 off the outliers: what
                                  gear_outliers.add_block_entries computes, signed zeros too).
So on MLX's CPU backend (the emulation) the kernel is the portable path bit for bit; on CUDA the
only possible difference is the low-rank sum's order, should cuBLAS split a K = RANK reduction
(the @cuda_test in tests/cache/test_gear_prefill_kernel.py measures it there).

Work split (session 19; Nsight Compute had session 6's split latency-bound at 30K history,
254 us per layer and chunk, 141 M instructions, ~135 per channel pair and position: every
element re-read its token's A row and its channel pair's B rows from global memory and
converted them): a block per (SUB consecutive tiles of TT = 32 positions, batch x kv head), of
threads_per_block() threads; SUB = 2 where the low-rank block and shared memory allow
(launch_plan), halving the blocks' prologues and barriers per element. A tile lies inside one
key group (G >= 32), a block inside one NB-token block (NB a multiple of 32 x SUB), and is all
history or all window (n is whole blocks). A thread keeps one key channel pair and one value
channel pair for the whole block (consecutive threads, consecutive pairs: a warp's stores stay
contiguous) and visits positions row, row + ROWS, ... in unrolled loops; its key scales and zero
points (one group per tile) and both pairs' B rows are read once into registers. The block
stages its key code words of every channel (KB words per tile), its A rows of keys and values
(floats) and, where shared memory allows (launch_plan), its value codes, scales and zero points
in shared memory; each thread reads its share of the block's sparse pairs (sparse_per_thread)
into registers with those loads, so a block waits on global memory once, then places the pairs
that fall into the block in a (TT x SUB x max(D, DV)) float32 correction tile (zeroed first;
refilled from the value pairs before the values). Shared memory: 4 x (KB x SUB x (D + 2)
rounded to 4 words, + 2 x TT x SUB x RANK, + TT x SUB x max(D, DV) when the sparse part is kept,
+ TT x SUB x (DV x KB / 32 + 2 x DV / G) when the values are staged) bytes (40.0 KB at the 8B
shape's D = 128, 2 bits, rank 4, SUB 2; supports() bounds one tile without the value stage by
CUDA's static 48 KB).

The portable path stays the fallback and the reference: on the CPU and Metal, with the kernels
switched off (VELOXQUANT_CUDA_KERNELS=0), for shapes `supports` refuses, and for subclasses with
their own dequantization. On a GPU, tests/cache/test_gear_prefill_kernel.py's @cuda_test
compares it with the portable path run on the CPU (each session's run: results/README.md);
nvcc 13 compiles it for sm_90 without spills (tests/cache/test_gear_prefill_kernel_nvcc.py).
Its time: `python -m veloxquant_mlx.bench.chunk_kernels profile --method gear` under Nsight
Compute, and the 32K prefill `python -m veloxquant_mlx.bench.prefill_chunks --methods gear`.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.kernel_name import build_kernel

SUPPORTED_BITS = (2, 3, 4, 8)
TILE = 32  # positions per block: a whole number of 32-token key words at every width
MAX_THREADS = 256

INPUTS = ("kc", "ks", "kz", "kat", "kbc", "koi", "kov", "vc", "vs", "vz", "vat", "vbc", "voi", "vov",
          "wk", "wv", "meta")

# Template constants: D, DV (key / value head dims), G (group), KB (bits), RANK (0: no low
# rank), NB (tokens per low-rank / outlier block), KCNT, VCNT (sparse pairs per block; 0: none),
# NT (threads per block: threads_per_block), SPP (sparse pairs per thread in registers),
# SUB / VSTAGE (tiles per block / values staged: launch_plan), ST (side dtype: scales, zeros,
# factors, sparse values), KIT, VIT (index dtypes), CT (the cache's dtype), WT (the window's),
# OT (the output's: the queries' dtype). meta = [n (history tokens), W (window tokens)].
_SOURCE = r"""
  constexpr int TT = 32;                      // positions per tile (TILE)
  constexpr int TB = TT * SUB;                // positions per block: SUB consecutive tiles
  constexpr int KW = KB;                      // key code words per channel and tile (TT * KB / 32)
  constexpr int DP = D + 2;                   // shared row stride: even, != 0 mod 32
  constexpr int WV = DV * KB / 32;            // value code words per token
  constexpr int GV = DV / G;                  // value groups per token
  constexpr int CD = D > DV ? D : DV;         // correction tile row
  constexpr bool SPARSE = KCNT > 0 || VCNT > 0;
  constexpr int RK = RANK > 0 ? RANK : 1;
  constexpr unsigned MASK = KB == 32 ? 0xffffffffu : (1u << KB) - 1u;
  // A thread keeps one channel pair for the whole block (its scales, zero points and low-rank
  // factor rows in registers, loaded once) and visits the block's positions tl = row,
  // row + ROWS, ...: consecutive threads hold consecutive pairs, so a warp's stores stay
  // contiguous.
  constexpr int KP = D / 2, VP = DV / 2;      // channel pairs
  constexpr int KROWS = NT / KP, VROWS = NT / VP;
  constexpr int KPER = (TT + KROWS - 1) / KROWS;   // a thread's key positions per tile
  constexpr int KPERB = (TB + KROWS - 1) / KROWS, VPERB = (TB + VROWS - 1) / VROWS;  // per block
  struct __align__(8) vq_f2 { float x, y; };
  struct __align__(2 * sizeof(OT)) vq_o2 { OT x, y; };
  __shared__ __align__(16) uint32_t kw_s[(KW * SUB * DP + 3) / 4 * 4];  // whole 16 bytes: no padding
  __shared__ __align__(16) float a_s[RANK > 0 ? 2 * TB * RK : 4];  // the block's A rows: keys', values'
  __shared__ __align__(16) float corr[SPARSE ? TB * CD : 4];
  // The block's value codes and their group scales and zero points (floats), staged with the
  // keys' words when VSTAGE (shared memory allows: launch_plan); read per position otherwise.
  __shared__ __align__(16) uint32_t vw_s[VSTAGE ? TB * WV : 4];
  __shared__ __align__(16) float vsz_s[VSTAGE ? 2 * TB * GV : 4];

  const int n = meta[0];
  const int n_window = meta[1];
  const int total = n + n_window;
  const int bh = blockIdx.y;
  const int t_start = blockIdx.x * TB;
  const int rows = min(t_start + TB, total) - t_start;
  const bool hist = t_start < n;              // the whole block: n is whole blocks of NB
  const int blk = t_start / NB;               // the block's low-rank / outlier block (NB % TB == 0)
  const int t_off = t_start - blk * NB;       // the block's first position inside it
  const int tid = threadIdx.x;
  const int kp = tid % KP, krow = tid / KP, d = 2 * kp;   // the thread's key pair
  const int vp = tid % VP, vrow = tid / VP, c = 2 * vp;   // and value pair

  const int row_words = kc_shape[3];
  const int row_groups = ks_shape[3];
  const int cap_v = vc_shape[2];
  const int cap_s = vs_shape[2];
  const uint32_t* kc_bh = kc + (size_t)bh * D * row_words;
  const ST* ks_bh = ks + (size_t)bh * D * row_groups;
  const ST* kz_bh = kz + (size_t)bh * D * row_groups;
  const uint32_t* vc_bh = vc + (size_t)bh * cap_v * WV;
  const ST* vs_bh = vs + (size_t)bh * cap_s * GV;
  const ST* vz_bh = vz + (size_t)bh * cap_s * GV;
  const WT* wk_bh = wk + (size_t)bh * n_window * D;
  const WT* wv_bh = wv + (size_t)bh * n_window * DV;
  OT* keys_bh = keys + (size_t)bh * total * D;
  OT* values_bh = values + (size_t)bh * total * DV;

  // The portable path's casts of a float32 history element: to the cache's dtype, then the
  // queries'.
  const auto out_of = [](float x) { return vq_cast_through<CT, OT>(x); };
  const auto exact = [](const WT* p) { return vq_o2{vq_cast<OT>(vq_f32(p[0])), vq_cast<OT>(vq_f32(p[1]))}; };
  // Two adjacent outputs in one store (ptxas kept a 16-bit pair as two 16-bit stores).
  const auto store_pair = [](OT* p, vq_o2 o) {
    if (sizeof(OT) == 2) {
      unsigned short lo, hi;
      memcpy(&lo, &o.x, 2);
      memcpy(&hi, &o.y, 2);
      *reinterpret_cast<unsigned int*>(p) = (unsigned int)lo | ((unsigned int)hi << 16);
    } else {
      *reinterpret_cast<vq_o2*>(p) = o;
    }
  };
  // Two channels' factor rows (B[ch][0..RK), B[ch + 1][0..RK)) as floats.
  const auto factor_rows = [](const ST* rows_of_pair, float* b0, float* b1) {
    #pragma unroll
    for (int r = 0; r < RK; ++r) {
      b0[r] = vq_f32(rows_of_pair[r]);
      b1[r] = vq_f32(rows_of_pair[RK + r]);
    }
  };
  // sum_r A[t][r] B[c][r], r ascending from 0 (the order of sgemm's K loop), for two channels.
  const auto low_rank = [](const float* a_row, const float* b0, const float* b1, float& x0, float& x1) {
    float l0 = 0.f, l1 = 0.f;
    #pragma unroll
    for (int r = 0; r < RK; ++r) {
      const float a = a_row[r];
      l0 = l0 + a * b0[r];
      l1 = l1 + a * b1[r];
    }
    x0 = x0 + l0;
    x1 = x1 + l1;
  };
  const auto zero_corr = [&]() {
    for (int i = tid; i < TB * CD / 4; i += NT) {
      reinterpret_cast<uint4*>(corr)[i] = uint4{0u, 0u, 0u, 0u};  // +0.0f
    }
  };
  // The block's sparse pairs: the first SPP x NT read into registers (SPP per thread) with the
  // tile's other loads, the rest (more than SPP_MAX per thread) read as they are placed; `place`
  // writes those inside this tile into `corr` ([position][channel], zeroed before):
  // (x + 0) + corr is add_block_entries' sum, signed zeros included.
  struct vq_sparse { int at[SPP]; float value[SPP]; };
  const auto slot_of = [&](int idx, int dim) {
    const int tl = idx / dim - t_off;
    return tl >= 0 && tl < TB ? tl * CD + idx % dim : -1;
  };
  // The block's first pair in the (B x H, blocks, count) outlier arrays.
  const auto block_base = [&](int count) { return ((size_t)bh * (size_t)(n_blocks_cap) + blk) * count; };
  const auto fetch_sparse = [&](const auto* index, const ST* value, int count, int dim) {
    vq_sparse e;
    const size_t base = block_base(count);
    #pragma unroll
    for (int k = 0; k < SPP; ++k) {
      const int j = tid + k * NT;
      e.at[k] = j < count ? slot_of((int)index[base + j], dim) : -1;
      e.value[k] = j < count ? vq_f32(value[base + j]) : 0.f;
    }
    return e;
  };
  const auto place = [&](const vq_sparse& e, const auto* index, const ST* value, int count, int dim) {
    #pragma unroll
    for (int k = 0; k < SPP; ++k) {
      if (e.at[k] >= 0) corr[e.at[k]] = e.value[k];
    }
    const size_t base = block_base(count);
    for (int j = tid + SPP * NT; j < count; j += NT) {
      const int at = slot_of((int)index[base + j], dim);
      if (at >= 0) corr[at] = vq_f32(value[base + j]);
    }
  };
"""

# The body after the declarations: the number of blocks the factor / outlier arrays hold is read
# from the first array that has it (kbc's or koi's shape), so the source names only arrays the
# launch passes for real.
_BODY = r"""
  if (!hist) {
    // ---- a window tile: its exact rows in the queries' dtype ----
    if (krow < KROWS) {
      #pragma unroll
      for (int j = 0; j < KPERB; ++j) {
        const int tl = krow + j * KROWS;
        if (tl < rows) {
          const int t = t_start + tl;
          store_pair(keys_bh + (size_t)t * D + d, exact(wk_bh + (size_t)(t - n) * D + d));
        }
      }
    }
    if (vrow < VROWS) {
      #pragma unroll
      for (int j = 0; j < VPERB; ++j) {
        const int tl = vrow + j * VROWS;
        if (tl < rows) {
          const int t = t_start + tl;
          store_pair(values_bh + (size_t)t * DV + c, exact(wv_bh + (size_t)(t - n) * DV + c));
        }
      }
    }
    return;
  }

  // ---- history tiles: the block's key code words and A rows to shared memory ----
  const int w0 = t_start * KB / 32;           // t_start is a multiple of 32: a word boundary
  for (int i = tid; i < D * KW * SUB; i += NT) {
    const int dd = i / (KW * SUB), w = i % (KW * SUB);
    kw_s[w * DP + dd] = __ldg(kc_bh + (size_t)dd * row_words + w0 + w);
  }
  if (RANK > 0) {
    const ST* ka = kat + ((size_t)bh * kat_shape[2] + t_start) * RK;
    const ST* va = vat + ((size_t)bh * vat_shape[2] + t_start) * RK;
    for (int i = tid; i < TB * RK; i += NT) {
      a_s[i] = vq_f32(ka[i]);
      a_s[TB * RK + i] = vq_f32(va[i]);
    }
  }
  if (VSTAGE) {
    const uint32_t* vrows = vc_bh + (size_t)t_start * WV;
    for (int i = tid; i < TB * WV; i += NT) vw_s[i] = __ldg(vrows + i);
    const size_t g0 = (size_t)t_start * GV;
    for (int i = tid; i < TB * GV; i += NT) {
      vsz_s[i] = vq_f32(vs_bh[g0 + i]);
      vsz_s[TB * GV + i] = vq_f32(vz_bh[g0 + i]);
    }
  }
  vq_sparse k_sparse, v_sparse;
  if (KCNT > 0) k_sparse = fetch_sparse(koi, kov, KCNT, D);
  if (VCNT > 0) v_sparse = fetch_sparse(voi, vov, VCNT, DV);
  if (KCNT > 0) zero_corr();
  // The thread's own side data, for the whole block (TT <= G: one key group per channel and tile).
  float ksc0[SUB], ksc1[SUB], kzp0[SUB], kzp1[SUB];
  float kb0[RK], kb1[RK], vb0[RK], vb1[RK];
  if (krow < KROWS) {
    #pragma unroll
    for (int u = 0; u < SUB; ++u) {
      const size_t g = (size_t)d * row_groups + (t_start + u * TT) / G;
      ksc0[u] = vq_f32(ks_bh[g]);
      ksc1[u] = vq_f32(ks_bh[g + row_groups]);
      kzp0[u] = vq_f32(kz_bh[g]);
      kzp1[u] = vq_f32(kz_bh[g + row_groups]);
    }
    if (RANK > 0) factor_rows(kbc + (((size_t)bh * kbc_shape[2] + blk) * D + d) * RK, kb0, kb1);
  }
  if (RANK > 0 && vrow < VROWS) {
    factor_rows(vbc + (((size_t)bh * vbc_shape[2] + blk) * DV + c) * RK, vb0, vb1);
  }
  if (KCNT > 0) {
    __syncthreads();                          // corr zeroed
    place(k_sparse, koi, kov, KCNT, D);
  }
  __syncthreads();

  // ---- keys ----
  if (krow < KROWS) {
    #pragma unroll
    for (int u = 0; u < SUB; ++u) {
    #pragma unroll
    for (int j = 0; j < KPER; ++j) {
      const int tl = u * TT + krow + j * KROWS;
      if (KPER * KROWS == TT || krow + j * KROWS < TT) {
        unsigned c0, c1;
        vq_staged_key_pair<KB>(kw_s, DP, tl, d, c0, c1);
        float x0 = ksc0[u] * (float)(c0 & MASK) + kzp0[u];
        float x1 = ksc1[u] * (float)(c1 & MASK) + kzp1[u];
        if (RANK > 0) low_rank(a_s + tl * RK, kb0, kb1, x0, x1);
        if (KCNT > 0) {
          const vq_f2 s = *reinterpret_cast<const vq_f2*>(corr + tl * CD + d);
          x0 = (x0 + 0.f) + s.x;
          x1 = (x1 + 0.f) + s.y;
        }
        store_pair(keys_bh + (size_t)(t_start + tl) * D + d, vq_o2{out_of(x0), out_of(x1)});
      }
    }
    }
  }

  // ---- values: corr refilled from the value pairs ----
  if (VCNT > 0) {
    __syncthreads();                          // the keys' reads of corr are done
    zero_corr();
    __syncthreads();
    place(v_sparse, voi, vov, VCNT, DV);
    __syncthreads();
  }
  if (vrow < VROWS) {
    #pragma unroll
    for (int j = 0; j < VPERB; ++j) {
      const int tl = vrow + j * VROWS;
      if (VPERB * VROWS == TB || tl < TB) {
        const int t = t_start + tl;
        unsigned c0, c1;
        float sc, zp;
        if (VSTAGE) {
          vq_code_pair<KB, false>(vw_s + tl * WV, c, c0, c1);  // c even
          const int g = tl * GV + c / G;      // c and c + 1 share a group (G is even)
          sc = vsz_s[g];
          zp = vsz_s[TB * GV + g];
        } else {
          vq_code_pair<KB>(vc_bh + (size_t)t * WV, c, c0, c1);
          const size_t g = (size_t)t * GV + c / G;
          sc = vq_f32(vs_bh[g]);
          zp = vq_f32(vz_bh[g]);
        }
        float x0 = sc * (float)(c0 & MASK) + zp;
        float x1 = sc * (float)(c1 & MASK) + zp;
        if (RANK > 0) low_rank(a_s + TB * RK + tl * RK, vb0, vb1, x0, x1);
        if (VCNT > 0) {
          const vq_f2 s = *reinterpret_cast<const vq_f2*>(corr + tl * CD + c);
          x0 = (x0 + 0.f) + s.x;
          x1 = (x1 + 0.f) + s.y;
        }
        store_pair(values_bh + (size_t)t * DV + c, vq_o2{out_of(x0), out_of(x1)});
      }
    }
  }
"""


def kernel_source(sparse_blocks_from: str) -> str:
    """The kernel's source; `sparse_blocks_from`: the input whose dim 2 counts the blocks of
    the outlier arrays (koi, or voi when only values keep outliers; unused without any)."""
    declare = _SOURCE.replace("(n_blocks_cap)", f"{sparse_blocks_from}_shape[2]")
    return declare + _BODY


def _kernel(sparse_blocks_from: str):
    """The kernel, built once per kernel factory (keyed by mx.fast.cuda_kernel itself, as
    fused_prefill_affine._kernel: an emulated kernel is never served to the real factory)."""
    return _kernel_for(mx.fast.cuda_kernel, sparse_blocks_from)


@lru_cache(maxsize=None)
def _kernel_for(factory, sparse_blocks_from: str):
    return build_kernel(
        factory,
        name="vq_gear_prefill_kv",
        input_names=list(INPUTS),
        output_names=["keys", "values"],
        source=kernel_source(sparse_blocks_from),
        header=kernel_header.HEADER,
    )


# The most consecutive tiles a block takes (launch_plan): two halve the blocks' prologues and
# barriers per element and read 16 bytes of each key channel's codes per block instead of 8 at
# 2 bits. 1 is session 19's first split (for A/B runs).
TILES_PER_BLOCK = 2


def launch_plan(head_dim: int, value_dim: int, bits: int, sparse: bool, rank: int, group: int,
                block_tokens: int) -> tuple[int, bool]:
    """(tiles per block, values staged): the most tiles (up to TILES_PER_BLOCK, dividing the
    low-rank block) whose shared memory fits CUDA's static 48 KB with the block's value codes,
    scales and zero points staged beside the keys' words (one wait on global memory per block
    instead of a second one in the value loop); else one tile, values read per position (8-bit
    codes at head dim 256)."""
    for sub in range(TILES_PER_BLOCK, 0, -1):
        staged = (_base_shared_bytes(head_dim, value_dim, bits, sparse, rank, sub)
                  + _value_stage_bytes(value_dim, bits, group, sub))
        if block_tokens % (TILE * sub) == 0 and staged <= kernel_header.STATIC_SHARED_BYTES:
            return sub, True
    return 1, False


def shared_bytes(head_dim: int, value_dim: int, bits: int, sparse: bool, rank: int, group: int,
                 block_tokens: int) -> int:
    """The kernel's static shared memory as launch_plan lays it out: the block's key code words
    over head_dim + 2 channels (rounded to 16 bytes), its low-rank A rows of keys and values
    (floats) if kept, the float32 correction tile if kept, and its value codes, scales and zero
    points where staged (the placeholders otherwise are never read, and ptxas drops them)."""
    sub, staged = launch_plan(head_dim, value_dim, bits, sparse, rank, group, block_tokens)
    base = _base_shared_bytes(head_dim, value_dim, bits, sparse, rank, sub)
    return base + (_value_stage_bytes(value_dim, bits, group, sub) if staged else 0)


def _base_shared_bytes(head_dim, value_dim, bits, sparse, rank, sub=1) -> int:
    positions = TILE * sub
    code_words = -(-bits * sub * (head_dim + 2) // 4) * 4
    lowrank = 2 * positions * rank if rank else 0
    return 4 * (code_words + lowrank + (positions * max(head_dim, value_dim) if sparse else 0))


def _value_stage_bytes(value_dim, bits, group, sub=1) -> int:
    return 4 * TILE * sub * (value_dim * bits // 32 + 2 * (value_dim // group))


# Sparse pairs per thread and side held in registers from the tile's first loads; a block's
# pairs beyond SPP_MAX per thread are read as they are placed (fractions above ~3% at the 8B
# shape: the registers stay bounded).
SPP_MAX = 4


def sparse_per_thread(k_count: int, v_count: int, threads: int) -> int:
    """SPP: the register slots per thread and side for the block's sparse pairs (at least 1)."""
    return max(1, min(SPP_MAX, -(-max(k_count, v_count) // threads)))


def threads_per_block(head_dim: int, value_dim: int) -> int:
    """A block's threads: the wider side's channel pairs times the largest power of two of tile
    positions that keeps the block within MAX_THREADS (a thread keeps one channel pair for the
    whole tile: its side data and factor rows are loaded once per thread, not once per
    element; the narrower side leaves the threads past its whole rows idle)."""
    pairs = max(head_dim, value_dim) // 2
    rows = 1
    while pairs * rows * 2 <= MAX_THREADS and rows * 2 <= TILE:
        rows *= 2
    return pairs * rows


def supports(head_dim: int, value_dim: int, group: int, bits: int, block_tokens: int, sparse: bool,
             rank: int) -> bool:
    """The shapes the kernel handles; others take the portable path: the widths gear stores
    (2, 3, 4, 8), groups of whole 32-token tiles (a tile inside one key group), blocks of whole
    tiles, even head dims (a thread writes channel pairs) whose pairs fit in a block, value
    tokens of whole words, and the shared memory within CUDA's static 48 KB."""
    if bits not in SUPPORTED_BITS or group % TILE or block_tokens % TILE or block_tokens < TILE:
        return False
    if head_dim < 2 or head_dim % 2 or value_dim < 2 or value_dim % group or (value_dim * bits) % 32:
        return False
    if max(head_dim, value_dim) > 2 * MAX_THREADS:
        return False
    return _base_shared_bytes(head_dim, value_dim, bits, sparse, rank) <= kernel_header.STATIC_SHARED_BYTES


def prefill_step(cache, queries):
    """GEARCache's prefill K/V (everything cached, in the queries' dtype) from the kernel, or None
    where it is not active (off CUDA, switched off, a shape `supports` refuses, no history, a
    window in another dtype than the cache's): the cache then takes the portable path. Its
    inputs wait for the queries (the base's ordering step, as mx.depends: no host sync)."""
    if not fused_decode.kernels_enabled() or cache.n_compressed == 0:
        return None
    st = cache.store
    k_count = st["k_out_values"].shape[-1] if "k_out_values" in st else 0
    v_count = st["v_out_values"].shape[-1] if "v_out_values" in st else 0
    if not supports(cache.head_dim, cache.value_dim, cache.code_group, cache.code_bits, cache.block_tokens,
                    bool(k_count or v_count), cache.rank):
        return None
    if any(a is not None and a.dtype != cache.dtype for a in (cache.window_keys, cache.window_values)):
        return None  # the portable path's promotions: not worth a kernel variant
    B, H, D = cache.batch_size, cache.n_kv_heads, cache.head_dim
    side = cache.side_dtype
    absent_side, absent_index = fused_decode.absent_input(side), fused_decode.absent_input(mx.uint16)
    arrays = [st["k_codes"].reshape(B, H, D, -1), st["k_scales"], st["k_zeros"]]
    arrays += [st["k_lr_tokens"], st["k_lr_channels"]] if cache.rank else [absent_side, absent_side]
    arrays += [st["k_out_index"], st["k_out_values"]] if k_count else [absent_index, absent_side]
    arrays += [st["v_codes"], st["v_scales"], st["v_zeros"]]
    arrays += [st["v_lr_tokens"], st["v_lr_channels"]] if cache.rank else [absent_side, absent_side]
    arrays += [st["v_out_index"], st["v_out_values"]] if v_count else [absent_index, absent_side]
    arrays = cache._inputs_after_queries(arrays, queries)
    return gear_prefill_keys_values(
        arrays, cache.window_keys, cache.window_values, n=cache.n_compressed, group=cache.code_group,
        bits=cache.code_bits, rank=cache.rank, block_tokens=cache.block_tokens, k_count=k_count,
        v_count=v_count, cache_dtype=cache.dtype, out_dtype=queries.dtype,
    )


def gear_prefill_keys_values(arrays, window_keys, window_values, *, n: int, group: int, bits: int, rank: int,
                             block_tokens: int, k_count: int, v_count: int, cache_dtype, out_dtype):
    """The kernel's launch -> (keys (B, H, n + W, D), values (B, H, n + W, DV)) in out_dtype.
    `arrays`: prefill_step's 14 inputs (kc ... vov, absent ones as fused_decode.absent_input).
    Only call where supports(...) holds: prefill_step checks."""
    kc, ks = arrays[0], arrays[1]
    B, H, D, _ = kc.shape
    DV = arrays[7].shape[-1] * 32 // bits
    W = 0 if window_keys is None else window_keys.shape[2]
    if window_keys is None:
        window_keys = window_values = fused_decode.absent_input(cache_dtype)
    total = n + W
    sub, staged = launch_plan(D, DV, bits, bool(k_count or v_count), rank, group, block_tokens)
    blocks = -(-total // (TILE * sub))
    threads = threads_per_block(D, DV)
    meta = mx.array([n, W], dtype=mx.int32)
    sparse_from = "koi" if k_count else "voi"
    keys, values = _kernel(sparse_from)(
        inputs=[*arrays, window_keys, window_values, meta],
        template=[("D", D), ("DV", DV), ("G", group), ("KB", bits), ("RANK", rank), ("NB", block_tokens),
                  ("KCNT", k_count), ("VCNT", v_count), ("NT", threads),
                  ("SPP", sparse_per_thread(k_count, v_count, threads)),
                  ("SUB", sub), ("VSTAGE", int(staged)),
                  ("ST", ks.dtype), ("KIT", arrays[5].dtype), ("VIT", arrays[12].dtype), ("CT", cache_dtype),
                  ("WT", window_keys.dtype), ("OT", out_dtype)],
        grid=(threads * blocks, B * H, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, H, total, D), (B, H, total, DV)],
        output_dtypes=[out_dtype, out_dtype],
    )
    return keys, values
