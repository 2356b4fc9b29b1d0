"""KVQuant's partials kernel compiled by nvcc for the H200 (sm_90) at the 8B shape (bf16, GQA 4,
head dim 128, the default 3 bits with outliers), in each setting of its value split and parking:
ptxas's registers per thread bound how many 4-warp blocks an SM holds (65536 registers, handed
out in units of 8 per thread: <= 128 four, <= 96 five; session 11's note said <= 102 five, which
Nsight Compute contradicts: 102 registers, 4 blocks, results/ncu_h200_s12.json), and none may
spill. The default's registers are asserted, so a change that loses four blocks fails here
(nvcc 13.0 measured 96 parked at OUTLIER_BATCH 4, 122 at 8 (the default since session 12: the
H200's nvrtc build of 4 took 102, four blocks already), 128 unparked, 168 for the old split).
Since session 32's two-level merge in the kernel (3c36222) OUTLIER_BATCH 4 takes 126 (nvcc
13.0.88, session 40, bisected): four blocks like the default, no longer five.
Slow (an nvcc run per setting); skipped without the CUDA toolkit. Every method's kernels at the
other shapes: tests/cache/test_kernels_nvcc.py."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from tests.cache import test_kernels_nvcc
from veloxquant_mlx.cache import fused_decode_codebook

pytestmark = [pytest.mark.slow, pytest.mark.skipif(test_kernels_nvcc.NVCC is None, reason="needs nvcc (the CUDA toolkit)")]

# (constants, the most registers allowed): the default parks (<= 128: four blocks per SM), and
# so does session 11's OUTLIER_BATCH 4 (<= 128; it fitted five by nvcc, <= 96, until session
# 32's two-level merge: 126 since; nvrtc took 102 on the H200 before it); the
# sums in registers at 32 accumulators and OUTLIER_BATCH 4 (<= 128: four); the old setting (64, unparked) only must
# not spill (168 registers: three blocks).
SETTINGS = [
    ({}, 128),
    ({"OUTLIER_BATCH": 4}, 128),
    ({"PARK_ACCUMULATORS": False, "OUTLIER_BATCH": 4}, 128),  # at 8 unparked: 150 (three blocks)
    ({"MAX_LANE_ACCUMULATORS": 64, "PARK_ACCUMULATORS": False}, 255),
    ({"KEY_SLOTS_BY_ROW": True}, 128),  # the key outliers' row-major slots (session 29, off)
]


@pytest.mark.parametrize("constants, most", SETTINGS, ids=["default", "ob4", "unparked", "old", "ksl"])
def test_the_8b_shape_compiles_within_its_register_bound(monkeypatch, tmp_path, constants, most):
    for constant, value in constants.items():
        monkeypatch.setattr(fused_decode_codebook, constant, value)
    captured = test_kernels_nvcc._captured("kvquant", mx.bfloat16, 4, 128)
    sources = {kernel.cuda_source(sig) for kernel, sig in captured if kernel.name == "vq_codebook_decode_partials_merged"}
    assert len(sources) == 1
    report = test_kernels_nvcc.compiled_without_spills(sources.pop(), tmp_path)
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    print(f"{constants or 'default'}: {registers} registers")
    assert registers <= most, report
