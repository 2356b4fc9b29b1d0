"""The outliers' selection on MLX's CUDA backend: the `count` smallest of each row, without a sort.

sparse_outliers.outlier_ranking picks a block's outliers with mx.argpartition over its scores
(-|x - mean| / std, one row of G * D entries per block). MLX's CUDA backend has no partition: its
ArgPartition sorts each row whole. For one layer's 2048-token chunk of 8 KV heads x 128 (512 rows
of 4096 per part) those sorts were 384 us of the chunk's 3.5 ms of kernels in Nsight Compute
(results/ncu_prefill_chunk_h200_s14.json: block_sort_kernel, four launches), more than KVQuant's
two encode kernels together.

This kernel selects instead of sorting, one CUDA block per row: the row's scores as order-keeping
unsigned keys (in shared memory where the row fits, else made again from the scores at each
pass), a radix select (four passes of an 8-bit histogram) for the key of
the count-th smallest, then the entries below it and, among those equal to it, the first by
position; the picks are written in ascending (score, position) order. That is what a stable
ascending sort's first `count` entries are: the rule MLX's CPU argsort follows (std::stable_sort),
which the tests compare it with. MLX's argpartition leaves both the choice among tied scores and
the order of its first `count` entries to its implementation (the CPU's nth_element and the CUDA
sort differ), so a cache encoded through this kernel stores the same outliers as the ops wherever
the count-th score is not tied, possibly in another order; the reading side sums them, so the
order changes nothing read. Its callers: KVQuant's later-chunk encode (kvquant.py, its 32 x 128
blocks' keys in shared memory) and GEAR's encoder (gear_encoder.py, 256 x 128 blocks: keys made
again from the scores at each pass), on CUDA.

-0.0 is keyed as +0.0 (equal floats, equal keys). NaN scores are not handled (scores are finite:
a vector's std has 1e-6 added).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.cache.kernel_name import build_kernel

# False: mx.argpartition instead, whatever the backend (for an A/B on the GPU: the measurement
# modules' `--set outlier_select_kernel.ENABLED=0`).
ENABLED = True
THREADS = 256
# Static shared memory per block is 48 KB: the row's keys (4 bytes each), the histogram and the
# per-thread tie counts (1 KB each), the picks' keys and positions (8 bytes each) and slack.
SHARED_BYTES = 48 * 1024
_FIXED_SHARED_BYTES = 4 * 256 + 4 * THREADS + 64  # histogram, tie counts, scalars

_HEADER = r"""
// Ascending floats -> ascending unsigned keys (negatives bit-flipped, positives' sign set);
// -0.0 first made +0.0 so that equal floats have equal keys.
__device__ __forceinline__ unsigned vq_order_key(float f) {
  const unsigned u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u >> 31) ? ~u : (u | 0x80000000u);
}
#define VQ_KEY(e) (KS ? key[e] : vq_order_key(s[e]))
"""

_SOURCE = r"""
  // TPB: the block's threads (THREADS, a template value so the source cannot disagree with the launch).
  constexpr int S = (N + TPB - 1) / TPB;  // each thread's run of positions, for the tie order
  const size_t row = blockIdx.x;
  const int tid = threadIdx.x;
  // KS: the row's keys kept in shared memory (rows that fit), else made again from the scores
  // at every pass (GEAR's 256 x 128 blocks: 128 KB of keys; the row stays in L2).
  __shared__ unsigned key[KS ? N : 1];
  __shared__ unsigned hist[256];
  __shared__ unsigned ties_before[TPB];
  __shared__ unsigned pick_key[NO];
  __shared__ unsigned pick_pos[NO];
  __shared__ unsigned found_key, found_rank, picked;
  const float* s = scores + row * (size_t)N;
  if (KS) {
    for (int e = tid; e < N; e += TPB) key[e] = vq_order_key(s[e]);
  }
  // Radix select: after the pass at `shift`, `prefix` holds the top bits of the NO-th smallest
  // key and `rank` its rank (1-based) among the keys that share those bits.
  unsigned prefix = 0u, mask = 0u, rank = NO;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = tid; b < 256; b += TPB) hist[b] = 0u;
    __syncthreads();
    for (int e = tid; e < N; e += TPB) {
      const unsigned k = VQ_KEY(e);
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (tid == 0) {
      unsigned below = 0u, b = 0u;
      while (below + hist[b] < rank) { below += hist[b]; ++b; }
      found_key = prefix | (b << shift);
      found_rank = rank - below;
    }
    __syncthreads();
    prefix = found_key;
    rank = found_rank;
    mask |= 255u << shift;
  }
  // prefix: the NO-th smallest key; rank: how many of the keys equal to it are picked (the
  // first by position); every key below it is picked (NO - rank of them).
  const int lo = tid * S;
  const int hi = lo + S < N ? lo + S : N;
  unsigned ties = 0u;
  for (int e = lo; e < hi; ++e) ties += VQ_KEY(e) == prefix ? 1u : 0u;
  ties_before[tid] = ties;
  if (tid == 0) picked = 0u;
  __syncthreads();
  if (tid == 0) {
    unsigned run = 0u;
    for (int t = 0; t < TPB; ++t) { const unsigned c = ties_before[t]; ties_before[t] = run; run += c; }
  }
  __syncthreads();
  unsigned tie = ties_before[tid];
  for (int e = lo; e < hi; ++e) {
    const unsigned k = VQ_KEY(e);
    bool take = k < prefix;
    if (k == prefix) { take = tie < rank; ++tie; }
    if (take) {
      const unsigned slot = atomicAdd(&picked, 1u);
      pick_key[slot] = k;
      pick_pos[slot] = (unsigned)e;
    }
  }
  __syncthreads();
  // Each pick's place in ascending (key, position) order.
  for (int i = tid; i < NO; i += TPB) {
    const unsigned k = pick_key[i], p = pick_pos[i];
    unsigned place = 0u;
    for (int j = 0; j < NO; ++j) {
      const unsigned kj = pick_key[j];
      place += (kj < k || (kj == k && pick_pos[j] < p)) ? 1u : 0u;
    }
    positions[row * NO + place] = p;
  }
"""


@lru_cache(maxsize=None)
def _kernel():
    return build_kernel(
        mx.fast.cuda_kernel,
        name="vq_outlier_select",
        input_names=["scores"],
        output_names=["positions"],
        source=_SOURCE,
        header=_HEADER,
    )


def enabled() -> bool:
    """Whether selections run through this kernel (MLX's CUDA backend, kernels on:
    fused_decode.kernels_enabled, VELOXQUANT_CUDA_KERNELS) and ENABLED."""
    return ENABLED and fused_decode.kernels_enabled()


def applies(entries: int, count: int) -> bool:
    """Whether a selection of `count` among rows of `entries` runs through this kernel here:
    `enabled` and `fits` (the callers' test: kvquant.py, gear_encoder.py)."""
    return enabled() and fits(entries, count)


def fits(entries: int, count: int) -> bool:
    """Whether `count` picks of rows of `entries` scores fit the kernel's shared memory (the
    row's keys are kept there too where they fit: `_keys_shared`)."""
    return 0 < count <= entries and 8 * count + _FIXED_SHARED_BYTES <= SHARED_BYTES


def _keys_shared(entries: int, count: int) -> bool:
    return 4 * entries + 8 * count + _FIXED_SHARED_BYTES <= SHARED_BYTES


def smallest(scores: mx.array, count: int) -> mx.array:
    """scores (..., N) float32 -> (..., count) uint32: per row, the positions of its `count`
    smallest scores, ties to the lower position, in ascending (score, position) order (a stable
    ascending argsort's first `count`)."""
    *lead, n = scores.shape
    if not fits(n, count):
        raise ValueError(f"outlier selection of {count} among {n} entries does not fit the kernel's shared "
                         f"memory: allowed is 0 < count <= entries and 8 * count <= "
                         f"{SHARED_BYTES - _FIXED_SHARED_BYTES}")
    rows = 1
    for size in lead:
        rows *= size
    return _kernel()(
        inputs=[scores.astype(mx.float32)],
        template=[("N", n), ("NO", count), ("KS", int(_keys_shared(n, count))), ("TPB", THREADS)],
        grid=(rows * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(*lead, count)],
        output_dtypes=[mx.uint32],
    )[0]
