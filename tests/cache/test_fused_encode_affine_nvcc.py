"""fused_encode_affine's kernel compiled by nvcc for the H200 (sm_90), as KIVICache._encode
launches it from a real flush (cuda_emulation.signatures_only records the launch): a proxy for
nvrtc's acceptance of the source (the CUDA intrinsics __fdiv_rn, __float2half_rn,
__float2bfloat16_rn are CUDA's own here, not the emulation's stand-ins), and ptxas must report no
register spills. Slow (an nvcc run per signature) and skipped without the CUDA toolkit; reuses
tests/cache/test_kernels_nvcc.py's _compile."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from tests.cache.test_fused_encode_affine import _block, _cache, emulated
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from veloxquant_mlx.cache import fused_encode_affine, kernel_header

pytestmark = [pytest.mark.slow, pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")]

# The 8B shape's default in bf16 (kivi-2), the width that straddles words (3 bits) in float16,
# mixed widths from float32, and the widest codes with the largest shared memory (head_dim 256,
# group 128, 8 bits).
CASES = [
    ("kivi-2 bf16 hd128", {"bit_width_inlier": 2}, mx.bfloat16, 128),
    ("kivi-3 fp16 hd128", {"bit_width_inlier": 3}, mx.float16, 128),
    ("kivi-4/2 fp32 hd64", {"key_bits": 4, "value_bits": 2}, mx.float32, 64),
    ("kivi-8 bf16 hd256 g128", {"bit_width_inlier": 8, "kivi_group_size": 128}, mx.bfloat16, 256),
]


@pytest.mark.parametrize("name, fields, dtype, D", CASES, ids=[c[0] for c in CASES])
def test_the_encode_kernel_compiles_for_sm90_without_spills(tmp_path, name, fields, dtype, D):
    cache = _cache(**fields)
    G = cache.group_size
    keys, values = _block(1, 2, 2 * G + 32, D, D, dtype, 2, 2, G)
    with cuda_emulation.signatures_only() as captured, emulated():
        cache.update_and_fetch(keys, values)
        cache._flush()
    assert [k.name for k, _ in captured] == ["vq_affine_encode_kv"], "the encode kernel was not taken"
    kernel, sig = captured[0]
    report = compiled_without_spills(kernel.cuda_source(sig), tmp_path)
    shared = re.search(r"(\d+) bytes smem", report)
    # supports() bounds the shared memory by fused_encode_affine.shared_bytes: it must be exact.
    assert shared and int(shared.group(1)) == fused_encode_affine.shared_bytes(D, G, cache.key_bits)
    assert int(shared.group(1)) <= kernel_header.STATIC_SHARED_BYTES
