"""One CUDA kernel that builds a KIVI-layout cache's whole K/V for a prefill chunk's attention.

Why: a prefill chunk's attention (base CompressedKVCache._attend_prefill) reads everything cached
as plain K/V, so per layer and chunk the portable path rebuilds the whole history: for KIVI
mx.dequantize of K^T, a swapaxes, a concatenation with the exact sink token, one with the exact
window and an astype (xquant: dequantize of the whole capacity, swapaxes, slice, astype,
concatenation); several kernel launches and full-history copies. On the H200 (8B-shaped llama,
8 layers, bf16, 32K prompt in 2048-token chunks, results/gpu_speed_h200_s4.json) kivi-2's
prefill took 1.46x the fp16 KVCache's time (0.59 s vs 0.41 s) and xquant's 1.72x, against a
target of <= 1.2x; one layer's probe (results/kernel_probe_h200.json, session 3) measured
0.54 ms for kivi's _full_keys_values at a 32K history against ~0.18 ms for its bare dequantize.
This kernel reads the codes, scales and zeros once and writes the (B, H, n + W, D) keys and
(B, H, n + W, DV) values in the queries' dtype directly, the exact sink tokens in place of
their placeholder columns and the exact window appended: one launch, nothing copied again.

Layout read (what KIVICache and XQuantCache store, MLX's mx.quantize stream, see kivi.pack_stream):
  keys   K^T per channel: codes kc (B, H, D, row_words) uint32, token t's code at bit KB * t of
         channel d's little-endian bit stream (a 3-bit code may straddle two words); scales and
         zeros ks / kz (B, H, D, row_groups), group t / G;
  values per token: codes vc (B, H, cap_v, DV * VB / 32), channel c's code at bit VB * c of
         token t's stream; scales and zeros vs / vz (B, H, cap_s, DV / G), group c / G.
  The rows may be longer than the history (growth slack; an xquant follower reads its leader's
  whole code arrays, whose capacity may exceed its own): only tokens [0, n) are read, the row
  lengths come from the arrays' shapes.
Exact tokens: the sink sk / sv (B, H, S, D / DV) replaces history columns [0, S) (KIVI's first
token; S = 0: none), the window wk / wv (B, H, W, D / DV) follows the history; both in the
cache's dtype.

Arithmetic (bit for bit the portable path's on MLX's CPU backend, tests check it): each element
is computed as mx.dequantize computes it in its dtype AT (the scales' dtype at the call: KIVI's
model dtype, to which it casts its fp16 / bf16 side data; XQuant's float16): p = AT(scale *
code), x = AT(p + zero), each step one rounding of the exact result (done in float32 and rounded
once to AT: float32 holds scale * code exactly, and float32 addition then rounding to a 16-bit
type equals the 16-bit addition, 24 >= 2 * 11 + 2 bits); then cast to the cache's dtype CT (the
portable _decode's astype; XQuant's float16 -> model dtype) and to the queries' dtype OT. MLX's
CUDA dequantize computes the same expression with cuda_fp16 / cuda_bf16 operators, which ptxas
may contract into one fma (one rounding instead of two); where it does, the two paths differ by
at most one rounding of the 16-bit product (the CUDA test reports the difference).

Work split: a block of 256 threads per (tile of TILE = 128 positions, batch x kv head); the grid
covers the n + W output positions; every thread handles pairs of neighbouring channels (even
head dims). Keys: the block first loads the tile's code words of every channel (4 * KB words
per channel: a tile starts on a word boundary at every width) and its scales and zeros into
shared memory, consecutive threads reading consecutive words of a channel's row, stored word
(group) major with rows of D + 2 channels; then it writes the tile's keys position by position,
consecutive threads on consecutive channel pairs: one 8-byte shared load gives a pair's two
code words (two more its scales and zeros), one store its two outputs (st.global.v2.u16 in
16-bit, checked in nvcc's PTX for sm_90: a warp stores 128 contiguous bytes). Values:
consecutive threads on consecutive channel pairs of a token read the pair's code word (both
codes in one word at 2, 4, 8 bits; each code may straddle at 3) and its group's scale and zero
(broadcasts within the warp), and store the pair. nvcc 13 for sm_90: 30-32 registers, no
spills, 8.3 KB of shared memory at head_dim 128 and 2 bits (35 KB at 256 and 8 bits).

What the next GPU session must measure (no GPU figure could be taken when this was written; no
speedup is claimed), each also with VELOXQUANT_CUDA_KERNELS=0 (fused_decode.kernels_enabled:
the portable path, for the A/B; it switches the decode kernels off too):
  pytest -m cuda tests/cache/test_fused_prefill_affine.py   (the kernel against MLX's dequantize)
  python -m veloxquant_mlx.bench.kernel_probe --parts prefill --methods kivi,xquant --out X.json
      (its history_keys_values: one layer's _prefill_keys_values at a 32K history, 0.54 ms for
      kivi on the portable path in session 3)
  python -m veloxquant_mlx.bench.gpu_speed --methods fp16,kivi,xquant --contexts 32768 --repeats 2 --out Y.json
      (the prefill ratios to fp16: 1.46x kivi, 1.72x xquant before; the target is <= 1.2x).
What it should do: one launch per layer and chunk instead of the portable path's several
(dequantize x 2, the swapaxes copy, the sink's and the window's concatenations, casts), the
K/V written once in the queries' dtype, and none of the portable path's full-history
intermediates (dequantized K^T, its swapped copy) held beside it. Not known until measured:
whether it reaches the copy bandwidth (wider stores, 8 or 16 bytes a thread, are the next step
if the probe shows it below), and how much of the prefill gap the K/V build was (the attention
and the chunk's encode are the rest).

The portable path (base CompressedKVCache._prefill_keys_values) stays the fallback: on the CPU
and Metal, with the kernels switched off, and for shapes `supports` refuses.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.errors import QuantizerConfigError

SUPPORTED_BITS = (2, 3, 4, 8)
TILE = 128  # output positions per block: a multiple of 32, so a tile starts on a word boundary
THREADS = 256

INPUTS = ("kc", "ks", "kz", "vc", "vs", "vz", "wk", "wv", "sk", "sv", "meta")

# Template constants: D, DV (key / value head dims), G (group), KB, VB (bits), AT (the
# dequantize's arithmetic dtype), CT (the cache's dtype), WT (the window's and the sink's
# dtype), OT (the output's: the queries' dtype). meta = [n (history tokens), W (window
# tokens), S (sink tokens)].
_SOURCE = r"""
  constexpr int TT = 128;                    // positions per block (TILE)
  constexpr int KW = TT * KB / 32;           // key code words per channel and tile
  constexpr int GT = TT >= G ? TT / G : 1;   // key groups per channel and tile
  constexpr int DP = D + 2;                  // shared row stride: even (pairs stay aligned),
                                             // != 0 mod 32 (staging stores spread over banks)
  constexpr int WV = DV * VB / 32;           // value code words per token
  constexpr int GV = DV / G;                 // value groups per token
  constexpr unsigned KMASK = (1u << KB) - 1u;
  constexpr unsigned VMASK = (1u << VB) - 1u;
  // A thread handles two neighbouring channels: one 8-byte shared load for both codes' words
  // and for both scales / zeros, one store of both outputs.
  struct __align__(8) vq_f2 { float x, y; };
  struct __align__(2 * sizeof(OT)) vq_o2 { OT x, y; };
  // Shared, word (group) major: [w][d] so that channels d, d + 1 are adjacent.
  __shared__ __align__(8) uint32_t kw_s[KW * DP];
  __shared__ __align__(8) float ks_s[GT * DP];
  __shared__ __align__(8) float kz_s[GT * DP];

  const int n = meta[0];
  const int n_window = meta[1];
  const int n_sink = meta[2];
  const int total = n + n_window;
  const int bh = blockIdx.y;
  const int t_start = blockIdx.x * TT;
  const int rows = min(t_start + TT, total) - t_start;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;

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
  const WT* sk_bh = sk + (size_t)bh * n_sink * D;
  const WT* sv_bh = sv + (size_t)bh * n_sink * DV;
  OT* keys_bh = keys + (size_t)bh * total * D;
  OT* values_bh = values + (size_t)bh * total * DV;

  // mx.dequantize's element in AT (two roundings: the product, then the sum), then the
  // portable path's casts to the cache's and the queries' dtypes.
  const auto dequant = [](float sc, float zp, unsigned code) {
    const float p = vq_f32(vq_cast<AT>(sc * (float)code));
    const float x = vq_f32(vq_cast<AT>(p + zp));
    return vq_cast_through<CT, OT>(x);
  };
  const auto side = [](ST s) { return vq_f32(vq_cast<AT>(vq_f32(s))); };
  const auto exact = [](const WT* p) { return vq_o2{vq_cast<OT>(vq_f32(p[0])), vq_cast<OT>(vq_f32(p[1]))}; };

  // ---- keys: the tile's code words, scales and zeros into shared memory ----
  if (t_start < n) {
    const int w0 = t_start * KB / 32;        // the tile's first word (t_start is a multiple of 32)
    // Consecutive threads read consecutive words of a channel's row (KW words per channel).
    for (int i = tid; i < D * KW; i += nthreads) {
      const int d = i / KW, w = i % KW;
      kw_s[w * DP + d] = w0 + w < row_words ? __ldg(kc_bh + (size_t)d * row_words + w0 + w) : 0u;
    }
    const int g0 = t_start / G;
    for (int i = tid; i < D * GT; i += nthreads) {
      const int d = i / GT, g = i % GT;
      const bool ok = g0 + g < row_groups;
      ks_s[g * DP + d] = ok ? side(ks_bh[(size_t)d * row_groups + g0 + g]) : 0.f;
      kz_s[g * DP + d] = ok ? side(kz_bh[(size_t)d * row_groups + g0 + g]) : 0.f;
    }
  }
  __syncthreads();

  // ---- keys out: consecutive threads write consecutive channel pairs of a position ----
  for (int i = tid; i < rows * (D / 2); i += nthreads) {
    const int tl = i / (D / 2), d = 2 * (i % (D / 2));
    const int t = t_start + tl;
    vq_o2 out;
    if (t < n_sink) {
      out = exact(sk_bh + (size_t)t * D + d);
    } else if (t < n) {
      unsigned c0, c1;
      vq_staged_key_pair<KB>(kw_s, DP, tl, d, c0, c1);
      const int g = tl / G;
      const vq_f2 sc = *reinterpret_cast<const vq_f2*>(ks_s + g * DP + d);
      const vq_f2 zp = *reinterpret_cast<const vq_f2*>(kz_s + g * DP + d);
      out = vq_o2{dequant(sc.x, zp.x, c0 & KMASK), dequant(sc.y, zp.y, c1 & KMASK)};
    } else {
      out = exact(wk_bh + (size_t)(t - n) * D + d);
    }
    *reinterpret_cast<vq_o2*>(keys_bh + (size_t)t * D + d) = out;
  }

  // ---- values out: consecutive threads on consecutive channel pairs of a token ----
  for (int i = tid; i < rows * (DV / 2); i += nthreads) {
    const int tl = i / (DV / 2), c = 2 * (i % (DV / 2));
    const int t = t_start + tl;
    vq_o2 out;
    if (t < n_sink) {
      out = exact(sv_bh + (size_t)t * DV + c);
    } else if (t < n) {
      const uint32_t* row = vc_bh + (size_t)t * WV;
      unsigned c0, c1;
      vq_code_pair<VB>(row, c, c0, c1);  // c even
      const size_t g = (size_t)t * GV + c / G;  // c and c + 1 share a group (G is even)
      const float sc = side(vs_bh[g]), zp = side(vz_bh[g]);
      out = vq_o2{dequant(sc, zp, c0 & VMASK), dequant(sc, zp, c1 & VMASK)};
    } else {
      out = exact(wv_bh + (size_t)(t - n) * DV + c);
    }
    *reinterpret_cast<vq_o2*>(values_bh + (size_t)t * DV + c) = out;
  }
"""


def _kernel():
    """The kernel, built once per kernel factory: keyed by mx.fast.cuda_kernel itself, so a
    kernel built while a test stands the CPU emulation in for it (tests/cache/cuda_emulation.py)
    is never served after the real factory is back, nor the other way round, whether or not
    the test empties this module's cache."""
    return _kernel_for(mx.fast.cuda_kernel)


@lru_cache(maxsize=None)
def _kernel_for(factory):
    return build_kernel(
        factory,
        name="vq_affine_prefill_kv",
        input_names=list(INPUTS),
        output_names=["keys", "values"],
        source=_SOURCE,
        header=kernel_header.HEADER,
    )


def shared_bytes(head_dim: int, group_size: int, key_bits: int) -> int:
    """The kernel's static shared memory: a tile's key code words, scales and zeros (floats),
    word (group) major over head_dim + 2 channels (DP)."""
    words = TILE * key_bits // 32
    groups = max(1, TILE // group_size)
    return 4 * (head_dim + 2) * (words + 2 * groups)


def supports(head_dim: int, value_dim: int, group_size: int, key_bits: int, value_bits: int) -> bool:
    """The shapes the kernel handles; others take the portable path: the widths MLX's affine
    layout packs (2, 3, 4, 8), groups of whole 32-token runs that tile TILE (or are tiled by
    it), value tokens of whole words, and the shared memory within CUDA's static 48 KB."""
    if key_bits not in SUPPORTED_BITS or value_bits not in SUPPORTED_BITS:
        return False
    if group_size % 32 or (TILE % group_size and group_size % TILE):
        return False
    if value_dim < 1 or value_dim % group_size or (value_dim * value_bits) % 32:
        return False
    if head_dim < 2 or head_dim % 2:  # a thread writes channel pairs
        return False
    return shared_bytes(head_dim, group_size, key_bits) <= kernel_header.STATIC_SHARED_BYTES


def prefill_step(cache, queries, arrays, *, group_size: int, key_bits: int, value_bits: int,
                 arith_dtype, sink=None):
    """A KIVI-layout cache's prefill K/V (everything cached, in the queries' dtype) from the
    kernel, or None where it is not active (off CUDA, switched off, a shape `supports` refuses,
    no history, dtypes that differ from the cache's): the cache then takes the portable path.
    Its inputs wait for the queries (the base's ordering step, as mx.depends: no host sync).
    `arrays()` gives (key codes, scales, zeros, value codes, scales, zeros), called only when
    the kernel runs; `arith_dtype`: the dtype mx.dequantize computes in on the portable path;
    `sink`: (keys, values) (B, H, S, D / DV) exact in place of history columns [0, S), or None."""
    if not fused_decode.kernels_enabled() or cache.n_compressed == 0:
        return None
    if not supports(cache.head_dim, cache.value_dim, group_size, key_bits, value_bits):
        return None
    exact = [a for a in (cache.window_keys, cache.window_values) if a is not None]
    if sink is not None:
        exact += list(sink)
    if any(a.dtype != cache.dtype for a in exact):
        return None  # the portable path's promotions: not worth a kernel variant
    return affine_prefill_keys_values(
        *cache._inputs_after_queries(arrays(), queries), cache.window_keys, cache.window_values, sink, n=cache.n_compressed,
        group_size=group_size, key_bits=key_bits, value_bits=value_bits,
        arith_dtype=arith_dtype, cache_dtype=cache.dtype, out_dtype=queries.dtype,
    )


def affine_prefill_keys_values(
    key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros, window_keys,
    window_values, sink, *, n: int, group_size: int, key_bits: int, value_bits: int,
    arith_dtype, cache_dtype, out_dtype,
):
    """The kernel's launch -> (keys (B, H, n + W, D), values (B, H, n + W, DV)) in out_dtype:
    history tokens [0, n) decoded from the arrays (those below the sink's S replaced by `sink`),
    then the window (None: W = 0). Only call where supports(...) holds: prefill_step checks."""
    B, H, D, _ = key_codes.shape
    DV = value_codes.shape[-1] * 32 // value_bits
    side = fused_decode.side_dtype(key_scales, key_zeros, value_scales, value_zeros, "fused prefill")
    if key_zeros.shape != key_scales.shape or value_zeros.shape != value_scales.shape:
        raise QuantizerConfigError(
            f"fused prefill: zeros {key_zeros.shape} / {value_zeros.shape} must have the scales' "
            f"shapes {key_scales.shape} / {value_scales.shape}"
        )
    rows_ok = (key_codes.shape[-1] * 32 // key_bits >= n and key_scales.shape[-1] * group_size >= n
               and value_codes.shape[2] >= n and value_scales.shape[2] >= n)
    if not rows_ok or n % group_size or n < 1:
        raise QuantizerConfigError(
            f"fused prefill: n={n} history tokens must be whole groups of {group_size}, >= 1, and "
            f"within the arrays (key codes {key_codes.shape}, key scales {key_scales.shape}, "
            f"value codes {value_codes.shape}, value scales {value_scales.shape})"
        )
    W = 0 if window_keys is None else window_keys.shape[2]
    exact_dtype = cache_dtype if window_keys is None else window_keys.dtype
    if window_keys is None:
        window_keys = window_values = fused_decode.absent_input(exact_dtype)
    S = 0
    if sink is None:
        sink_keys = sink_values = fused_decode.absent_input(exact_dtype)
    else:
        sink_keys, sink_values = sink
        S = sink_keys.shape[2]
        if (S < 1 or S > n or sink_keys.shape != (B, H, S, D) or sink_values.shape != (B, H, S, DV)
                or sink_keys.dtype != exact_dtype or sink_values.dtype != exact_dtype):
            raise QuantizerConfigError(
                f"fused prefill: sink {sink_keys.shape} / {sink_values.shape} ({sink_keys.dtype}); "
                f"allowed are (B, H, S, D) / (B, H, S, DV) = ({B}, {H}, S, {D}) / ({B}, {H}, S, "
                f"{DV}), 1 <= S <= n={n}, in the window's dtype {exact_dtype}"
            )
    total = n + W
    tiles = -(-total // TILE)
    meta = mx.array([n, W, S], dtype=mx.int32)
    keys, values = _kernel()(
        inputs=[key_codes, key_scales, key_zeros, value_codes, value_scales, value_zeros,
                window_keys, window_values, sink_keys, sink_values, meta],
        template=[("D", D), ("DV", DV), ("G", group_size), ("KB", key_bits), ("VB", value_bits),
                  ("ST", side), ("AT", arith_dtype), ("CT", cache_dtype), ("WT", exact_dtype),
                  ("OT", out_dtype)],
        grid=(THREADS * tiles, B * H, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, total, D), (B, H, total, DV)],
        output_dtypes=[out_dtype, out_dtype],
    )
    return keys, values
