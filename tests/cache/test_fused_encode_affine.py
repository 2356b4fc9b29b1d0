"""fused_encode_affine's kernel (a block of KIVI's K/V encoded into the store layout in one
launch), run on the CPU by the thread-level emulation (tests/cache/cuda_emulation.py), against
the portable kivi.compiled_affine_quantize.

Expected: bit for bit, every output (codes, scales, biases of keys and values): the kernel does
the portable path's IEEE operations in the same order (fused_encode_affine's docstring). The
data make the rounding cases happen: outlier channels and tokens, constant groups (scale 0: the
safe divisor 1), and elements exactly half-way between two levels (round half to even; a kernel
that rounds half away from zero must fail). Source corruptions must fail the comparison.

The emulation's shim has no __fdiv_rn / __float2half_rn / __float2bfloat16_rn: the kernel's
header defines them where __CUDACC__ is not defined (the emulation's g++), as the IEEE division
and the shim's round-to-nearest-even conversions; nvcc and nvrtc keep CUDA's own.
"""

from contextlib import contextmanager

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import fused_decode, fused_encode_affine
from veloxquant_mlx.cache.kivi import KIVICache, compiled_affine_quantize

_needs_compiler = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)


def emulation(test):
    """Decorator of an emulated test: skipped without g++, and the emulated programs are built
    up front (in parallel) only when such a test runs: not for `pytest -m cuda` on the GPU."""
    return pytest.mark.usefixtures("_programs_built_in_parallel")(_needs_compiler(test))


BIT_VIEW = {mx.float32: mx.uint32, mx.float16: mx.uint16, mx.bfloat16: mx.uint16}


@contextmanager
def emulated():
    """The kernels on and emulated, this module's kernel switched on (emulated_kernels() switches
    on the attention kernels only: fused_encode_affine._kernels_enabled) and its factory emptied
    before and after, so a mutated source is built anew."""
    switch = fused_encode_affine._kernels_enabled
    fused_encode_affine._kernel_for.cache_clear()
    fused_encode_affine._kernels_enabled = lambda: True  # emulated_kernels() does not switch it on
    try:
        with cuda_emulation.emulated_kernels() as made:
            yield made
    finally:
        fused_encode_affine._kernels_enabled = switch
        fused_encode_affine._kernel_for.cache_clear()


def _side(dtype):
    return mx.bfloat16 if dtype == mx.bfloat16 else mx.float16


def _halfway_run(levels: int, length: int, step: float = 0.25) -> mx.array:
    """A run of `length` values whose group has min 0 and max levels * step (step a power of
    two: the scale is `step` exactly in every dtype) and whose other elements sit exactly
    half-way between two levels: (x - bias) / scale = k + 0.5, k = 0 .. levels - 1 (ties: half
    to even rounds k + 0.5 to the even neighbour, half away from zero always up)."""
    ks = (np.arange(length) % levels) + 0.5
    ks[0], ks[1] = 0.0, levels
    return mx.array(ks * step, dtype=mx.float32)


def _block(B, H, T, D, DV, dtype, key_bits, value_bits, group, seed=0):
    """Keys and values (B, H, T, D / DV) with what real layers and the rounding corners have:
    an offset, outlier key channels, a huge first token, rare value spikes; a channel far from
    zero with a narrow range; constant key channel groups and constant value groups (scale 0); key channel 1 and value group 0 of every other
    token exactly half-way between levels."""
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    keys = mx.random.normal((B, H, T, D), key=k1) + 0.5
    keys = keys * mx.where(mx.arange(D) % 16 == 3, 8.0, 1.0)
    keys = keys + mx.where(mx.arange(T)[:, None] == 0, 40.0, 0.0)
    values = mx.random.normal((B, H, T, DV), key=k2)
    values = mx.where(mx.random.uniform(shape=values.shape, key=k3) < 0.003, 15.0, values)
    token, channel = mx.arange(T)[:, None], mx.arange(D)
    # Constant: key channel 5 over every token (each of its groups), and value tokens 3 mod 7 in
    # their last group of channels.
    keys = mx.where(channel == 5, -1.25, keys)
    # Far from zero with a narrow range (key channel 7): a float32 minimum rounded to the 16-bit
    # side dtype moves by more than the scale, so codes fall outside [0, levels] before the clip.
    keys = mx.where(channel == 7, 1000.2 + 0.02 * keys, keys)  # float16 bias: 1000.0
    vchannel = mx.arange(DV)
    values = mx.where((token % 7 == 3) & (vchannel >= DV - group), 0.75, values)
    # Half-way: key channel 1 along tokens (per group), value group 0 of even tokens.
    key_run = mx.concatenate([_halfway_run(2**key_bits - 1, group)] * -(-T // group))[:T]
    keys = mx.where(channel == 1, key_run[:, None], keys)
    value_run = mx.concatenate([_halfway_run(2**value_bits - 1, group), mx.zeros((DV - group,))])
    values = mx.where((token % 2 == 0) & (vchannel < group), value_run, values)
    return keys.astype(dtype), values.astype(dtype)


def _portable(keys, values, group, key_bits, value_bits):
    side = _side(keys.dtype)
    return (*compiled_affine_quantize(group, key_bits, side)(keys.swapaxes(-1, -2)),
            *compiled_affine_quantize(group, value_bits, side)(values))


def _bits(a: mx.array) -> np.ndarray:
    return np.array(mx.view(a, BIT_VIEW[a.dtype]) if a.dtype in BIT_VIEW else a)


def _assert_same(got, expected):
    for name, g, e in zip(fused_encode_affine.OUTPUTS, got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, (name, g.dtype, g.shape, e.dtype, e.shape)
        differ = int((_bits(g) != _bits(e)).sum())
        assert differ == 0, f"{name}: {differ} of {g.size} elements differ from the portable encoder"


def _encode(keys, values, group, key_bits, value_bits):
    with emulated() as made:
        got = fused_encode_affine.affine_encode_kv(
            keys, values, group_size=group, key_bits=key_bits, value_bits=value_bits, side_dtype=_side(keys.dtype))
        mx.eval(*got)
    assert [k.calls for k in made] == [1], "the kernel did not run"
    return got


# (name, dtype, key bits, value bits, group, batch, heads, tokens, head dim, value dim)
CASES = [
    ("2 bits bf16 g32 hd128 b2 one group", mx.bfloat16, 2, 2, 32, 2, 2, 32, 128, 128),
    ("2 bits bf16 g32 hd128 b2 2048 tokens", mx.bfloat16, 2, 2, 32, 2, 2, 2048, 128, 128),
    ("3 bits fp16 g32 hd64 b2", mx.float16, 3, 3, 32, 2, 2, 96, 64, 64),
    ("4 bits fp32 g64 hd128 b2", mx.float32, 4, 4, 64, 2, 2, 128, 128, 128),
    ("8 bits bf16 g128 hd64 b2", mx.bfloat16, 8, 8, 128, 2, 2, 256, 64, 128),
    ("3/8 bits fp32 g128 hd128 one group", mx.float32, 3, 8, 128, 2, 1, 128, 128, 128),
    ("4/2 bits fp16 g64 hd64 dv128", mx.float16, 4, 2, 64, 1, 3, 192, 64, 128),
    ("2/3 bits fp32 g32 hd256 (two channels per thread)", mx.float32, 2, 3, 32, 1, 2, 64, 256, 256),
]


@pytest.fixture(scope="module")
def _programs_built_in_parallel():
    """The emulated programs the tests below run, compiled up front one per core (a cold run
    pays g++ ~1 s each): their signatures captured from one-group blocks of the same settings."""
    if cuda_emulation.COMPILER is None:
        return
    settings = [(dtype, kb, vb, g, D, DV) for _, dtype, kb, vb, g, _, _, _, D, DV in CASES]
    settings += [(mx.float32, 2, 2, 32, 32, 32), (mx.bfloat16, 2, 2, 32, 64, 64), (mx.float32, 3, 4, 32, 64, 64)]
    with cuda_emulation.signatures_only() as captured:
        for dtype, kb, vb, g, D, DV in settings:
            with emulated():
                fused_encode_affine.affine_encode_kv(
                    mx.zeros((1, 1, g, D), dtype), mx.zeros((1, 1, g, DV), dtype), group_size=g,
                    key_bits=kb, value_bits=vb, side_dtype=_side(dtype))
        for _, old, new in MUTATIONS:
            with pytest.MonkeyPatch.context() as mutated, emulated():
                mutated.setattr(fused_encode_affine, "_SOURCE", fused_encode_affine._SOURCE.replace(old, new, 1))
                keys, values = _mutation_block()
                fused_encode_affine.affine_encode_kv(keys, values, group_size=32, key_bits=3, value_bits=3,
                                                     side_dtype=mx.float16)
    cuda_emulation.prebuild_captured(captured)


@emulation
@pytest.mark.parametrize("name, dtype, key_bits, value_bits, group, B, H, T, D, DV", CASES, ids=[c[0] for c in CASES])
def test_the_emulated_kernel_is_the_compiled_portable_encoder(name, dtype, key_bits, value_bits, group, B, H, T, D, DV):
    keys, values = _block(B, H, T, D, DV, dtype, key_bits, value_bits, group)
    expected = _portable(keys, values, group, key_bits, value_bits)
    # The data hit the corners: scale-0 groups and exact ties are in the portable result.
    key_scales, value_scales = np.array(expected[1].astype(mx.float32)), np.array(expected[4].astype(mx.float32))
    assert (key_scales[:, :, 5] == 0).all() and (value_scales == 0).any()
    _assert_same(_encode(keys, values, group, key_bits, value_bits), expected)


@emulation
def test_half_way_elements_round_to_even():
    # The tie cases directly: the kernel's codes of a half-way run are the even neighbours.
    levels, group = 3, 32
    run = _halfway_run(levels, group)
    keys = mx.broadcast_to(run[None, None, :, None], (1, 1, group, 32)).astype(mx.float32)
    values = mx.broadcast_to(run[None, None, None, :], (1, 1, group, group)).astype(mx.float32)
    got = _encode(keys, values, group, 2, 2)
    codes = np.array(got[3][0, 0, 0])  # token 0's value codes: the run along channels
    unpacked = [(int(codes[(2 * j) // 32]) >> ((2 * j) % 32)) & 3 for j in range(group)]
    ks = np.array(run) / 0.25
    assert unpacked == [int(np.round(k)) for k in ks]  # numpy rounds half to even too
    assert any(k % 1 == 0.5 and np.round(k) < k for k in ks), "no tie rounded down: the data test nothing"
    _assert_same(got, _portable(keys, values, group, 2, 2))


@emulation
def test_a_zero_minimum_keeps_the_sign_of_the_groups_first_zero():
    # Groups whose minimum is 0 with both +0.0 and -0.0 in them: MLX's CPU reduction keeps the
    # first (the kernel's `v < lo ? v : lo` too), and the bias stores its sign bit.
    rng = np.random.default_rng(0)
    rows = []
    for plus, minus in [(0, 1), (1, 0), (5, 20), (20, 5), (30, 2), (2, 30), (9, 17), (17, 9)]:
        row = np.abs(rng.normal(size=32)).astype(np.float32) + 0.5
        row[plus], row[minus] = 0.0, -0.0
        rows.append(row)
    rows = np.stack(rows * 4)  # (32 tokens, 32 channels): a value group per token
    values = mx.array(rows)[None, None]
    keys = mx.array(np.ascontiguousarray(rows[:8].T))[None, None]  # key channels along tokens
    keys = mx.concatenate([keys] * 4, axis=3)
    expected = _portable(keys, values, 32, 2, 2)
    signs = np.signbit(np.array(expected[5].astype(mx.float32)))
    assert signs.any() and not signs.all(), "no mix of -0.0 and +0.0 biases: the data test nothing"
    assert np.signbit(np.array(expected[2].astype(mx.float32))).any()
    _assert_same(_encode(keys, values, 32, 2, 2), expected)


def _cache(**fields):
    return KIVICache(KVCacheConfig(method="kivi", kivi_residual_length=32, **fields))


def _feed(cache, keys, values, pieces):
    start = 0
    for size in pieces:
        cache.update_and_fetch(keys[:, :, start:start + size], values[:, :, start:start + size])
        cache._flush()
        mx.eval(cache.store)
        start += size


@emulation
@pytest.mark.parametrize("dtype, fields", [(mx.bfloat16, {"bit_width_inlier": 2}),
                                           (mx.float32, {"key_bits": 3, "value_bits": 4})],
                         ids=["kivi-2 bf16", "kivi-3/4 fp32"])
def test_a_cache_filled_through_the_kernel_stores_and_decodes_as_the_portable_one(dtype, fields):
    # A prefill chunk, a second chunk, then single decode tokens (a group leaves the window at a
    # time): the first block sets the exact sink aside and the kernel encodes its placeholder.
    keys, values = _block(2, 2, 64 + 200 + 40, 64, 64, dtype, 2, 2, 32, seed=5)
    pieces = [64, 200] + [1] * 40
    portable, fused = _cache(**fields), _cache(**fields)
    _feed(portable, keys, values, pieces)
    with emulated() as made:
        _feed(fused, keys, values, pieces)
    assert [k.name for k in made] == ["vq_affine_encode_kv"] and made[0].calls >= 3
    assert fused.n_compressed == portable.n_compressed > 200 and fused._sink_length() == 1
    assert sorted(fused.store) == sorted(portable.store)
    for name in portable.store:
        assert np.array_equal(_bits(fused.store[name]), _bits(portable.store[name])), f"{name} differs"
    for got, want in zip(fused._decode(), portable._decode()):
        assert mx.array_equal(got, want).item()
    for got, want in zip((fused.sink_keys, fused.sink_values), (portable.sink_keys, portable.sink_values)):
        assert mx.array_equal(got, want).item()


# A corrupted kernel must fail the comparison (in memory; the module is untouched), on float32
# input (so that rounding the bias to the float16 side dtype changes it), 3-bit codes
# (straddling words) and half-way elements.
MUTATIONS = [
    ("key code shift", "const int bit = j * KB, sh = bit & 31;", "const int bit = j * KB, sh = (bit + 1) & 31;"),
    ("value straddle carry", "word = sh + VB > 32 ? c >> (32 - sh) : 0u;", "word = 0u;"),
    ("round half away from zero", "rintf(__fdiv_rn(", "roundf(__fdiv_rn("),
    ("bias not rounded to the side dtype first", "p.bias32 = vq_f32(p.bias);", "p.bias32 = lo;"),
    ("scale not rounded to the side dtype first", "const float scale32 = vq_f32(p.scale);",
     "const float scale32 = __fdiv_rn(hi - lo, levels);"),
    ("no clip to the levels", "fminf(fmaxf(rintf(__fdiv_rn(x - p.bias32, p.safe)), 0.f), levels)",
     "fmaxf(rintf(__fdiv_rn(x - p.bias32, p.safe)), 0.f)"),
    ("value group offset", "+ gv * G;", "+ gv;"),
]


def _mutation_block():
    return _block(1, 2, 64, 64, 64, mx.float32, 3, 3, 32, seed=2)


@emulation
@pytest.mark.parametrize("name, old, new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_corrupted_kernel_source_fails_the_comparison(monkeypatch, name, old, new):
    source = fused_encode_affine._SOURCE
    assert old in source, f"fused_encode_affine._SOURCE no longer contains {old!r}: pick a new mutation"
    monkeypatch.setattr(fused_encode_affine, "_SOURCE", source.replace(old, new, 1))
    keys, values = _mutation_block()
    expected = _portable(keys, values, 32, 3, 3)
    got = _encode(keys, values, 32, 3, 3)
    with pytest.raises(AssertionError, match="elements differ from the portable encoder"):
        _assert_same(got, expected)


@emulation
def test_the_portable_path_is_kept_where_the_kernel_is_not_active(monkeypatch):
    cache = _cache(bit_width_inlier=2)
    keys, values = _block(1, 2, 96, 64, 64, mx.float32, 2, 2, 32)
    cache.update_and_fetch(keys[:, :, :1], values[:, :, :1])  # the cache learns its shapes
    # Switched off by the environment (or off CUDA: the CPU here), a width or a shape the kernel
    # refuses, different dtypes: nothing launched.
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    assert fused_encode_affine.encode_step(cache, keys, values) is None
    monkeypatch.delenv(fused_decode.ENV_SWITCH)
    assert fused_encode_affine._kernels_enabled() == fused_decode._on_cuda()
    # The attention kernels' emulation alone leaves the encoder portable (its tests count the
    # kernels they launch): a flush inside it builds nothing.
    with cuda_emulation.emulated_kernels() as made:
        cache.update_and_fetch(keys[:, :, 1:], values[:, :, 1:])
        cache._flush()
        mx.eval(cache.store)
    assert made == [] and cache.n_compressed == 64
    assert not fused_encode_affine.supports(64, 64, 32, 5, 2)
    assert not fused_encode_affine.supports(64, 64, 16, 2, 2)
    assert not fused_encode_affine.supports(64, 48, 32, 2, 2)
    assert not fused_encode_affine.supports(512, 512, 128, 8, 8)  # 64 KB of shared memory
    assert fused_encode_affine.supports(256, 256, 128, 8, 8)
    with emulated() as made:
        assert fused_encode_affine.encode_step(cache, keys.astype(mx.float16), values) is None  # dtypes differ
        monkeypatch.setattr(fused_encode_affine, "supports", lambda *a: False)
        assert fused_encode_affine.encode_step(cache, keys, values) is None
    assert made == []


def test_bad_launch_arguments_are_refused_with_what_is_allowed():
    block = mx.zeros((1, 1, 40, 64), mx.float16)
    with pytest.raises(Exception, match="whole groups of 32"):
        fused_encode_affine.affine_encode_kv(block, block, group_size=32, key_bits=2, value_bits=2,
                                             side_dtype=mx.float16)
    block = mx.zeros((1, 1, 32, 64), mx.float16)
    with pytest.raises(Exception, match="key_bits=5"):
        fused_encode_affine.affine_encode_kv(block, block, group_size=32, key_bits=5, value_bits=2,
                                             side_dtype=mx.float16)
    with pytest.raises(Exception, match="side_dtype=mlx.core.float32"):
        fused_encode_affine.affine_encode_kv(block, block, group_size=32, key_bits=2, value_bits=2,
                                             side_dtype=mx.float32)
    with pytest.raises(Exception, match="same B, H, T"):
        fused_encode_affine.affine_encode_kv(block, block[:, :, :16], group_size=32, key_bits=2,
                                             value_bits=2, side_dtype=mx.float16)
    with pytest.raises(Exception, match="allowed is one dtype"):
        fused_encode_affine.affine_encode_kv(block, block.astype(mx.bfloat16), group_size=32, key_bits=2,
                                             value_bits=2, side_dtype=mx.float16)


@cuda_test
@pytest.mark.parametrize("dtype, key_bits, value_bits", [(mx.bfloat16, 2, 2), (mx.float16, 3, 3), (mx.bfloat16, 4, 2)])
def test_the_kernel_on_cuda_is_the_compiled_portable_encoder(monkeypatch, dtype, key_bits, value_bits):
    """On the GPU, at the 8B head shape (8 kv heads of 128, a 2048-token block): the kernel
    against the compiled portable encoder run by MLX's CUDA backend, bit for bit. If MLX compiles
    its division approximately there, codes of elements within an ulp of a rounding boundary
    differ (and scales by an ulp): the printed counts say how many."""
    keys, values = _block(1, 8, 2048, 128, 128, dtype, key_bits, value_bits, 32)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    cache = _cache(key_bits=key_bits, value_bits=value_bits)
    cache.update_and_fetch(keys[:, :, :1], values[:, :, :1])
    got = fused_encode_affine.encode_step(cache, keys, values)
    assert got is not None, "the kernel did not run on CUDA"
    got = [got[name] for name in fused_encode_affine.OUTPUTS]
    expected = _portable(keys, values, 32, key_bits, value_bits)
    mx.eval(*got, *expected)
    for name, g, e in zip(fused_encode_affine.OUTPUTS, got, expected):
        print(f"{dtype} {key_bits}/{value_bits} {name}: {int((_bits(g) != _bits(e)).sum())} of {g.size} differ")
    _assert_same(got, expected)
