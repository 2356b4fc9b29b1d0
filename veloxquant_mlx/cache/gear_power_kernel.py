"""GEAR's low rank (gear_lowrank.low_rank_factors) on MLX's CUDA backend: the whole power
iteration of a block in one CUDA block.

As MLX ops the power iteration is, per step and side, two batched matmuls and a modified
Gram-Schmidt of the (n, r) iterate whose sums must be MLX's reductions (gear_encode_kernel.py
keeps them so, for the stored bits): at rank 4 and 3 steps ~60 row reductions, ~42 elementwise
kernels and 12 matmuls per layer and 2048-token chunk. Nsight Compute on the H200 put those at
~0.26 ms (reductions), ~0.1 ms (Gram-Schmidt kernels) and ~0.09 ms (matmuls) of gear's 3.09 ms
chunk at 30K history, fp16's whole chunk being 1.76 ms (results/ncu_prefill_chunk_h200_s16.json),
and each launch is also host time while the graph is built.

Here one CUDA block of THREADS threads runs every step for one (n, d) block of the residual,
its iterates in shared memory, the residual read from global memory (L2) twice per step:
  - Y = R @ right: a thread per row of R, read in 16-byte vectors (d a multiple of 4);
  - Y's columns orthonormalized by modified Gram-Schmidt in the ops' order (each column minus
    its projections on the earlier ones, each projection's sum taken after the previous
    subtraction, then divided by max(norm, gear_encode_kernel.NORM_FLOOR): a zero column stays
    zero), each sum a block reduction;
  - right = R^T @ left: a thread per (channel, part of the rows), parts added in a fixed order.
The sums run in another order than MLX's matmuls and reductions, so the factors differ from the
ops' in their last bits (tests/cache/test_gear_power_kernel.py bounds the difference on the CPU
through the CUDA emulation, and checks the result is the same subspace fit); they are stored in
the side dtype (bf16 / fp16), where most of that difference rounds away. The order is fixed, so
a block's factors are the same on every run. ENABLED = False restores the ops (and with
gear_encode_kernel's kernels their bits) for an A/B.

Measured on the H200 (session 17, results/README.md has the commands): gear's 32K prefill in
one process, fills alternating, 2.02x fp16's without this kernel and 1.33x with it
(results/prefill_chunks_h200_s17_32k_power.json); one layer's chunk at 30K history 210 -> 92
kernels (Nsight Compute), this kernel 47 us per side. It is latency-bound (one CUDA block of 256
threads per 256 x 128 block, 64 blocks per side for 132 SMs; 512 or 1024 threads a block were no
faster in session 26): since session 42 GEAR's keys and values run as one launch of both sides'
blocks (factors_pair, cache/paired_rows.py; gear_encoder.encode_sides).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, gear_encode_kernel, kernel_header, paired_rows
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.errors import QuantizerConfigError

# False: the MLX ops (gear_lowrank's power iteration) instead, whatever the backend (an A/B on
# the GPU: the measurement modules' `--set gear_power_kernel.ENABLED=0`).
ENABLED = True
THREADS = 256
# 16 bytes read as one 128-bit access (a plain struct: CUDA's float4 is not needed).
_HEADER = r"""
struct __align__(16) vq_float4 { float x, y, z, w; };
"""

_SOURCE = r"""
  // N rows (tokens) x D channels of one block; R columns; STEPS power-iteration steps.
  constexpr int NW = TPB / 32;
  // Parts of the rows each channel's sum of R^T @ left is split into (a thread per channel
  // and part, consecutive channels in a warp: the residual's rows are read coalesced).
  constexpr int P = TPB >= D ? TPB / D : 1;
  __shared__ float left_s[N * R];
  __shared__ float right_s[D * R];
  __shared__ float partial_s[P * D * R];
  __shared__ float warp_sum[NW];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const float* res = vq_residual + vq_row * N * D;

  for (int i = tid; i < D * R; i += TPB) right_s[i] = start[i];
  __syncthreads();

  for (int step = 0; step < STEPS; ++step) {
    // Y = R @ right, a thread per row, its row read in 16-byte vectors; right_s is read at one
    // address by the whole warp. (A warp per row with a shuffle reduction per column: 32 rows
    // x R columns x 5 dependent shuffles per warp and step, one after another; the launch took
    // 52 us for 3 steps at 256 x 128, rank 4, on the H200, results/ncu_prefill_chunk_h200_s17_power.json;
    // this way 47 us, results/ncu_prefill_chunk_h200_s17.json.)
    for (int n = tid; n < N; n += TPB) {
      float acc[R];
      #pragma unroll
      for (int j = 0; j < R; ++j) acc[j] = 0.0f;
      const vq_float4* row = reinterpret_cast<const vq_float4*>(res + (size_t)n * D);
      #pragma unroll 4
      for (int q = 0; q < D / 4; ++q) {
        const vq_float4 x = row[q];
        const float xs[4] = {x.x, x.y, x.z, x.w};
        #pragma unroll
        for (int c = 0; c < 4; ++c) {
          #pragma unroll
          for (int j = 0; j < R; ++j) acc[j] += xs[c] * right_s[(4 * q + c) * R + j];
        }
      }
      #pragma unroll
      for (int j = 0; j < R; ++j) left_s[n * R + j] = acc[j];
    }
    __syncthreads();
    // Modified Gram-Schmidt: each thread holds the rows n = tid, tid + TPB, ... of the iterate.
    for (int J = 0; J < R; ++J) {
      for (int k = 0; k <= J; ++k) {
        // k < J: the projection of column J on the finished column k; k == J: J's norm.
        float part = 0.0f;
        for (int n = tid; n < N; n += TPB) part += left_s[n * R + k] * left_s[n * R + J];
        for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
        if (lane == 0) warp_sum[warp] = part;
        __syncthreads();
        float total = 0.0f;
        for (int w = 0; w < NW; ++w) total += warp_sum[w];
        __syncthreads();  // warp_sum is reused by the next sum
        if (k < J) {
          for (int n = tid; n < N; n += TPB) left_s[n * R + J] -= left_s[n * R + k] * total;
        } else {
          const float norm = sqrtf(total);
          // MLX's maximum: a NaN operand first is returned as is, else the larger.
          const float floor_ = (norm != norm || norm > FLOOR) ? norm : FLOOR;
          for (int n = tid; n < N; n += TPB) left_s[n * R + J] = left_s[n * R + J] / floor_;
        }
        // Each thread updated only its own rows, which only it reads until the next sum's
        // barrier: no barrier needed here.
      }
    }
    __syncthreads();
    // right = R^T @ left: partial sums over the rows n = part, part + P, ...
    for (int i = tid; i < P * D; i += TPB) {
      const int d = i % D, part = i / D;
      float acc[R];
      #pragma unroll
      for (int j = 0; j < R; ++j) acc[j] = 0.0f;
      #pragma unroll 8
      for (int n = part; n < N; n += P) {
        const float x = res[(size_t)n * D + d];
        #pragma unroll
        for (int j = 0; j < R; ++j) acc[j] += x * left_s[n * R + j];
      }
      #pragma unroll
      for (int j = 0; j < R; ++j) partial_s[(part * D + d) * R + j] = acc[j];
    }
    __syncthreads();
    for (int i = tid; i < D * R; i += TPB) {
      float total = 0.0f;
      for (int part = 0; part < P; ++part) total += partial_s[part * D * R + i];
      right_s[i] = total;
    }
    __syncthreads();
  }
  FT* l_out = vq_left + vq_row * N * R;
  FT* r_out = vq_right + vq_row * D * R;
  // In the factors' dtype FT (float, or the side dtype GEAR stores them in: no cast after).
  for (int i = tid; i < N * R; i += TPB) l_out[i] = vq_cast<FT>(left_s[i]);
  for (int i = tid; i < D * R; i += TPB) r_out[i] = vq_cast<FT>(right_s[i]);
"""


# The arrays a paired launch takes per side (paired_rows): the start is shared.
_PAIRED = ("residual", "left", "right")


@lru_cache(maxsize=None)
def _kernel(paired: bool = False):
    """The power iteration's kernel; `paired`: two arrays of blocks in one launch (paired_rows)."""
    return build_kernel(
        mx.fast.cuda_kernel,
        name="vq_gear_power_iteration" + ("_pair" if paired else ""),
        input_names=paired_rows.argument_names(["residual", "start"], _PAIRED, paired),
        output_names=paired_rows.argument_names(["left", "right"], _PAIRED, paired),
        # the Gram-Schmidt kernels' FLOOR
        source=gear_encode_kernel.floor_constant() + paired_rows.prologue(_PAIRED, paired) + _SOURCE,
        header=kernel_header.HEADER + _HEADER,
    )


def enabled() -> bool:
    """Whether gear's power iteration runs through this kernel: MLX's CUDA backend, kernels on
    (fused_decode.kernels_enabled, VELOXQUANT_CUDA_KERNELS), and ENABLED."""
    return ENABLED and fused_decode.kernels_enabled()


def shared_bytes(n: int, d: int, rank: int) -> int:
    """The kernel's static shared memory for blocks of n x d at `rank`: the iterates (n x r and
    d x r floats), the partial sums of R^T @ left (max(THREADS, d) x r floats) and the
    reduction's per-warp slots, within kernel_header.STATIC_SHARED_BYTES."""
    parts = THREADS // d if THREADS >= d else 1
    return 4 * (n * rank + d * rank + parts * d * rank + THREADS // 32)


def fits(n: int, d: int, rank: int) -> bool:
    """Whether blocks of n x d at `rank` fit the kernel's shared memory (and its rows its
    16-byte reads: d a multiple of 4)."""
    return rank > 0 and d % 4 == 0 and shared_bytes(n, d, rank) <= kernel_header.STATIC_SHARED_BYTES


def applies(n: int, d: int, rank: int) -> bool:
    """`enabled` and `fits`: gear_lowrank's test for taking this kernel."""
    return enabled() and fits(n, d, rank)


def factors(residual: mx.array, start: mx.array, steps: int,
            dtype: mx.Dtype = mx.float32) -> tuple[mx.array, mx.array]:
    """residual (..., n, d) float32, start (d, r) float32 -> (A (..., n, r), B (..., d, r))
    after `steps` power-iteration steps: gear_lowrank._power_iteration's result up to the order
    of its sums, in `dtype` (float32, or a 16-bit dtype the float32 result is rounded to, as
    astype rounds it)."""
    return tuple(_iterate([residual], start, steps, dtype))


def factors_pair(first: mx.array, second: mx.array, start: mx.array, steps: int,
                 dtype: mx.Dtype = mx.float32) -> tuple[tuple[mx.array, mx.array], tuple[mx.array, mx.array]]:
    """`factors` of two residuals of the same block shape in one launch (paired_rows):
    (factors(first, ...), factors(second, ...)), the same bits."""
    if first.shape[-2:] != second.shape[-2:]:
        raise QuantizerConfigError(f"a paired gear power iteration takes blocks of one shape: got "
                                   f"{first.shape[-2:]} and {second.shape[-2:]}")
    left_a, left_b, right_a, right_b = _iterate([first, second], start, steps, dtype)
    return (left_a, right_a), (left_b, right_b)


def _iterate(sides: list[mx.array], start: mx.array, steps: int, dtype: mx.Dtype) -> list[mx.array]:
    """The kernel's outputs for one or two residuals: the left factors then the right ones (the
    paired build's output order: left_a, left_b, right_a, right_b)."""
    *lead, n, d = sides[0].shape
    rank = start.shape[-1]
    if start.shape != (d, rank) or not fits(n, d, rank):
        raise QuantizerConfigError(f"gear power iteration of blocks {n} x {d} from a start of shape {start.shape}: allowed "
                         f"is a start of shape ({d}, r) with r >= 1, d a multiple of 4 and "
                         f"{shared_bytes(n, d, rank)} <= {kernel_header.STATIC_SHARED_BYTES} bytes of shared "
                         "memory")
    residuals = [side.astype(mx.float32) for side in sides]
    return _kernel(len(sides) == 2)(
        inputs=[*residuals, start.astype(mx.float32)],
        template=[("N", n), ("D", d), ("R", rank), ("STEPS", steps), ("TPB", THREADS), ("FT", dtype),
                  *paired_rows.lead_axes(sides, 2)],
        grid=(paired_rows.total_rows(sides, 2) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*side.shape[:-1], rank) for side in sides] + [(*side.shape[:-2], d, rank) for side in sides],
        output_dtypes=[dtype] * (2 * len(sides)),
    )
