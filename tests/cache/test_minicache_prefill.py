"""MiniCache's prefill K/V: ordered after the queries without a host sync, and on CUDA built by
one kernel (cache/fused_prefill_merged.py), run here on the CPU by the thread-level emulation
(tests/cache/cuda_emulation.py).

Expected: bit for bit the previous path's K/V (the base's host sync, then MiniCacheCache._decode
and the window's concatenation, cast to the queries' dtype): mx.depends changes no value, and
the kernel computes each element as the portable ops do (see the kernel module's docstring).
"""

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import fused_prefill_merged
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.minicache import QUANT_GROUP, MiniCacheCache

emulation = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)

H, REP = 2, 2


@contextmanager
def emulated():
    """The kernels on and emulated, this module's kernel factory emptied before and after."""
    fused_prefill_merged._kernel_for.cache_clear()
    try:
        with cuda_emulation.emulated_kernels() as made:
            yield made
    finally:
        fused_prefill_merged._kernel_for.cache_clear()


def _pair(B=1, D=64, dtype=mx.float16, n=300, extra=5, bits=None, slots=4, threshold=0.9, residual=0, seed=0,
          merge=None):
    """A lower / upper MiniCache pair after a chunk of n tokens, merged (the upper layer's
    attention flushes the pair) and `extra` more tokens in each window; layer-alike K/V so that some
    tokens merge and some are retained. `merge`: a stand-in for MiniCacheCache._merge."""
    config = KVCacheConfig(method="minicache", minicache_start_fraction=0.0, minicache_bits=bits,
                           minicache_retain_slots=slots, minicache_threshold=threshold,
                           minicache_residual_length=residual)
    caches = MiniCacheCache.build_layers(config, 2)
    if merge is not None:
        for cache in caches:
            cache._merge = merge.__get__(cache)
    mx.random.seed(seed)
    shared_k = mx.random.normal((B, H, n + extra, D))
    shared_v = mx.random.normal((B, H, n + extra, D))
    data = []
    for _ in caches:
        k = shared_k + 0.4 * mx.random.normal(shared_k.shape)
        v = shared_v + 0.4 * mx.random.normal(shared_v.shape)
        data.append((k.astype(dtype), v.astype(dtype)))
    for cache, (k, v) in zip(caches, data):
        cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
        mx.eval(cache.attention(mx.random.normal((B, H * REP, 1, D)).astype(dtype), scale=D**-0.5))
    for cache, (k, v) in zip(caches, data):
        if extra:
            cache.update_and_fetch(k[:, :, n:], v[:, :, n:])
    if extra >= 32:  # a second merge, at offset n_compressed > 0
        for cache in caches:
            mx.eval(cache.attention(mx.random.normal((B, H * REP, 16, D)).astype(dtype), scale=D**-0.5, mask="causal"))
    assert all(c.n_compressed > 0 for c in caches)
    return caches


def _previous_decode(cache):
    """MiniCacheCache._decode as it was before this change (main 4954451), frozen here."""
    out = []
    for part in ("k", "v"):
        direction = cache._directions(part)
        if cache.dir_bits is not None:
            direction = (mx.dequantize(*direction, group_size=QUANT_GROUP, bits=cache.dir_bits),)
        x = cache.store[f"mag_{part}"][..., None].astype(mx.float32) * direction[0].astype(mx.float32)
        if cache.slots:
            x = mx.concatenate([x, mx.zeros_like(x[:, :, :1])], axis=2)
            index = cache._slot_index(part)[..., None]
            index = mx.broadcast_to(index, (*index.shape[:-1], x.shape[-1]))
            x = mx.put_along_axis(x, index, cache.store[f"ret_{part}"].astype(mx.float32), axis=2)
            x = x[:, :, :-1]
        out.append(x[:, :, : cache.n_compressed].astype(cache.dtype))
    return out[0], out[1]


def _previous_path(cache, queries):
    """The K/V as the code before this change built them (base _prefill_keys_values): the host
    sync, the decode above and the window's concatenation, cast to the queries' dtype."""
    mx.eval(queries, *[a for a in (cache.window_keys, cache.window_values) if a is not None])
    keys, values = _previous_decode(cache)
    if cache.window_keys is not None:
        keys = mx.concatenate([keys, cache.window_keys], axis=2)
        values = mx.concatenate([values, cache.window_values], axis=2)
    return keys.astype(queries.dtype), values.astype(queries.dtype)


def _retained_somewhere(cache) -> bool:
    return bool(cache.slots) and bool(mx.any(cache.store["retpos_k"][..., : cache.n_compressed // 32 * cache.slots] >= 0).item())


CASES = [
    # (name, pair kwargs, queries dtype)
    ("fp16 hd64 4 slots", dict(), mx.float16),
    ("bf16 hd128 b2 4 slots", dict(B=2, D=128, dtype=mx.bfloat16), mx.bfloat16),
    ("fp32 cache, bf16 queries", dict(dtype=mx.float32), mx.bfloat16),
    ("bf16 cache, fp32 queries", dict(dtype=mx.bfloat16), mx.float32),
    ("4-bit directions", dict(bits=4, D=64), mx.float16),
    ("2-bit directions bf16", dict(bits=2, D=128, dtype=mx.bfloat16), mx.bfloat16),
    ("8-bit directions, 8 slots", dict(bits=8, slots=8), mx.float16),
    ("no slots", dict(slots=0), mx.float16),
    ("16 slots, all used", dict(threshold=1.0, slots=16), mx.float16),
    ("no window", dict(n=256, extra=0, residual=0), mx.float16),
]


def _queries(cache, dtype):
    B, D = cache.batch_size, cache.head_dim
    return mx.random.normal((B, H * REP, 16, D), key=mx.random.key(5)).astype(dtype)


@pytest.mark.parametrize("lower", [True, False], ids=["lower", "upper"])
def test_the_portable_prefill_is_the_previous_path_without_a_sync(lower, monkeypatch):
    caches = _pair(dtype=mx.bfloat16)
    cache = caches[0 if lower else 1]
    queries = _queries(cache, mx.bfloat16)
    expected = _previous_path(cache, queries)
    mx.eval(*expected)
    synced, ordered = [], []
    monkeypatch.setattr(mx, "eval", lambda *a: synced.append(a))
    real = CompressedKVCache._inputs_after_queries
    monkeypatch.setattr(CompressedKVCache, "_inputs_after_queries",
                        lambda self, arrays, q: (ordered.append(len(arrays)), real(self, arrays, q))[1])
    got = cache._prefill_keys_values(queries)
    monkeypatch.undo()
    assert not synced, "the prefill K/V took a host sync"
    assert ordered == [len(cache._history_arrays())], "the decode's inputs were not made to wait for the queries"
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype == queries.dtype and g.shape == e.shape
        assert mx.array_equal(g, e).item()


def test_a_chunks_attention_is_unchanged():
    # The whole attention of a prefill chunk (>= prefill_rows rows, causal) against the previous
    # path's K/V in the same mx.fast attention, and the pair's merge after it: same store.
    before, after = _pair(dtype=mx.float16, seed=3), _pair(dtype=mx.float16, seed=3)
    mx.random.seed(9)
    k, v = mx.random.normal((1, H, 64, 64)).astype(mx.float16), mx.random.normal((1, H, 64, 64)).astype(mx.float16)
    queries = mx.random.normal((1, H * REP, 64, 64)).astype(mx.float16)
    for pair, previous in ((before, True), (after, False)):
        for cache in pair:
            cache.update_and_fetch(k, v)
            if previous:
                keys, values = _previous_path(cache, queries)
                out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask="causal")
                cache._flush()
            else:
                out = cache.attention(queries, scale=0.125, mask="causal")
            mx.eval(out)
            cache.out = out
    for b, a in zip(before, after):
        assert mx.array_equal(b.out, a.out).item()
        assert b.n_compressed == a.n_compressed and sorted(b.store) == sorted(a.store)
        assert all(mx.array_equal(b.store[n], a.store[n]).item() for n in b.store)


@pytest.fixture(scope="module")
def _programs_built_in_parallel():
    """The emulated programs the kernel tests run, compiled up front one per core."""
    if cuda_emulation.COMPILER is None:
        return
    with cuda_emulation.signatures_only() as captured:
        for _, kwargs, q_dtype in CASES:
            for cache in _pair(**{**kwargs, "n": 64}):
                with emulated():
                    cache._prefill_keys_values(_queries(cache, q_dtype))
    cuda_emulation.prebuild_captured(captured)


@emulation
@pytest.mark.parametrize("name, kwargs, q_dtype", CASES, ids=[c[0] for c in CASES])
def test_the_emulated_kernel_is_the_previous_path(name, kwargs, q_dtype, _programs_built_in_parallel):
    for cache in _pair(**kwargs):
        queries = _queries(cache, q_dtype)
        expected = _previous_path(cache, queries)
        mx.eval(*expected)
        with emulated() as made:
            got = cache._prefill_keys_values(queries)
            mx.eval(*got)
        assert [k.name for k in made] == ["vq_merged_prefill_kv"] and made[0].calls == 1, "the kernel did not run"
        for label, g, e in zip(("keys", "values"), got, expected):
            assert g.dtype == e.dtype == q_dtype and g.shape == e.shape, (label, g.shape, e.shape)
            diff = np.abs(np.array(g.astype(mx.float32)) - np.array(e.astype(mx.float32))).max()
            assert mx.array_equal(g, e).item(), f"{name} {cache.role} {label}: max |kernel - previous| {diff:.3g}"
        if name == "no window":
            assert cache.window_keys is None
        if "slots" in name and name != "no slots":
            assert _retained_somewhere(cache), "the case retains no token: the slots go untested"


@emulation
def test_the_kernel_is_not_used_where_it_does_not_apply(_programs_built_in_parallel):
    # 3-bit direction codes straddle words: the portable path.
    for cache in _pair(bits=3, D=64):
        with emulated() as made:
            cache._prefill_keys_values(_queries(cache, mx.float16))
        assert not made
    assert not fused_prefill_merged.supports(64, 64, 4, 3)
    assert fused_prefill_merged.supports(64, 64, 4, None) and fused_prefill_merged.supports(128, 128, 0, 2)


@cuda_test
@pytest.mark.parametrize("name, kwargs, q_dtype", CASES[:3] + CASES[4:5], ids=[c[0] for c in CASES[:3] + CASES[4:5]])
def test_the_kernel_on_cuda_is_the_previous_path(name, kwargs, q_dtype, monkeypatch):
    # On the H200: the real kernel against the portable path on the same GPU (kernels off); the
    # differing elements are printed (the figure to report).
    from veloxquant_mlx.cache import fused_decode

    for cache in _pair(**kwargs):
        queries = _queries(cache, q_dtype)
        monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: False)
        expected = _previous_path(cache, queries)
        mx.eval(*expected)
        monkeypatch.undo()
        got = cache._prefill_keys_values(queries)
        mx.eval(*got)
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype
            diff = mx.abs(g.astype(mx.float32) - e.astype(mx.float32))
            print(name, cache.role, "differing", int((diff > 0).sum().item()), "max", float(diff.max().item()))
            if kwargs.get("bits") is None:
                # mag x direction in float32 is exact and the casts are the same on any device.
                assert mx.array_equal(g, e).item()
            else:
                # MLX's CUDA dequantize may contract the direction's scale * code + bias into one
                # fma (the kernel rounds twice, as the CPU does): a float16 rounding apart.
                assert mx.allclose(g.astype(mx.float32), e.astype(mx.float32), rtol=2e-3, atol=2e-3).item()


def _previous_merge(self, k_low, v_low, k_up, v_up):
    """MiniCacheCache._merge as it was before this change (main 4954451, uncompiled), frozen."""
    from veloxquant_mlx.cache.minicache import BLOCK, SIDE_DTYPE, slerp_merge

    def retained_positions(cos):
        B_, H_, n = cos.shape
        blocks = cos.reshape(B_, H_, n // BLOCK, BLOCK)
        order = mx.argsort(blocks, axis=-1)[..., : self.slots]
        chosen_cos = mx.take_along_axis(blocks, order, axis=-1)
        base = self.n_compressed + mx.arange(n // BLOCK)[:, None] * BLOCK
        positions = (order + base).astype(mx.int32)
        positions = mx.where(chosen_cos < self.threshold, positions, -1)
        return positions.reshape(B_, H_, -1)

    def retained(part, x, positions):
        local = mx.maximum(positions - self.n_compressed, 0)
        vectors = mx.take_along_axis(x, local[..., None], axis=2)
        return {f"ret_{part}": vectors.astype(self.dtype), f"retpos_{part}": positions}

    def encode_direction(part, merged):
        if self.dir_bits is None:
            return {f"dir_{part}": merged.astype(SIDE_DTYPE)}
        codes, scales, biases = mx.quantize(merged, group_size=QUANT_GROUP, bits=self.dir_bits)
        return {f"dir_{part}": codes, f"dirscale_{part}": scales.astype(SIDE_DTYPE),
                f"dirbias_{part}": biases.astype(SIDE_DTYPE)}

    low, up = {}, {}
    for part, x_low, x_up in (("k", k_low, k_up), ("v", v_low, v_up)):
        merged, mag_low, mag_up, cos = slerp_merge(x_low, x_up)
        low.update(encode_direction(part, merged))
        low[f"mag_{part}"] = mag_low.astype(SIDE_DTYPE)
        up[f"mag_{part}"] = mag_up.astype(SIDE_DTYPE)
        if self.slots:
            positions = retained_positions(cos)
            low.update(retained(part, x_low, positions))
            up.update(retained(part, x_up, positions))
    return low, up


@pytest.mark.parametrize("kwargs", [dict(dtype=mx.bfloat16, D=128), dict(bits=4, dtype=mx.float16),
                                    dict(slots=16, threshold=1.0, dtype=mx.float32), dict(slots=0)],
                         ids=["bf16 fp16-directions", "4-bit directions", "16 slots fp32", "no slots"])
def test_the_compiled_merge_stores_what_the_previous_merge_stored(kwargs, monkeypatch):
    # Two chunks merged after the first (offsets 0 and 288): every store array bit for bit.
    compiled = _pair(**kwargs, n=300, extra=70, seed=4)
    caches_before = _pair(**kwargs, n=300, extra=70, seed=4, merge=_previous_merge)
    for new, old in zip(compiled, caches_before):
        assert old.n_compressed == new.n_compressed > 0
        assert sorted(old.store) == sorted(new.store)
        for name in old.store:
            assert old.store[name].dtype == new.store[name].dtype, name
            assert mx.array_equal(old.store[name], new.store[name]).item(), name


def test_the_uncompiled_merge_switch_stores_the_same_arrays(monkeypatch):
    # minicache.COMPILE_MERGE = False (the bench modules' --set, for a GPU A/B) runs merge_part
    # as plain ops: on the CPU the same bits as the compiled merge.
    from veloxquant_mlx.cache import minicache

    compiled = _pair(bits=4, dtype=mx.bfloat16, n=300, extra=70, seed=6)
    monkeypatch.setattr(minicache, "COMPILE_MERGE", False)
    plain = _pair(bits=4, dtype=mx.bfloat16, n=300, extra=70, seed=6)
    for a, b in zip(compiled, plain):
        assert a.n_compressed == b.n_compressed > 0
        for name in a.store:
            assert mx.array_equal(a.store[name], b.store[name]).item(), name
