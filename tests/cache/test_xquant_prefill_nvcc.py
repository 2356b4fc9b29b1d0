"""The prefill kernels of xquant's encode (fused_encode_xquant) and minicache's K/V build
(fused_prefill_merged) compiled by nvcc for the H200 (sm_90), as the caches launch them
(cuda_emulation.signatures_only records the launches): a proxy for nvrtc's acceptance of the
sources, and ptxas must report no register spills. Slow (an nvcc run per signature) and skipped
without the CUDA toolkit (tests/cache/test_kernels_nvcc.py's helper is reused)."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from tests.cache.test_minicache_prefill import _pair as _minicache_pair
from tests.cache.test_minicache_prefill import _queries
from tests.cache.test_minicache_prefill import emulated as minicache_emulated
from tests.cache.test_xquant_prefill_kernel import _data, _pair as _xquant_pair
from tests.cache.test_xquant_prefill_kernel import emulated as xquant_emulated
from veloxquant_mlx.cache import fused_encode_xquant

pytestmark = [pytest.mark.slow, pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")]


# The 8B shape's defaults in bf16 (2 bits, group 32), 3 bits (codes straddle words) in fp16,
# 4 bits with groups of 128 (the largest shared memory) in float32.
XQUANT_CASES = [("2-bit g32 bf16", 2, 32, mx.bfloat16), ("3-bit g32 fp16", 3, 32, mx.float16),
                ("4-bit g128 fp32", 4, 128, mx.float32)]


@pytest.mark.parametrize("name, bits, group, dtype", XQUANT_CASES, ids=[c[0] for c in XQUANT_CASES])
def test_the_xquant_encode_kernels_compile_for_sm90_without_spills(tmp_path, name, bits, group, dtype):
    pair = _xquant_pair(bits=bits, group=group)
    with cuda_emulation.signatures_only() as captured, xquant_emulated():
        for cache in pair:
            k, v = _data(1, 2 * group + 40, 128, dtype, seed=0)
            cache.update_and_fetch(k, v)
            cache.attention(mx.random.normal((1, 4, 16, 128)).astype(dtype), scale=128**-0.5, mask="causal")
    kernels = {kernel.name: (kernel, sig) for kernel, sig in captured if kernel.name.startswith("vq_xquant")}
    assert sorted(kernels) == ["vq_xquant_encode_kv", "vq_xquant_fit_kv"], [k.name for k, _ in captured]
    for index, (kernel, sig) in enumerate(kernels.values()):
        report = compiled_without_spills(kernel.cuda_source(sig), tmp_path, index)
        if kernel.name == "vq_xquant_encode_kv":
            shared = re.search(r"(\d+) bytes smem", report)
            assert shared and int(shared.group(1)) == fused_encode_xquant.shared_bytes(128, group, bits)


MINICACHE_CASES = [("fp16 directions bf16", dict(D=128, dtype=mx.bfloat16), mx.bfloat16),
                   ("4-bit directions fp16", dict(D=128, bits=4, dtype=mx.float16), mx.float16),
                   ("no slots fp32 -> bf16", dict(D=64, slots=0, dtype=mx.float32), mx.bfloat16)]


@pytest.mark.parametrize("name, kwargs, q_dtype", MINICACHE_CASES, ids=[c[0] for c in MINICACHE_CASES])
def test_the_minicache_prefill_kernel_compiles_for_sm90_without_spills(tmp_path, name, kwargs, q_dtype):
    cache = _minicache_pair(**kwargs, n=64)[1]
    with cuda_emulation.signatures_only() as captured, minicache_emulated():
        cache._prefill_keys_values(_queries(cache, q_dtype))
    assert [k.name for k, _ in captured] == ["vq_merged_prefill_kv"], "the prefill kernel was not taken"
    kernel, sig = captured[0]
    compiled_without_spills(kernel.cuda_source(sig), tmp_path)
