"""KVQuant's decode kernel (fused_decode_codebook's partials + fused_decode's merge) run on the CPU by
the thread-level emulation (tests/cache/cuda_emulation.py), against the portable attention.

The emulation stands in for mx.fast.cuda_kernel and the kernels are reported active, so the
decode step goes the way it goes on CUDA: KVQuantCache.attention -> _fused_decode ->
fused_decode_codebook.decode_step (the exact sink as skip 1 + an exact prefix of the window) ->
codebook_partials (blocks, meta, template, grid) -> the kernel source as written -> merge_partials.
Expected: the same step with the kernels off (the CPU default: the compiled chunked codebook
path of kvquant_attention.py). Corrupted sources (in memory) show that the comparison fails.
What the emulation cannot check is listed in its docstring (nvrtc, speed, lock-step races).
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import base, fused_decode, fused_decode_codebook
from veloxquant_mlx.cache.kvquant import KVQuantCache

pytestmark = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)


def _kvquant(**fields):
    return lambda: KVQuantCache(KVCacheConfig(method="kvquant", **fields))


def _filled(cache, n, *, B, H, rep, D, dtype, seed=0):
    """A cache after a prefill of n tokens (keys with an offset and outlier channels, as real
    keys have, and a large first token, as a real attention sink), then one decode token:
    returns the decode step's queries."""
    mx.random.seed(seed)
    k = mx.random.normal((B, H, n, D)) * mx.where(mx.arange(D) % 16 == 3, 4.0, 1.0) + 0.5
    k = mx.concatenate([k[:, :, :1] * 3.0, k[:, :, 1:]], axis=2)
    cache.update_and_fetch(k.astype(dtype), mx.random.normal((B, H, n, D)).astype(dtype))
    # One query row is enough for the attention call that flushes the prefill into blocks.
    mx.eval(cache.attention(mx.random.normal((B, rep * H, 1, D)).astype(dtype), scale=D**-0.5))
    cache.update_and_fetch(mx.random.normal((B, H, 1, D)).astype(dtype), mx.random.normal((B, H, 1, D)).astype(dtype))
    return (2 * mx.random.normal((B, rep * H, 1, D))).astype(dtype)


_emulated_step = cuda_emulation.emulated_decode_step

# (name, cache factory, dtype, head dim, batch, GQA rows, prefill tokens, TARGET_WARPS or None,
# fused_decode_codebook constants set for the case: the value split and the parking)
OLD = {"MAX_LANE_ACCUMULATORS": 64, "PARK_ACCUMULATORS": False}  # the kernel before session 5
UNPARKED = {"PARK_ACCUMULATORS": False}
CASES = [
    # the default (3 bits: codes straddle tokens inside words; 1% outliers; G 32); 1088 history
    # tokens: blocks of 512, 512 and a ragged 64 (half a tile)
    ("kvquant-3 default hd128 gqa4", _kvquant(), mx.float32, 128, 1, 4, 1100, None, {}),
    ("kvquant-2 hd128 batch2 mha", _kvquant(kvquant_bits=2), mx.float32, 128, 2, 1, 700, None, {}),
    ("kvquant-4 hd64 gqa2 no outliers", _kvquant(kvquant_bits=4, kvquant_outlier_fraction=0.0),
     mx.float32, 64, 1, 2, 700, None, {}),
    # 3 bits at head dim 64: a token's last run of codes is 4 channels (64 = 6 * 10 + 4)
    ("kvquant-3 hd64 batch2 gqa2", _kvquant(), mx.float32, 64, 2, 2, 700, None, {}),
    # 8 rows: 4 value channels per lane (32 lanes per token), which for 2 bits is a quarter word
    # starting inside it (the two-word window with all 32 bits used)
    ("kvquant-2 hd128 gqa8", _kvquant(kvquant_bits=2), mx.float32, 128, 1, 8, 700, None, {}),
    ("kvquant-3 g64 hd128 gqa4", _kvquant(kvquant_group_size=64), mx.float32, 128, 1, 4, 700, None, {}),
    # a tile is one block of 128 tokens (164 outliers each)
    ("kvquant-4 g128 hd128 gqa4", _kvquant(kvquant_bits=4, kvquant_group_size=128), mx.float32, 128, 1, 4, 1100, None, {}),
    # one block per head: each warp walks several 128-token tiles (online softmax across tiles)
    ("kvquant-3 many tiles per warp", _kvquant(), mx.float32, 128, 1, 4, 1100, 1, {}),
    # the 16-bit load and store paths (QT, ST)
    ("kvquant-3 fp16 hd128 gqa4", _kvquant(), mx.float16, 128, 1, 4, 700, None, {}),
    ("kvquant-3 bf16 hd128 gqa4", _kvquant(), mx.bfloat16, 128, 1, 4, 700, None, {}),
    ("kvquant-2 bf16 hd64 mha", _kvquant(kvquant_bits=2), mx.bfloat16, 64, 1, 1, 700, None, {}),
    # The value split (channels_per_lane): 32 accumulators give 8 channels at 4 rows (16 lanes per
    # token; 3 bits: a lane's 8 codes start inside a word) and 4 at 8 rows (32 lanes per token);
    # 3 rows at head dim 64 (SmolLM2): 8 channels, 8 lanes. The cases above park the value sums
    # in shared memory (parks()) except at 8 rows with value outliers (too much shared memory).
    ("kvquant-3 hd128 gqa8", _kvquant(), mx.float32, 128, 1, 8, 700, None, {}),
    ("kvquant-4 hd128 gqa8 no outliers", _kvquant(kvquant_bits=4, kvquant_outlier_fraction=0.0),
     mx.float32, 128, 1, 8, 700, None, {}),
    ("kvquant-3 hd64 gqa3", _kvquant(), mx.float32, 64, 1, 3, 700, None, {}),
    # the sums in registers (PARK_ACCUMULATORS off), and the old setting through the constants
    # (64 accumulators: 16 channels up to 4 rows, 8 above; not parked)
    ("kvquant-3 default hd128 gqa4 unparked", _kvquant(), mx.float32, 128, 1, 4, 1100, None, UNPARKED),
    ("kvquant-3 many tiles per warp unparked", _kvquant(), mx.float32, 128, 1, 4, 1100, 1, UNPARKED),
    ("kvquant-3 default hd128 gqa4 old split", _kvquant(), mx.float32, 128, 1, 4, 1100, None, OLD),
    ("kvquant-2 hd128 gqa8 old split", _kvquant(kvquant_bits=2), mx.float32, 128, 1, 8, 700, None, OLD),
    # the unaligned value loop one round at a time (the kernel before session 11), and in batches
    # of 2 (several batches per tile at 64 rounds) over several tiles per warp
    ("kvquant-3 default hd128 gqa4 one round", _kvquant(), mx.float32, 128, 1, 4, 1100, None,
     {"UNALIGNED_VALUE_BATCH": 1}),
    ("kvquant-3 many tiles per warp batch 2", _kvquant(), mx.float32, 128, 1, 4, 1100, 1,
     {"UNALIGNED_VALUE_BATCH": 2}),
    # outliers one entry at a time (before session 11), and 4 per lane (session 11; the default
    # takes 8 since session 12: one batch per tile)
    ("kvquant-3 default hd128 gqa4 outliers one by one", _kvquant(), mx.float32, 128, 1, 4, 1100, None,
     {"OUTLIER_BATCH": 1}),
    ("kvquant-3 many tiles per warp outliers 4", _kvquant(), mx.float32, 128, 1, 4, 1100, 1,
     {"OUTLIER_BATCH": 4}),
    # the key outliers' sums on row-major slots (KEY_SLOTS_BY_ROW, off: prepared in session 29),
    # at 4 rows and at 8 (R * SLOTS: the whole probability buffer)
    ("kvquant-3 default hd128 gqa4 key slots by row", _kvquant(), mx.float32, 128, 1, 4, 1100, None,
     {"KEY_SLOTS_BY_ROW": True}),
    ("kvquant-3 bf16 hd128 gqa8 key slots by row", _kvquant(), mx.bfloat16, 128, 1, 8, 700, None,
     {"KEY_SLOTS_BY_ROW": True}),
]

# Each must fail the comparison (one change in the source, in memory).
MUTATIONS = [
    ("sink placeholder attended", "const int lo = window ? 0 : n_skip;", "const int lo = 0;"),
    ("key outliers ignored", "const float delta = ex[b] - fmaf(cbk[code], osc[b], ozp[b]);", "const float delta = 0.f;"),
    ("value outliers ignored", "const float u = (ex[b] - ozp[b]) / osc[b] - cbv[code];", "const float u = 0.f;"),
    # a batch's later entries dropped (OB = 8, the default: at 1100 tokens a lane holds up to 6
    # entries of a tile, all in its first batch)
    ("outlier batch cut to one entry", "if (j0 + 32 * b < n_entries && t >= base && t < tile_end) {",
     "if (b == 0 && j0 + 32 * b < n_entries && t >= base && t < tile_end) {"),
    ("3-bit phase ignored", "win[i] = vq_window<BITS>(lead[i], next, ph[i]);",
     "win[i] = vq_window<BITS>(lead[i], next, 0);"),
    ("3-bit value phase ignored", "vq_window<BITS>(words[k][g], words[k][g + 1], phase[k]);",
     "vq_window<BITS>(words[k][g], words[k][g + 1], 0);"),
    ("value zeros dropped", "red_o[r * DV + ch0 + c] = acc[r][c] + zsum[r] + fix;",
     "red_o[r * DV + ch0 + c] = acc[r][c] + fix;"),
    # the parked value sums (the default case parks): lost between tiles, or not rescaled to a
    # later tile's maxima (the test runs these with one block per head: several tiles per warp)
    ("parked sums not stored", "for (int c = 0; c < CPL; ++c) acc_park[(r * CPL + c) * 32] = acc[r][c];",
     "for (int c = 0; c < CPL; ++c) (void)acc[r][c];"),
    ("parked sums not rescaled", "acc[r][c] = acc_park[(r * CPL + c) * 32] * alpha_r[r];",
     "acc[r][c] = acc_park[(r * CPL + c) * 32];"),
]


def _mutated(monkeypatch, old, new):
    source = fused_decode_codebook._PARTIALS
    assert old in source, f"fused_decode_codebook._PARTIALS no longer contains {old!r}: pick a new mutation"
    monkeypatch.setattr(fused_decode_codebook, "_PARTIALS", source.replace(old, new, 1))


@pytest.fixture(scope="module", autouse=True)
def _programs_built_in_parallel():
    """Every program the tests below compile, built up front one per core: the signatures are
    captured from small caches of the same shapes."""
    with cuda_emulation.signatures_only() as captured:
        for name, make, dtype, D, B, rep, n, warps, constants in CASES:
            with pytest.MonkeyPatch.context() as split:
                for constant, value in constants.items():
                    split.setattr(fused_decode_codebook, constant, value)
                cache = make()
                _emulated_step(cache, _filled(cache, 100, B=B, H=2, rep=rep, D=D, dtype=dtype), D**-0.5)
        for name, old, new in MUTATIONS:
            with pytest.MonkeyPatch.context() as mutated:
                _mutated(mutated, old, new)
                cache = CASES[0][1]()
                _emulated_step(cache, _filled(cache, 100, B=1, H=2, rep=4, D=128, dtype=mx.float32), 128**-0.5)
    cuda_emulation.prebuild_captured(captured)


@pytest.mark.parametrize("name, make, dtype, D, B, rep, n, warps, constants", CASES, ids=[c[0] for c in CASES])
def test_the_emulated_kernels_are_the_portable_attention(monkeypatch, name, make, dtype, D, B, rep, n, warps,
                                                         constants):
    if warps:
        monkeypatch.setattr(fused_decode, "TARGET_WARPS", warps)
    for constant, value in constants.items():
        monkeypatch.setattr(fused_decode_codebook, constant, value)
    cache = make()
    q_heads = _filled(cache, n, B=B, H=2, rep=rep, D=D, dtype=dtype)
    n_valid, window = cache.n_compressed, cache.window_keys.shape[2]
    outliers = "value_outlier_position" in cache.store
    assert outliers == ("no outliers" not in name)
    assert fused_decode_codebook.supports(D, D, cache.group_size, cache.code_bits, rep, outliers)
    # which path the case takes: the value sums parked in shared memory unless switched off (or
    # the old split) or 8 rows with value outliers (54 KB of shared memory with them)
    parked = constants.get("PARK_ACCUMULATORS", True) and not (rep == 8 and outliers)
    assert fused_decode_codebook.parks(D, D, rep, cache.code_bits, outliers) == parked
    # Kernels off (the CPU default) over the same store and window, float32 queries: the kernel
    # computes in float32 and rounds once at the end, while the portable path in fp16/bf16
    # rounds its scores and sums.
    expected = cache.attention(q_heads.astype(mx.float32), scale=D**-0.5)
    mx.eval(expected)
    assert (cache.n_compressed, cache.window_keys.shape[2]) == (n_valid, window)  # nothing flushed

    got, made = _emulated_step(cache, q_heads, D**-0.5)
    assert sorted(k.name for k in made if k.calls) == ["vq_codebook_decode_partials_merged"]
    assert got.dtype == dtype and got.shape == q_heads.shape

    per_block = fused_decode.tokens_per_block(n_valid, B * 2)
    if warps:
        assert n_valid <= per_block and n_valid > 4 * fused_decode.TILE  # one block, >1 tile per warp
    else:
        assert n_valid > per_block  # several history blocks to merge
    if name.startswith("kvquant-3 default"):
        assert n_valid % per_block and (n_valid % per_block) % fused_decode.TILE  # a ragged last tile
    got, expected = np.array(got.astype(mx.float32)), np.array(expected)
    diff = np.abs(got - expected).max()
    print(f"{name}: {n_valid} history + {window} window tokens, max |kernel - portable| = {diff:.3g}")
    tol = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]  # the output's rounding
    assert np.allclose(got, expected, atol=tol, rtol=tol), diff


@pytest.mark.parametrize("name, old, new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_corrupted_kernel_source_fails_the_comparison(monkeypatch, name, old, new):
    cache = CASES[0][1]()
    q_heads = _filled(cache, 1100, B=1, H=2, rep=4, D=128, dtype=mx.float32)
    expected = np.array(cache.attention(q_heads, scale=128**-0.5))
    if name.startswith("parked"):
        monkeypatch.setattr(fused_decode, "TARGET_WARPS", 1)
    _mutated(monkeypatch, old, new)
    got, made = _emulated_step(cache, q_heads, 128**-0.5)
    assert sorted(k.name for k in made if k.calls) == ["vq_codebook_decode_partials_merged"]
    diff = np.abs(np.array(got) - expected).max()
    print(f"mutation {name!r}: max |kernel - portable| = {diff:.3g}")
    assert diff > 1e-4  # 5x the float32 tolerance above, at least


def test_the_kernel_reads_a_window_written_in_place(monkeypatch):
    # base.DECODE_WINDOW_IN_PLACE: the window is a buffer with slack rows (cache/window_buffer.py);
    # the kernel gets it whole and the filled rows as wn's length, at each of a few steps.
    monkeypatch.setattr(base, "DECODE_WINDOW_IN_PLACE", 1)
    # The uncompiled launch reading the buffers (wn's length the filled rows); the compiled one
    # (as shipped, the count as data) is tests/cache/test_compiled_launch.py's.
    monkeypatch.setattr(fused_decode, "COMPILED_LAUNCH", False)
    cache = _kvquant()()
    q_heads = _filled(cache, 700, B=1, H=2, rep=4, D=128, dtype=mx.float32)
    for step in range(2):
        buf_k, _, n = cache.window_buffers()
        assert buf_k.shape[2] > n  # slack rows the kernel must not read
        expected = np.array(cache.attention(q_heads, scale=128**-0.5))
        got, made = _emulated_step(cache, q_heads, 128**-0.5)
        assert sorted(k.name for k in made if k.calls) == ["vq_codebook_decode_partials_merged"]
        got = np.array(got)
        assert np.allclose(got, expected, atol=2e-5, rtol=2e-5), (step, np.abs(got - expected).max())
        mx.random.seed(60 + step)
        cache.update_and_fetch(mx.random.normal((1, 2, 1, 128)), mx.random.normal((1, 2, 1, 128)))
        q_heads = 2 * mx.random.normal((1, 8, 1, 128))
