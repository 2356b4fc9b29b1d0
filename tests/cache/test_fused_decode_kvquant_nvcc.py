"""KVQuant's partials kernel compiled by nvcc for the H200 (sm_90) at the 8B shape (bf16, GQA 4,
head dim 128, the default 3 bits with outliers), in each setting of its value split and parking:
ptxas's registers per thread bound how many 4-warp blocks an SM holds (65536 registers: <= 128
four, <= 102 five), and none may spill. The default's registers are asserted, so a change that
loses the saving fails here (nvcc 13.0 measured 96 parked, 128 unparked, 168 for the old split).
Slow (an nvcc run per setting); skipped without the CUDA toolkit. Every method's kernels at the
other shapes: tests/cache/test_kernels_nvcc.py."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from tests.cache import test_kernels_nvcc
from veloxquant_mlx.cache import fused_decode_codebook

pytestmark = [pytest.mark.slow, pytest.mark.skipif(test_kernels_nvcc.NVCC is None, reason="needs nvcc (the CUDA toolkit)")]

# (constants, the most registers allowed): the default parks (<= 102: five blocks per SM); the
# sums in registers at 32 accumulators (<= 128: four); the old setting (64, unparked) only must
# not spill (168 registers: three blocks).
SETTINGS = [
    ({}, 102),
    ({"PARK_ACCUMULATORS": False}, 128),
    ({"MAX_LANE_ACCUMULATORS": 64, "PARK_ACCUMULATORS": False}, 255),
]


@pytest.mark.parametrize("constants, most", SETTINGS, ids=["default", "unparked", "old"])
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
