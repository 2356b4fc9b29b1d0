"""KVQuantCache's prefill history (`_prefill_keys_values`: fixed-size pieces written into one
preallocated result) gives exactly the K/V of the base class's path (the whole history through
`_decode`, concatenated with the window, cast to the queries' dtype), compiled or eager."""

from __future__ import annotations

import io
import re

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache import kvquant, kvquant_prefill_kernel
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.kvquant import KVQuantCache
from veloxquant_mlx.config import KVCacheConfig


@pytest.fixture(autouse=True)
def _pieces_path(monkeypatch):
    """These tests are about the pieces (the CPU's path, and a GPU's without our CUDA kernel);
    the kernel has its own tests (test_kvquant_prefill_kernel_emulated.py)."""
    monkeypatch.setattr(kvquant_prefill_kernel, "enabled", lambda: False)


def _filled(dtype, tokens: int, chunk: int, fraction: float, bits: int = 3, dim: int = 64, seed: int = 0):
    """A cache fed `tokens` tokens in prompt chunks (flushed as a prefill leaves it), with a
    window of tokens % 32 left; heavy-tailed K/V so that outliers matter."""
    cache = KVQuantCache(KVCacheConfig(method="kvquant", kvquant_bits=bits, kvquant_outlier_fraction=fraction))
    cache.decode_chunk_tokens = 4 * 32  # pieces of 4 blocks: several pieces and an overlap
    mx.random.seed(seed)
    k = (mx.random.normal((1, 2, tokens, dim)) * mx.exp(mx.random.normal((1, 2, tokens, dim)))).astype(dtype)
    v = mx.random.normal((1, 2, tokens, dim)).astype(dtype)
    for s0 in range(0, tokens, chunk):
        cache.update_and_fetch(k[:, :, s0 : s0 + chunk], v[:, :, s0 : s0 + chunk])
        cache._flush()
        mx.eval(cache.store)
    return cache


def _assert_same(a: mx.array, b: mx.array) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    # Bit for bit, NaN-free: compare the raw bytes.
    assert np.array_equal(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)))
    assert bytes(memoryview(a)) == bytes(memoryview(b))


# (compiled, product apart): the CPU's fused pieces, the eager ops a GPU runs by default, and
# the compiled pieces with the product written apart (KVQuantCache.prefill_compiled_off_cpu).
MODES = {"fused": (True, False), "eager": (False, False), "apart": (True, True)}


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("fraction", [0.0, 0.01])
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("tokens", [70, 32 * 4 + 5, 32 * 11 + 17])
def test_prefill_history_is_the_base_path_bit_for_bit(monkeypatch, dtype, fraction, mode, tokens):
    monkeypatch.setattr(kvquant, "_prefill_piece_mode", lambda: MODES[mode])
    cache = _filled(dtype, tokens, chunk=50, fraction=fraction)
    assert cache.n_compressed and cache.window_keys is not None
    queries = mx.random.normal((1, 4, 20, 64)).astype(dtype)
    ours = cache._prefill_keys_values(queries)
    reference = CompressedKVCache._prefill_keys_values(cache, queries)
    for a, b in zip(ours, reference):
        _assert_same(a, b)


@pytest.mark.parametrize("bits", [2, 4])
def test_prefill_history_other_bits_and_queries_dtype(bits):
    # float32 queries over a bfloat16 cache: the history is rounded to bfloat16 first, as the
    # base path's _decode does, then widened.
    cache = _filled(mx.bfloat16, 32 * 9, chunk=96, fraction=0.01, bits=bits)
    queries = mx.random.normal((1, 4, 20, 64))
    ours = cache._prefill_keys_values(queries)
    reference = CompressedKVCache._prefill_keys_values(cache, queries)
    for a, b in zip(ours, reference):
        assert a.dtype == mx.float32
        _assert_same(a, b)


def test_prefill_pieces_have_one_size_once_the_history_holds_one():
    cache = KVQuantCache(KVCacheConfig(method="kvquant"))
    cache.decode_chunk_tokens = 4 * 32
    assert cache._prefill_pieces(3) == (3, [0])
    assert cache._prefill_pieces(4) == (4, [0])
    assert cache._prefill_pieces(9) == (4, [0, 4, 5])
    assert cache._prefill_pieces(12) == (4, [0, 4, 8])
    cache.prefill_piece_tokens = 3 * 32 + 5  # whole blocks only
    assert cache._prefill_pieces(7) == (3, [0, 3, 4])


def test_prefill_attention_matches_the_base_path():
    cache = _filled(mx.float32, 32 * 6 + 9, chunk=64, fraction=0.01)
    queries = mx.random.normal((1, 4, 24, 64))
    out = cache._attend_prefill(queries, 64**-0.5, "causal")
    keys, values = CompressedKVCache._prefill_keys_values(cache, queries)
    ref = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=64**-0.5, mask="causal")
    _assert_same(out, ref)


@pytest.mark.parametrize("mode", ["fused", "apart"])
def test_product_apart_leaves_no_kernel_that_could_form_an_fma(monkeypatch, mode):
    # What nvrtc could contract is a Multiply feeding an Add inside one fused kernel; with the
    # product apart no compiled kernel of the piece holds both (the fused mode's does: the
    # check sees it).
    monkeypatch.setattr(kvquant, "_prefill_piece_mode", lambda: MODES[mode])
    cache = _filled(mx.bfloat16, 32 * 5, chunk=80, fraction=0.01)
    queries = mx.random.normal((1, 4, 20, 64)).astype(mx.bfloat16)
    mx.eval(queries, cache.window_keys, cache.window_values)
    keys, values = cache._prefill_keys_values(queries)
    dot = io.StringIO()
    mx.export_to_dot(dot, keys, values)
    kernels = [k for k in re.findall(r'label ?= ?"([A-Za-z_]+)"', dot.getvalue()) if k.startswith("Compiled")]
    assert kernels
    both = [k for k in kernels if "Multiply" in k and "Add" in k]
    assert (both == []) == (mode == "apart"), kernels
