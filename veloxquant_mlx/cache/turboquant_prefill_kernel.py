"""turboquant_rvq's prefill history built by one CUDA kernel: decode, unrotate, window, one launch.

Why. A prefill chunk's attention reads the layer's whole history decoded
(TurboQuantRVQCache._prefill_keys_values). The portable path builds it in 16 MiB float32 pieces
through a compiled decoder and evaluates each piece before the next (prefill_pieces.settle), plus
one evaluation of the queries first (base._order_after_queries): at a 32K prompt of 8 layers in
2048-token chunks (8 kv heads, d 128: 4096-token pieces) chunk c >= 1 makes ~ceil(c / 2) pieces
per part, so 15 + 2 * 64 = 143 host syncs per layer, ~1,150 in all, each draining the GPU queue. On the H200 (session 6,
8B-shaped llama, 8 layers, bf16, 32K prompt) turboquant_rvq's prefill took 2.43x the fp16
KVCache's time: ~0.5 s more, ~4 ms per layer and chunk, far above its arithmetic or bytes
(writing one layer's 32K-token bf16 K/V is ~134 MB, ~50 us at HBM speed). Here one launch per
layer and chunk writes the whole (B, H, n + W, D) keys and (B, H, n + W, DV) values in the
queries' dtype, the exact window appended: no piece, no float32 history, no concatenation, and
no host sync (its inputs wait for the queries through mx.depends, the base's
_inputs_after_queries, as kivi's fused_prefill_affine.py and kvquant_prefill_kernel.py do).

Layout read (TurboQuantRVQCache._store_layout; fused_decode_rotated.store_arrays hands the
arrays in this order: kc1, ks1, kz1, kc2, km2, vc1, vs1, vz1, vc2, vm2), per token of a part of
head dim N, all (B, H, capacity, ...) with growth slack past the n compressed tokens:
  stage 1, total bits 3 / 4: B1 = 2 / 3-bit uniform codes (B, H, cap, N * B1 / 32) uint32,
      mx.quantize's little-endian bit stream along the channels (a 3-bit code may straddle two
      words), fp16 scales and zeros (B, H, cap, N / G), G = min(64, N): y1 = scale * code + zero;
  stage 1, total bits 2: a sign plane: words (B, H, cap, N / 32), bit j of word w is channel
      32 w + j, fp16 magnitude a1 (B, H, cap, 1): y1 = 2 a1 * bit - a1;
  stage 2 (always): a sign plane with magnitude a2: y2 = 2 a2 * bit - a2;
  total bits 1: stage 2 only (stage-1 inputs are one-element dummies never read).
Also read: the rotation signs s (N,) float32, the key mean (B, H, 1, D), the sink deltas
(B, H, S, D / DV) (exact - decoded of the first S tokens; S = 0: none) and the exact window
(B, H, W, D / DV) in the cache's dtype.

What one warp computes per token t (one token per warp; lane i holds channels [E i, E i + E),
E = N / 32), for keys then values:
  t < n: y = y1 + y2 (float32); the Walsh-Hadamard transform over N channels, Sylvester order,
      as MLX's CPU hadamard_transform runs it (mlx/backend/cpu/hadamard.cpp): butterflies
      (a + b, a - b) over pairs h = 1, 2, 4, ..., N / 2 apart, in that order (h < E inside a
      lane, h >= E by __shfl_xor_sync between lanes), then * N^-1/2 (MLX multiplies in the last
      stage: the same single rounding); * s (exact: s = +-1); keys + mean; t < S: + delta;
  t >= n: the window's token;
  then cast to the cache's dtype and to the queries' dtype, as the portable path does
  (`_decode_range` casts to the cache dtype, `_prefill_keys_values` to the queries').
Every float operation is a __fadd_rn / __fmul_rn / __fmaf_rn, which nvrtc never contracts or
splits: the portable ops round each step, and a fused multiply-add stands only where its product
is exact (a 16-bit scale times a code < 8, 2a times a bit, +-1 times a butterfly's operand), so
its one rounding is the sum's the portable path rounds (session 18: one instruction for two).

Exactness. On MLX's CPU backend (the thread-level emulation, tests/cache/cuda_emulation.py) the
result is the portable path's bit for bit: the same operations in the same order, each rounded
once (tests/cache/test_turboquant_prefill_kernel.py, every width 1..4, key bits !=
value bits, with and without the sink, bf16 / fp16 / float32, head dims 64 and 128, batch 2).
On MLX's CUDA backend the portable path's own order may differ: mx.hadamard_transform's CUDA
kernel (or the Sylvester matmul where the backend has none, hadamard.fast_transform_available)
may sum in another order, and mx.dequantize's CUDA kernel may contract. The CUDA test compares
the kernel bit for bit against the portable path run on the CPU (the order this kernel copies)
and reports how many elements differ from the CUDA portable path (allowed: one unit in the last
place of the output dtype). Perhaps none: the stage values are fp16 side data times small codes
(few significant bits), so many of the transform's float32 sums are exact whatever their order
(the butterfly stages run in reverse order gave the same bytes in the emulated float32 d-64 test,
which is why that corruption is not among the test's); what rounds besides is the N^-1/2 scale
(d 128), the key mean and the sink correction, single operations in any order.

Work split: blocks of 256 threads, 8 warps, each warp TOKENS_PER_WARP consecutive tokens of one
(batch, kv head), one after the other (the signs times the scale and the key mean read once per
warp); the grid covers the n + W output positions. A lane reads its E codes (E * B1 bits: one
word, or two where they cross a boundary, read once for all E), its group's scale and zero (one
group per lane: E divides G), its E sign bits (inside one word: E divides 32), the token's
magnitudes (warp broadcasts), and stores its E
outputs as one vector (alignas(min(16, E * sizeof(OT)))): a warp writes the token's row of N
outputs contiguously. Per layer and chunk: one launch, the store read once, K/V written once in
the output dtype; no float32 array exists.

Session 6 wrote it untimed (53 registers at bf16 d 128 4 bits under nvcc 13 for sm_90). Session
18's Nsight Compute run on the H200 (one layer's 30K history + 2048 window, 188 us,
results/ncu_full_s18_turboquant_rvq.csv) found it issue-bound: 77% of issue slots, 150.9 M
instructions, 58% of its global-load sectors excess (each code read by its own load); hence the
tokens per warp, the codes' words read once and the fused multiply-adds: 87.4 M instructions
(105.1 M with one token per warp), turboquant_rvq's 32K prefill 1.18x fp16's against 1.21x with
one token per warp in one process (results/prefill_chunks_h200_s18_32k_tpw.json); 96 registers
at bf16 d 128 4 bits under nvrtc (nvcc 13: 80), no spills; capping them at 64 by launch bounds
gained nothing (results/prefill_chunks_h200_s18_32k_bounds.json). Session 6's aim: remove the
portable path's host syncs (one per 16 MiB piece plus the queries': ~9 per layer and chunk at 16K
history tokens, 8 kv heads, d 128) and the compiled decoder's launches per piece, leaving one
launch that reads the store once and writes the K/V once. The next GPU session must
run, each also with VELOXQUANT_CUDA_KERNELS=0 for the portable A/B (that switch turns off the
decode kernels too):
  python3 -m pytest -m cuda tests/cache/test_turboquant_prefill_kernel*.py
  python -m veloxquant_mlx.bench.gpu_speed --methods fp16,turboquant_rvq --contexts 32768 --repeats 3
and compare turboquant_rvq's prefill ratio to fp16 against session 6's 2.43x (target <= 1.2x);
`python -m veloxquant_mlx.bench.kernel_probe --parts prefill --methods fp16,turboquant_rvq` gives
one layer's 32K prefill and its history build alone (`history_keys_values`).

The portable path stays the fallback: on the CPU and Metal, with the kernels switched off
(VELOXQUANT_CUDA_KERNELS=0), and for shapes `supports` refuses.
"""

from __future__ import annotations

import struct
from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.fused_decode_rotated import store_arrays
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.errors import QuantizerConfigError

THREADS = 256  # 8 warps
# Consecutive tokens per warp. One token per warp (session 6's kernel) spent its instructions
# on per-token set-up (meta, the signs, the key mean, the addresses): Nsight Compute had it
# issue-bound (77% of issue slots, 150.9 M instructions for one layer's 30K-token history plus a
# 2048-token window on the H200, results/ncu_full_s18_turboquant_rvq.csv). 1 for an A/B
# (prefill_chunks --alternate turboquant_prefill_kernel.TOKENS_PER_WARP=1).
TOKENS_PER_WARP = 4
MIN_DIM, MAX_DIM = 32, 256  # a lane holds N / 32 channels: 1..8
SUPPORTED_BITS = (1, 2, 3, 4)
MAX_GROUP = 64  # TurboQuantRVQCache.max_group_size: G = min(64, N)
FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y: batch x kv heads

INPUTS = ("kc1", "ks1", "kz1", "kc2", "km2", "vc1", "vs1", "vz1", "vc2", "vm2",
          "ksg", "vsg", "kmean", "dk", "dv", "wk", "wv", "meta")

_HELPERS = r"""
#if !defined(__CUDACC__)
// Only for compilers without CUDA's intrinsics (the CPU emulation): plain float ops, which
// round each result once as __fmul_rn / __fadd_rn / __fmaf_rn do.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmaf_rn(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#endif

// One compressed token's vector of 32 * E channels read back in the rotated basis, y = y1 + y2;
// the lane holds channels [E lane, E lane + E). B1: stage-1 bits (0: none, 1: a sign plane,
// 2 / 3: uniform codes with a scale and zero per group of G channels). A sign plane reads as
// mx.dequantize reads its widened 0/1 codes with scale 2a and zero -a (sign_plane.sign_values):
// 2a * bit - a, each step rounded as there (the same zeros' signs too). Where a product is
// exact in float32 (2a * bit with bit 0 / 1; a 16-bit scale, <= 11 significant bits, times a
// code < 8) one fused multiply-add rounds once, as the product's exact value then the sum's
// rounding did: the same bits in one instruction.
template <int E, int B1, int G, typename ST>
__device__ __forceinline__ void vq_rvq_stages(float (&y)[E], int lane, size_t tok,
                                              const uint32_t* c1, const ST* s1, const ST* z1,
                                              const uint32_t* c2, const ST* m2) {
  constexpr int N = 32 * E;
  constexpr int WS = N / 32;  // sign words per token
  const int j0 = lane * E;
  const unsigned sw2 = __ldg(c2 + tok * WS + (j0 >> 5)) >> (j0 & 31);
  const float a2 = vq_f32(m2[tok]);
  const float two_a2 = 2.f * a2;
  float v1[E];
  if (B1 == 1) {
    const unsigned sw1 = __ldg(c1 + tok * WS + (j0 >> 5)) >> (j0 & 31);
    const float a1 = vq_f32(s1[tok]);
    #pragma unroll
    for (int e = 0; e < E; ++e) v1[e] = __fmaf_rn(2.f * a1, (float)((sw1 >> e) & 1u), -a1);
  } else if (B1 > 1) {
    constexpr int W1 = N * (B1 > 1 ? B1 : 1) / 32;  // stage-1 words per token
    constexpr unsigned MASK = (1u << (B1 > 1 ? B1 : 1)) - 1u;
    // A float32 scale times a code may round: there the product is rounded first, as the
    // portable path does.
    constexpr bool EXACT_PRODUCT = sizeof(ST) == 2;
    const uint32_t* row = c1 + tok * W1;
    const int bit0 = j0 * B1, sh0 = bit0 & 31;
    // The lane's E * B1 <= 24 bits: in the word holding the first, or across it and the next
    // (inside the row: the bits end within it). One or two loads for all E codes.
    unsigned long long bits = __ldg(row + (bit0 >> 5));
    if (sh0 + E * B1 > 32) bits |= (unsigned long long)__ldg(row + (bit0 >> 5) + 1) << 32;
    bits >>= sh0;
    const size_t g = tok * (N / G) + j0 / G;  // E divides G: one group per lane
    const float sc = vq_f32(s1[g]), zp = vq_f32(z1[g]);
    #pragma unroll
    for (int e = 0; e < E; ++e) {
      const float code = (float)((unsigned)(bits >> (e * B1)) & MASK);
      v1[e] = EXACT_PRODUCT ? __fmaf_rn(sc, code, zp) : __fadd_rn(__fmul_rn(sc, code), zp);
    }
  }
  #pragma unroll
  for (int e = 0; e < E; ++e) {
    const float v2 = __fmaf_rn(two_a2, (float)((sw2 >> e) & 1u), -a2);
    y[e] = B1 > 0 ? __fadd_rn(v1[e], v2) : v2;
  }
}

// x = s * (H y) * scale over the warp's 32 * E channels: the butterflies of MLX's CPU
// hadamard_transform in its order (pairs h = 1, 2, ..., N / 2 apart; h < E inside the lane,
// h >= E with the lane (lane ^ h / E)), each sum and difference rounded once, then the scale
// (MLX applies it in the last stage: the same rounding) and the signs. Across lanes the pair's
// first element takes y + other, its second other - y: both are other + (+-1) y, one fused
// multiply-add (the product by +-1 is exact; a sum is the same in either order). `scaled_signs`
// holds scale * s per channel of the lane: (y * scale) * s equals y * (scale * s) for s = +-1
// (rounding to nearest is symmetric).
template <int E>
__device__ __forceinline__ void vq_rvq_unrotate(float (&y)[E], int lane, const float (&scaled_signs)[E]) {
  #pragma unroll
  for (int h = 1; h < E; h <<= 1) {
    #pragma unroll
    for (int e = 0; e < E; ++e) {
      if (e & h) continue;
      const float a = y[e], b = y[e + h];
      y[e] = __fadd_rn(a, b);
      y[e + h] = __fadd_rn(a, -b);
    }
  }
  #pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
    const float own = (lane & m) ? -1.f : 1.f;  // -1: the lane holds the pair's second element
    #pragma unroll
    for (int e = 0; e < E; ++e) {
      const float other = __shfl_xor_sync(0xffffffffu, y[e], m);
      y[e] = __fmaf_rn(own, y[e], other);
    }
  }
  #pragma unroll
  for (int e = 0; e < E; ++e) y[e] = __fmul_rn(y[e], scaled_signs[e]);
}

// The lane's E outputs, one vector store (a warp writes the token's row contiguously).
template <typename T, int E>
struct alignas(sizeof(T) * E < 16 ? sizeof(T) * E : 16) vq_rvq_row { T v[E]; };
"""

# Template constants: D, DV (key / value head dims), KB1, VB1 (stage-1 bits: total - 1), KG, VG
# (stage-1 groups), ST (side data), MT (key mean), DT (sink deltas), WT (window), CT (cache), OT
# (output: the queries' dtype), TPW (consecutive tokens per warp). meta = [n (history tokens),
# W (window), S (sink tokens), capacity (store tokens per head), key scale and value scale
# (N^-1/2) as float bits].
_SOURCE = r"""
  constexpr int EK = D / 32, EV = DV / 32;
  const int n = meta[0], n_window = meta[1], n_sink = meta[2], cap = meta[3];
  const int total = n + n_window;
  const int lane = threadIdx.x & 31;
  // TPW consecutive tokens per warp: t is the same for the warp's 32 lanes, so every branch
  // below is warp-uniform and the shuffles see the whole warp.
  const int first = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * TPW;
  if (first >= total) return;
  const int bh = blockIdx.y;
  // Per lane and (batch, head), read once for the warp's tokens: the signs times the scale,
  // the key mean.
  const float key_scale = __int_as_float(meta[4]), value_scale = __int_as_float(meta[5]);
  float kss[EK], vss[EV], km[EK];
  #pragma unroll
  for (int e = 0; e < EK; ++e) {
    kss[e] = __fmul_rn(key_scale, ksg[lane * EK + e]);
    km[e] = vq_f32(kmean[(size_t)bh * D + lane * EK + e]);
  }
  #pragma unroll
  for (int e = 0; e < EV; ++e) vss[e] = __fmul_rn(value_scale, vsg[lane * EV + e]);
  // Not unrolled: four tokens' registers at once (96 per thread at bf16 d 128 4 bits, from 56
  // one at a time) would halve the blocks an SM holds.
  #pragma unroll 1
  for (int i = 0; i < TPW; ++i) {
    const int t = first + i;
    if (t >= total) return;
    vq_rvq_row<OT, EK>* key_out = reinterpret_cast<vq_rvq_row<OT, EK>*>(keys + ((size_t)bh * total + t) * D) + lane;
    vq_rvq_row<OT, EV>* value_out = reinterpret_cast<vq_rvq_row<OT, EV>*>(values + ((size_t)bh * total + t) * DV) + lane;
    vq_rvq_row<OT, EK> kr;
    vq_rvq_row<OT, EV> vr;
    if (t >= n) {  // the exact window, cast to the output dtype
      const WT* wkr = wk + ((size_t)bh * n_window + (t - n)) * D + lane * EK;
      const WT* wvr = wv + ((size_t)bh * n_window + (t - n)) * DV + lane * EV;
      #pragma unroll
      for (int e = 0; e < EK; ++e) kr.v[e] = vq_cast<OT>(vq_f32(wkr[e]));
      #pragma unroll
      for (int e = 0; e < EV; ++e) vr.v[e] = vq_cast<OT>(vq_f32(wvr[e]));
      *key_out = kr;
      *value_out = vr;
      continue;
    }
    const size_t tok = (size_t)bh * cap + t;
    float k[EK];
    vq_rvq_stages<EK, KB1, KG, ST>(k, lane, tok, kc1, ks1, kz1, kc2, km2);
    vq_rvq_unrotate<EK>(k, lane, kss);
    #pragma unroll
    for (int e = 0; e < EK; ++e) k[e] = __fadd_rn(k[e], km[e]);
    if (t < n_sink) {
      #pragma unroll
      for (int e = 0; e < EK; ++e) k[e] = __fadd_rn(k[e], vq_f32(dk[((size_t)bh * n_sink + t) * D + lane * EK + e]));
    }
    #pragma unroll
    for (int e = 0; e < EK; ++e) kr.v[e] = vq_cast_through<CT, OT>(k[e]);
    *key_out = kr;

    float v[EV];
    vq_rvq_stages<EV, VB1, VG, ST>(v, lane, tok, vc1, vs1, vz1, vc2, vm2);
    vq_rvq_unrotate<EV>(v, lane, vss);
    if (t < n_sink) {
      #pragma unroll
      for (int e = 0; e < EV; ++e) v[e] = __fadd_rn(v[e], vq_f32(dv[((size_t)bh * n_sink + t) * DV + lane * EV + e]));
    }
    #pragma unroll
    for (int e = 0; e < EV; ++e) vr.v[e] = vq_cast_through<CT, OT>(v[e]);
    *value_out = vr;
  }
"""


def _kernel():
    """The kernel, built once per kernel factory: keyed by mx.fast.cuda_kernel itself, so a
    kernel built while a test stands the CPU emulation in for it is never served after the real
    factory is back, nor the other way round."""
    return _kernel_for(mx.fast.cuda_kernel)


@lru_cache(maxsize=None)
def _kernel_for(factory):
    return build_kernel(
        factory,
        name="vq_rvq_prefill_kv",
        input_names=list(INPUTS),
        output_names=["keys", "values"],
        source=_SOURCE,
        header=kernel_header.HEADER + _HELPERS,
    )


def supports(head_dim: int, value_dim: int, key_bits: int, value_bits: int) -> bool:
    """The shapes the kernel takes; others take the portable path: head dims powers of two in
    32..256 (a lane holds N / 32 channels, which divide the 32 bits of a sign word and the
    stage-1 group min(64, N)), total bits 1..4 (turboquant_rvq's widths)."""
    for d in (head_dim, value_dim):
        if not isinstance(d, int) or d < MIN_DIM or d > MAX_DIM or d & (d - 1):
            return False
    return key_bits in SUPPORTED_BITS and value_bits in SUPPORTED_BITS


def prefill_step(cache, queries):
    """A TurboQuantRVQCache's prefill K/V (history decoded + exact window, in the queries'
    dtype) from the kernel, or None where it is not active (off CUDA, switched off, a shape
    `supports` refuses, no history, a window in another dtype than the cache's): the cache then
    takes its portable path. The store's inputs wait for the queries (the base's ordering step
    as mx.depends: no host sync)."""
    if not fused_decode.kernels_enabled() or cache.n_compressed == 0:
        return None
    if not supports(cache.head_dim, cache.value_dim, cache.key_bits, cache.value_bits):
        return None
    if cache.batch_size * cache.n_kv_heads > MAX_GRID_Y:
        return None  # one grid row per (batch, kv head): CUDA's grid limit
    if any(a is not None and a.dtype != cache.dtype for a in (cache.window_keys, cache.window_values)):
        return None  # the portable path's promotions: not worth a kernel variant
    stores = cache._inputs_after_queries(store_arrays(cache), queries)
    return rotated_prefill_keys_values(
        stores, cache._signs[0], cache._signs[1], cache.key_mean, cache.window_keys,
        cache.window_values, cache.sink_deltas, n=cache.n_compressed, key_bits=cache.key_bits,
        value_bits=cache.value_bits, cache_dtype=cache.dtype, out_dtype=queries.dtype,
    )


def _float_bits(x: float) -> int:
    """x rounded to float32 (as MLX's hadamard_transform takes its scale), as int32 bits."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def rotated_prefill_keys_values(stores, key_signs, value_signs, key_mean, window_keys, window_values,
                                sink_deltas, *, n: int, key_bits: int, value_bits: int, cache_dtype,
                                out_dtype):
    """The kernel's launch -> (keys (B, H, n + W, D), values (B, H, n + W, DV)) in out_dtype:
    compressed tokens [0, n) decoded (their first S corrected by `sink_deltas`, (keys, values)
    (B, H, S, D / DV), or None), then the window (None: W = 0).

    stores: (kc1, ks1, kz1, kc2, km2, vc1, vs1, vz1, vc2, vm2) as fused_decode_rotated.store_arrays
    gives them; key_signs / value_signs (D,) / (DV,) float32 +-1; key_mean (B, H, 1, D). Only
    call where supports(...) holds: prefill_step checks."""
    kc1, ks1, kz1, kc2, km2, vc1, vs1, vz1, vc2, vm2 = stores
    B, H, cap = kc2.shape[:3]
    D, DV = kc2.shape[3] * 32, vc2.shape[3] * 32
    if not supports(D, DV, key_bits, value_bits):
        raise QuantizerConfigError(
            f"rotated prefill kernel: head dims {D} / {DV} and bits {key_bits} / {value_bits}; "
            f"allowed are powers of two in {MIN_DIM}..{MAX_DIM} and bits {SUPPORTED_BITS}")
    planes = [a for a, bits in ((kc1, key_bits), (ks1, key_bits), (kz1, key_bits), (vc1, value_bits),
                                (vs1, value_bits), (vz1, value_bits)) if bits > 1 and a.size > 1]
    planes += [km2, vc2, vm2]
    if not 1 <= n <= cap or any(a.shape[:3] != (B, H, cap) for a in planes):
        raise QuantizerConfigError(
            f"rotated prefill kernel: n={n} history tokens must be >= 1 and within the store, whose "
            f"arrays must all be (B, H, capacity, ...) = ({B}, {H}, {cap}, ...); got "
            f"{[tuple(a.shape) for a in stores]}")
    side = ks1.dtype if key_bits > 1 else km2.dtype
    if {a.dtype for a in (ks1, kz1, km2, vs1, vz1, vm2)} != {side}:
        raise QuantizerConfigError(
            "rotated prefill kernel: scales, zeros and magnitudes must share one dtype, got "
            f"{[str(a.dtype) for a in (ks1, kz1, km2, vs1, vz1, vm2)]}")
    if key_mean.shape != (B, H, 1, D):
        raise QuantizerConfigError(
            f"rotated prefill kernel: key mean {key_mean.shape}; allowed is (B, H, 1, D) = ({B}, {H}, 1, {D})")
    W = 0 if window_keys is None else window_keys.shape[2]
    exact_dtype = cache_dtype if window_keys is None else window_keys.dtype
    if window_keys is None:
        window_keys = window_values = fused_decode.absent_input(exact_dtype)
    elif (window_keys.shape != (B, H, W, D) or window_values.shape != (B, H, W, DV)
          or window_values.dtype != exact_dtype):
        raise QuantizerConfigError(
            f"rotated prefill kernel: window {window_keys.shape} / {window_values.shape} "
            f"({window_keys.dtype} / {window_values.dtype}); allowed are (B, H, W, D) / (B, H, W, DV) "
            f"= ({B}, {H}, W, {D}) / ({B}, {H}, W, {DV}) in one dtype")
    S = 0
    if sink_deltas is None:
        dk = dv = fused_decode.absent_input(mx.float32)
    else:
        dk, dv = sink_deltas
        S = dk.shape[2]
        if S < 1 or S > n or dk.shape != (B, H, S, D) or dv.shape != (B, H, S, DV) or dk.dtype != dv.dtype:
            raise QuantizerConfigError(
                f"rotated prefill kernel: sink deltas {dk.shape} / {dv.shape} ({dk.dtype} / {dv.dtype}); "
                f"allowed are (B, H, S, D) / (B, H, S, DV) = ({B}, {H}, S, {D}) / ({B}, {H}, S, {DV}), "
                f"1 <= S <= n={n}, in one dtype")
    for label, dtype in (("cache", cache_dtype), ("output", out_dtype), ("window", exact_dtype),
                         ("key mean", key_mean.dtype), ("sink deltas", dk.dtype)):
        if dtype not in FLOAT_DTYPES:
            raise QuantizerConfigError(
                f"rotated prefill kernel: {label} dtype {dtype}; allowed are float16, bfloat16, float32")
    total = n + W
    meta = mx.array([n, W, S, cap, _float_bits(D**-0.5), _float_bits(DV**-0.5)], dtype=mx.int32)
    per_block = THREADS // 32 * TOKENS_PER_WARP
    blocks = -(-total // per_block)
    keys, values = _kernel()(
        inputs=[kc1, ks1, kz1, kc2, km2, vc1, vs1, vz1, vc2, vm2, key_signs.astype(mx.float32),
                value_signs.astype(mx.float32), key_mean, dk, dv, window_keys, window_values, meta],
        template=[("D", D), ("DV", DV), ("KB1", key_bits - 1), ("VB1", value_bits - 1),
                  ("KG", min(MAX_GROUP, D)), ("VG", min(MAX_GROUP, DV)), ("ST", side),
                  ("MT", key_mean.dtype), ("DT", dk.dtype), ("WT", exact_dtype), ("CT", cache_dtype),
                  ("OT", out_dtype), ("TPW", TOKENS_PER_WARP)],
        grid=(THREADS * blocks, B * H, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, total, D), (B, H, total, DV)],
        output_dtypes=[out_dtype, out_dtype],
    )
    return keys, values
