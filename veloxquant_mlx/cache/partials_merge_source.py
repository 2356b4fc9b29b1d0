"""The CUDA text that merges a decode launch's block partials into its output rows.

MERGE is the second kernel of the split build (PartialsKernel.split + merge_partials);
FUSED_PROLOGUE / FUSED_EPILOGUE wrap any partials kernel's source so that its last block per
head merges in the same launch (the fused build, fused_decode.MERGE_IN_KERNEL): the partials go
to the launch's scratch and the header's vq_merge_if_last merges them.
"""

from __future__ import annotations

# Kernel 2: merge the blocks' partials of one (batch*kv-head, row) into the output row. One
# block of DV threads per row: the block weights exp(m_b - M) are computed once, spread over the
# threads, then each thread sums its channel over the blocks (loads independent, coalesced).
MAX_BLOCKS = 2048
MERGE = r"""
  __shared__ float weight[MAX_BLOCKS];
  __shared__ float red[32];
  const float neg_inf = __int_as_float(0xff800000);
  const int c = threadIdx.x;
  const int row = blockIdx.y;                 // bh * R + r
  const int n_blocks = part_m_shape[1];
  const int R = part_m_shape[2];
  const int bh = row / R, r = row % R;
  const float* pm = part_m + (size_t)bh * n_blocks * R + r;
  const float* pl = part_l + (size_t)bh * n_blocks * R + r;
  const float* po = part_o + ((size_t)bh * n_blocks * R + r) * DV + c;

  float top = neg_inf;
  for (int b = c; b < n_blocks; b += DV) top = fmaxf(top, pm[(size_t)b * R]);
  top = vq_warp_max(top);
  if (c % 32 == 0) red[c / 32] = top;
  __syncthreads();
  top = neg_inf;
  for (int w = 0; w < DV / 32; ++w) top = fmaxf(top, red[w]);
  __syncthreads();

  float den = 0.f;
  for (int b = c; b < n_blocks; b += DV) {
    const float mb = pm[(size_t)b * R];
    const float e = mb == neg_inf ? 0.f : expf(mb - top);
    weight[b] = e;
    den = fmaf(e, pl[(size_t)b * R], den);
  }
  den = vq_warp_sum(den);
  if (c % 32 == 0) red[c / 32] = den;
  __syncthreads();
  den = 0.f;
  for (int w = 0; w < DV / 32; ++w) den += red[w];

  float o = 0.f;
  #pragma unroll 8
  for (int b = 0; b < n_blocks; ++b) o = fmaf(weight[b], po[(size_t)b * R * DV], o);
  out[(size_t)row * DV + c] = vq_cast<QT>(o / den);
"""

# Put before / after a partials kernel's source to fuse the merge in: the source writes part_o /
# part_m / part_l (BH, n_blocks, R, DV) / (BH, n_blocks, R) as before, now slices of `scratch`
# (grid: x = n_blocks blocks, y = BH), and ends with its block partial written.
# Macros, not pointer variables: computed where used (the end), so no register holds them
# through the kernel's loops (as variables: 106 registers against 96, ptxas sm_90, kivi's 8B shape).
# `counts` and `scratch` are inputs (MLX declares them const): the kernel counts in the one and
# leaves it at zero, and writes the partials to the other, read back within the same launch.
FUSED_PROLOGUE = r"""
#define part_o (const_cast<float*>(scratch))
#define part_m (const_cast<float*>(scratch) + (size_t)gridDim.y * gridDim.x * R * DV)
#define part_l (const_cast<float*>(scratch) + (size_t)gridDim.y * gridDim.x * R * (DV + 1))
"""
FUSED_EPILOGUE = r"""
  vq_merge_if_last<R, DV>(part_o, part_m, part_l, part_l + (size_t)gridDim.y * gridDim.x * R,
                          const_cast<int*>(counts), out, blockIdx.y, gridDim.x);
#undef part_o
#undef part_m
#undef part_l
"""
