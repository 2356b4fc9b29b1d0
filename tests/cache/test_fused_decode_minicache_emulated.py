"""fused_decode_merged's partials kernel (+ fused_decode's merge kernel) for MiniCache's paired
layers, run on the CPU by the thread-level emulation (tests/cache/cuda_emulation.py), through
the caches' real decode path, against their portable attention.

The emulation stands in for mx.fast.cuda_kernel and the kernels are reported active, so a paired
layer's decode step goes the way it goes on CUDA: CompressedKVCache.attention ->
MiniCacheCache._fused_decode -> fused_decode_merged.decode_step (the lower layer's directions,
the layer's magnitudes and retained slots, the window) -> merged_launch (blocks, meta,
template constants, grid) -> the two kernel sources, as written. Expected: the same step with
the kernels off (the CPU default: _scores / _weighted_values). Both layers of a pair are checked
(the lower one reads its own directions, the upper one its partner's). A corrupted source (in
memory) shows that the comparison fails. What the emulation cannot check is listed in its
docstring (nvrtc, speed, lock-step races).
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.test_fused_decode_minicache import _pair
from veloxquant_mlx.cache import base, fused_decode, fused_decode_merged

pytestmark = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)


_emulated_step = cuda_emulation.emulated_decode_step

# (name, dtype, head dim, batch, GQA rows, prefill tokens, config fields, TARGET_WARPS or None)
# (PREFETCH_FIRST_VALUES is on, the default, except in the case that says otherwise)
CASES = [
    ("default f32 hd128 gqa4", mx.float32, 128, 1, 4, 700, {}, None),
    ("default bf16 hd128 gqa4", mx.bfloat16, 128, 1, 4, 700, {}, None),
    ("default fp16 hd64 batch2 mha", mx.float16, 64, 2, 1, 500, {}, None),
    ("no slots f32 hd128 gqa4", mx.float32, 128, 1, 4, 700, {"minicache_retain_slots": 0}, None),
    # one block per head, each warp walks several 32-token tiles (online softmax across tiles)
    ("many tiles per warp f32 hd128 gqa4", mx.float32, 128, 1, 4, 1100, {}, 1),
    # a window of 40 + 28 tokens: the window block's warps take 2 tiles, the last one ragged
    ("long window f32 hd128 gqa4", mx.float32, 128, 1, 4, 740, {"minicache_residual_length": 40}, None),
    # quantized directions (minicache_bits): 4 bits, a word per 8-channel chunk
    ("4-bit directions f32 hd128 gqa4", mx.float32, 128, 1, 4, 700, {"minicache_bits": 4}, None),
]
# Slow (each compiles its own program, ~2 s cold, not built up front): the other corners.
SLOW_CASES = [
    ("default f32 hd128 gqa4 no prefetch", mx.float32, 128, 1, 4, 700, {}, None),
    # 1 slot: fewer slots than the 4 rows of a value round (hd 64): the zero weight row
    ("1 slot f32 hd64 gqa2", mx.float32, 64, 1, 2, 500, {"minicache_retain_slots": 1}, None),
    # 16 slots (4 key iterations over them), 8 rows per kv head (the most supports() takes)
    ("16 slots f32 hd64 gqa8", mx.float32, 64, 1, 8, 500, {"minicache_retain_slots": 16}, None),
    # 2 bits (half a word: odd chunks in the upper half), 8 bits (two words)
    ("2-bit directions bf16 hd64 mha", mx.bfloat16, 64, 1, 1, 500, {"minicache_bits": 2}, None),
    ("8-bit directions no slots f32 hd128 gqa4", mx.float32, 128, 1, 4, 500,
     {"minicache_bits": 8, "minicache_retain_slots": 0}, None),
]


# A corrupted kernel must fail the comparison (in memory; fused_decode_merged.py is untouched):
# (name, config fields of the pair, source text, its replacement).
MUTATIONS = [
    ("retained keys ignored", {}, "if (pk_bh[blk * S + k] == t) {", "if (pk_bh[blk * S + k] == t && false) {"),
    ("4-bit key biases ignored", {"minicache_bits": 4},
     "fmaf(sc[jj][c], dot[jj][r], fmaf(bs[jj][c], qsum, part[j0 + jj][r]))",
     "fmaf(sc[jj][c], dot[jj][r], part[j0 + jj][r])"),
]


def _mutated(monkeypatch, old, new):
    source = fused_decode_merged._PARTIALS + fused_decode_merged._HEADER
    assert source.count(old) == 1, f"fused_decode_merged no longer contains {old!r} once: pick a new mutation"
    for attr in ("_PARTIALS", "_HEADER"):
        monkeypatch.setattr(fused_decode_merged, attr, getattr(fused_decode_merged, attr).replace(old, new))


def _prefetch_setting(monkeypatch, case_name):
    if "no prefetch" in case_name:
        monkeypatch.setattr(fused_decode_merged, "PREFETCH_FIRST_VALUES", False)


@pytest.fixture(scope="module", autouse=True)
def _programs_built_in_parallel():
    """Every program the tests below compile, built up front one per core (the signatures are
    captured from small pairs of the same shapes; a cold build costs the compiler ~1-2 s each)."""
    with cuda_emulation.signatures_only() as captured:
        for name, dtype, D, B, rep, n, fields, warps in CASES:
            with pytest.MonkeyPatch.context() as mp:
                _prefetch_setting(mp, name)
                lower, upper, queries = _pair(100, B=B, H=2, rep=rep, D=D, dtype=dtype, **fields)
                _emulated_step(upper, queries[1], D**-0.5)
        for name, fields, old, new in MUTATIONS:
            with pytest.MonkeyPatch.context() as mutated:
                _mutated(mutated, old, new)
                lower, upper, queries = _pair(100, B=1, H=2, rep=4, D=128, dtype=mx.float32, **fields)
                _emulated_step(upper, queries[1], 128**-0.5)
    cuda_emulation.prebuild_captured(captured)


@pytest.mark.parametrize("name, dtype, D, B, rep, n, fields, warps",
                         CASES + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_CASES],
                         ids=[c[0] for c in CASES + SLOW_CASES])
def test_the_emulated_kernels_are_the_portable_attention(monkeypatch, name, dtype, D, B, rep, n, fields, warps):
    _prefetch_setting(monkeypatch, name)
    if warps:
        monkeypatch.setattr(fused_decode_merged, "TARGET_WARPS", warps)
    lower, upper, queries = _pair(n, B=B, H=2, rep=rep, D=D, dtype=dtype, **fields)
    n_valid = upper.n_compressed
    residual = fields.get("minicache_residual_length", 0)
    assert lower.n_compressed == n_valid == (n - residual) // 32 * 32 and "dir_k" not in upper.store
    slots = upper.slots
    if slots:  # used and unused slots, keys and values choosing differently
        for cache in (lower, upper):
            pos = np.array(cache.store["retpos_k"])[..., : n_valid // 32 * slots]
            assert (pos >= 0).any() and (pos < 0).any(), pos
        assert not np.array_equal(np.array(upper.store["retpos_k"]), np.array(upper.store["retpos_v"]))
    per_block = fused_decode_merged.tokens_per_block(n_valid, B * 2)
    if warps:
        assert n_valid <= per_block and n_valid > 4 * fused_decode_merged.TILE  # >1 tile per warp
    else:
        assert n_valid > per_block and n_valid % per_block  # several blocks, the last one ragged
    if fields.get("minicache_residual_length"):
        assert upper.window_keys.shape[2] > 32 and upper.window_keys.shape[2] % 32
    for label, cache, q_heads in (("lower", lower, queries[0]), ("upper", upper, queries[1])):
        assert fused_decode_merged.supports(D, D, slots, rep, cache.dir_bits)
        window = cache.window_keys.shape[2]
        # Kernels off (the CPU default), over the same store and window but with float32 queries:
        # the kernels compute in float32 and round once at the end, while the portable path in
        # fp16 / bf16 rounds its scores and sums.
        expected = cache.attention(q_heads.astype(mx.float32), scale=D**-0.5)
        mx.eval(expected)
        assert (cache.n_compressed, cache.window_keys.shape[2]) == (n_valid, window)  # nothing flushed
        got, made = _emulated_step(cache, q_heads, D**-0.5)
        ran = sorted((k.name, k.calls) for k in made if k.calls)
        assert ran == [("vq_merged_decode_partials_merged", 1)], ran
        assert got.dtype == dtype and got.shape == q_heads.shape
        got, expected = np.array(got.astype(mx.float32)), np.array(expected)
        tol = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]  # the output's rounding
        print(f"{name} {label}: max |kernel - portable| = {np.abs(got - expected).max():.2e}")
        assert np.allclose(got, expected, atol=tol, rtol=tol), (label, np.abs(got - expected).max())


@pytest.mark.parametrize("name, fields, old, new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_corrupted_kernel_source_fails_the_comparison(monkeypatch, name, fields, old, new):
    lower, upper, queries = _pair(700, B=1, H=2, rep=4, D=128, dtype=mx.float32, **fields)
    expected = np.array(upper.attention(queries[1], scale=128**-0.5))
    _mutated(monkeypatch, old, new)
    got, made = _emulated_step(upper, queries[1], 128**-0.5)
    assert sorted(k.name for k in made if k.calls) == ["vq_merged_decode_partials_merged"]
    difference = np.abs(np.array(got) - expected).max()
    print(f"{name}: max |kernel - portable| = {difference:.2e}")
    assert difference > 1e-3  # 50x the tolerance above, at least


def test_the_kernel_reads_a_window_written_in_place(monkeypatch):
    # base.DECODE_WINDOW_IN_PLACE: a paired layer's decode token goes into window buffers with
    # slack rows (cache/window_buffer.py); the kernel gets them whole and the filled rows as
    # wn's length.
    monkeypatch.setattr(base, "DECODE_WINDOW_IN_PLACE", 1)
    # The uncompiled launch reading the buffers (wn's length the filled rows); the compiled one
    # (as shipped, the count as data) is tests/cache/test_compiled_launch.py's.
    monkeypatch.setattr(fused_decode, "COMPILED_LAUNCH", False)
    lower, upper, queries = _pair(700, B=1, H=2, rep=4, D=128, dtype=mx.float32)
    for cache, q_heads in ((lower, queries[0]), (upper, queries[1])):
        buf_k, _, n = cache.window_buffers()
        assert buf_k.shape[2] > n  # slack rows the kernel must not read
        expected = np.array(cache.attention(q_heads, scale=128**-0.5))
        got, made = _emulated_step(cache, q_heads, 128**-0.5)
        assert sorted((k.name, k.calls) for k in made if k.calls) == [("vq_merged_decode_partials_merged", 1)]
        got = np.array(got)
        assert np.allclose(got, expected, atol=2e-5, rtol=2e-5), np.abs(got - expected).max()
