"""KVQuant's prefill history kernel (kvquant_prefill_kernel.py) against the MLX ops' path, bit
for bit: on the CPU through the thread-level CUDA emulation (tests/cache/cuda_emulation.py,
which cannot check nvrtc's acceptance nor speed), on MLX's CUDA backend for real, and compiled
by nvcc for sm_90 (slow) as a proxy for nvrtc."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from veloxquant_mlx.cache import kvquant_prefill_kernel
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.kvquant import KVQuantCache
from veloxquant_mlx.config import KVCacheConfig


def _filled(dtype, tokens: int, *, bits=3, fraction=0.01, dim=64, B=1, H=2, chunk=96, seed=0, window=20, group=32):
    cache = KVQuantCache(KVCacheConfig(method="kvquant", kvquant_bits=bits, kvquant_outlier_fraction=fraction,
                                       kvquant_group_size=group))
    mx.random.seed(seed)
    k = mx.random.normal((B, H, tokens, dim)) * mx.exp(mx.random.normal((B, H, tokens, dim))) + 0.5
    k = mx.concatenate([k[:, :, :1] * 8.0, k[:, :, 1:]], axis=2).astype(dtype)  # a large sink
    v = mx.random.normal((B, H, tokens, dim)).astype(dtype)
    for s0 in range(0, tokens, chunk):
        cache.update_and_fetch(k[:, :, s0 : s0 + chunk], v[:, :, s0 : s0 + chunk])
        cache._flush()
        mx.eval(cache.store)
    # One more (unflushed) chunk: the window the result ends with (the kernel's last grid blocks
    # copy it, G = 32 tokens each, after the fill's unflushed 7 tokens).
    cache.update_and_fetch(k[:, :, :window], v[:, :, :window])
    return cache


def _kernel_path(cache, queries):
    with cuda_emulation.emulated_kernels() as made:
        kvquant_prefill_kernel._kernel.cache_clear()
        try:
            out = cache._prefill_keys_values(queries)
            mx.eval(out)
        finally:
            kvquant_prefill_kernel._kernel.cache_clear()
    assert [k.name for k in made] == ["vq_kvquant_history_decode"]
    return out


CASES = [
    # (cache dtype, queries dtype, bits, outlier fraction, head dim, batch)
    (mx.bfloat16, mx.bfloat16, 3, 0.01, 64, 1),
    (mx.float16, mx.float32, 2, 0.01, 64, 2),
    (mx.float32, mx.bfloat16, 4, 0.0, 64, 1),
    (mx.bfloat16, mx.bfloat16, 3, 0.01, 128, 1),
]


@pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")
def test_blocks_too_large_for_shared_memory_are_written_straight_to_global_memory():
    # 128 tokens x 128 channels of float32 output: 64 KB, past the kernel's 32 KB staging tile.
    cache = _filled(mx.bfloat16, 128 * 2 + 7, dim=128, group=128, chunk=128)
    queries = mx.random.normal((1, 4, 20, 128)).astype(mx.float32)
    reference = CompressedKVCache._prefill_keys_values(cache, queries)
    mx.eval(reference)
    ours = _kernel_path(cache, queries)
    for a, b in zip(ours, reference):
        assert a.shape == b.shape and a.dtype == b.dtype == mx.float32
        assert bytes(memoryview(a)) == bytes(memoryview(b))


@pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")
def test_kernel_copies_a_window_of_several_blocks_after_the_history():
    cache = _filled(mx.bfloat16, 32 * 3 + 7, window=70)
    assert cache.n_compressed == 96 and cache._window_length() == 77  # 2 whole blocks and 13 tokens
    queries = mx.random.normal((1, 4, 70, 64)).astype(mx.float16)
    reference = CompressedKVCache._prefill_keys_values(cache, queries)
    mx.eval(reference)
    ours = _kernel_path(cache, queries)
    for a, b in zip(ours, reference):
        assert a.shape == b.shape == (1, 2, cache.offset, 64) and a.dtype == b.dtype == mx.float16
        assert bytes(memoryview(a)) == bytes(memoryview(b))


@pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")
@pytest.mark.parametrize("dtype, qdtype, bits, fraction, dim, B", CASES)
def test_kernel_history_is_the_ops_path_bit_for_bit(dtype, qdtype, bits, fraction, dim, B):
    cache = _filled(dtype, 32 * 5 + 7, bits=bits, fraction=fraction, dim=dim, B=B)
    queries = mx.random.normal((B, 4, 20, dim)).astype(qdtype)
    reference = CompressedKVCache._prefill_keys_values(cache, queries)
    mx.eval(reference)
    ours = _kernel_path(cache, queries)
    for a, b in zip(ours, reference):
        assert a.shape == b.shape and a.dtype == b.dtype == qdtype
        assert bytes(memoryview(a)) == bytes(memoryview(b))


@cuda_test
@pytest.mark.parametrize("dtype, qdtype, bits, fraction, dim, B", CASES)
def test_kernel_history_on_cuda_is_the_ops_path_bit_for_bit(monkeypatch, dtype, qdtype, bits, fraction, dim, B):
    cache = _filled(dtype, 32 * 70 + 7, bits=bits, fraction=fraction, dim=dim, B=B, chunk=512)
    queries = mx.random.normal((B, 4, 20, dim)).astype(qdtype)
    monkeypatch.setattr(kvquant_prefill_kernel, "enabled", lambda: False)
    reference = cache._prefill_keys_values(queries)  # the eager pieces
    base = CompressedKVCache._prefill_keys_values(cache, queries)
    monkeypatch.setattr(kvquant_prefill_kernel, "enabled", lambda: True)
    ours = cache._prefill_keys_values(queries)
    mx.eval(reference, base, ours)
    for a, b, c in zip(ours, reference, base):
        assert bytes(memoryview(a)) == bytes(memoryview(b)) == bytes(memoryview(c))


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    cache = _filled(mx.bfloat16, 32 * 3 + 7, dim=128)
    queries = mx.random.normal((1, 4, 20, 128)).astype(mx.bfloat16)
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        kvquant_prefill_kernel._kernel.cache_clear()
        cache._prefill_keys_values(queries)
    kvquant_prefill_kernel._kernel.cache_clear()
    sources = sorted({kernel.cuda_source(sig) for kernel, sig in captured})
    assert len(sources) == 2  # keys (per-channel side data) and values (per-token)
    for i, source in enumerate(sources):
        compiled_without_spills(source, tmp_path, i)
