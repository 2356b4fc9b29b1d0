"""fused_decode.MMA_SCORES (template MMA: the history's scores on tensor cores; on as shipped
for kivi and xquant since session 30, GEAR's build by fused_decode_gear.MMA_SCORES) alone, with
the values' FMA loop (MMA_VALUES off; both together: test_fused_decode_mma_values_emulated.py),
run on the CPU by the thread-level emulation (tests/cache/cuda_emulation.py, whose mma.sync
follows PTX's fragment layout), against the portable attention and against the FMA build.

The shapes cover what the MMA path indexes: key groups of 32, 64 and 128 tokens (2, 4 and 8
m-tiles of 16 tokens per group), 1, 2 and 4 query rows (B's columns past them zero), head_dim 64
and 128 (4 and 8 k-tiles), a ragged last block and a warp walking several tiles, KIVI's exact
sink, and GEAR's low-rank and sparse key terms added to the same scores. Corrupted sources (in
memory) show that the comparison fails. What the emulation cannot check (the GPU's own sum
order inside an mma, nvrtc, speed) the CUDA tests and the nvcc test do.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.test_fused_decode_emulated import _filled as _filled_affine
from tests.cache.test_fused_decode_gear_emulated import _filled as _filled_gear
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import fused_decode, fused_decode_gear
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.cache.kivi import KIVICache
from veloxquant_mlx.cache.xquant import XQuantCache

pytestmark = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)


def _kivi(**fields):
    return lambda: KIVICache(KVCacheConfig(method="kivi", kivi_residual_length=32, bit_width_inlier=2, **fields))


def _xquant():
    return XQuantCache(KVCacheConfig(method="xquant", bit_width_inlier=2, xquant_residual_length=32))


def _gear():
    return GEARCache(KVCacheConfig(method="gear"))


# (name, cache factory, filler, dtype, head dim, batch, GQA rows, prefill tokens, target warps)
CASES = [
    ("kivi-2 bf16 hd128 gqa4 sink", _kivi(), _filled_affine, mx.bfloat16, 128, 1, 4, 1100, None),
    ("kivi-2 fp16 hd128 gqa2 group 64", _kivi(kivi_group_size=64), _filled_affine, mx.float16, 128, 1, 2, 700, None),
    ("kivi-2 bf16 hd128 mha group 128 batch2", _kivi(kivi_group_size=128), _filled_affine, mx.bfloat16, 128, 2, 1, 700, None),
    ("kivi-2 fp16 hd64 gqa4", _kivi(), _filled_affine, mx.float16, 64, 1, 4, 700, None),
    # 672 history tokens: blocks of 512 leave a last block of 160, whose second tile holds 32
    ("kivi-2 bf16 ragged last block", _kivi(), _filled_affine, mx.bfloat16, 128, 1, 4, 730, None),
    # one block per head, each warp walks several 128-token tiles (B rebuilt per tile and group)
    ("kivi-2 bf16 many tiles per warp", _kivi(), _filled_affine, mx.bfloat16, 128, 1, 4, 1100, 1),
    ("xquant-2 bf16 hd128 gqa4", _xquant, _filled_affine, mx.bfloat16, 128, 1, 4, 700, None),
    # GEAR's hooks add its low-rank and sparse key terms to the tile's scores before the codes'
    ("gear-2 bf16 hd128 gqa4", _gear, _filled_gear, mx.bfloat16, 128, 1, 4, 1100, None),
]

# A corrupted MMA path must fail: token g's bits rotated one code off; B's fragments written to
# the lanes of the wrong k rows; the ones-mma's offset not taken off; the second m-tile of a
# pair weighed from the first one's words.
MUTATIONS = [
    ("rotation one code off", "const int rot = (2 * g8 - 8) & 31;", "const int rot = (2 * g8 - 6) & 31;"),
    ("B fragment rows", "h * 4 + (cc % 8) / 2) * 2 + cc / 8]", "h * 4 + (cc % 8) / 2) * 2 + 0]"),
    ("offset kept", "c[j][0] = bz0 - off[0];", "c[j][0] = bz0;"),
    ("pair's second words", "x[i][MP - 1] = pair.y;", "x[i][MP - 1] = pair.x;"),
]


@pytest.fixture(scope="module", autouse=True)
def _programs_built_in_parallel():
    """Every program the tests below compile, built up front one per core."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_decode, "MMA_VALUES", 0)
        patch.setattr(fused_decode, "MMA_SCORES", 1)
        patch.setattr(fused_decode_gear, "MMA_SCORES", True)
        with cuda_emulation.signatures_only() as captured:
            for name, make, fill, dtype, D, B, rep, n, warps in CASES:
                for mma in (0, 1):
                    patch.setattr(fused_decode, "MMA_SCORES", mma)
                    patch.setattr(fused_decode_gear, "MMA_SCORES", bool(mma))
                    cache = make()
                    cuda_emulation.emulated_decode_step(cache, fill(cache, 300, B=B, H=2, rep=rep, D=D, dtype=dtype), D**-0.5)
            patch.setattr(fused_decode, "MMA_SCORES", 1)
            patch.setattr(fused_decode_gear, "MMA_SCORES", True)
            for name, old, new in MUTATIONS:
                with pytest.MonkeyPatch.context() as mutated:
                    _mutated(mutated, old, new)
                    cache = CASES[0][1]()
                    cuda_emulation.emulated_decode_step(
                        cache, _filled_affine(cache, 300, B=1, H=2, rep=4, D=128, dtype=mx.bfloat16), 128**-0.5)
    cuda_emulation.prebuild_captured(captured)


def _mutated(monkeypatch, old, new):
    for module, attr in ((fused_decode, "_PARTIALS"), (fused_decode_gear, "PARTIALS_SOURCE")):
        source = getattr(module, attr)
        assert old in source, f"{module.__name__}.{attr} no longer contains {old!r}: pick a new mutation"
        monkeypatch.setattr(module, attr, source.replace(old, new, 1))


def _step(monkeypatch, cache, q_heads, D, mma: int):
    """The emulated decode step with MMA_SCORES = mma (GEAR's too) and the values' FMA loop ->
    (output as float32, the partials launch's template)."""
    monkeypatch.setattr(fused_decode, "MMA_VALUES", 0)
    monkeypatch.setattr(fused_decode, "MMA_SCORES", mma)
    monkeypatch.setattr(fused_decode_gear, "MMA_SCORES", bool(mma))
    return cuda_emulation.planned_step_and_template(monkeypatch, cache, q_heads, D**-0.5)


@pytest.mark.parametrize("name, make, fill, dtype, D, B, rep, n, warps", CASES, ids=[c[0] for c in CASES])
def test_the_tensor_core_scores_are_the_portable_attention(monkeypatch, name, make, fill, dtype, D, B, rep, n, warps):
    if warps:
        monkeypatch.setattr(fused_decode, "AFFINE_TARGET_WARPS", warps)
        monkeypatch.setattr(fused_decode, "TARGET_WARPS", warps)  # GEAR's launch
    cache = make()
    q_heads = fill(cache, n, B=B, H=2, rep=rep, D=D, dtype=dtype)
    # The portable path over the same store with float32 queries (the kernels compute in float32).
    expected = np.array(cache.attention(q_heads.astype(mx.float32), scale=D**-0.5))
    fma, fma_template = _step(monkeypatch, cache, q_heads, D, 0)
    got, template = _step(monkeypatch, cache, q_heads, D, 1)
    assert (fma_template["MMA"], template["MMA"]) == (0, 1)
    if warps:
        assert cache.n_compressed > 4 * fused_decode.TILE  # one block: a warp walks several tiles
    tol = {mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]  # the output's rounding, as for the FMA build
    diff = np.abs(got - expected).max()
    print(f"{name}: max |mma - portable| = {diff:.2e}, |fma - portable| = {np.abs(fma - expected).max():.2e}")
    assert np.allclose(got, expected, atol=tol, rtol=tol), diff
    # Beside the FMA build, within the same rounding: B's fp16 queries (11 bits) where the FMA
    # loop keeps float32 (kivi bf16: 7.7e-3 off the portable path either way here; fp16
    # 1.1e-3 against 4.7e-4; the portable path in bf16 is ~9e-2 off its own float32 result).
    assert np.allclose(got, fma, atol=tol, rtol=tol), np.abs(got - fma).max()


@pytest.mark.parametrize("name, old, new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_corrupted_mma_path_fails_the_comparison(monkeypatch, name, old, new):
    _, make, fill, dtype, D, B, rep, n, warps = CASES[0]
    cache = make()
    q_heads = fill(cache, n, B=B, H=2, rep=rep, D=D, dtype=dtype)
    expected = np.array(cache.attention(q_heads.astype(mx.float32), scale=D**-0.5))
    _mutated(monkeypatch, old, new)
    got, template = _step(monkeypatch, cache, q_heads, D, 1)
    assert template["MMA"] == 1
    assert not np.allclose(got, expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype, key_bits, rows, group, expected", [
    (mx.bfloat16, 2, 4, 32, 1), (mx.float16, 2, 1, 128, 1),
    (mx.float32, 2, 4, 32, 0),   # float32 queries keep the FMA loop's float32 scores
    (mx.bfloat16, 4, 4, 32, 0),  # only 2-bit keys have the bit-operation conversion
    (mx.bfloat16, 2, 3, 32, 0),  # rows must divide 32 (B's lanes per row)
    (mx.bfloat16, 2, 8, 32, 0),  # 8 rows: the whole tile's stage does not fit beside B
])
def test_mma_plan_takes_the_shapes_the_path_handles(monkeypatch, dtype, key_bits, rows, group, expected):
    monkeypatch.setattr(fused_decode, "MMA_SCORES", 1)
    mma, stage = fused_decode.mma_plan(128, 128, rows, group, key_bits, 2, 2, 0, dtype)
    assert mma == expected and stage is not None
    assert (dict(stage)["KSC"] == 128) or not mma
    monkeypatch.setattr(fused_decode, "MMA_SCORES", 0)
    assert fused_decode.mma_plan(128, 128, rows, group, key_bits, 2, 2, 0, dtype)[0] == 0
