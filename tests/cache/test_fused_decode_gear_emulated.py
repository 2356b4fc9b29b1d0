"""fused_decode_gear's partials kernel (fused_decode's plus GEAR's low-rank and sparse terms) and
fused_decode's merge kernel, run on the CPU by the thread-level emulation
(tests/cache/cuda_emulation.py), against GEARCache's portable attention.

The emulation stands in for mx.fast.cuda_kernel and the kernels are reported active, so the
decode step goes the way it goes on CUDA: GEARCache.attention -> _fused_decode ->
fused_decode_gear.decode_step (store arrays, dummies, template) -> fused_decode.affine_partials
(blocks, meta, grid) -> the two kernel sources, as written. Expected: the same step with the
kernels off (the CPU default: gear_attention's quantized_matmul + low-rank + sparse, in float32).
Corrupted sources (in memory), one per GEAR term, show that each term is checked.
What the emulation cannot check is listed in its docstring (nvrtc, speed, lock-step races).
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.gear_clash_data import clashing_cache
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import fused_decode, fused_decode_gear, kernel_header
from veloxquant_mlx.cache.gear import GEARCache

pytestmark = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)


def _gear(**fields):
    return lambda: GEARCache(KVCacheConfig(method="gear", **fields))


def _filled(cache, n, *, B, H, rep, D, dtype, seed=0):
    """A cache after a prefill of n tokens (keys with an offset channel, a wide channel and
    value spikes, so the outliers and the low-rank residual carry weight), then one decode
    token: returns the decode step's queries."""
    mx.random.seed(seed)
    k = mx.random.normal((B, H, n, D)) * mx.where(mx.arange(D) % 16 == 3, 4.0, 1.0) + 0.5
    k = k + mx.where(mx.arange(D) == 5, 10.0, 0.0)
    v = mx.random.normal((B, H, n, D))
    v = mx.where(mx.random.uniform(shape=v.shape) < 0.003, 12.0, v)
    cache.update_and_fetch(k.astype(dtype), v.astype(dtype))
    # One query row flushes the window into the compressed history (n rows would cost seconds).
    mx.eval(cache.attention(mx.random.normal((B, rep * H, 1, D)).astype(dtype), scale=D**-0.5))
    cache.update_and_fetch(mx.random.normal((B, H, 1, D)).astype(dtype), mx.random.normal((B, H, 1, D)).astype(dtype))
    return (2 * mx.random.normal((B, rep * H, 1, D))).astype(dtype)


_emulated_step = cuda_emulation.emulated_decode_step

# (name, cache factory, dtype, head dim, batch, GQA rows, prefill tokens, TARGET_WARPS or None)
CASES = [
    # the default (2 bits, group 32, rank 4, 1% outliers: 328 pairs per 256 x 128 block)
    ("gear-2 hd128 gqa4", _gear(), mx.float32, 128, 1, 4, 1100, None),
    ("gear-2 bf16 hd128 gqa4", _gear(), mx.bfloat16, 128, 1, 4, 1100, None),
    ("gear-2 fp16 hd64 batch2 mha", _gear(), mx.float16, 64, 2, 1, 800, None),
    ("gear-2 hd64 gqa3 (SmolLM2's heads)", _gear(), mx.float32, 64, 1, 3, 800, None),
    # variants: 4 bits, rank 2, 5% outliers; rank 0 without outliers (fused_decode's kernel
    # over GEAR's arrays); 8 bits with rank 8 (4 rows x 8 ranks: the per-lane limit of 32)
    ("gear-4 r2 5% hd128 gqa2", _gear(gear_bits=4, gear_rank=2, gear_outlier_fraction=0.05), mx.float32, 128, 1, 2, 800, None),
    ("gear-2 r0 no outliers hd128 gqa4", _gear(gear_rank=0, gear_outlier_fraction=0.0), mx.float32, 128, 1, 4, 800, None),
    ("gear-8 r8 1% hd64 gqa4", _gear(gear_bits=8, gear_rank=8), mx.float32, 64, 1, 4, 800, None),
    # 8 rows x rank 4: the per-lane limit too, in fp16
    ("gear-2 fp16 hd128 gqa8", _gear(), mx.float16, 128, 1, 8, 800, None),
    # 768 history tokens: blocks of 512 tokens leave a last block of 256 (two tiles, two idle warps)
    ("gear-2 ragged last block", _gear(), mx.float32, 128, 1, 4, 800, None),
    # one block per head, each warp walks three 128-token tiles (online softmax across tiles,
    # the sparse value sums rescaled between them)
    ("gear-2 many tiles per warp", _gear(), mx.float32, 128, 1, 4, 1600, 1),
]

# A corrupted kernel must fail the comparison: one change per GEAR term (in memory; the module
# is untouched), each replacing the first occurrence in the composed source; (name, old, new,
# TARGET_WARPS or None). The rescale of the sparse value sums matters only when a warp walks
# several tiles: one block per head there.
MUTATIONS = [
    ("key outliers dropped", "float* sum = &p_tile[key_slot(t, r)];", "float lost = 0.f; float* sum = &lost;", None),
    ("key low rank dropped", "s[i][r] = fmaf(qb[r][j], a, s[i][r]);", ";", None),
    ("value low rank dropped", "acc[r][c] = fmaf(uj[r], b, acc[r][c]);", ";", None),
    ("value outliers dropped", "atomicAdd(&vsp_w[r * DV + c], p_tile[tile_slot(t) * R + r] * val);", ";", None),
    ("value outliers not rescaled", "vsp_w[r * DV + c] *= al[r];", ";", 1),
    # a round's later entries dropped (OUTLIER_BATCH 4: 3 of a lane's 4 consecutive entries)
    ("outlier batch cut to one entry", "const bool mine = valid && idx >= first && idx < end;",
     "const bool mine = b == 0 && valid && idx >= first && idx < end;", None),
    # the sorted scan stopped after its first round (128 entries) where a tile's run is ~164
    ("sorted scan stopped early", "past |= valid && (forward ? idx >= end : idx < first);", "past = true;", None),
    # the block's second tile walking forward from the block's start but stopping as a backward
    # walk does (at the first entry before the tile); either direction alone is correct
    ("sorted scan's backward walk read forward", "const int e = SORTED && !forward ? CNT - 1 - k : k;",
     "const int e = k;", None),
]


def _mutated(monkeypatch, old, new):
    """`old` replaced by `new` in the one text of the kernel that holds it: its source or its
    header (GEAR's helper for the sparse entries)."""
    holders = [name for name in ("PARTIALS_SOURCE", "_HEADER") if old in getattr(fused_decode_gear, name)]
    assert len(holders) == 1, f"fused_decode_gear's source and header hold {old!r} in {holders}: pick a new mutation"
    text = getattr(fused_decode_gear, holders[0])
    monkeypatch.setattr(fused_decode_gear, holders[0], text.replace(old, new, 1))


@pytest.fixture(scope="module", autouse=True)
def _programs_built_in_parallel():
    """Every program the tests below compile, built up front one per core: the signatures are
    captured from small caches of the same shapes (a cold build costs ~1 s each)."""
    with cuda_emulation.signatures_only() as captured:
        for name, make, dtype, D, B, rep, n, warps in CASES:
            cache = make()
            _emulated_step(cache, _filled(cache, 300, B=B, H=2, rep=rep, D=D, dtype=dtype), D**-0.5)
        for name, old, new, warps in MUTATIONS:
            with pytest.MonkeyPatch.context() as mutated:
                _mutated(mutated, old, new)
                cache = CASES[0][1]()
                _emulated_step(cache, _filled(cache, 300, B=1, H=2, rep=4, D=128, dtype=mx.float32), 128**-0.5)
    cuda_emulation.prebuild_captured(captured)


def _portable(cache, q_heads, D):
    """The same step with the kernels off, over the same store and window but with float32
    queries: the kernel computes in float32 and rounds once at the end, while the portable path
    in fp16/bf16 would round its scores and sums."""
    n_valid, window = cache.n_compressed, cache.window_keys.shape[2]
    expected = cache.attention(q_heads.astype(mx.float32), scale=D**-0.5)
    mx.eval(expected)
    assert (cache.n_compressed, cache.window_keys.shape[2]) == (n_valid, window)  # nothing flushed
    return np.array(expected)


@pytest.mark.parametrize("name, make, dtype, D, B, rep, n, warps", CASES, ids=[c[0] for c in CASES])
def test_the_emulated_kernels_are_the_portable_attention(monkeypatch, name, make, dtype, D, B, rep, n, warps):
    if warps:
        monkeypatch.setattr(fused_decode, "TARGET_WARPS", warps)
    cache = make()
    q_heads = _filled(cache, n, B=B, H=2, rep=rep, D=D, dtype=dtype)
    n_valid = cache.n_compressed
    outliers = "v_out_values" in cache.store
    assert fused_decode_gear.supports(D, D, 32, cache.code_bits, cache.rank, 256, rep, outliers)
    expected = _portable(cache, q_heads, D)

    got, made = _emulated_step(cache, q_heads, D**-0.5)
    # fused_decode builds its own partials kernel with the merge one; it must not run
    assert sorted((k.name, k.calls) for k in made if k.calls) == [("vq_gear_decode_partials_merged", 1)]
    assert got.dtype == dtype and got.shape == q_heads.shape

    per_block = fused_decode.tokens_per_block(n_valid, B * 2)
    if "ragged" in name:
        assert n_valid % per_block == 256
    if warps:
        assert n_valid <= per_block and n_valid >= 3 * 4 * fused_decode.TILE  # one block, 3 tiles per warp
    else:
        assert n_valid > per_block  # several history blocks to merge
    got = np.array(got.astype(mx.float32))
    diff = np.abs(got - expected).max()
    print(f"{name}: max |kernel - portable| = {diff:.2e} (history {n_valid}, window {cache.window_keys.shape[2]})")
    tol = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]  # the output's rounding
    assert np.allclose(got, expected, atol=tol, rtol=tol), diff


@pytest.mark.parametrize("batch, sorted_scan, key_slots_by_row", [(1, True, True), (8, True, True), (4, False, False),
                                                                   (1, False, True), (8, False, False)])
def test_other_outlier_batches_are_the_portable_attention(monkeypatch, batch, sorted_scan, key_slots_by_row):
    # One entry at a time (the kernel before session 11) and 8 per lane (a ragged second round
    # of 328 entries), each with the sorted scan (a tile's run) and the full one (every entry of
    # the block, as before session 29), and both layouts of the key outliers' sums, against the
    # portable step, several tiles per warp.
    monkeypatch.setattr(fused_decode_gear, "OUTLIER_BATCH", batch)
    monkeypatch.setattr(fused_decode_gear, "SORTED_SCAN", sorted_scan)
    monkeypatch.setattr(fused_decode_gear, "KEY_SLOTS_BY_ROW", key_slots_by_row)
    monkeypatch.setattr(fused_decode, "TARGET_WARPS", 1)
    cache = CASES[0][1]()
    q_heads = _filled(cache, 1600, B=1, H=2, rep=4, D=128, dtype=mx.float32)
    expected = _portable(cache, q_heads, 128)
    got, made = _emulated_step(cache, q_heads, 128**-0.5)
    assert sorted((k.name, k.calls) for k in made if k.calls) == [("vq_gear_decode_partials_merged", 1)]
    template = dict(cache._fused_plan[1][1]["template"])  # the launch's
    assert (template["OB"], template["OSORT"], template["KSL"]) == (batch, sorted_scan, key_slots_by_row)
    diff = np.abs(np.array(got) - expected).max()
    assert diff <= 2e-5, diff


@pytest.mark.parametrize("name, old, new, warps", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_corrupted_kernel_source_fails_the_comparison(monkeypatch, name, old, new, warps):
    if warps:
        monkeypatch.setattr(fused_decode, "TARGET_WARPS", warps)
    cache = CASES[0][1]()
    q_heads = _filled(cache, 1100, B=1, H=2, rep=4, D=128, dtype=mx.float32)
    expected = _portable(cache, q_heads, 128)
    _mutated(monkeypatch, old, new)
    got, made = _emulated_step(cache, q_heads, 128**-0.5)
    assert sorted(k.name for k in made if k.calls == 1) == ["vq_gear_decode_partials_merged"]
    diff = np.abs(np.array(got) - expected).max()
    print(f"{name}: max |corrupted kernel - portable| = {diff:.2e}")
    assert diff > 1e-4  # 5x the float32 tolerance above, at least


# The key scan's atomic branch (a step whose lanes meet on one token) dropped: the clashing
# data's comparison must fail with it.
CLASH_MUTATIONS = [(None, None), ("else atomicAdd(sum, qs[c * R + r] * val);", "else;")]


@pytest.mark.parametrize("old, new", CLASH_MUTATIONS, ids=["shipped", "key atomics dropped"])
def test_entries_meeting_on_one_target_are_the_portable_attention(monkeypatch, old, new):
    # Key spikes on a few tokens (one token's run spans neighbouring lanes' entries of a step:
    # those steps take the atomics, the others plain adds) and a value channel spiking in a
    # third of the tokens (lanes of a step on one channel: the value sums' atomics meet).
    cache = clashing_cache(CASES[0][1](), heads=2, tokens=1100)
    q_heads = 2 * mx.random.normal((1, 8, 1, 128))
    expected = _portable(cache, q_heads, 128)
    if old:
        _mutated(monkeypatch, old, new)
    got, made = _emulated_step(cache, q_heads, 128**-0.5)
    assert sorted(k.name for k in made if k.calls == 1) == ["vq_gear_decode_partials_merged"]
    # relative to the outputs' size: the spikes make them ~10x the random data's
    diff = np.abs(np.array(got) - expected).max() / np.abs(expected).max()
    print(f"clashing entries, {old or 'shipped'}: max |kernel - portable| / max |portable| = {diff:.2e}")
    assert diff <= 1e-4 if old is None else diff > 1e-2, diff


def test_supports_counts_the_kernels_shared_memory():
    # The static __shared__ bytes of the compiled programs (from their symbol tables) are what
    # shared_bytes() counts for the 48 KB limit supports() applies (the programs are built
    # already: the module's fixture).
    with cuda_emulation.signatures_only() as captured:
        for name, make, dtype, D, B, rep, n, warps in CASES:
            cache = make()
            _emulated_step(cache, _filled(cache, 300, B=B, H=2, rep=rep, D=D, dtype=dtype), D**-0.5)
    checked = 0
    for kernel, sig in captured:
        if kernel.name != "vq_gear_decode_partials_merged":
            continue
        t = dict(sig.template)
        counted = cuda_emulation._static_shared_bytes(kernel.executable(sig))
        if counted is None:
            pytest.skip("no nm to read the programs' symbol tables")
        # Without value outliers the 1-float-per-warp placeholder is unused: an optimizing
        # build drops it (16 bytes), the count keeps it; so is MMA's one word per warp while
        # MMA is off (16 more).
        allowed = (0, 16) if t["VCNT"] else (0, 16, 32)
        # Plus the warps' stages of the history, sized by what the rest leaves (STAGE_WORDS).
        stages = 4 * fused_decode.WARPS_PER_BLOCK * t["STAGE_WORDS"]
        assert fused_decode_gear.shared_bytes(t["D"], t["DV"], t["R"], t["VCNT"] > 0) + stages - counted in allowed, t
        assert counted <= kernel_header.STATIC_SHARED_BYTES - fused_decode.SHARED_MARGIN, t
        checked += 1
    assert checked == len(CASES)


def test_after_a_trim_the_kernel_ignores_the_stale_blocks(monkeypatch):
    # Trimming into the history re-opens its last blocks: capacity stays 1024 while 768 tokens
    # stay compressed, and the slack blocks still hold the old codes, factors and outliers.
    cache = CASES[0][1]()
    _filled(cache, 1100, B=1, H=2, rep=4, D=128, dtype=mx.float32)
    cache.trim(300)
    mx.random.seed(7)
    cache.update_and_fetch(mx.random.normal((1, 2, 1, 128)), mx.random.normal((1, 2, 1, 128)))
    q_heads = 2 * mx.random.normal((1, 8, 1, 128))
    assert (cache.n_compressed, cache.capacity, cache.window_keys.shape[2]) == (768, 1024, 34)
    expected = _portable(cache, q_heads, 128)
    got, made = _emulated_step(cache, q_heads, 128**-0.5)
    assert "vq_gear_decode_partials_merged" in [k.name for k in made if k.calls == 1]
    assert np.allclose(np.array(got), expected, atol=2e-5, rtol=2e-5), np.abs(np.array(got) - expected).max()
