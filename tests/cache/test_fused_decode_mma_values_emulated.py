"""fused_decode.MMA_VALUES (template MMAV: the history's values weighed on tensor cores, on as
shipped since session 30 for kivi and xquant) run on the CPU by the thread-level emulation (tests/cache/cuda_emulation.py: its
mma.sync follows PTX's fragment layout, in fp16 and in bf16), against the portable attention and
against the FMA build.

The shapes cover what the MMAV path indexes: value groups of 32, 64 and 128 channels (2, 4 and 8
m-tiles per group), 1, 2, 3, 4 and 8 query rows (B's columns past them zero; C's rows 2t, 2t + 1),
head_dim 64 and 128 (4 and 8 m-tiles), bf16 and fp16 side data (the A codes' mantissa bits
differ), a ragged last block, a warp walking several tiles (the fragments' rescale by the online
softmax), KIVI's exact sink, and the tensor-core scores beside it. Corrupted sources (in memory)
show that the comparison fails. What the emulation cannot check (the GPU's sum order inside an
mma, nvrtc, speed) the CUDA tests and the nvcc test do.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.test_fused_decode_emulated import _filled
from tests.cache.test_fused_decode_mma_emulated import _kivi, _xquant
from veloxquant_mlx.cache import fused_decode

pytestmark = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)


# (name, cache factory, dtype, head dim, batch, GQA rows, prefill tokens, target warps, MMA_SCORES)
CASES = [
    ("kivi-2 bf16 hd128 gqa4 sink", _kivi(), mx.bfloat16, 128, 1, 4, 1100, None, 0),
    ("kivi-2 fp16 hd128 gqa2 group 64", _kivi(kivi_group_size=64), mx.float16, 128, 1, 2, 700, None, 0),
    ("kivi-2 bf16 hd128 mha group 128 batch2", _kivi(kivi_group_size=128), mx.bfloat16, 128, 2, 1, 700, None, 0),
    ("kivi-2 fp16 hd64 gqa8", _kivi(), mx.float16, 64, 1, 8, 700, None, 0),
    # SmolLM2's heads (the demo's model): 3 rows, C's row 3 of lane t = 1 past them
    ("kivi-2 bf16 hd64 gqa3", _kivi(), mx.bfloat16, 64, 1, 3, 700, None, 0),
    # 672 history tokens: blocks of 512 leave a last block of 160, whose second tile holds 32
    ("kivi-2 bf16 ragged last block", _kivi(), mx.bfloat16, 128, 1, 4, 730, None, 0),
    # one block per head, each warp walks several 128-token tiles (the fragments' rescale)
    ("kivi-2 bf16 many tiles per warp", _kivi(), mx.bfloat16, 128, 1, 4, 1100, 1, 0),
    ("xquant-2 bf16 hd128 gqa4", _xquant, mx.bfloat16, 128, 1, 4, 700, None, 0),
    # both products on tensor cores
    ("kivi-2 bf16 with tensor-core scores", _kivi(), mx.bfloat16, 128, 1, 4, 1100, None, 1),
    # both, a warp walking several tiles (the scores' stage and fragments reused tile after tile)
    ("kivi-2 bf16 tensor-core scores, many tiles per warp", _kivi(), mx.bfloat16, 128, 1, 4, 1100, 1, 1),
]

# A corrupted MMAV path must fail (on the many-tiles case): a code's bits one code off; the
# scale's factor 4 lost; the ones-mma's sum of B not taken off, or not rescaled between tiles;
# the C fragments not rescaled between tiles; the zeros read from the scales' row.
MUTATIONS = [
    ("rotation one code off", "const int rot = (2 * g8 - MT::POS) & 31;", "const int rot = (2 * g8 + 2 - MT::POS) & 31;"),
    ("factor 4 lost", "red_o[2 * t4 * DV + ch] = fmaf(4.f, cv[mt][0] - one[0], b_lo[16 * mt / G]);",
     "red_o[2 * t4 * DV + ch] = fmaf(1.f, cv[mt][0] - one[0], b_lo[16 * mt / G]);"),
    ("ones' sum kept", "fmaf(4.f, cv[mt][0] - one[0], b_lo[16 * mt / G])", "fmaf(4.f, cv[mt][0], b_lo[16 * mt / G])"),
    ("ones' sum not rescaled", "cones[j][0] *= a_lo;", "cones[j][0] *= 1.f;"),
    ("no rescale", "cv[mt][0] *= a_lo;", "cv[mt][0] *= 1.f;"),
    ("zeros read as scales", "vq_shared_row<GV>(vzs + tj[i] * GV, zp[i]);", "vq_shared_row<GV>(vss + tj[i] * GV, zp[i]);"),
]
MUTATED_CASE = next(c for c in CASES if c[0] == "kivi-2 bf16 many tiles per warp")


def _make(case):
    name, make, dtype, D, B, rep, n, warps, mma = case
    cache = make()
    return cache, _filled(cache, n, B=B, H=2, rep=rep, D=D, dtype=dtype)


@pytest.fixture(scope="module", autouse=True)
def _programs_built_in_parallel():
    """Every program the tests below compile, built up front one per core."""
    with pytest.MonkeyPatch.context() as patch:
        with cuda_emulation.signatures_only() as captured:
            for case in CASES:
                for mmav in (0, 1):
                    _set(patch, case, mmav)
                    cache = case[1]()
                    cuda_emulation.emulated_decode_step(
                        cache, _filled(cache, 300, B=case[4], H=2, rep=case[5], D=case[3], dtype=case[2]), case[3] ** -0.5)
            for _, old, new in MUTATIONS:
                with pytest.MonkeyPatch.context() as mutated:
                    _mutated(mutated, old, new)
                    _set(mutated, MUTATED_CASE, 1)
                    cache = MUTATED_CASE[1]()
                    cuda_emulation.emulated_decode_step(
                        cache, _filled(cache, 300, B=1, H=2, rep=4, D=128, dtype=mx.bfloat16), 128**-0.5)
    cuda_emulation.prebuild_captured(captured)


def _set(monkeypatch, case, mmav: int):
    warps, mma = case[7], case[8]
    monkeypatch.setattr(fused_decode, "MMA_VALUES", mmav)
    monkeypatch.setattr(fused_decode, "MMA_SCORES", mma)
    if warps:
        monkeypatch.setattr(fused_decode, "AFFINE_TARGET_WARPS", warps)


def _mutated(monkeypatch, old, new):
    source = fused_decode._PARTIALS
    assert old in source, f"fused_decode._PARTIALS no longer contains {old!r}: pick a new mutation"
    monkeypatch.setattr(fused_decode, "_PARTIALS", source.replace(old, new, 1))


def _step(monkeypatch, cache, q_heads, D):
    """The emulated decode step -> (output as float32, the partials launch's template)."""
    return cuda_emulation.planned_step_and_template(monkeypatch, cache, q_heads, D**-0.5)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_tensor_core_values_are_the_portable_attention(monkeypatch, case):
    name, _, dtype, D, _, _, _, warps, mma = case
    cache, q_heads = _make(case)
    # The portable path over the same store with float32 queries (the kernels compute in float32).
    expected = np.array(cache.attention(q_heads.astype(mx.float32), scale=D**-0.5))
    _set(monkeypatch, case, 0)
    fma, fma_template = _step(monkeypatch, cache, q_heads, D)
    _set(monkeypatch, case, 1)
    got, template = _step(monkeypatch, cache, q_heads, D)
    assert (fma_template["MMAV"], template["MMAV"], template["MMA"]) == (0, 1, mma)
    if warps:
        assert cache.n_compressed > 4 * fused_decode.TILE  # one block: a warp walks several tiles
    tol = {mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]  # the output's rounding, as for the FMA build
    diff = np.abs(got - expected).max()
    print(f"{name}: max |mmav - portable| = {diff:.2e}, |fma - portable| = {np.abs(fma - expected).max():.2e}")
    assert np.allclose(got, expected, atol=tol, rtol=tol), diff
    assert np.allclose(got, fma, atol=tol, rtol=tol), np.abs(got - fma).max()


@pytest.mark.parametrize("name, old, new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_corrupted_mma_values_path_fails_the_comparison(monkeypatch, name, old, new):
    cache, q_heads = _make(MUTATED_CASE)
    expected = np.array(cache.attention(q_heads.astype(mx.float32), scale=128**-0.5))
    _mutated(monkeypatch, old, new)
    _set(monkeypatch, MUTATED_CASE, 1)
    got, template = _step(monkeypatch, cache, q_heads, 128)
    assert template["MMAV"] == 1
    assert not np.allclose(got, expected, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype, side, value_bits, rows, group, vst, expected", [
    (mx.bfloat16, mx.bfloat16, 2, 4, 32, 128, 1), (mx.float16, mx.float16, 2, 8, 128, 16, 1),
    (mx.float32, mx.float16, 2, 4, 32, 128, 0),   # float32 queries keep the float32 FMA loop
    (mx.bfloat16, mx.float32, 2, 4, 32, 128, 0),  # float32 side data: no 16-bit B
    (mx.bfloat16, mx.bfloat16, 4, 4, 32, 128, 0),  # only 2-bit values: a token word is one m-tile
    (mx.bfloat16, mx.bfloat16, 2, 16, 32, 128, 0),  # more rows than the mma's 8 columns
    (mx.bfloat16, mx.bfloat16, 2, 4, 32, 8, 0),    # a stage of 8 tokens: not whole 16-token steps
])
def test_mma_values_takes_the_launches_the_path_handles(monkeypatch, dtype, side, value_bits, rows, group, vst,
                                                        expected):
    stage = (("STAGE_WORDS", 1536), ("KSC", 128), ("VST", vst))
    monkeypatch.setattr(fused_decode, "MMA_VALUES", 1)
    assert fused_decode.mma_values(128, rows, group, value_bits, dtype, side, stage) == expected
    monkeypatch.setattr(fused_decode, "MMA_VALUES", 0)
    assert fused_decode.mma_values(128, rows, group, value_bits, dtype, side, stage) == 0


def test_a_caches_own_switch_takes_the_tensor_core_values(monkeypatch):
    # The bench ablation `kivi-mmav` (bench.ablations.tensor_core_values) sets `mma_values` on a
    # cache: its launches take MMAV whatever MMA_VALUES says, and attend as the FMA build does.
    from veloxquant_mlx.bench.ablations import ABLATIONS

    case = CASES[0]
    cache, q_heads = _make(case)
    _set(monkeypatch, case, 0)
    fma, fma_template = _step(monkeypatch, cache, q_heads, 128)
    ABLATIONS["kivi-mmav"][0].mark([cache])
    got, template = _step(monkeypatch, cache, q_heads, 128)
    assert (fma_template["MMAV"], template["MMAV"]) == (0, 1)
    assert np.allclose(got, fma, atol=1e-2, rtol=1e-2), np.abs(got - fma).max()


@pytest.mark.parametrize("shipped", [0, 1], ids=["switches-off", "switches-on"])
def test_the_tensor_cores_and_fma_ablations_take_their_products_whatever_the_switches(monkeypatch, shipped):
    # `kivi-tc` sets `mma_values` and `mma_scores` on a cache, `kivi-fma` clears both: their
    # launches take MMAV and MMA, or neither, whatever the module's switches say.
    from veloxquant_mlx.bench.ablations import ABLATIONS

    case = next(c for c in CASES if c[0] == "kivi-2 bf16 with tensor-core scores")
    _set(monkeypatch, case, shipped)
    monkeypatch.setattr(fused_decode, "MMA_SCORES", shipped)
    cache, q_heads = _make(case)
    ABLATIONS["kivi-fma"][0].mark([cache])
    fma, fma_template = _step(monkeypatch, cache, q_heads, 128)
    ABLATIONS["kivi-tc"][0].mark([cache])
    got, template = _step(monkeypatch, cache, q_heads, 128)
    assert (fma_template["MMAV"], fma_template["MMA"], template["MMAV"], template["MMA"]) == (0, 0, 1, 1)
    assert np.allclose(got, fma, atol=1e-2, rtol=1e-2), np.abs(got - fma).max()
