"""The outliers' selection on MLX's CUDA backend: the `count` smallest of each row, without a sort.

sparse_outliers.outlier_ranking picks a block's outliers with mx.argpartition over its scores
(-|x - mean| / std, one row of G * D entries per block). MLX's CUDA backend has no partition: its
ArgPartition sorts each row whole. For one layer's 2048-token chunk of 8 KV heads x 128 (512 rows
of 4096 per part) those sorts were 384 us of the chunk's 3.5 ms of kernels in Nsight Compute
(results/ncu_prefill_chunk_h200_s14.json: block_sort_kernel, four launches), more than KVQuant's
two encode kernels together.

This kernel selects instead of sorting, one CUDA block per row: the row's scores as order-keeping
unsigned keys (in shared memory where the row fits, else made again from the scores at each
pass, with 1024 threads a block instead of 256), a radix select (three passes of a histogram of
11, 11 and 10 key bits, each pass's bin found by a block scan) for the key of the count-th
smallest, then the picks. Where every key equal to that one is picked (no tie cut: the usual
case), the picks are all keys up to it, taken in one coalesced pass; otherwise the entries below
it and, among those equal to it, the first by position (each thread counts the ties of a
contiguous run of positions, a block scan orders the runs). The picks are written in ascending
(score, position) order. That is what a stable ascending sort's first `count` entries are: the
rule MLX's CPU argsort follows (std::stable_sort), which the tests compare it with. MLX's
argpartition leaves both the choice among tied scores and the order of its first `count` entries
to its implementation (the CPU's nth_element and the CUDA sort differ), so a cache encoded
through this kernel stores the same outliers as the ops wherever the count-th score is not tied,
possibly in another order; the reading side sums them, so the order changes nothing read. Its
callers: KVQuant's later-chunk encode (kvquant.py, its 32 x 128 blocks' keys in shared memory)
and GEAR's encoder (gear_encoder.py, 256 x 128 blocks: keys made again from the scores at each
pass), on CUDA; GEAR's keys and values in one launch (smallest_pair, cache/paired_rows.py: 64
rows per side, each a block's chain of passes, would leave half the SMs idle per launch).

-0.0 is keyed as +0.0 (equal floats, equal keys). NaN scores are not handled (scores are finite:
a vector's std has 1e-6 added).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header, paired_rows
from veloxquant_mlx.cache.kernel_name import build_kernel

# False: mx.argpartition instead, whatever the backend (for an A/B on the GPU: the measurement
# modules' `--set outlier_select_kernel.ENABLED=0`).
ENABLED = True
# Threads per block where the row's keys fit shared memory (KVQuant's 512 rows of 4096: 4 blocks
# per SM). Rows whose keys stay in global memory (GEAR's 64 rows of 32768 per launch, fewer blocks
# than the H200's 132 SMs) get WIDE_THREADS: 32 warps per SM keep more L2 loads in flight.
THREADS = 256
WIDE_THREADS = 1024
# The block's static shared memory (within kernel_header.STATIC_SHARED_BYTES) holds the row's
# keys where they fit (4 bytes each), the histogram (4 bytes a bin), the picks' keys and
# positions (8 bytes each), the block scan's per-warp sums and scalars.
_FIXED_SHARED_BYTES = 4 * 2048 + 4 * 32 + 64  # histogram (the source's RADIX bins), warp sums, scalars

_HEADER = r"""
// Ascending floats -> ascending unsigned keys (negatives bit-flipped, positives' sign set);
// -0.0 first made +0.0 so that equal floats have equal keys.
__device__ __forceinline__ unsigned vq_order_key(float f) {
  const unsigned u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u >> 31) ? ~u : (u | 0x80000000u);
}
#define VQ_KEY(e) (KS ? key[e] : vq_order_key(s[e]))

// The sum of v over the block's threads before this one (thread order). Every thread calls it
// (barriers, full-warp shuffles); warp_sum: 32 words of shared scratch, free again after the
// caller's next __syncthreads.
template <int TPB>
__device__ __forceinline__ unsigned vq_block_exclusive_sum(unsigned v, unsigned* warp_sum) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned inclusive = v;
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned other = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += other;
  }
  if (lane == 31) warp_sum[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    const unsigned own = lane < TPB / 32 ? warp_sum[lane] : 0u;
    unsigned run = own;
    for (int d = 1; d < 32; d <<= 1) {
      const unsigned other = __shfl_up_sync(0xffffffffu, run, d);
      if (lane >= d) run += other;
    }
    if (lane < TPB / 32) warp_sum[lane] = run - own;
  }
  __syncthreads();
  return warp_sum[warp] + inclusive - v;
}
"""

_SOURCE = r"""
  // TPB: the block's threads (THREADS or WIDE_THREADS, a template value so the source cannot
  // disagree with the launch).
  constexpr int RADIX = 1 << 11;  // the digits: bits 31..21, 20..10 and 9..0 of the keys
  constexpr int BINS_PER_THREAD = RADIX / TPB;
  const size_t row = vq_row;
  const int tid = threadIdx.x;
  // KS: the row's keys kept in shared memory (rows that fit), else made again from the scores
  // at every pass (GEAR's 256 x 128 blocks: 128 KB of keys; the row stays in L2).
  __shared__ unsigned key[KS ? N : 1];
  __shared__ unsigned hist[RADIX];
  __shared__ unsigned warp_sum[32];
  __shared__ unsigned pick_key[NO];
  __shared__ unsigned pick_pos[NO];
  __shared__ unsigned found_key, found_rank, found_count, picked;
  static_assert(RADIX % TPB == 0 && TPB % 32 == 0 && TPB <= 1024, "each thread scans whole bins");
  const float* s = vq_scores + row * (size_t)N;
  if (tid == 0) picked = 0u;
  unsigned prefix = 0u, rank = NO;
  // Radix select: after the pass at `shift`, `prefix` holds the top bits of the NO-th smallest
  // key and `rank` its rank (1-based) among the keys that share those bits. Scores -|x - mean| /
  // std have few exponents: 8-bit digits put most of a row's keys in two or three bins, whose
  // shared atomics from every warp serialize; 11 bits split each exponent's keys in four, over
  // more banks, and make three passes over the row instead of four.
#pragma unroll
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : pass == 1 ? 10 : 0;
    const unsigned digits = pass == 2 ? 1023u : 2047u;
    const unsigned mask = pass == 0 ? 0u : pass == 1 ? 0xffe00000u : 0xfffffc00u;
    for (int b = tid; b < RADIX; b += TPB) hist[b] = 0u;
    __syncthreads();
    // Strided, so a warp's loads are coalesced; unrolled, so several are in flight at once.
#pragma unroll 8
    for (int e = tid; e < N; e += TPB) {
      // The first pass makes the keys (and keeps them where they fit): no pass of its own.
      const unsigned k = pass == 0 ? vq_order_key(s[e]) : VQ_KEY(e);
      if (KS && pass == 0) key[e] = k;
      if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & digits], 1u);
    }
    __syncthreads();
    // The bin where the count of keys so far reaches `rank`: each thread sums its run of bins,
    // a block scan places the runs, the one thread whose run holds the crossing walks it.
    const int first = tid * BINS_PER_THREAD;
    unsigned own = 0u;
    for (int i = 0; i < BINS_PER_THREAD; ++i) own += hist[first + i];
    unsigned below = vq_block_exclusive_sum<TPB>(own, warp_sum);
    if (below < rank && rank <= below + own) {
      int b = first;
      while (below + hist[b] < rank) below += hist[b++];
      found_key = prefix | ((unsigned)b << shift);
      found_rank = rank - below;
      found_count = hist[b];
    }
    __syncthreads();
    prefix = found_key;
    rank = found_rank;
  }
  // prefix: the NO-th smallest key; found_count: how many keys equal it; rank: how many of those
  // are picked (the first by position); every key below it is picked (NO - rank of them).
  if (found_count == rank) {
    // Every key equal to it is picked (no tie to break: the usual case), so every key <= it is:
    // a coalesced pass in any order, the place step below orders the picks.
    for (int e = tid; e < N; e += TPB) {
      const unsigned k = VQ_KEY(e);
      if (k <= prefix) {
        const unsigned slot = atomicAdd(&picked, 1u);
        pick_key[slot] = k;
        pick_pos[slot] = (unsigned)e;
      }
    }
  } else {
    // Ties cut: each thread takes a contiguous run of positions, so that the block scan of the
    // runs' tie counts gives each tie its order by position.
    constexpr int S = (N + TPB - 1) / TPB;
    const int lo = tid * S;
    const int hi = lo + S < N ? lo + S : N;
    unsigned ties = 0u;
    for (int e = lo; e < hi; ++e) ties += VQ_KEY(e) == prefix ? 1u : 0u;
    unsigned tie = vq_block_exclusive_sum<TPB>(ties, warp_sum);
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
  }
  __syncthreads();
  // Each pick's place in ascending (key, position) order, or in ascending position (BY_POSITION).
  for (int i = tid; i < NO; i += TPB) {
    const unsigned k = pick_key[i], p = pick_pos[i];
    unsigned place = 0u;
    for (int j = 0; j < NO; ++j) {
      const unsigned kj = pick_key[j];
      place += (BY_POSITION ? pick_pos[j] < p : (kj < k || (kj == k && pick_pos[j] < p))) ? 1u : 0u;
    }
    vq_positions[row * NO + place] = p;
  }
"""


# The arrays a paired launch takes per side (paired_rows).
_PAIRED = ("scores", "positions")


@lru_cache(maxsize=None)
def _kernel(paired: bool = False):
    """The selection's kernel; `paired`: two arrays of rows in one launch (paired_rows)."""
    return build_kernel(
        mx.fast.cuda_kernel,
        name="vq_outlier_select" + ("_pair" if paired else ""),
        input_names=paired_rows.argument_names(["scores"], _PAIRED, paired),
        output_names=paired_rows.argument_names(["positions"], _PAIRED, paired),
        source=paired_rows.prologue(_PAIRED, paired) + _SOURCE,
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
    return 0 < count <= entries and 8 * count + _FIXED_SHARED_BYTES <= kernel_header.STATIC_SHARED_BYTES


def _keys_shared(entries: int, count: int) -> bool:
    return 4 * entries + 8 * count + _FIXED_SHARED_BYTES <= kernel_header.STATIC_SHARED_BYTES


def smallest(scores: mx.array, count: int, by_position: bool = False) -> mx.array:
    """scores (..., N) float32 -> (..., count) uint32: per row, the positions of its `count`
    smallest scores, ties to the lower position, in ascending (score, position) order (a stable
    ascending argsort's first `count`); `by_position`: the same positions in ascending order
    (what GEAR stores: no sort after)."""
    return _select([scores], count, by_position)[0]


def smallest_pair(first: mx.array, second: mx.array, count: int,
                  by_position: bool = False) -> tuple[mx.array, mx.array]:
    """`smallest` of two arrays of rows of the same length in one launch (paired_rows):
    (smallest(first, count, by_position), smallest(second, ...)), the same bits."""
    if first.shape[-1] != second.shape[-1]:
        raise ValueError(f"a paired outlier selection takes rows of one length: got {first.shape[-1]} and "
                         f"{second.shape[-1]} entries")
    return _select([first, second], count, by_position)


def _select(sides: list[mx.array], count: int, by_position: bool) -> list[mx.array]:
    n = sides[0].shape[-1]
    if not fits(n, count):
        raise ValueError(f"outlier selection of {count} among {n} entries does not fit the kernel's shared "
                         f"memory: allowed is 0 < count <= entries and 8 * count <= "
                         f"{kernel_header.STATIC_SHARED_BYTES - _FIXED_SHARED_BYTES}")
    keys_shared = _keys_shared(n, count)
    threads = THREADS if keys_shared else WIDE_THREADS
    return _kernel(len(sides) == 2)(
        inputs=[side.astype(mx.float32) for side in sides],
        template=[("N", n), ("NO", count), ("KS", int(keys_shared)), ("TPB", threads), ("BY_POSITION", int(by_position)),
                  *paired_rows.lead_axes(sides, 1)],
        grid=(paired_rows.total_rows(sides, 1) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*side.shape[:-1], count) for side in sides],
        output_dtypes=[mx.uint32] * len(sides),
    )
