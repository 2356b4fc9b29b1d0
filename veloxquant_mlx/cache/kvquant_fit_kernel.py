"""The codebook fit's Lloyd iterations on MLX's CUDA backend: two kernels and one MLX sum each.

nonuniform_codebook.fit_codebook runs 20 Lloyd iterations on a cache's first chunk (per layer,
keys and values). Off the CPU it runs eagerly (a fused kernel per distinct op chain would be a
JIT compile on first use), ~13 launches per iteration: the nearest level (2 fused kernels), the
one-hot hits (2), their counts (a sum), the hits times the samples and its sum (2), the new
levels (4: compare, maximum, divide, select) and their sort: ~520 launches per layer and first
chunk (`python -m tests.cache.bench_kvquant_encode`, first chunk, `cuda` path before this).

The one order-sensitive op stays MLX's: the float32 sum over the samples of hits * x (another
summation order rounds differently). Per iteration here:
  - `_PRODUCT`: one thread per sample: its nearest level (the number of midpoints
    (l[k+1] + l[k]) * 0.5 below it, as nearest_level) and the row hits * x of the ops'
    (..., N, K) product (x where the level is the sample's, x * 0.0 elsewhere: the same values,
    signed zeros included), written in the ops' layout;
  - MLX sums it over the samples (axis -2), the ops' `sums`;
  - `_UPDATE`: one block per codebook: each level's count of samples (an integer: exact in any
    order), the new level sums / max(count, 1) where the count is > 0 (one IEEE division), else
    the old level, then the K levels sorted (insertion sort: a sort of values gives the same
    values whatever the algorithm, except the relative order of -0.0 and +0.0, which compare
    equal: kept in their pre-sort order here).
Three launches per iteration instead of ~13: a first chunk's encode on CUDA (both fits, 20
iterations each, one layer of 8 KV heads x 128, 2048 tokens) 604 -> 202 primitives
(results/kvquant_encode_s6.json); every float op is the ops' op with CUDA's _rn intrinsics
(no FMA contraction).
Bit for bit the ops' fit on the CPU through tests/cache/cuda_emulation.py
(tests/cache/test_kvquant_encode_fit_kernel.py); on CUDA its `@cuda_test` case; nvcc compiles it
without spills (slow test). Not yet compiled by nvrtc nor timed on a GPU.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.cache.kvquant_encode_kernel import _ROUNDING

# False: the MLX ops instead, whatever the backend (for an A/B on the GPU: the measurement
# modules' `--set kvquant_fit_kernel.ENABLED=0`).
ENABLED = True
PRODUCT_THREADS = 256
UPDATE_THREADS = 256

# grid: one thread per sample of every codebook (B * H * N); levels (B*H, K), x (B*H, N).
_PRODUCT = r"""
  constexpr int K = 1 << BITS;
  const int n = meta[0];
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)meta[1] * n) return;
  const size_t book = i / n;
  const float* lv = levels + book * K;
  const float v = x[i];
  unsigned code = 0u;
  #pragma unroll
  for (int k = 0; k < K - 1; ++k) code += v > __fmul_rn(__fadd_rn(lv[k + 1], lv[k]), 0.5f) ? 1u : 0u;
  #pragma unroll
  for (int k = 0; k < K; ++k) product[i * K + k] = __fmul_rn(k == (int)code ? 1.0f : 0.0f, v);
"""

# grid: one block per codebook.
_UPDATE = r"""
  constexpr int K = 1 << BITS;
  const int n = meta[0];
  const size_t book = blockIdx.x;
  const int tid = threadIdx.x;
  const float* lv = levels + book * K;
  __shared__ float mids[K - 1];
  __shared__ int counts[K];
  if (tid < K - 1) mids[tid] = __fmul_rn(__fadd_rn(lv[tid + 1], lv[tid]), 0.5f);
  if (tid < K) counts[tid] = 0;
  __syncthreads();
  int mine[K];
  #pragma unroll
  for (int k = 0; k < K; ++k) mine[k] = 0;
  for (int s = tid; s < n; s += blockDim.x) {
    const float v = x[book * n + s];
    int code = 0;
    #pragma unroll
    for (int k = 0; k < K - 1; ++k) code += v > mids[k] ? 1 : 0;
    #pragma unroll
    for (int k = 0; k < K; ++k) mine[k] += k == code ? 1 : 0;
  }
  #pragma unroll
  for (int k = 0; k < K; ++k) if (mine[k]) atomicAdd(&counts[k], mine[k]);
  __syncthreads();
  if (tid == 0) {
    float next[K];
    #pragma unroll
    for (int k = 0; k < K; ++k) {
      const float c = (float)counts[k];
      next[k] = c > 0.0f ? __fdiv_rn(sums[book * K + k], c > 1.0f ? c : 1.0f) : lv[k];
    }
    for (int a = 1; a < K; ++a) {  // insertion sort, ascending, stable
      const float v = next[a];
      int b = a - 1;
      while (b >= 0 && next[b] > v) { next[b + 1] = next[b]; --b; }
      next[b + 1] = v;
    }
    #pragma unroll
    for (int k = 0; k < K; ++k) out[book * K + k] = next[k];
  }
"""


@lru_cache(maxsize=None)
def _product_kernel():
    return build_kernel(
        mx.fast.cuda_kernel,
        name="vq_kvquant_fit_product",
        input_names=["x", "levels", "meta"],
        output_names=["product"],
        source=_PRODUCT,
        header=kernel_header.HEADER + _ROUNDING,
    )


@lru_cache(maxsize=None)
def _update_kernel():
    return build_kernel(
        mx.fast.cuda_kernel,
        name="vq_kvquant_fit_update",
        input_names=["x", "levels", "sums", "meta"],
        output_names=["out"],
        source=_UPDATE,
        header=kernel_header.HEADER + _ROUNDING,
    )


def enabled() -> bool:
    """Whether fit_codebook's iterations run through these kernels off the CPU (MLX's CUDA
    backend, kernels on: fused_decode.kernels_enabled, VELOXQUANT_CUDA_KERNELS) and ENABLED."""
    return ENABLED and fused_decode.kernels_enabled()


def lloyd_iterations(x: mx.array, levels: mx.array, iterations: int) -> mx.array:
    """`iterations` Lloyd steps: x (..., N) float32 samples, levels (..., K) sorted float32
    (K = 2**bits, 2 <= bits <= 4) -> levels after the steps, as nonuniform_codebook._lloyd's loop."""
    lead, n, K = x.shape[:-1], x.shape[-1], levels.shape[-1]
    bits = K.bit_length() - 1
    books = 1
    for d in lead:
        books *= d
    # Contiguous once: a kernel's non-contiguous input (the fit's strided subsample) would be
    # copied at every launch (mx.fast.cuda_kernel's ensure_row_contiguous).
    x2, levels = mx.contiguous(x.reshape(books, n)), levels.reshape(books, K)
    meta = mx.array([n, books], dtype=mx.int32)
    template = [("BITS", bits)]
    total = books * n
    for _ in range(iterations):
        product = _product_kernel()(
            inputs=[x2, levels, meta], template=template,
            grid=((total + PRODUCT_THREADS - 1) // PRODUCT_THREADS * PRODUCT_THREADS, 1, 1),
            threadgroup=(PRODUCT_THREADS, 1, 1), output_shapes=[(books, n, K)], output_dtypes=[mx.float32],
        )[0]
        sums = product.sum(axis=-2)  # MLX's reduction: the ops' summation order
        levels = _update_kernel()(
            inputs=[x2, levels, sums, meta], template=template,
            grid=(books * UPDATE_THREADS, 1, 1), threadgroup=(UPDATE_THREADS, 1, 1),
            output_shapes=[(books, K)], output_dtypes=[mx.float32],
        )[0]
    return levels.reshape(*lead, K)
