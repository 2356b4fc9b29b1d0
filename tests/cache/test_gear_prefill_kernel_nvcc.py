"""gear_prefill_kernel's kernel compiled by nvcc for the H200 (sm_90), as GEARCache launches it
from a prefill chunk (cuda_emulation.signatures_only records the launch): a proxy for nvrtc's
acceptance of the source, and ptxas must report no register spills and the static shared
memory gear_prefill_kernel.shared_bytes counts. Slow (an nvcc run per signature) and skipped
without the CUDA toolkit."""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from tests.cache.test_gear_prefill_kernel import emulated, filled
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from veloxquant_mlx.cache import gear_prefill_kernel, kernel_header

pytestmark = [pytest.mark.slow, pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")]

# The policy's gear-2 at the 8B shape in bf16; 3-bit codes (straddling words) in fp16; the
# widest codes, rank 8 and the largest shared memory (head_dim 256, 8 bits) in float32; no low
# rank and no outliers (their code compiled out).
CASES = [
    ("gear-2 bf16 hd128", dict(dim=128)),
    ("gear-3 fp16 hd128", dict(dim=128, bits=3, dtype=mx.float16)),
    ("gear-8 fp32 hd256 g128 r8", dict(dim=256, bits=8, group=128, rank=8, dtype=mx.float32)),
    ("gear-2 bf16 hd128 r0 no outliers", dict(dim=128, rank=0, fraction=0.0)),
]


@pytest.mark.parametrize("name, args", CASES, ids=[c[0] for c in CASES])
def test_the_gear_prefill_kernel_compiles_for_sm90_without_spills(tmp_path, name, args):
    cache = filled(**{**args, "chunks": (256, 3)})
    queries = mx.zeros((1, 4, 16, cache.head_dim), cache.dtype)
    with cuda_emulation.signatures_only() as captured, emulated():
        cache._prefill_keys_values(queries)
    assert [k.name for k, _ in captured] == ["vq_gear_prefill_kv"], "the prefill kernel was not taken"
    kernel, sig = captured[0]
    report = compiled_without_spills(kernel.cuda_source(sig), tmp_path)
    shared = re.search(r"(\d+) bytes smem", report)
    sparse = cache.outlier_fraction > 0
    assert shared and int(shared.group(1)) <= kernel_header.STATIC_SHARED_BYTES
    assert int(shared.group(1)) == gear_prefill_kernel.shared_bytes(cache.head_dim, cache.value_dim,
                                                                   cache.code_bits, sparse, cache.rank,
                                                                   cache.code_group, cache.block_tokens)
