"""KVQuant's block encode kernels (kvquant_encode_kernel.py) against the MLX ops' encode, bit for
bit: on the CPU through the thread-level CUDA emulation (tests/cache/cuda_emulation.py, which
cannot check nvrtc's acceptance nor speed), on MLX's CUDA backend for real (`pytest -m cuda`),
and compiled by nvcc for sm_90 without spills (slow) as a proxy for nvrtc."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.test_encoder_identity import _bits, _kv
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from tests.cache.stable_selection import stable_argpartition
from veloxquant_mlx.cache import (
    kvquant_encode_kernel,
    kvquant_fit_kernel,
    nonuniform_codebook,
    outlier_select_kernel,
)
from veloxquant_mlx.cache.kvquant import KVQuantCache
from veloxquant_mlx.config import KVCacheConfig

needs_compiler = pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")


def _primed(bits, fraction, keys, values, first_tokens):
    """A cache that has encoded its first chunk (sink and codebooks) through the MLX ops."""
    config = KVCacheConfig(method="kvquant", kvquant_bits=bits, kvquant_outlier_fraction=fraction)
    cache = KVQuantCache(config)
    cache.update_and_fetch(keys[:, :, :first_tokens], values[:, :, :first_tokens])
    cache._flush()
    mx.eval(cache.store)
    return cache


def _later_chunk_both_ways(bits, fraction, keys, values, first_tokens, kernel):
    """`_encode` of the chunk after the first: through the MLX ops and through `kernel`
    (a context manager turning the kernels on), the same cache state for both."""
    cache = _primed(bits, fraction, keys, values, first_tokens)
    chunk_k, chunk_v = keys[:, :, first_tokens:], values[:, :, first_tokens:]
    reference = cache._encode(chunk_k, chunk_v)
    mx.eval(reference)
    with kernel() as made:
        ours = cache._encode(chunk_k, chunk_v)
        mx.eval(ours)
    return reference, ours, made


@pytest.fixture
def stable_selection():
    """The ops' outliers chosen by the selection kernel's rule (tests/cache/stable_selection.py)."""
    with stable_argpartition():
        yield


def _assert_same_bits(reference: dict, ours: dict) -> None:
    assert sorted(ours) == sorted(reference)
    for name, a in reference.items():
        b = ours[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert np.array_equal(_bits(a), _bits(b)), f"{name} differs"


CASES = [
    # (heads, head dim, dtype, bits, outlier fraction, data)
    (2, 128, mx.bfloat16, 3, 0.01, True),  # the 8B heads' dim in bf16, the H200 runs' setting
    (2, 64, mx.float32, 3, 0.01, False),
    (3, 64, mx.float16, 2, 0.01, True),  # SmolLM2's shape
    (2, 64, mx.float16, 4, 0.0, True),  # no outliers: the encode kernel alone
    (2, 64, mx.float16, 3, 0.02, "degenerate"),  # zero vectors, -0.0, ties among outlier scores
    (2, 80, mx.bfloat16, 3, 0.01, True),  # values of 80 channels: the outlier ranking runs eagerly
]


def _batched(keys, values, batch):
    """K/V of `batch` sequences: the given ones, then the same scaled and shifted."""
    ks = [keys * (1 + 0.5 * b) + b for b in range(batch)]
    vs = [values * (1 - 0.25 * b) for b in range(batch)]
    return mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)


@needs_compiler
@pytest.mark.parametrize("heads, dim, dtype, bits, fraction, data", CASES)
def test_kernel_encode_is_the_ops_encode_bit_for_bit(stable_selection, heads, dim, dtype, bits, fraction, data):
    # The degenerate data's later chunk spans all-zero keys (tokens < 300) and -0.0 values (600..900).
    first = 32 * 9 if data == "degenerate" else 32 * 6
    later = 32 * 12 if data == "degenerate" else 32 * 4
    keys, values = _kv(first + later, heads, dim, dtype, seed=bits, real_shaped=data)
    if dim == 64 and data is True:  # two sequences: per-sequence codebooks and blocks
        keys, values = _batched(keys, values, 2)
    reference, ours, made = _later_chunk_both_ways(bits, fraction, keys, values, first, cuda_emulation.emulated_kernels)
    names = sorted(k.name for k in made)
    expected = ["vq_kvquant_block_encode", "vq_kvquant_encode_masked", "vq_outlier_select"]
    assert names == (expected if fraction else ["vq_kvquant_block_encode"])
    _assert_same_bits(reference, ours)


@needs_compiler
def test_without_the_selection_kernel_the_argpartition_is_read_in_place(monkeypatch):
    """outlier_select_kernel.ENABLED = False: the encode kernels read the whole argpartition
    (its first `count` per block), bit for bit the ops' encode with argpartition's own picks."""
    monkeypatch.setattr(outlier_select_kernel, "ENABLED", False)
    keys, values = _kv(32 * 10, 2, 128, mx.bfloat16, seed=3, real_shaped=True)
    reference, ours, made = _later_chunk_both_ways(3, 0.01, keys, values, 32 * 6, cuda_emulation.emulated_kernels)
    assert sorted(k.name for k in made) == ["vq_kvquant_block_encode", "vq_kvquant_encode_masked"]
    _assert_same_bits(reference, ours)


@needs_compiler
def test_a_first_chunk_keeps_the_ops():
    """The first chunk fits the codebooks on the normalized values: no kernel runs."""
    keys, values = _kv(64, 2, 64, mx.float16, seed=1, real_shaped=True)
    cache = KVQuantCache(KVCacheConfig(method="kvquant"))
    cache.update_and_fetch(keys, values)
    with cuda_emulation.emulated_kernels() as made:
        cache._flush()
        mx.eval(cache.store)
    assert made == []


@needs_compiler
def test_the_enabled_switches_turn_the_kernels_off(monkeypatch):
    """kvquant_encode_kernel.ENABLED / kvquant_fit_kernel.ENABLED = False (the measurement
    modules' --set, for an A/B on the GPU): the MLX ops, with our other kernels still on."""
    monkeypatch.setattr(kvquant_encode_kernel, "ENABLED", False)
    monkeypatch.setattr(kvquant_fit_kernel, "ENABLED", False)
    monkeypatch.setattr(nonuniform_codebook, "_fit_compiled", lambda: False)
    keys, values = _kv(128, 2, 64, mx.float16, seed=1, real_shaped=True)
    cache = KVQuantCache(KVCacheConfig(method="kvquant"))
    with cuda_emulation.emulated_kernels() as made:
        for part in (slice(0, 64), slice(64, 128)):  # a first chunk (the fit), then a later one
            cache.update_and_fetch(keys[:, :, part], values[:, :, part])
            cache._flush()
            mx.eval(cache.store)
    assert cache.n_compressed == 128 and made == []


def test_blocks_too_large_for_the_shared_flags_keep_the_ops(monkeypatch):
    monkeypatch.setattr(kvquant_encode_kernel, "enabled", lambda: True)
    cache = KVQuantCache(KVCacheConfig(method="kvquant", kvquant_group_size=128))
    cache.head_dim = cache.value_dim = 512  # 128 x 512 entries per block: over MAX_BLOCK_ENTRIES
    assert not cache._encode_kernel_applies()
    cache.head_dim = cache.value_dim = 128
    assert cache._encode_kernel_applies()


class _KernelsOn:
    """The real kernels (MLX's CUDA backend) with fused_decode.kernels_enabled forced on."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def __call__(self):
        self.monkeypatch.setattr(kvquant_encode_kernel, "enabled", lambda: True)
        return self

    def __enter__(self):
        return []

    def __exit__(self, *exc):
        self.monkeypatch.setattr(kvquant_encode_kernel, "enabled", lambda: False)
        return False


@cuda_test
@pytest.mark.parametrize("heads, dim, dtype, bits, fraction, data", CASES + [(8, 128, mx.bfloat16, 3, 0.01, True)])
def test_kernel_encode_on_cuda_is_the_ops_encode_bit_for_bit(stable_selection, monkeypatch, heads, dim, dtype, bits, fraction, data):
    monkeypatch.setattr(kvquant_encode_kernel, "enabled", lambda: False)
    keys, values = _kv(2048 + 2048, heads, dim, dtype, seed=bits, real_shaped=data)
    reference, ours, _ = _later_chunk_both_ways(bits, fraction, keys, values, 2048, _KernelsOn(monkeypatch))
    _assert_same_bits(reference, ours)


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_kernels_compile_for_sm90_without_spills(tmp_path):
    keys, values = _kv(32 * 4, 2, 128, mx.bfloat16, seed=3, real_shaped=True)
    cache = _primed(3, 0.01, keys, values, 64)
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        cache._encode(keys[:, :, 64:], values[:, :, 64:])
    sources = sorted({kernel.cuda_source(sig) for kernel, sig in captured})
    # The encode kernel for keys (per channel) and values (per token); one masked kernel and one
    # selection kernel serve both (same block shape and outlier count).
    assert len(sources) == 4
    for i, source in enumerate(sources):
        compiled_without_spills(source, tmp_path, i)
