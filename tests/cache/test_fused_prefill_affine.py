"""fused_prefill_affine's kernel (a KIVI-layout cache's whole prefill K/V in one launch), run on
the CPU by the thread-level emulation (tests/cache/cuda_emulation.py), against the portable
_prefill_keys_values (the base's decode + concatenations, with the kernels off).

Expected: bit for bit. The kernel computes each element as mx.dequantize does on MLX's CPU
backend, in the dequantize's dtype with two roundings (the product, then the sum: checked
against mx.dequantize itself below), then the portable path's casts; exact tokens (sink,
window) are copies with the same casts. On the GPU, MLX's own dequantize may fuse the product
and sum into one fma: the @cuda_test at the end measures that difference there (next session).

The emulation's `emulated_kernels()` empties the kernel factories of the fused_decode* modules
only; this module keys its kernel by the factory (fused_prefill_affine._kernel_for), and the
`emulated` helper here empties it too, so a mutated source is built anew.
"""

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import fused_decode, fused_prefill_affine, kernel_header
from veloxquant_mlx.cache.kivi import KIVICache
from veloxquant_mlx.cache.xquant import XQuantCache

emulation = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)


@contextmanager
def emulated():
    """The kernels on and emulated, this module's kernel factory emptied before and after."""
    fused_prefill_affine._kernel_for.cache_clear()
    try:
        with cuda_emulation.emulated_kernels() as made:
            yield made
    finally:
        fused_prefill_affine._kernel_for.cache_clear()


def _kivi(residual=32, sink=1, **fields):
    """A KIVI cache factory; `sink`: its exact sink tokens (the class default is 1)."""
    def make():
        cache = KIVICache(KVCacheConfig(method="kivi", kivi_residual_length=residual, **fields))
        cache.exact_sink_tokens = sink
        return cache
    return make


def _data(B, H, n, D, dtype, seed):
    mx.random.seed(seed)
    # Keys with an offset and outlier channels (as real keys have), values plain normal.
    k = mx.random.normal((B, H, n, D)) * mx.where(mx.arange(D) % 16 == 3, 4.0, 1.0) + 0.5
    return k.astype(dtype), mx.random.normal((B, H, n, D)).astype(dtype)


def _fill(cache, n, extra, *, B, H, D, dtype, seed=0, query_dtype=None):
    """A cache after a chunk of n tokens (flushed into the history by an attention call) and
    `extra` more tokens in its window; returns a prefill chunk's queries (B, 2H, 16, D), in
    `query_dtype` (default: the cache's)."""
    k, v = _data(B, H, n + extra, D, dtype, seed)
    cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
    mx.eval(cache.attention(mx.random.normal((B, 2 * H, 1, D)).astype(dtype), scale=D**-0.5))
    if extra:
        cache.update_and_fetch(k[:, :, n:], v[:, :, n:])
    return mx.random.normal((B, 2 * H, 16, D)).astype(query_dtype or dtype)


def _xquant_pair(bits=2):
    config = KVCacheConfig(method="xquant", bit_width_inlier=bits, xquant_residual_length=32)
    return XQuantCache.build_layers(config, 2)


def _check(cache, queries):
    """The emulated kernel's K/V against the portable path's, bit for bit; returns the
    history length, the window length and the kernel launches."""
    expected = cache._prefill_keys_values(queries)  # kernels off: the CPU default
    mx.eval(*expected)
    with emulated() as made:
        got = cache._prefill_keys_values(queries)
        mx.eval(*got)
    assert [k.name for k in made] == ["vq_affine_prefill_kv"] and made[0].calls == 1, "the kernel did not run"
    for label, g, e in zip(("keys", "values"), got, expected):
        assert g.dtype == e.dtype == queries.dtype and g.shape == e.shape, (label, g.shape, e.shape)
        a, b = np.array(g.astype(mx.float32)), np.array(e.astype(mx.float32))
        assert mx.array_equal(g, e).item(), f"{label}: max |kernel - portable| {np.abs(a - b).max():.3g}"
    return cache.n_compressed, cache._window_length()


# (name, cache factory, dtype, batch, head dim, tokens flushed, tokens after)
KIVI_CASES = [
    # 2 bits, batch 2, head_dim 128, float32: history 320 (not a multiple of the 128-token tile)
    ("kivi-2 fp32 hd128 b2", _kivi(bit_width_inlier=2), mx.float32, 2, 128, 352, 5),
    # 3 bits: codes straddle words (keys along tokens, values along channels)
    ("kivi-3 bf16 hd128 b2", _kivi(bit_width_inlier=3), mx.bfloat16, 2, 128, 352, 5),
    ("kivi-4 fp16 hd64 b2", _kivi(bit_width_inlier=4), mx.float16, 2, 64, 300, 3),
    ("kivi-8 bf16 hd64 b2", _kivi(bit_width_inlier=8), mx.bfloat16, 2, 64, 300, 3),
    ("kivi-4/2 fp16 hd128", _kivi(key_bits=4, value_bits=2), mx.float16, 1, 128, 288, 7),
    ("kivi-3/8 fp32 hd64 b2", _kivi(key_bits=3, value_bits=8), mx.float32, 2, 64, 300, 3),
    # no exact sink: column 0 decoded from token 0's own codes
    ("kivi-2 bf16 no sink", _kivi(bit_width_inlier=2, sink=0), mx.bfloat16, 2, 128, 300, 3),
    # a sink of 2 tokens (the kernel takes any S <= n; the class default is 1)
    ("kivi-2 fp32 hd128 b2 sink of 2", _kivi(bit_width_inlier=2, sink=2), mx.float32, 2, 128, 300, 4),
    # no window (n == everything cached): residual 0, whole groups; history 256 = 2 tiles
    ("kivi-2 fp16 no window", _kivi(residual=0, bit_width_inlier=2), mx.float16, 2, 64, 256, 0),
    # groups of 64 and 128 (a group as long as the tile)
    ("kivi-2 g64 bf16", _kivi(bit_width_inlier=2, kivi_group_size=64), mx.bfloat16, 1, 128, 400, 2),
    ("kivi-3 g128 fp32", _kivi(bit_width_inlier=3, kivi_group_size=128), mx.float32, 1, 128, 420, 2),
]


@pytest.fixture(scope="module", autouse=True)
def _programs_built_in_parallel():
    """The emulated programs the tests below run, compiled up front one per core (a cold run
    pays g++ ~1-2 s each): their signatures captured from caches of the same shapes."""
    if cuda_emulation.COMPILER is None:
        return
    calls = [(make, dtype, B, D, 160, 3, None) for _, make, dtype, B, D, _, _ in KIVI_CASES]
    calls += [(_kivi(bit_width_inlier=2), mx.bfloat16, 1, 64, 160, 3, mx.float32),
              (_kivi(bit_width_inlier=2), mx.float16, 1, 64, 160, 3, None),
              (_kivi(bit_width_inlier=3), mx.bfloat16, 1, 64, 160, 3, None),
              (lambda: _xquant_pair(2)[0], mx.bfloat16, 2, 64, 160, 3, None),
              (lambda: _xquant_pair(2)[0], mx.float32, 2, 64, 160, 3, None),
              (lambda: _xquant_pair(3)[0], mx.float16, 1, 128, 160, 3, None)]
    with cuda_emulation.signatures_only() as captured:
        for make, dtype, B, D, n, extra, query_dtype in calls:
            cache = make()
            queries = _fill(cache, n, extra, B=B, H=2, D=D, dtype=dtype, query_dtype=query_dtype)
            with emulated():
                cache._prefill_keys_values(queries)
        for _, old, new, value_bits in MUTATIONS:
            with pytest.MonkeyPatch.context() as mutated, emulated():
                _mutate(mutated, old, new)
                cache, queries = _mutation_case(value_bits)
                cache._prefill_keys_values(queries)
    cuda_emulation.prebuild_captured(captured)


@emulation
@pytest.mark.parametrize("name, make, dtype, B, D, n, extra", KIVI_CASES, ids=[c[0] for c in KIVI_CASES])
def test_the_emulated_kernel_is_the_portable_kivi_prefill(name, make, dtype, B, D, n, extra):
    cache = make()
    queries = _fill(cache, n, extra, B=B, H=2, D=D, dtype=dtype)
    n_hist, window = _check(cache, queries)
    assert n_hist > 0
    assert cache._sink_length() == (0 if "no sink" in name else 2 if "sink of 2" in name else 1)
    if "no window" in name:
        assert window == 0 and cache.window_keys is None
    else:
        assert window > 0
    if name == "kivi-2 fp32 hd128 b2":
        assert n_hist % fused_prefill_affine.TILE and (n_hist + window) % fused_prefill_affine.TILE


@emulation
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "fp32"])
def test_the_emulated_kernel_is_the_portable_xquant_prefill_leader_and_follower(dtype):
    leader, follower = _xquant_pair(2)
    k, v = _data(2, 2, 300, 64, dtype, seed=3)
    queries = None
    for cache in (leader, follower):
        cache.update_and_fetch(k, v)
        mx.eval(cache.attention(mx.random.normal((2, 4, 1, 64)).astype(dtype), scale=0.125))
        queries = mx.random.normal((2, 4, 16, 64)).astype(dtype)
    assert follower.shared and "k_codes" not in follower.store and follower.n_compressed > 0
    for cache in (leader, follower):
        n_hist, window = _check(cache, queries)
        assert n_hist > 0 and window > 0


@emulation
def test_queries_in_another_dtype_get_the_kv_in_theirs():
    # A bf16 cache read by float32 queries: the kernel writes float32 (the portable path's
    # astype after the decode in bf16), so the values are the bf16 ones, widened.
    cache = _kivi(bit_width_inlier=2)()
    queries = _fill(cache, 160, 3, B=1, H=2, D=64, dtype=mx.bfloat16, query_dtype=mx.float32)
    _check(cache, queries)


@emulation
def test_a_prefill_chunks_attention_takes_the_kernel_after_the_ordering_step(monkeypatch):
    # The whole attention of a chunk (>= prefill_rows query rows, causal): the same output as
    # the portable path, bit for bit (same K/V into the same mx.fast attention); the kernel's
    # inputs were made to wait for the queries (the base's ordering step, as mx.depends) and
    # no host sync was taken for it.
    # Two caches filled alike (attention flushes the window afterwards: one call each).
    portable, cache = _kivi(bit_width_inlier=2)(), _kivi(bit_width_inlier=2)()
    queries = _fill(portable, 300, 20, B=1, H=2, D=64, dtype=mx.float16)
    assert mx.array_equal(queries, _fill(cache, 300, 20, B=1, H=2, D=64, dtype=mx.float16)).item()
    expected = portable.attention(queries, scale=0.125, mask="causal")  # the last 16 positions'
    mx.eval(expected)
    order, synced = [], []
    real = type(cache)._inputs_after_queries
    monkeypatch.setattr(type(cache), "_inputs_after_queries",
                        lambda self, arrays, q: (order.append(q.shape), real(self, arrays, q))[1])
    monkeypatch.setattr(type(cache), "_order_after_queries", lambda self, q: synced.append(q.shape))
    with emulated() as made:
        got = cache.attention(queries, scale=0.125, mask="causal")
        mx.eval(got)
    assert [k.calls for k in made] == [1] and order == [queries.shape] and synced == []
    assert mx.array_equal(got, expected).item()


@emulation
def test_xquant_3_bits_and_a_follower_whose_leader_holds_more():
    # The follower's key rows are its leader's whole rows (longer than its own capacity: the
    # kernel takes the row length from the codes' shape, not from the scales').
    config = KVCacheConfig(method="xquant", bit_width_inlier=3, xquant_residual_length=32)
    leader, follower = XQuantCache.build_layers(config, 2)
    k, v = _data(1, 2, 600, 128, mx.float16, seed=4)
    leader.update_and_fetch(k, v)
    mx.eval(leader.attention(mx.random.normal((1, 4, 1, 128)).astype(mx.float16), scale=0.1))
    follower.update_and_fetch(k[:, :, :200], v[:, :, :200])
    mx.eval(follower.attention(mx.random.normal((1, 4, 1, 128)).astype(mx.float16), scale=0.1))
    assert follower.shared and leader.capacity > follower.capacity
    queries = mx.random.normal((1, 4, 16, 128)).astype(mx.float16)
    _check(follower, queries)


def test_the_kernels_arithmetic_is_mx_dequantizes_on_the_cpu():
    # What the kernel computes per element (float32 product rounded to the dtype, then the sum
    # rounded), in numpy-free MLX ops, equals mx.dequantize bit for bit; one rounding (fma)
    # does not at 16 bits. This is why the emulated comparisons above can be exact.
    mx.random.seed(1)
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        for bits in (2, 3, 4, 8):
            x = mx.random.normal((64, 256)) * 3 + 0.7
            w, s, b = mx.quantize(x, group_size=32, bits=bits)
            side = mx.float16 if dtype == mx.float32 else dtype
            s, b = s.astype(side).astype(dtype), b.astype(side).astype(dtype)
            want = mx.dequantize(w, s, b, group_size=32, bits=bits)
            codes = mx.dequantize(w, mx.ones_like(s), mx.zeros_like(b), group_size=32, bits=bits).astype(mx.float32)
            sf, bf = (mx.repeat(a.astype(mx.float32), 32, axis=-1) for a in (s, b))
            two = ((sf * codes).astype(dtype).astype(mx.float32) + bf).astype(dtype)
            assert mx.array_equal(two, want).item(), (dtype, bits)
            if dtype != mx.float32:
                assert not mx.array_equal((sf * codes + bf).astype(dtype), want).item()


# A corrupted kernel must fail the comparison (in memory; the module is untouched), on a cache
# of 3-bit keys (codes straddling words) and `value_bits` values.
MUTATIONS = [
    # The key codes are read by the shared header's vq_staged_key_pair.
    ("key code shift", "const int w = bit >> 5, sh = bit & 31;\n  const uint2 word",
     "const int w = bit >> 5, sh = (bit + 1) & 31;\n  const uint2 word", 2),
    ("key 3-bit straddle ignored", "if (32 % KB != 0 && sh + KB > 32) {", "if (false) {", 2),
    ("key pair's second scale", "dequant(sc.y, zp.y, c1 & KMASK)", "dequant(sc.x, zp.y, c1 & KMASK)", 2),
    # The value codes are read by the shared header's vq_code_pair (kernel_header.HEADER).
    ("value pair's second code", "c1 = word >> ((bit & 31) + BITS);", "c1 = word >> (bit & 31);", 2),
    ("value 3-bit straddle ignored", "if ((b1 & 31) + BITS > 32) c1", "if (false) c1", 3),
    ("one rounding (fma) instead of two",
     "const float p = vq_f32(vq_cast<AT>(sc * (float)code));", "const float p = sc * (float)code;", 2),
    ("sink ignored", "const int n_sink = meta[2];", "const int n_sink = 0;", 2),
    ("value group index", "const size_t g = (size_t)t * GV + c / G;", "const size_t g = (size_t)t * GV;", 2),
]


def _mutate(patch, old, new):
    """Replace `old` by `new` in the kernel's own source, or in the shared header where the
    kernel's device functions live (vq_code_pair)."""
    for module, name in ((fused_prefill_affine, "_SOURCE"), (kernel_header, "HEADER")):
        text = getattr(module, name)
        if old in text:
            patch.setattr(module, name, text.replace(old, new, 1))
            return
    raise AssertionError(f"neither fused_prefill_affine._SOURCE nor kernel_header.HEADER contains {old!r}: "
                         "pick a new mutation")


def _mutation_case(value_bits):
    cache = _kivi(key_bits=3, value_bits=value_bits)()
    return cache, _fill(cache, 160, 3, B=1, H=2, D=64, dtype=mx.bfloat16)


@emulation
@pytest.mark.parametrize("name, old, new, value_bits", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_corrupted_kernel_source_fails_the_comparison(monkeypatch, name, old, new, value_bits):
    _mutate(monkeypatch, old, new)
    cache, queries = _mutation_case(value_bits)
    with pytest.raises(AssertionError, match=r"max \|kernel - portable\|"):
        _check(cache, queries)


@emulation
def test_the_portable_path_is_kept_where_the_kernel_is_not_active(monkeypatch):
    cache = _kivi(bit_width_inlier=2)()
    queries = _fill(cache, 160, 3, B=1, H=2, D=64, dtype=mx.float32)
    expected = cache._prefill_keys_values(queries)
    # Switched off by the environment, or a group the kernel refuses: nothing is launched.
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    assert fused_prefill_affine.prefill_step(cache, queries, lambda: 1 / 0, group_size=32, key_bits=2,
                                             value_bits=2, arith_dtype=mx.float32) is None
    monkeypatch.delenv(fused_decode.ENV_SWITCH)
    assert not fused_prefill_affine.supports(64, 64, 48, 2, 2)
    assert not fused_prefill_affine.supports(64, 64, 32, 5, 2)
    assert fused_prefill_affine.supports(256, 256, 32, 8, 8)
    with emulated() as made:
        monkeypatch.setattr(fused_prefill_affine, "supports", lambda *a: False)
        got = cache._prefill_keys_values(queries)
    assert made == [] and all(mx.array_equal(g, e).item() for g, e in zip(got, expected))


def test_bad_launch_arguments_are_refused_with_what_is_allowed():
    z = mx.zeros((1, 1, 64, 2), mx.uint32)
    side = mx.zeros((1, 1, 64, 1), mx.float16)
    with pytest.raises(Exception, match="whole groups of 32"):
        fused_prefill_affine.affine_prefill_keys_values(
            z, side, side, mx.zeros((1, 1, 64, 2), mx.uint32), side, side, None, None, None, n=40,
            group_size=32, key_bits=2, value_bits=2, arith_dtype=mx.float16,
            cache_dtype=mx.float16, out_dtype=mx.float16)
    with pytest.raises(Exception, match="share one dtype"):
        fused_prefill_affine.affine_prefill_keys_values(
            z, side, side.astype(mx.bfloat16), z, side, side, None, None, None, n=32,
            group_size=32, key_bits=2, value_bits=2, arith_dtype=mx.float16,
            cache_dtype=mx.float16, out_dtype=mx.float16)


@cuda_test
@pytest.mark.parametrize("method, dtype", [("kivi", mx.bfloat16), ("kivi", mx.float16), ("xquant", mx.bfloat16)])
def test_the_kernel_on_cuda_is_the_portable_prefill(monkeypatch, method, dtype):
    """On the GPU: the kernel against MLX's own CUDA dequantize + concatenations, at the 8B
    head shape (8 kv heads of 128). Exact unless MLX's dequantize fuses its product and sum into
    one fma (one rounding instead of two): then each element may differ by about one unit in
    the last place of its group's magnitude; bounded here by two relative ulps of the head's
    largest magnitude (a wrong code or group moves elements by a whole quantization step, far
    more). The exact tokens (sink, window) must be equal. Prints whether all was bit for bit."""
    if method == "kivi":
        cache = _kivi(residual=128, bit_width_inlier=2)()
    else:
        cache = _xquant_pair(2)[0]
    queries = _fill(cache, 4096, 70, B=1, H=8, D=128, dtype=dtype)
    n, S = cache.n_compressed, (cache._sink_length() if method == "kivi" else 0)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    got = cache._prefill_keys_values(queries)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    expected = cache._prefill_keys_values(queries)
    rel = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10}[dtype]
    for label, g, e in zip(("keys", "values"), got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        diff = mx.abs(g.astype(mx.float32) - e.astype(mx.float32))
        bound = 2 * rel * mx.max(mx.abs(e.astype(mx.float32)), axis=(2, 3), keepdims=True)
        print(f"{method} {dtype} {label}: bit for bit {mx.array_equal(g, e).item()}, "
              f"max diff {mx.max(diff).item():.3g}, bound {mx.min(bound).item():.3g}")
        assert mx.all(diff <= bound).item()
        assert mx.array_equal(g[:, :, :S], e[:, :, :S]).item() and mx.array_equal(g[:, :, n:], e[:, :, n:]).item()
