"""CUDA kernels that encode a block of XQuant's K/V at prefill: a leader's codes and calibrated
scales / zeros, and a follower's least-squares scales / zeros over its leader's codes.

Why: on the H200 (session 6: 8B-shaped llama, 8 layers, bf16, 32K prompt in 2048-token chunks)
xquant prefilled at 1.43x the fp16 cache's time, kivi at 1.19x, although both build the prefill
K/V with the same kernel (cache/fused_prefill_affine.py). What a chunk of theirs does beyond
kivi's is the encode of the 2048 tokens that leave the window (counted by
tests/cache/bench_pair_prefill.py with the CUDA kernels emulated, the H200's path; primitives
~ kernel launches per layer and chunk): kivi's leader-like layer 47 with one encode kernel,
xquant's leader 73 (its mx.compile'd quantize_groups: min and max reductions, the fused
elementwise code computation, the bit-stream packing through an arange, a shift and a sum, for
K^T and V each, and the K^T transpose copy), its follower 142 on the CPU, ~80 on CUDA (where
mx.dequantize is one kernel): the leader's codes unpacked by two mx.dequantize calls against
freshly allocated ones / zeros, then the compiled fit_to_codes, whose four means are four
reductions each for K and V). Here each layer's encode is ONE launch that reads the block
(B, H, T, D) in the model dtype once (and the follower its leader's packed codes) and writes the
arrays of XQuantCache._store_layout directly.

Layout written (exactly xquant.quantize_groups / fit_to_codes' output, MLX's bit stream):
  leader  k_codes (B, H, D, T / G, G * B / 32) uint32 (K^T per channel, groups of G tokens: the
          token's code at bit B * t of the channel's little-endian stream; 3-bit codes straddle
          words), k_scale / k_zero (B, H, D, T / G) float16; v_codes (B, H, T, DV * B / 32)
          (per token, groups of G channels), v_scale / v_zero (B, H, T, DV / G) float16;
  follower  k_scale, k_zero, v_scale, v_zero as above, fitted to the leader's codes of the same
          positions (read from the leader's store at token offset `start`).

Arithmetic (bit for bit the portable compiled path's on MLX's CPU backend; tests check it
under the CPU emulation): every float operation of the portable expression, in its order, each
an IEEE operation with one rounding. The intrinsics __fadd_rn / __fsub_rn / __fmul_rn /
__fdiv_rn keep nvcc / nvrtc from contracting a product and a sum into one fma and from an
approximate division, whatever the flags.
  leader (quantize_groups, XQuant's data-free calibration with eta): lo, hi the group's exact
    minimum and maximum (a serial scan); scale = max((hi - lo) / levels, 1e-8); codes
    clip(rint((x - lo) / scale), 0, levels); stored scale (1 - 2 eta) * scale and zero
    lo + (eta * scale) * levels, rounded to float16 (eta and 1 - 2 eta as the float32 constants
    the portable path's scalars become);
  follower (fit_to_codes): means as sequential float32 sums (MLX's CPU reduction sums a
    contiguous axis in order, measured) times 1 / G (exact: G is a power of two, as mean's
    division); var = mean((c - c_mean)^2), cov = mean((c - c_mean)(x - x_mean)),
    scale = var > 0 ? cov / max(var, 1e-12) : 0, zero = x_mean - scale * c_mean, both to float16.
On the GPU the portable path's reductions run in MLX's CUDA order (a tree), so there the two
differ by float rounding of the follower's sums (the @cuda_test measures it); the leader's
min / max are exact in any order.

Work split (as fused_encode_affine's kernel): a block of 128 threads per (group of G tokens,
batch x kv head). Keys: a thread per channel walks its G tokens (a warp reads 32 neighbouring
channels of a token row); the leader's finished code words go through shared memory (word
major, rows of D + 1 words) and leave with consecutive threads on consecutive words. Values: a
thread per (token, group of G channels). The follower reads its leader's code words of the
same group (keys: the channel's KW words; values: the group's words of the token row).

What the next GPU session must measure (no GPU figure could be taken when this was written; no
speedup is claimed), each also with VELOXQUANT_CUDA_KERNELS=0 (the portable path, for the A/B):
  pytest -m cuda tests/cache/test_xquant_prefill_kernel.py
  python -m veloxquant_mlx.bench.gpu_speed --methods fp16,xquant,minicache --contexts 32768 --repeats 3
      (xquant's prefill: 1.43x fp16 before, kivi's 1.19x; the target is <= 1.2x).
What it should do: one launch per layer and chunk for the encode instead of ~25 (leader) and
~35 (follower) MLX ops, no K^T transpose copy, no float32 copies of the block.

The portable path (quantize_groups_fused / fit_to_codes_fused) stays the fallback: on the CPU
and Metal, with the kernels switched off, and for shapes `supports` refuses.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.errors import QuantizerConfigError

SUPPORTED_BITS = (2, 3, 4)
THREADS = 128
INPUT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)

# The kernels' switch (CUDA and VELOXQUANT_CUDA_KERNELS), bound when this module is imported,
# as fused_encode_affine's: tests/cache/cuda_emulation.emulated_kernels() stands `lambda: True`
# in for fused_decode.kernels_enabled so that the attention kernels run emulated, and the
# emulated attention tests count the kernels their steps launch: they keep the portable encoder.
# This module's tests switch it on explicitly (monkeypatching this name).
_kernels_enabled = fused_decode.kernels_enabled

LEADER_OUTPUTS = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")
FOLLOWER_OUTPUTS = ("k_scale", "k_zero", "v_scale", "v_zero")

# Where the source is compiled as plain C++ (the CPU emulation, tests/cache/cuda_emulation.py,
# whose shim has none of these intrinsics) they are what they compute: IEEE operations with
# round to nearest (g++ without fast math, and without -mfma does not contract).
_HEADER = kernel_header.HEADER + r"""
#ifndef __CUDACC__
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline __half __float2half_rn(float x) { return __float2half(x); }
#endif
// A group's exact minimum and maximum, its G elements `stride` apart, in order (a serial scan
// keeps the first of -0.0 / +0.0 as MLX's CPU reduction does).
template <int G, typename IT>
__device__ __forceinline__ void vq_xq_range(const IT* x, size_t stride, float& lo, float& hi) {
  lo = vq_f32(x[0]);
  hi = lo;
  #pragma unroll 8
  for (int j = 1; j < G; ++j) {
    const float v = vq_f32(x[(size_t)j * stride]);
    lo = v < lo ? v : lo;
    hi = v > hi ? v : hi;
  }
}
// A code of `bits` bits at stream bit `bit` of a row of words (it may straddle two words).
template <int B>
__device__ __forceinline__ unsigned vq_xq_code(const uint32_t* row, int bit) {
  unsigned c = row[bit >> 5] >> (bit & 31);
  if (32 % B != 0 && (bit & 31) + B > 32) c |= row[(bit >> 5) + 1] << (32 - (bit & 31));
  return c & ((1u << B) - 1u);
}
"""

# Leader. Template constants: D, DV, G, B (bits), IT (the block's dtype). calib = [1 - 2 eta,
# eta] as float32. The block length T comes from the keys' shape.
_LEADER = r"""
  constexpr int KW = G * B / 32;             // key code words per channel and group
  constexpr int VW = G * B / 32;             // value code words per group of channels
  constexpr int GV = DV / G;                 // value groups per token
  constexpr int WV = DV * B / 32;            // value code words per token
  constexpr int DP = D + 1;                  // shared row stride (see fused_encode_affine)
  constexpr float LEVELS = (float)((1 << B) - 1);
  __shared__ uint32_t kw_s[KW * DP];

  const int T = keys_shape[2];
  const int n_groups = T / G;
  const int g = blockIdx.x;
  const int bh = blockIdx.y;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const size_t t0 = (size_t)g * G;
  const float shrink = calib[0];
  const float eta = calib[1];

  // quantize_groups: the codes against the exact minimum and scale, the stored pair calibrated.
  struct vq_group { float lo, scale; __half scale_cal, zero_cal; };
  const auto params = [&](float lo, float hi) {
    vq_group p;
    p.lo = lo;
    p.scale = fmaxf(__fdiv_rn(__fsub_rn(hi, lo), LEVELS), 1e-8f);
    p.scale_cal = __float2half_rn(__fmul_rn(shrink, p.scale));
    p.zero_cal = __float2half_rn(__fadd_rn(lo, __fmul_rn(__fmul_rn(eta, p.scale), LEVELS)));
    return p;
  };
  const auto code = [](float x, const vq_group& p) {
    return (unsigned)fminf(fmaxf(rintf(__fdiv_rn(__fsub_rn(x, p.lo), p.scale)), 0.f), LEVELS);
  };

  // ---- keys: a thread per channel, the group's G tokens of the channel ----
  const IT* k_tile = keys + ((size_t)bh * T + t0) * D;
  for (int d = tid; d < D; d += nthreads) {
    const IT* x = k_tile + d;
    float lo, hi;
    vq_xq_range<G>(x, (size_t)D, lo, hi);
    const vq_group p = params(lo, hi);
    const size_t side_at = ((size_t)bh * D + d) * n_groups + g;
    k_scale[side_at] = p.scale_cal;
    k_zero[side_at] = p.zero_cal;
    uint32_t word = 0u;
    #pragma unroll 8
    for (int j = 0; j < G; ++j) {
      const unsigned c = code(vq_f32(x[(size_t)j * D]), p);
      const int bit = j * B, sh = bit & 31;
      word |= c << sh;
      if (sh + B >= 32) {
        kw_s[(bit >> 5) * DP + d] = word;
        word = sh + B > 32 ? c >> (32 - sh) : 0u;
      }
    }
  }
  __syncthreads();
  const int row_words = T * B / 32;
  for (int i = tid; i < D * KW; i += nthreads) {
    const int d = i / KW, w = i % KW;
    k_codes[((size_t)bh * D + d) * row_words + (size_t)g * KW + w] = kw_s[w * DP + d];
  }

  // ---- values: a thread per (token, group of G channels) ----
  for (int i = tid; i < G * GV; i += nthreads) {
    const int tl = i / GV, gv = i % GV;
    const size_t t = t0 + tl;
    const IT* x = values + ((size_t)bh * T + t) * DV + gv * G;
    float lo, hi;
    vq_xq_range<G>(x, (size_t)1, lo, hi);
    const vq_group p = params(lo, hi);
    const size_t side_at = ((size_t)bh * T + t) * GV + gv;
    v_scale[side_at] = p.scale_cal;
    v_zero[side_at] = p.zero_cal;
    uint32_t* out = v_codes + ((size_t)bh * T + t) * WV + gv * VW;
    uint32_t word = 0u;
    #pragma unroll 8
    for (int j = 0; j < G; ++j) {
      const unsigned c = code(vq_f32(x[j]), p);
      const int bit = j * B, sh = bit & 31;
      word |= c << sh;
      if (sh + B >= 32) {
        out[bit >> 5] = word;
        word = sh + B > 32 ? c >> (32 - sh) : 0u;
      }
    }
  }
"""

# Follower. Template constants as the leader's. Inputs: the block (keys, values), the leader's
# whole code arrays lk (B, H, D, cap / G, G * B / 32) and lv (B, H, cap_v, DV * B / 32), meta =
# [start]: the block's first position (a multiple of G) in the leader's arrays.
_FOLLOWER = r"""
  constexpr int KW = G * B / 32;
  constexpr int GV = DV / G;
  constexpr int WV = DV * B / 32;
  constexpr float INV_G = 1.0f / (float)G;   // exact: G is a power of two

  const int T = keys_shape[2];
  const int n_groups = T / G;
  const int g = blockIdx.x;
  const int bh = blockIdx.y;
  const int tid = threadIdx.x;
  const int nthreads = blockDim.x;
  const size_t t0 = (size_t)g * G;
  const int start = meta[0];
  const int lk_row = lk_shape[3] * KW;       // words per channel row of the leader's key codes
  const int lv_rows = lv_shape[2];

  // fit_to_codes over G (code, x) pairs: the least-squares scale and zero, in its order.
  const auto fit = [&](const uint32_t* codes, int first_bit, const IT* x, size_t stride, __half& s, __half& z) {
    float c_sum = 0.f, x_sum = 0.f;
    for (int j = 0; j < G; ++j) {
      c_sum = __fadd_rn(c_sum, (float)vq_xq_code<B>(codes, first_bit + j * B));
      x_sum = __fadd_rn(x_sum, vq_f32(x[(size_t)j * stride]));
    }
    const float c_mean = __fmul_rn(c_sum, INV_G), x_mean = __fmul_rn(x_sum, INV_G);
    float var = 0.f, cov = 0.f;
    for (int j = 0; j < G; ++j) {
      const float cc = __fsub_rn((float)vq_xq_code<B>(codes, first_bit + j * B), c_mean);
      var = __fadd_rn(var, __fmul_rn(cc, cc));
      cov = __fadd_rn(cov, __fmul_rn(cc, __fsub_rn(vq_f32(x[(size_t)j * stride]), x_mean)));
    }
    var = __fmul_rn(var, INV_G);
    cov = __fmul_rn(cov, INV_G);
    const float scale = var > 0.f ? __fdiv_rn(cov, fmaxf(var, 1e-12f)) : 0.f;
    s = __float2half_rn(scale);
    z = __float2half_rn(__fsub_rn(x_mean, __fmul_rn(scale, c_mean)));
  };

  // ---- keys: a thread per channel; the leader's words of this channel and group ----
  const IT* k_tile = keys + ((size_t)bh * T + t0) * D;
  const size_t lk_group = (size_t)(start / G + g) * KW;
  for (int d = tid; d < D; d += nthreads) {
    const uint32_t* codes = lk + ((size_t)bh * D + d) * lk_row + lk_group;
    const size_t side_at = ((size_t)bh * D + d) * n_groups + g;
    fit(codes, 0, k_tile + d, (size_t)D, k_scale[side_at], k_zero[side_at]);
  }

  // ---- values: a thread per (token, group of G channels) ----
  for (int i = tid; i < G * GV; i += nthreads) {
    const int tl = i / GV, gv = i % GV;
    const size_t t = t0 + tl;
    const uint32_t* row = lv + ((size_t)bh * lv_rows + start + t) * WV;
    const size_t side_at = ((size_t)bh * T + t) * GV + gv;
    fit(row, gv * G * B, values + ((size_t)bh * T + t) * DV + gv * G, (size_t)1, v_scale[side_at], v_zero[side_at]);
  }
"""


@lru_cache(maxsize=None)
def _kernels_for(factory):
    """(leader kernel, follower kernel), built once per kernel factory: keyed by
    mx.fast.cuda_kernel itself, so a kernel built while a test stands the CPU emulation in for
    it is never served after the real factory is back (as fused_prefill_affine._kernel)."""
    leader = build_kernel(factory, name="vq_xquant_encode_kv", input_names=["keys", "values", "calib"],
                          output_names=list(LEADER_OUTPUTS), source=_LEADER, header=_HEADER)
    follower = build_kernel(factory, name="vq_xquant_fit_kv", input_names=["keys", "values", "lk", "lv", "meta"],
                            output_names=list(FOLLOWER_OUTPUTS), source=_FOLLOWER, header=_HEADER)
    return leader, follower


def _kernels():
    return _kernels_for(mx.fast.cuda_kernel)


def shared_bytes(head_dim: int, group_size: int, bits: int) -> int:
    """The leader kernel's static shared memory: a group's key code words, rows of D + 1."""
    return 4 * (group_size * bits // 32) * (head_dim + 1)


def supports(head_dim: int, value_dim: int, group_size: int, bits: int) -> bool:
    """The shapes the kernels take; others take the portable path: XQuant's widths (2, 3, 4),
    groups that are a power of two and a multiple of 32 (whole words; the follower's means
    multiply by 1 / G exactly), value groups dividing value_dim, shared memory within 48 KB."""
    if bits not in SUPPORTED_BITS or group_size < 32 or group_size % 32 or group_size & (group_size - 1):
        return False
    if head_dim < 1 or value_dim < 1 or value_dim % group_size:
        return False
    return shared_bytes(head_dim, group_size, bits) <= kernel_header.STATIC_SHARED_BYTES


def encode_step(cache, keys: mx.array, values: mx.array, leader_codes=None):
    """XQuantCache's encoded block (the dict _encode returns) from a kernel, or None where the
    kernels are not active (off CUDA, switched off, a shape `supports` refuses, an input dtype
    without a variant): the cache then takes the portable compiled path. `leader_codes`: for a
    follower, (the leader's k_codes, v_codes) store arrays; the block starts at
    cache.n_compressed in them."""
    if not _kernels_enabled():
        return None
    if not supports(cache.head_dim, cache.value_dim, cache.group, cache.code_bits):
        return None
    if keys.dtype not in INPUT_DTYPES or values.dtype != keys.dtype:
        return None
    if leader_codes is None:
        arrays = xquant_encode_kv(keys, values, group_size=cache.group, bits=cache.code_bits, eta=cache.eta)
        return dict(zip(LEADER_OUTPUTS, arrays))
    arrays = xquant_fit_kv(keys, values, *leader_codes, start=cache.n_compressed, group_size=cache.group,
                           bits=cache.code_bits)
    return dict(zip(FOLLOWER_OUTPUTS, arrays))


def _check_block(keys, values, group_size: int, bits: int) -> tuple[int, int, int, int, int]:
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
        raise QuantizerConfigError(
            f"xquant fused encode: keys {keys.shape} and values {values.shape} must be (B, H, T, D) "
            "and (B, H, T, DV) with the same B, H, T"
        )
    B, H, T, D = keys.shape
    DV = values.shape[3]
    if not supports(D, DV, group_size, bits):
        raise QuantizerConfigError(
            f"xquant fused encode: head_dim={D}, value_dim={DV}, group_size={group_size}, bits={bits} "
            f"are not supported: allowed are bits in {SUPPORTED_BITS}, a power-of-two group >= 32 "
            f"dividing value_dim, and {kernel_header.STATIC_SHARED_BYTES} bytes of shared memory at most"
        )
    if T < 1 or T % group_size:
        raise QuantizerConfigError(
            f"xquant fused encode: a block of T={T} tokens; allowed are whole groups of {group_size}, >= 1"
        )
    if keys.dtype not in INPUT_DTYPES or values.dtype != keys.dtype:
        raise QuantizerConfigError(
            f"xquant fused encode: keys {keys.dtype} and values {values.dtype}; allowed is one dtype "
            f"of {[str(d) for d in INPUT_DTYPES]}"
        )
    return B, H, T, D, DV


def xquant_encode_kv(keys: mx.array, values: mx.array, *, group_size: int, bits: int, eta: float):
    """The leader kernel's launch: keys (B, H, T, D), values (B, H, T, DV) -> (k_codes
    (B, H, D, T / G, G * bits / 32), k_scale, k_zero (B, H, D, T / G), v_codes
    (B, H, T, DV * bits / 32), v_scale, v_zero (B, H, T, DV / G)): quantize_groups of the
    K^T groups and of the value groups (float16 side data)."""
    B, H, T, D, DV = _check_block(keys, values, group_size, bits)
    G = group_size
    # The portable path's scalars: Python floats that MLX turns into float32 constants.
    calib = mx.array([1 - 2 * eta, eta], dtype=mx.float32)
    return _kernels()[0](
        inputs=[keys, values, calib],
        template=[("D", D), ("DV", DV), ("G", G), ("B", bits), ("IT", keys.dtype)],
        grid=(THREADS * (T // G), B * H, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, D, T // G, G * bits // 32), (B, H, D, T // G), (B, H, D, T // G),
                       (B, H, T, DV * bits // 32), (B, H, T, DV // G), (B, H, T, DV // G)],
        output_dtypes=[mx.uint32, mx.float16, mx.float16, mx.uint32, mx.float16, mx.float16],
    )


def xquant_fit_kv(keys: mx.array, values: mx.array, leader_k_codes: mx.array, leader_v_codes: mx.array,
                  *, start: int, group_size: int, bits: int):
    """The follower kernel's launch: the block (B, H, T, D / DV) and its leader's code arrays
    (k_codes (B, H, D, cap / G, G * bits / 32), v_codes (B, H, cap_v, DV * bits / 32)) holding
    positions [start, start + T) -> (k_scale, k_zero (B, H, D, T / G), v_scale, v_zero
    (B, H, T, DV / G)): fit_to_codes of each group to the leader's codes (float16)."""
    B, H, T, D, DV = _check_block(keys, values, group_size, bits)
    G = group_size
    lk_ok = (leader_k_codes.ndim == 5 and leader_k_codes.shape[:3] == (B, H, D)
             and leader_k_codes.shape[4] == G * bits // 32 and leader_k_codes.shape[3] * G >= start + T)
    lv_ok = (leader_v_codes.ndim == 4 and leader_v_codes.shape[:2] == (B, H)
             and leader_v_codes.shape[3] == DV * bits // 32 and leader_v_codes.shape[2] >= start + T)
    if not (lk_ok and lv_ok) or start % G or start < 0 or leader_k_codes.dtype != mx.uint32:
        raise QuantizerConfigError(
            f"xquant fused fit: leader codes {leader_k_codes.shape} / {leader_v_codes.shape} "
            f"({leader_k_codes.dtype}) for a block of {T} tokens at start={start}; allowed are "
            f"uint32 (B, H, D, >= (start + T) / G, G * bits / 32) and (B, H, >= start + T, "
            f"DV * bits / 32) with start a multiple of G={G}"
        )
    meta = mx.array([start], dtype=mx.int32)
    return _kernels()[1](
        inputs=[keys, values, leader_k_codes, leader_v_codes, meta],
        template=[("D", D), ("DV", DV), ("G", G), ("B", bits), ("IT", keys.dtype)],
        grid=(THREADS * (T // G), B * H, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, H, D, T // G), (B, H, D, T // G), (B, H, T, DV // G), (B, H, T, DV // G)],
        output_dtypes=[mx.float16] * 4,
    )
