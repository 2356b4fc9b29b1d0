"""turboquant_rvq's prefill history kernel (cache/turboquant_prefill_kernel.py) against the
portable `_prefill_keys_values`, bit for bit: on the CPU through the thread-level CUDA emulation
(tests/cache/cuda_emulation.py: the kernel's indexing, bit reads, butterflies, roundings and casts
as written; not nvrtc's acceptance, not speed), on MLX's CUDA backend for real (`pytest -m cuda`),
and compiled by nvcc for sm_90 (slow) as a proxy for nvrtc."""

from __future__ import annotations

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from veloxquant_mlx.cache import turboquant_prefill_kernel as tpk
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache
from veloxquant_mlx.config import KVCacheConfig
from veloxquant_mlx.errors import QuantizerConfigError

needs_emulation = pytest.mark.skipif(cuda_emulation.COMPILER is None,
                                     reason="needs g++ with C++20 for the CUDA emulation")


def filled(dtype, history: int, window: int, *, key_bits: int, value_bits: int, dim: int = 64,
           B: int = 2, H: int = 1, sink: bool = True, block: int = 64) -> TurboQuantRVQCache:
    """A cache of `history` compressed tokens (a multiple of `block`, the encode block) and
    `window` exact ones (the exact residual set to it), everything evaluated; keys carry a
    constant offset (what the key mean removes) and a large first token (what the sink keeps)."""
    config = KVCacheConfig(method="turboquant_rvq", key_bits=key_bits, value_bits=value_bits)
    cache = TurboQuantRVQCache(config, 0, 1)
    cache.encode_block, cache.exact_window = block, window
    cache.exact_sink_tokens = 1 if sink else 0
    assert history % block == 0
    mx.random.seed(history + window + 7 * key_bits + value_bits)
    total = history + window
    k = mx.random.normal((B, H, total, dim)) * 0.7 + 0.4
    k = mx.concatenate([k[:, :, :1] * 6.0, k[:, :, 1:]], axis=2).astype(dtype)
    v = mx.random.normal((B, H, total, dim)).astype(dtype)
    for s0 in range(0, total, 96):
        cache.update_and_fetch(k[:, :, s0 : s0 + 96], v[:, :, s0 : s0 + 96])
        cache._flush()
        mx.eval([a for a in cache.state if isinstance(a, mx.array)])
    assert cache.n_compressed == history and cache._window_length() == window
    assert (cache.sink_deltas is not None) == sink
    return cache


def kernel_path(cache, queries):
    """The cache's prefill K/V with the kernels on and emulated (the kernel must have run)."""
    with cuda_emulation.emulated_kernels() as made:
        out = cache._prefill_keys_values(queries)
        mx.eval(out)
    assert [k.name for k in made] == ["vq_rvq_prefill_kv"] and made[0].calls == 1
    return out


def same_bytes(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bytes(memoryview(a)) == bytes(memoryview(b))


CASES = [
    # (cache dtype, queries dtype, key bits, value bits, head dim, sink, history, window, block)
    # A warp takes TOKENS_PER_WARP (4) consecutive tokens, a block 8 warps: the totals 139, 67
    # and 69 end inside a warp's tokens, 64 and 68 do not; 4-token encode blocks give a history
    # (68) that is not whole blocks of 32.
    pytest.param(mx.bfloat16, mx.bfloat16, 4, 4, 64, True, 128, 11, 64, id="bf16-4-4-d64-sink"),
    pytest.param(mx.float16, mx.float32, 1, 3, 64, False, 68, 0, 4, id="fp16-to-f32-1-3-d64"),
    pytest.param(mx.float32, mx.bfloat16, 2, 4, 128, True, 64, 3, 4, id="f32-to-bf16-2-4-d128-sink"),
    pytest.param(mx.bfloat16, mx.float16, 3, 2, 128, False, 64, 0, 64, id="bf16-to-fp16-3-2-d128"),
    pytest.param(mx.float32, mx.float32, 3, 1, 64, True, 64, 5, 64, id="f32-3-1-d64-sink"),
    # The widest and narrowest lanes: 8 channels (24 bits of 3-bit codes, across a word in some
    # lanes) and 1 channel (a 3-bit code across a word in lanes 10 and 21).
    pytest.param(mx.bfloat16, mx.bfloat16, 4, 4, 256, True, 64, 6, 64, id="bf16-4-4-d256-sink"),
    pytest.param(mx.float16, mx.float16, 4, 3, 32, False, 64, 2, 64, id="fp16-4-3-d32"),
]


@needs_emulation
@pytest.mark.parametrize("dtype, qdtype, kb, vb, dim, sink, history, window, block", CASES)
def test_kernel_history_is_the_portable_path_bit_for_bit(dtype, qdtype, kb, vb, dim, sink, history,
                                                          window, block):
    cache = filled(dtype, history, window, key_bits=kb, value_bits=vb, dim=dim, sink=sink, block=block)
    queries = mx.random.normal((2, 2, 9, dim)).astype(qdtype)
    pieces = cache._prefill_keys_values(queries)  # the portable path: kernels off on the CPU
    one_graph = CompressedKVCache._prefill_keys_values(cache, queries)
    mx.eval(pieces, one_graph)
    ours = kernel_path(cache, queries)
    for a, b, c in zip(ours, pieces, one_graph):
        assert a.shape[2] == history + window and a.dtype == qdtype
        assert same_bytes(a, b) and same_bytes(a, c)


@needs_emulation
@pytest.mark.parametrize("per_warp", [1, 3])
def test_tokens_per_warp_leave_the_bits(monkeypatch, per_warp):
    """Other TOKENS_PER_WARP (1: a warp per token, the A/B's; 3: warps ending inside the window
    and inside the history) give the portable path's bytes too."""
    monkeypatch.setattr(tpk, "TOKENS_PER_WARP", per_warp)
    cache = filled(mx.bfloat16, 68, 5, key_bits=4, value_bits=3, dim=64, block=4)
    queries = mx.random.normal((2, 2, 9, 64)).astype(mx.bfloat16)
    reference = cache._prefill_keys_values(queries)
    mx.eval(reference)
    for a, b in zip(kernel_path(cache, queries), reference):
        assert same_bytes(a, b)


@needs_emulation
def test_prefill_chunk_attention_through_the_kernel_is_unchanged():
    """A whole prefill chunk's attention (update_and_fetch, then cache.attention of >=
    prefill_rows queries: the fused mx.fast attention over the kernel's K/V, then the flush) gives
    the portable path's output and leaves the same store."""
    caches = [filled(mx.bfloat16, 64, 7, key_bits=4, value_bits=2, dim=64) for _ in range(2)]
    mx.random.seed(11)
    k, v = mx.random.normal((2, 2, 1, 24, 64)).astype(mx.bfloat16)
    queries = mx.random.normal((2, 2, 24, 64)).astype(mx.bfloat16)
    outs = []
    for i, cache in enumerate(caches):
        cache.update_and_fetch(k, v)
        if i:
            with cuda_emulation.emulated_kernels() as made:
                outs.append(cache.attention(queries, scale=0.125))
                mx.eval(outs[-1])
            assert [m.name for m in made] == ["vq_rvq_prefill_kv"]
        else:
            outs.append(cache.attention(queries, scale=0.125))
    assert same_bytes(outs[0], outs[1])
    assert caches[0].n_compressed == caches[1].n_compressed
    for name, array in caches[0].store.items():
        assert mx.array_equal(array, caches[1].store[name]).item(), name


# Source changes the comparison must catch (each compiles one more emulated program).
CORRUPTIONS = [
    # a butterfly across lanes with its sum and difference swapped (other - y for y + other). Not here: the
    # stages in the other order, which gave the same bytes: the stage values carry ~11-13
    # significant bits, so the transform's float32 sums were exact whatever their order.
    ("y[e] = __fmaf_rn(own, y[e], other);", "y[e] = __fmaf_rn(-own, y[e], other);"),
    # the centered-out key mean not added back
    ("k[e] = __fadd_rn(k[e], km[e]);", "k[e] = __fadd_rn(k[e], 0.f * km[e]);"),
    # the sink's correction forgotten for the values
    ("v[e] = __fadd_rn(v[e], vq_f32(dv[", "v[e] = __fadd_rn(v[e], 0.f * vq_f32(dv["),
    # a 3-bit code's bits in the next word dropped
    ("if (sh0 + E * B1 > 32) bits |=", "if (false) bits |="),
    # the values' rotation signs not applied
    ("vq_rvq_unrotate<EV>(v, lane, vss);", "vq_rvq_unrotate<EV>(v, lane, kss);"),
]


@needs_emulation
@pytest.mark.parametrize("old, new", CORRUPTIONS, ids=["butterfly-difference", "no-mean", "no-value-sink",
                                                       "straddle", "value-signs"])
def test_corrupted_sources_fail(monkeypatch, old, new):
    sources = tpk._SOURCE + tpk._HELPERS
    assert sources.count(old) == 1, old
    monkeypatch.setattr(tpk, "_SOURCE", tpk._SOURCE.replace(old, new))
    monkeypatch.setattr(tpk, "_HELPERS", tpk._HELPERS.replace(old, new))
    cache = filled(mx.float32, 64, 3, key_bits=4, value_bits=4, sink=True)
    queries = mx.random.normal((2, 2, 5, 64))
    reference = cache._prefill_keys_values(queries)
    mx.eval(reference)
    ours = kernel_path(cache, queries)
    assert not all(same_bytes(a, b) for a, b in zip(ours, reference))


def test_kernel_path_orders_after_the_queries_without_a_host_sync(monkeypatch):
    """The portable path's syncs (the queries' evaluation, one per piece) are not taken; the
    store's inputs go through the base's mx.depends on the queries instead."""
    from veloxquant_mlx.cache import prefill_pieces

    cache = filled(mx.bfloat16, 64, 3, key_bits=3, value_bits=3)
    queries = mx.random.normal((2, 2, 5, 64)).astype(mx.bfloat16)

    def no_sync(*args):
        raise AssertionError("a host sync of the portable path ran on the kernel path")

    waited = []
    ordered = CompressedKVCache._inputs_after_queries
    monkeypatch.setattr(prefill_pieces, "settle", no_sync)
    monkeypatch.setattr(TurboQuantRVQCache, "_order_after_queries", no_sync)
    monkeypatch.setattr(TurboQuantRVQCache, "_inputs_after_queries",
                        lambda self, arrays, q: waited.append(q) or ordered(self, arrays, q))
    keys, values = kernel_path(cache, queries)
    assert len(waited) == 1 and waited[0] is queries
    assert keys.shape == (2, 1, 67, 64) and values.dtype == mx.bfloat16


def test_portable_path_stays_off_cuda_and_for_refused_shapes(monkeypatch):
    """The kernel is taken only where it runs: on the CPU (kernels off) prefill_step answers None;
    with the kernels on, a shape supports() refuses (no kernel built) answers None too."""
    cache = filled(mx.bfloat16, 64, 3, key_bits=4, value_bits=4)
    queries = mx.random.normal((2, 2, 5, 64)).astype(mx.bfloat16)
    assert tpk.prefill_step(cache, queries) is None
    assert tpk.supports(64, 128, 1, 4) and tpk.supports(256, 32, 3, 2)
    for args in ((512, 64, 4, 4), (64, 16, 4, 4), (96, 64, 4, 4), (64, 64, 5, 4), (64, 64, 4, 0)):
        assert not tpk.supports(*args), args
    monkeypatch.setattr(tpk, "supports", lambda *a: False)
    with cuda_emulation.emulated_kernels() as made:
        keys, values = cache._prefill_keys_values(queries)
    assert made == [] and keys.shape == (2, 1, 67, 64)


def test_launch_refuses_inconsistent_inputs():
    cache = filled(mx.bfloat16, 64, 3, key_bits=4, value_bits=3)
    from veloxquant_mlx.cache.fused_decode_rotated import store_arrays

    stores = store_arrays(cache)
    args = (stores, cache._signs[0], cache._signs[1], cache.key_mean, cache.window_keys,
            cache.window_values, cache.sink_deltas)
    kwargs = dict(n=64, key_bits=4, value_bits=3, cache_dtype=mx.bfloat16, out_dtype=mx.bfloat16)
    with pytest.raises(QuantizerConfigError, match=r"n=999 history tokens"):
        tpk.rotated_prefill_keys_values(*args, **{**kwargs, "n": 999})
    with pytest.raises(QuantizerConfigError, match=r"key mean"):
        tpk.rotated_prefill_keys_values(*args[:3], cache.key_mean[:1], *args[4:], **kwargs)
    with pytest.raises(QuantizerConfigError, match=r"window"):
        tpk.rotated_prefill_keys_values(*args[:4], cache.window_keys[:, :, :2], *args[5:], **kwargs)
    with pytest.raises(QuantizerConfigError, match=r"sink deltas"):
        deltas = (cache.sink_deltas[0], cache.sink_deltas[1][:1])
        tpk.rotated_prefill_keys_values(*args[:6], deltas, **kwargs)
    with pytest.raises(QuantizerConfigError, match=r"bits 5 / 3"):
        tpk.rotated_prefill_keys_values(*args, **{**kwargs, "key_bits": 5})


# ---- MLX's CUDA backend (the H200: pytest -m cuda) ----------------------------------------------

GPU_CASES = [
    # (cache dtype = queries dtype, key bits, value bits, head dim, sink)
    pytest.param(mx.bfloat16, 4, 4, 128, True, id="bf16-4-d128-sink"),
    pytest.param(mx.float16, 2, 3, 64, False, id="fp16-2-3-d64"),
    pytest.param(mx.float32, 1, 4, 128, True, id="f32-1-4-d128-sink"),
]


@cuda_test
@pytest.mark.parametrize("dtype, kb, vb, dim, sink", GPU_CASES)
def test_kernel_on_cuda_is_the_cpu_portable_path_bit_for_bit(monkeypatch, dtype, kb, vb, dim, sink):
    """On the GPU: bit for bit the portable path computed on the CPU (the order the kernel
    copies). Against the GPU's own portable path (whose Hadamard transform, or the Sylvester
    matmul where MLX's CUDA backend has none, and dequantize may sum or contract otherwise):
    the count of differing elements printed, and at most one unit in the last place of a
    16-bit output (of bfloat16 for a float32 output: a sanity bound, the float32 sums of
    another order may differ by more than one float32 ulp)."""
    cache = filled(dtype, 64 * 40, 37, key_bits=kb, value_bits=vb, dim=dim, sink=sink, H=4)
    queries = mx.random.normal((2, 8, 16, dim)).astype(dtype)
    assert tpk.prefill_step(cache, queries) is not None  # the kernel runs here
    ours = cache._prefill_keys_values(queries)
    mx.eval(ours)
    monkeypatch.setattr(tpk, "prefill_step", lambda *a: None)
    try:
        gpu_portable = cache._prefill_keys_values(queries)
        mx.eval(gpu_portable)
        mx.set_default_device(mx.cpu)
        cpu_portable = cache._prefill_keys_values(queries)
        mx.eval(cpu_portable)
    finally:
        mx.set_default_device(mx.gpu)
    for a, b, c in zip(ours, cpu_portable, gpu_portable):
        assert same_bytes(a, b)
        x, y = a.astype(mx.float32), c.astype(mx.float32)
        bound = mx.bfloat16 if dtype == mx.float32 else dtype
        ulp = mx.abs(y) * mx.finfo(bound).eps  # eps: one ulp at 1.0, so this bounds one ulp of y
        differ = mx.sum(x != y).item()
        print(f"{dtype}: {differ} of {x.size} elements differ from the GPU's portable path")
        assert mx.all(mx.abs(x - y) <= ulp).item()


# ---- nvcc for sm_90 (slow) ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    """The sources the caches launch (the 8B shape's bf16 d 128 at 4 bits, SmolLM2's d 64 at
    key 2 / value 3 bits in float32 with the sink), compiled for the H200 with no spills."""
    captured = []
    for dtype, kb, vb, dim, sink in ((mx.bfloat16, 4, 4, 128, True), (mx.float32, 2, 3, 64, True),
                                     (mx.float16, 1, 1, 256, False)):
        cache = filled(dtype, 64, 3, key_bits=kb, value_bits=vb, dim=dim, sink=sink)
        queries = mx.random.normal((2, 4, 5, dim)).astype(dtype)
        with cuda_emulation.signatures_only() as found, cuda_emulation.emulated_kernels():
            cache._prefill_keys_values(queries)
        captured += found
    sources = sorted({kernel.cuda_source(sig) for kernel, sig in captured})
    assert len(sources) == 3
    for i, source in enumerate(sources):
        compiled_without_spills(source, tmp_path, i)
