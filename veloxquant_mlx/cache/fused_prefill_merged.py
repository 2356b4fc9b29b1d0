"""One CUDA kernel that builds a MiniCache paired layer's whole K/V for a prefill chunk's attention.

Why: on the H200 (session 6: 8B-shaped llama, 8 layers, bf16, 32K prompt in 2048-token chunks)
minicache prefilled at 1.41x the fp16 cache's time against a target of <= 1.2x. A prefill chunk's
attention (base CompressedKVCache._attend_prefill) reads everything cached as plain K/V, and a
paired layer built it on the portable path: first a host sync (base `_order_after_queries`:
mx.eval of the queries and the window, which drains the GPU queue once per paired layer and
chunk), then MiniCacheCache._decode for keys and values: the magnitudes times the merged
directions in float32, a zero column appended, the retained slots' positions masked and
broadcast, put_along_axis of the retained vectors, the slice, the casts, then the window's
concatenation and the cast to the queries' dtype: about a dozen MLX ops and several
full-history float32 intermediates per K and V (tests/cache/bench_pair_prefill.py counts them).
This kernel reads the directions, magnitudes and retained slots once and writes the
(B, H, n + W, D) keys and (B, H, n + W, DV) values in the queries' dtype directly, the retained
tokens' exact vectors in place and the exact window appended: one launch, no sync (its inputs
wait for the queries through mx.depends, base `_inputs_after_queries`, as the KIVI-layout
prefill kernel's do).

Layout read (minicache.py's store; MiniCache, Liu et al., NeurIPS 2024, arXiv 2405.14366):
  dk, dv  the pair's merged unit directions (B, H, cap_pair, D / DV) float16, held by the lower
          layer (the upper layer passes its partner's arrays); with `minicache_bits` DB their
          per-token codes (B, H, cap_pair, D * DB / 32) uint32 (mx.quantize's layout, groups of 32
          channels) and float16 scales / biases dks, dkb, dvs, dvb (B, H, cap_pair, D / 32);
  mk, mv  this layer's magnitudes (B, H, cap) float16;
  rk, rv  retained exact vectors (B, H, cap / 32 * S, D / DV) in the cache's dtype, pk, pv their
          absolute positions (B, H, cap / 32 * S) int32, -1 for an unused slot; the S slots of
          block b (tokens [32 b, 32 b + 32)) are entries [b S, b S + S) and hold positions inside
          that block (minicache._retained_positions), so a tile of whole blocks finds its
          retained tokens among its own slots;
  wk, wv  the exact window (B, H, W, D / DV) in the cache's dtype.
Rows may be longer than the history (growth slack; an upper layer reads its partner's arrays):
only tokens [0, n) are read, row lengths come from the arrays' shapes.

Arithmetic (bit for bit the portable path's on MLX's CPU backend, tests check it under the
emulation): direction element e = float(fp16 direction), or with DB the dequantized code as
mx.dequantize computes it in float16 (p = half(scale * code), e = half(p + bias)); x = mag * e in
float32 (exact: two 11-bit significands); a retained token's x is its exact vector; then the
portable path's casts, to the cache's dtype CT and to the queries' dtype OT. The window's tokens
are copies with the cast to OT.

Work split: a block of 256 threads per (tile of 64 positions, batch x kv head); the grid covers
the n + W output positions. The block first marks in shared memory which of its positions are
retained (per position: the slot index or -1, keys and values separately), then writes keys and
values position by position, consecutive threads on consecutive channel pairs (a warp reads 128
contiguous bytes of fp16 directions and stores 128 bytes of bf16 output).

What the next GPU session must measure (no GPU figure could be taken when this was written; no
speedup is claimed), each also with VELOXQUANT_CUDA_KERNELS=0 (the portable path for the A/B):
  pytest -m cuda tests/cache/test_minicache_prefill_kernel.py
  python -m veloxquant_mlx.bench.gpu_speed --methods fp16,xquant,minicache --contexts 32768 --repeats 3
      (minicache's prefill: 1.41x fp16 before; the target is <= 1.2x).
What it should do: one launch per paired layer and chunk instead of the portable path's dozen,
none of its float32 full-history intermediates, and no host sync (the sync per paired layer and
chunk stopped the CPU from queueing the next layers' work while the GPU ran).

The portable path (MiniCacheCache._decode + the base's concatenation) stays the fallback: on the
CPU and Metal, with the kernels switched off, and for shapes `supports` refuses.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.errors import QuantizerConfigError

TILE = 64  # output positions per block: whole MiniCache blocks of 32
THREADS = 256
DIRECTION_BITS = (2, 4, 8)  # codes of a channel pair never straddle a 32-bit word
MAX_SLOTS = 16  # minicache_retain_slots allows 0..16

INPUTS = ("dk", "dv", "dks", "dkb", "dvs", "dvb", "mk", "mv", "rk", "rv", "pk", "pv", "wk", "wv", "meta")

_HEADER = kernel_header.HEADER + r"""
// A direction row's channels c, c + 1 (c even) as floats: fp16 directions (DB = 0) or codes of
// DB bits dequantized as mx.dequantize does in float16 (the product, then the sum, each rounded
// to float16). Only the specialization a launch uses is instantiated (DT is uint32_t for codes).
template <int DB, typename DT, typename ST>
struct vq_direction_pair {
  __device__ static void get(const DT* row, const ST* scales, const ST* biases, int c, float& a, float& b) {
    const int bit = c * DB;  // c even: both codes in one word (2 * DB divides 32)
    const unsigned word = row[bit >> 5] >> (bit & 31);
    const float sc = vq_f32(scales[c / 32]), zp = vq_f32(biases[c / 32]);
    const unsigned mask = (1u << DB) - 1u;
    a = vq_f32(vq_cast<__half>(vq_f32(vq_cast<__half>(sc * (float)(word & mask))) + zp));
    b = vq_f32(vq_cast<__half>(vq_f32(vq_cast<__half>(sc * (float)((word >> DB) & mask))) + zp));
  }
};
template <typename DT, typename ST>
struct vq_direction_pair<0, DT, ST> {
  __device__ static void get(const DT* row, const ST*, const ST*, int c, float& a, float& b) {
    a = vq_f32(row[c]);
    b = vq_f32(row[c + 1]);
  }
};
"""

# Template constants: D, DV (key / value head dims), S (retained slots per 32 tokens; 0: rk..pv
# are unused dummies), DB (direction bits, 0 = fp16 directions), CT (the cache's dtype: the
# retained vectors' and the window's), OT (the output's: the queries' dtype). meta = [n (history
# tokens, a multiple of 32), W (window tokens)].
_SOURCE = r"""
  constexpr int TT = 64;                     // positions per block (TILE)
  constexpr int KROW = DB > 0 ? D * DB / 32 : D;    // direction row elements (codes or fp16)
  constexpr int VROW = DB > 0 ? DV * DB / 32 : DV;
  struct __align__(2 * sizeof(OT)) vq_o2 { OT x, y; };
  __shared__ int slot_k[TT];
  __shared__ int slot_v[TT];

  const int n = meta[0];
  const int n_window = meta[1];
  const int total = n + n_window;
  const int bh = blockIdx.y;
  const int t_start = blockIdx.x * TT;
  const int rows = min(t_start + TT, total) - t_start;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;

  const int cap_dir = dk_shape[2];
  const int cap_side = DB > 0 ? dks_shape[2] : 0;  // absent (1-element) side data at DB = 0
  const int cap_mag = mk_shape[2];
  const int n_slots = S > 0 ? pk_shape[2] : 0;
  const DT* dk_bh = dk + (size_t)bh * cap_dir * KROW;
  const DT* dv_bh = dv + (size_t)bh * cap_dir * VROW;
  const ST* dks_bh = DB > 0 ? dks + (size_t)bh * cap_side * (D / 32) : dks;
  const ST* dkb_bh = DB > 0 ? dkb + (size_t)bh * cap_side * (D / 32) : dkb;
  const ST* dvs_bh = DB > 0 ? dvs + (size_t)bh * cap_side * (DV / 32) : dvs;
  const ST* dvb_bh = DB > 0 ? dvb + (size_t)bh * cap_side * (DV / 32) : dvb;
  const MT* mk_bh = mk + (size_t)bh * cap_mag;
  const MT* mv_bh = mv + (size_t)bh * cap_mag;
  const CT* rk_bh = rk + (size_t)bh * n_slots * D;
  const CT* rv_bh = rv + (size_t)bh * n_slots * DV;
  const int* pk_bh = pk + (size_t)bh * n_slots;
  const int* pv_bh = pv + (size_t)bh * n_slots;
  const CT* wk_bh = wk + (size_t)bh * n_window * D;
  const CT* wv_bh = wv + (size_t)bh * n_window * DV;
  OT* keys_bh = keys + (size_t)bh * total * D;
  OT* values_bh = values + (size_t)bh * total * DV;

  // ---- which of the tile's history positions are retained (their slot), keys and values ----
  for (int i = tid; i < TT; i += nthreads) {
    slot_k[i] = -1;
    slot_v[i] = -1;
  }
  __syncthreads();
  if (S > 0) {
    // The tile's blocks of 32 that lie in the history; each block's S slots hold positions
    // inside it or -1 (unused).
    const int first_block = t_start / 32;
    const int blocks = max(0, min(TT, n - t_start) / 32);
    for (int i = tid; i < blocks * S; i += nthreads) {
      const int j = first_block * S + i;
      const int block_start = (first_block + i / S) * 32;
      const int pk_j = pk_bh[j], pv_j = pv_bh[j];
      if (pk_j >= block_start && pk_j < block_start + 32) slot_k[pk_j - t_start] = j;
      if (pv_j >= block_start && pv_j < block_start + 32) slot_v[pv_j - t_start] = j;
    }
  }
  __syncthreads();

  const auto out_pair = [](float a, float b) {
    return vq_o2{vq_cast_through<CT, OT>(a), vq_cast_through<CT, OT>(b)};
  };
  const auto exact = [](const CT* p) { return vq_o2{vq_cast<OT>(vq_f32(p[0])), vq_cast<OT>(vq_f32(p[1]))}; };

  // ---- keys: consecutive threads on consecutive channel pairs of a position ----
  for (int i = tid; i < rows * (D / 2); i += nthreads) {
    const int tl = i / (D / 2), c = 2 * (i % (D / 2));
    const int t = t_start + tl;
    vq_o2 out;
    if (t >= n) {
      out = exact(wk_bh + (size_t)(t - n) * D + c);
    } else if (slot_k[tl] >= 0) {
      out = exact(rk_bh + (size_t)slot_k[tl] * D + c);
    } else {
      float a, b;
      vq_direction_pair<DB, DT, ST>::get(dk_bh + (size_t)t * KROW, dks_bh + (size_t)t * (D / 32),
                                         dkb_bh + (size_t)t * (D / 32), c, a, b);
      const float m = vq_f32(mk_bh[t]);
      out = out_pair(m * a, m * b);
    }
    *reinterpret_cast<vq_o2*>(keys_bh + (size_t)t * D + c) = out;
  }

  // ---- values: the same over DV ----
  for (int i = tid; i < rows * (DV / 2); i += nthreads) {
    const int tl = i / (DV / 2), c = 2 * (i % (DV / 2));
    const int t = t_start + tl;
    vq_o2 out;
    if (t >= n) {
      out = exact(wv_bh + (size_t)(t - n) * DV + c);
    } else if (slot_v[tl] >= 0) {
      out = exact(rv_bh + (size_t)slot_v[tl] * DV + c);
    } else {
      float a, b;
      vq_direction_pair<DB, DT, ST>::get(dv_bh + (size_t)t * VROW, dvs_bh + (size_t)t * (DV / 32),
                                         dvb_bh + (size_t)t * (DV / 32), c, a, b);
      const float m = vq_f32(mv_bh[t]);
      out = out_pair(m * a, m * b);
    }
    *reinterpret_cast<vq_o2*>(values_bh + (size_t)t * DV + c) = out;
  }
"""


def _kernel():
    """The kernel, built once per kernel factory (keyed by mx.fast.cuda_kernel itself, so an
    emulated kernel is never served after the real factory is back, nor the other way round)."""
    return _kernel_for(mx.fast.cuda_kernel)


@lru_cache(maxsize=None)
def _kernel_for(factory):
    return build_kernel(
        factory,
        name="vq_merged_prefill_kv",
        input_names=list(INPUTS),
        output_names=["keys", "values"],
        source=_SOURCE,
        header=_HEADER,
    )


def supports(head_dim: int, value_dim: int, slots: int, direction_bits) -> bool:
    """The shapes the kernel takes; others take the portable path: fp16 directions or codes of
    DIRECTION_BITS bits (3-bit codes straddle words), even head dims (a thread writes channel
    pairs; multiples of 32 with codes: their groups), 0..MAX_SLOTS slots per 32 tokens."""
    if direction_bits is not None and direction_bits not in DIRECTION_BITS:
        return False
    if head_dim < 2 or head_dim % 2 or value_dim < 2 or value_dim % 2:
        return False
    if direction_bits is not None and (head_dim % 32 or value_dim % 32):
        return False
    return 0 <= slots <= MAX_SLOTS


def prefill_step(cache, queries):
    """A paired MiniCacheCache layer's prefill K/V (everything cached, in the queries' dtype) from
    the kernel, or None where it is not active (off CUDA, switched off, a plain layer, no history,
    a shape `supports` refuses, a window in another dtype than the cache's, a partner whose
    directions no longer cover the history): the cache then takes the portable path. The
    kernel's inputs wait for the queries (base `_inputs_after_queries`: no host sync)."""
    if cache.role == "plain" or cache.n_compressed == 0 or not fused_decode.kernels_enabled():
        return None
    if not supports(cache.head_dim, cache.value_dim, cache.slots, cache.dir_bits):
        return None
    if cache.window_keys is not None and cache.window_keys.dtype != cache.dtype:
        return None  # the portable path's promotion: not worth a kernel variant
    source = cache._direction_store()
    if source["dir_k"].shape[2] < cache.n_compressed:
        return None  # a trimmed partner no longer holds these positions' directions
    names = ["dir_k", "dir_v"]
    if cache.dir_bits is not None:
        names += ["dirscale_k", "dirbias_k", "dirscale_v", "dirbias_v"]
    arrays = [source[name] for name in names]
    s = cache.store
    arrays += [s["mag_k"], s["mag_v"]]
    if cache.slots:
        arrays += [s["ret_k"], s["ret_v"], s["retpos_k"], s["retpos_v"]]
    arrays = cache._inputs_after_queries(arrays, queries)
    directions, arrays = arrays[: len(names)], arrays[len(names):]
    side = None if cache.dir_bits is None else tuple(directions[2:])
    magnitudes, retained = arrays[:2], (tuple(arrays[2:]) if cache.slots else None)
    return merged_prefill_keys_values(
        directions[0], directions[1], side, magnitudes[0], magnitudes[1], retained,
        cache.window_keys, cache.window_values, n=cache.n_compressed, slots=cache.slots,
        direction_bits=cache.dir_bits, cache_dtype=cache.dtype, out_dtype=queries.dtype,
    )


def merged_prefill_keys_values(
    dir_k, dir_v, direction_side, mag_k, mag_v, retained, window_keys, window_values, *, n: int,
    slots: int, direction_bits, cache_dtype, out_dtype,
):
    """The kernel's launch -> (keys (B, H, n + W, D), values (B, H, n + W, DV)) in out_dtype:
    history tokens [0, n) as mag x direction (retained tokens exact), then the window (None:
    W = 0). direction_side: (key scales, key biases, value scales, value biases) with
    direction_bits, else None; retained: (ret_k, ret_v, retpos_k, retpos_v), None for 0 slots.
    Only call where supports(...) holds: prefill_step checks."""
    B, H = mag_k.shape[:2]
    if direction_bits is None:
        D, DV = dir_k.shape[-1], dir_v.shape[-1]
    else:
        D, DV = dir_k.shape[-1] * 32 // direction_bits, dir_v.shape[-1] * 32 // direction_bits
    if n % 32 or not 0 < n <= min(dir_k.shape[2], mag_k.shape[2]):
        raise QuantizerConfigError(
            f"merged fused prefill: n={n} with directions of {dir_k.shape[2]} and magnitudes of "
            f"{mag_k.shape[2]} tokens; allowed is a positive multiple of 32 within both"
        )
    if (retained is None) != (slots == 0) or (direction_side is None) != (direction_bits is None):
        raise QuantizerConfigError(
            f"merged fused prefill: slots={slots} with retained arrays "
            f"{'missing' if retained is None else 'given'}, direction_bits={direction_bits} with "
            f"scales {'missing' if direction_side is None else 'given'}; allowed is retained "
            "arrays exactly when slots > 0 and scales exactly when direction_bits is set"
        )
    absent = fused_decode.absent_input
    if retained is None:
        retained = (absent(cache_dtype), absent(cache_dtype), absent(mx.int32), absent(mx.int32))
    elif retained[2].shape[2] * 32 < n * slots:
        raise QuantizerConfigError(
            f"merged fused prefill: {retained[2].shape[2]} retained slots do not cover n={n} "
            f"tokens at {slots} slots per 32"
        )
    if direction_side is None:
        direction_side = (absent(mx.float16),) * 4
    W = 0 if window_keys is None else window_keys.shape[2]
    if window_keys is None:
        window_keys = window_values = absent(cache_dtype)
    total = n + W
    meta = mx.array([n, W], dtype=mx.int32)
    keys, values = _kernel()(
        inputs=[dir_k, dir_v, *direction_side, mag_k, mag_v, *retained, window_keys, window_values, meta],
        template=[("D", D), ("DV", DV), ("S", slots), ("DB", direction_bits or 0),
                  ("DT", dir_k.dtype), ("ST", direction_side[0].dtype), ("MT", mag_k.dtype),
                  ("CT", cache_dtype), ("OT", out_dtype)],
        grid=(THREADS * (-(-total // TILE)), B * H, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, total, D), (B, H, total, DV)],
        output_dtypes=[out_dtype, out_dtype],
    )
    return keys, values
