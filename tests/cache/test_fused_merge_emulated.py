"""The merge fused into every partials kernel (fused_decode.vq_merge_if_last), run alone on the
CPU by the thread-level emulation (tests/cache/cuda_emulation.py) over more blocks than a warp
has lanes: its lanes take the partials 32 at a time, and past MERGE_GROUP blocks per head it
merges in two levels (groups of MERGE_GROUP blocks, then the groups' partials); the caches'
emulated decode steps (tests/cache/test_fused_decode_emulated.py, a few blocks per head) reach
neither.

A kernel whose every block calls vq_merge_if_last on block partials handed in as inputs (the
scratch the partials kernels write; the groups' scratch and the counters sized as the caller
sizes them): the last block per head to count in writes the merged rows; against numpy's
sum_b e_b o_b / sum_b e_b l_b, e_b = exp(m_b - max m), with some blocks empty (m = -inf, as a
block past a short history leaves it), in some cases a whole group of them.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from veloxquant_mlx.cache import fused_decode, kernel_header

pytestmark = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)

# Each block hands the merge its own slab of `out` (n_blocks slabs of heads x R x DV): the one
# slab per head written must be the last block's. The emulation runs blocks in index order with
# the partials already in place, so a merge by any other block would still come out right.
_SOURCE = """
  vq_merge_if_last<R, DV>(part_o, part_m, part_l, const_cast<float*>(groups), const_cast<int*>(counts),
                          out + (size_t)blockIdx.x * gridDim.y * R * DV, blockIdx.y, gridDim.x);
"""


def _reference(part_o, part_m, part_l):
    top = part_m.max(axis=1, keepdims=True)
    e = np.where(np.isneginf(part_m), 0.0, np.exp(part_m - top))
    return (e[..., None] * part_o).sum(axis=1) / (e * part_l).sum(axis=1)[..., None]


# One level (5, 16 blocks), two levels with a last group of one block (17, 33), of a few (41,
# 70) and runs of 32 groups (130 blocks in 9 groups: one run); channels a lane takes 1-8.
@pytest.mark.parametrize("heads, n_blocks, R, DV, empty_group", [
    (2, 70, 4, 128, True), (1, 33, 8, 64, False), (3, 5, 1, 96, False), (1, 16, 4, 128, False),
    (2, 17, 4, 128, False), (1, 130, 2, 256, True), (2, 41, 4, 80, False)],
    ids=["70 blocks, 4 rows", "33 blocks, 8 rows over 4 warps", "5 blocks, 1 row, 96 channels",
         "16 blocks: one level", "17 blocks: two levels", "130 blocks, 256 channels", "41 blocks, 80 channels"])
def test_the_last_block_merges_every_blocks_partial(heads, n_blocks, R, DV, empty_group):
    rng = np.random.default_rng(n_blocks)
    part_m = rng.normal(scale=3.0, size=(heads, n_blocks, R)).astype(np.float32)
    part_m[:, 1::9] = -np.inf  # empty blocks
    if empty_group:  # every block of the second group empty: its group partial is too
        part_m[:, kernel_header.MERGE_GROUP:2 * kernel_header.MERGE_GROUP] = -np.inf
    part_l = rng.uniform(0.5, 4.0, size=(heads, n_blocks, R)).astype(np.float32)
    part_l[np.isneginf(part_m)] = 0.0
    part_o = rng.normal(size=(heads, n_blocks, R, DV)).astype(np.float32)
    kernel = cuda_emulation.cuda_kernel(
        name="vq_test_fused_merge", input_names=["part_o", "part_m", "part_l", "groups", "counts"],
        output_names=["out"], source=_SOURCE, header=kernel_header.HEADER)
    groups_floats = fused_decode.scratch_floats(heads, n_blocks, R, DV) - heads * n_blocks * R * (DV + 2)
    assert (groups_floats > 0) == (n_blocks > kernel_header.MERGE_GROUP)
    counts = mx.zeros((fused_decode.merge_counters(heads, n_blocks),), dtype=mx.int32)
    (out,) = kernel(
        inputs=[mx.array(part_o), mx.array(part_m), mx.array(part_l), mx.zeros((max(groups_floats, 1),)), counts],
        template=[("R", R), ("DV", DV)], grid=(32 * fused_decode.WARPS_PER_BLOCK * n_blocks, heads, 1),
        threadgroup=(32 * fused_decode.WARPS_PER_BLOCK, 1, 1),
        output_shapes=[(n_blocks, heads, R, DV)], output_dtypes=[mx.float32])
    out = np.array(out)
    # Unwritten slabs keep the emulation's fill (NaN): only the last block's holds the rows.
    assert np.isnan(out[:-1]).all()
    np.testing.assert_allclose(out[-1], _reference(part_o, part_m, part_l), rtol=2e-5, atol=2e-6)
