"""fused_prefill_affine's kernel compiled by nvcc for the H200 (sm_90), as the caches launch it
from a real prefill chunk (cuda_emulation.signatures_only records the launch): a proxy for
nvrtc's acceptance of the source, and ptxas must report no register spills. Slow (an nvcc run
per signature) and skipped without the CUDA toolkit; tests/cache/test_kernels_nvcc.py does the
same for the decode kernels (its _compile is reused), and could list this kernel itself."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from tests.cache.test_fused_prefill_affine import _fill, _kivi, _xquant_pair, emulated
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from veloxquant_mlx.cache import fused_prefill_affine, kernel_header

pytestmark = [pytest.mark.slow, pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")]

# The 8B shape's defaults in bf16 (kivi-2, xquant-2: float16 arithmetic into bf16), the widths
# that straddle words (3 bits) and the widest codes (8 bits) with the largest shared memory
# (head_dim 256), float32 and float16 outputs.
CASES = [
    ("kivi-2 bf16 hd128", _kivi(bit_width_inlier=2), mx.bfloat16, 128),
    ("kivi-3 fp16 hd128", _kivi(bit_width_inlier=3), mx.float16, 128),
    ("kivi-8 fp32 hd256 g128", _kivi(bit_width_inlier=8, kivi_group_size=128), mx.float32, 256),
    ("xquant-2 bf16 hd128", lambda: _xquant_pair(2)[0], mx.bfloat16, 128),
]


@pytest.mark.parametrize("name, make, dtype, D", CASES, ids=[c[0] for c in CASES])
def test_the_prefill_kernel_compiles_for_sm90_without_spills(tmp_path, name, make, dtype, D):
    cache = make()
    queries = _fill(cache, 160, 3, B=1, H=2, D=D, dtype=dtype)
    with cuda_emulation.signatures_only() as captured, emulated():
        cache._prefill_keys_values(queries)
    assert [k.name for k, _ in captured] == ["vq_affine_prefill_kv"], "the prefill kernel was not taken"
    kernel, sig = captured[0]
    report = compiled_without_spills(kernel.cuda_source(sig), tmp_path)
    shared = re.search(r"(\d+) bytes smem", report)
    assert shared and int(shared.group(1)) <= kernel_header.STATIC_SHARED_BYTES
    # supports() bounds the shared memory by fused_prefill_affine.shared_bytes: it must be exact.
    G = cache.group_size if cache.method == "kivi" else cache.group
    bits = cache.key_bits if cache.method == "kivi" else cache.code_bits
    assert int(shared.group(1)) == fused_prefill_affine.shared_bytes(D, G, bits)
