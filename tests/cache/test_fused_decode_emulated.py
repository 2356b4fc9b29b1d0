"""fused_decode's two CUDA kernels (partials over KIVI-layout codes, and the merge), run on the CPU
by the thread-level emulation (tests/cache/cuda_emulation.py), against the portable attention.

The emulation stands in for mx.fast.cuda_kernel and the kernels are reported active, so a cache's
decode step goes the way it goes on CUDA: KIVICache._fused_decode / XQuantCache._fused_decode ->
decode_step (the exact sink as skip + the partials kernel's sink inputs sk / sv) ->
affine_decode_attention (blocks, meta, template constants, grid) -> the two kernel sources, as
written. Expected: the same step with the
kernels off (the CPU default: CompressedKVCache's portable attention over quantized_matmul).
turboquant_rvq's step (fused_decode_rotated's partials kernel + this merge kernel) goes the same
way in ROTATED_CASES (8 query rows per kv head among them). Corrupted sources (in memory: four of
fused_decode's, one of the rotated kernel's) show that the comparison fails.
What the emulation cannot check is listed in its docstring (nvrtc, speed, lock-step races).
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import base, fused_decode, fused_decode_rotated
from veloxquant_mlx.cache.kivi import KIVICache
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache
from veloxquant_mlx.cache.xquant import XQuantCache

pytestmark = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)


def _kivi(**fields):
    return lambda: KIVICache(KVCacheConfig(method="kivi", kivi_residual_length=32, **fields))


def _xquant():
    return XQuantCache(KVCacheConfig(method="xquant", bit_width_inlier=2, xquant_residual_length=32))


def _filled(cache, n, *, B, H, rep, D, dtype, seed=0):
    """A cache after a prefill of n tokens (keys with an offset and outlier channels, as real
    keys have), then one decode token: returns the decode step's queries."""
    mx.random.seed(seed)
    k = mx.random.normal((B, H, n, D)) * mx.where(mx.arange(D) % 16 == 3, 4.0, 1.0) + 0.5
    cache.update_and_fetch(k.astype(dtype), mx.random.normal((B, H, n, D)).astype(dtype))
    # One query row (the last prefill token's) is enough for the attention call that flushes
    # the window into the compressed history; n rows under a causal mask cost ~1 s on the CPU.
    mx.eval(cache.attention(mx.random.normal((B, rep * H, 1, D)).astype(dtype), scale=D**-0.5))
    cache.update_and_fetch(mx.random.normal((B, H, 1, D)).astype(dtype), mx.random.normal((B, H, 1, D)).astype(dtype))
    return (2 * mx.random.normal((B, rep * H, 1, D))).astype(dtype)


_emulated_step = cuda_emulation.emulated_decode_step

# (name, cache factory, dtype, head dim, batch, GQA rows, prefill tokens, AFFINE_TARGET_WARPS or None)
CASES = [
    ("kivi-2 hd128 gqa4 sink", _kivi(bit_width_inlier=2), mx.float32, 128, 1, 4, 1100, None),
    ("kivi-4/2 hd64 batch2 mha", _kivi(key_bits=4, value_bits=2), mx.float32, 64, 2, 1, 700, None),
    ("kivi-8 hd128 gqa2", _kivi(bit_width_inlier=8), mx.float32, 128, 1, 2, 700, None),
    ("xquant-2 hd128 gqa4", _xquant, mx.float32, 128, 1, 4, 700, None),
    # 672 history tokens: blocks of 512 leave a last block of 160, whose second tile holds 32
    ("kivi-2 ragged last block", _kivi(bit_width_inlier=2), mx.float32, 128, 1, 4, 730, None),
    # one block per head, each warp walks several 128-token tiles (online softmax across tiles)
    ("kivi-2 many tiles per warp", _kivi(bit_width_inlier=2), mx.float32, 128, 1, 4, 1100, 1),
    # the 16-bit load and store paths (QT, ST): the kernel's output in the queries' dtype
    ("kivi-4/2 fp16 hd64 batch2 mha", _kivi(key_bits=4, value_bits=2), mx.float16, 64, 2, 1, 700, None),
    ("kivi-2 bf16 hd128 gqa4", _kivi(bit_width_inlier=2), mx.bfloat16, 128, 1, 4, 700, None),
    # 8 rows: 16 lanes per value token, each a half word of codes (lanes_per_token)
    ("kivi-2 fp16 hd128 gqa8 half-word lanes", _kivi(bit_width_inlier=2), mx.float16, 128, 1, 8, 700, None),
    ("kivi-4 hd128 gqa8 half-word lanes", _kivi(bit_width_inlier=4), mx.float32, 128, 1, 8, 700, None),
]


# A corrupted kernel must fail the comparison: one index changed in each kernel (in memory;
# fused_decode.py is untouched). Two partials ones are subtle: the attention sink, handed in
# exactly as sk / sv, is also attended from its compressed codes (0.0013 off); or the sink
# inputs are ignored (the exact block attends the window alone, token 0 is not attended).
MUTATIONS = [
    ("partials: skip ignored", "_PARTIALS", "const int lo = window ? 0 : n_skip;", "const int lo = 0;"),
    ("partials: sink inputs ignored", "_PARTIALS", "const int n_sink = meta[5];", "const int n_sink = 0;"),
    # the history's value loop reading the probabilities where the old layout kept them
    ("partials: probability slots", "_PARTIALS", "const int pslot = (slot_b0 + tile_slot(k * TPR)) * R;\n            float pj[R];",
     "const int pslot = (v0 + (b0 + k) * TPR + tl) * R;\n            float pj[R];"),
    # the keys' stage read as if it held one channel
    ("partials: key stage rows", "_PARTIALS", "kstage[warp][dd * WR + lane_word]", "kstage[warp][lane_word]"),
    ("merge kernel: block stride", "_MERGE", "po[(size_t)b * R * DV]", "po[(size_t)b * DV]"),
    # the merge fused into the partials kernel (MERGE_IN_KERNEL) reading block 0's partial only
    ("fused merge: block stride", "_HEADER", "__ldcg(po + (size_t)k * R * DV + 32 * j)", "__ldcg(po + (size_t)k * DV + 32 * j)"),
]


def _launches():
    """The kernels a decode step runs: one with the merge fused in, else partials and merge."""
    return [1] if fused_decode.MERGE_IN_KERNEL else [1, 1]


def _mutated(monkeypatch, attr, old, new):
    source = getattr(fused_decode, attr)
    assert old in source, f"fused_decode.{attr} no longer contains {old!r}: pick a new mutation"
    monkeypatch.setattr(fused_decode, attr, source.replace(old, new, 1))


# turboquant_rvq's decode step: fused_decode_rotated's partials kernel and fused_decode's merge
# kernel, as fused_decode_rotated.decode_step wires them (its own emulation test assembles the
# partials' arguments itself and merges in numpy); the 16-bit load paths run here only.
# (name, bits, dtype, head dim, batch, GQA rows, prefill tokens)
ROTATED_CASES = [
    ("turboquant_rvq-4 hd128 gqa4 sink", 4, mx.float32, 128, 1, 4, 300),
    ("turboquant_rvq-4 bf16 hd64 batch2 mha", 4, mx.bfloat16, 64, 2, 1, 300),
    # 8 rows (70B-class GQA 64 / 8): value lanes of 8 channels (fused_decode_rotated.
    # channels_per_lane), 3-bit stage-1 codes crossing words at 4 bits, a sign plane at 2
    ("turboquant_rvq-4 fp16 hd128 gqa8 sink", 4, mx.float16, 128, 1, 8, 300),
    ("turboquant_rvq-4 bf16 hd128 gqa8 sink", 4, mx.bfloat16, 128, 1, 8, 300),
    ("turboquant_rvq-2 fp16 hd128 gqa8 sink", 2, mx.float16, 128, 1, 8, 300),
    ("turboquant_rvq-2 bf16 hd128 gqa8 sink", 2, mx.bfloat16, 128, 1, 8, 300),
]

# A corrupted rotated kernel must fail too: value lanes whose 3-bit codes cross a word read
# them with a plain shift (the 8-row case: 24 bits a lane).
ROTATED_MUTATION = ("constexpr bool STRADDLE = VB1 > 0 && LANE_BITS1 % 32 != 0 && 32 % LANE_BITS1 != 0;",
                    "constexpr bool STRADDLE = false;")


def _rotated(bits=4):
    return TurboQuantRVQCache(KVCacheConfig(method="turboquant_rvq", bit_width_inlier=bits))


@pytest.fixture(scope="module", autouse=True)
def _programs_built_in_parallel():
    """Every program the tests below compile, built up front one per core: the signatures are
    captured from small caches of the same shapes (a cold run pays the compiler ~1 s each)."""
    captured = []
    with cuda_emulation.signatures_only() as captured:
        for name, make, dtype, D, B, rep, n, warps in CASES:
            cache = make()
            q_heads = _filled(cache, 100, B=B, H=2, rep=rep, D=D, dtype=dtype)
            _emulated_step(cache, q_heads, D**-0.5)
        for name, bits, dtype, D, B, rep, n in ROTATED_CASES:
            cache = _rotated(bits)  # 100 tokens would all be in its exact window: no kernel call
            _emulated_step(cache, _filled(cache, 300, B=B, H=2, rep=rep, D=D, dtype=dtype), D**-0.5)
        with pytest.MonkeyPatch.context() as mutated:
            _mutated_rotated(mutated)
            cache = _rotated(4)
            _emulated_step(cache, _filled(cache, 300, B=1, H=2, rep=8, D=128, dtype=mx.float32), 128**-0.5)
        for name, attr, old, new in MUTATIONS:
            with pytest.MonkeyPatch.context() as mutated:
                _mutated(mutated, attr, old, new)
                cache = CASES[0][1]()
                _emulated_step(cache, _filled(cache, 100, B=1, H=2, rep=4, D=128, dtype=mx.float32), 128**-0.5)
    cuda_emulation.prebuild_captured(captured)


def test_small_stages_walk_several_key_and_value_stages_per_tile(monkeypatch):
    # At the 8B shape a warp stages a whole tile at once (128 key channels, 128 value tokens);
    # with 768 bytes per warp it takes 8 key stages of 16 channels and up to 8 value stages of
    # 16 tokens per tile, and stops at the ragged last tile's end (32 valid tokens: 2 stages).
    monkeypatch.setattr(fused_decode, "STAGE_BYTES", 768)
    assert fused_decode.stage_template(128, 128, 4, 32, 2, 2, 2) == (("STAGE_WORDS", 192), ("KSC", 16), ("VST", 16))
    cache = _kivi(bit_width_inlier=2)()
    q_heads = _filled(cache, 730, B=1, H=2, rep=4, D=128, dtype=mx.float32)
    expected = np.array(cache.attention(q_heads, scale=128**-0.5))
    got, made = _emulated_step(cache, q_heads, 128**-0.5)
    assert [k.calls for k in made if k.calls] == _launches()
    assert np.allclose(np.array(got), expected, atol=2e-5, rtol=2e-5), np.abs(np.array(got) - expected).max()


@pytest.mark.parametrize("name, make, dtype, D, B, rep, n, warps", CASES, ids=[c[0] for c in CASES])
def test_the_emulated_kernels_are_the_portable_attention(monkeypatch, name, make, dtype, D, B, rep, n, warps):
    if warps:
        monkeypatch.setattr(fused_decode, "AFFINE_TARGET_WARPS", warps)
    cache = make()
    q_heads = _filled(cache, n, B=B, H=2, rep=rep, D=D, dtype=dtype)
    n_valid, window = cache.n_compressed, cache.window_keys.shape[2]
    assert fused_decode.supports(D, D, 32, cache.key_bits if cache.method == "kivi" else cache.code_bits,
                                 cache.value_bits if cache.method == "kivi" else cache.code_bits, rep)
    # Kernels off (the CPU default), over the same stored codes, side data and window but with
    # float32 queries: the kernels compute in float32 and round once at the end, while the
    # portable path in fp16/bf16 rounds its scores and sums (on the CPU 0.023 / 0.089 off its own
    # float32 result in the 16-bit cases here; the kernels' output is within 9e-4 / 7e-3).
    expected = cache.attention(q_heads.astype(mx.float32), scale=D**-0.5)
    mx.eval(expected)
    assert (cache.n_compressed, cache.window_keys.shape[2]) == (n_valid, window)  # nothing flushed

    got, made = _emulated_step(cache, q_heads, D**-0.5)
    assert [k.calls for k in made if k.calls] == _launches(), "the decode step did not run its kernels"
    assert got.dtype == dtype and got.shape == q_heads.shape

    per_block = fused_decode.affine_tokens_per_block(n_valid, B * 2)
    if "ragged" in name:
        assert n_valid % per_block and (n_valid % per_block) % fused_decode.TILE
    if warps:
        assert n_valid <= per_block and n_valid > 4 * fused_decode.TILE  # one block, >1 tile per warp
    else:
        assert n_valid > per_block  # several history blocks to merge
    if cache.method == "kivi":
        assert cache._sink_length() == 1  # the sink goes in as skip=1 + an exact prefix
    got, expected = np.array(got.astype(mx.float32)), np.array(expected)
    tol = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]  # the output's rounding
    assert np.allclose(got, expected, atol=tol, rtol=tol), np.abs(got - expected).max()



def test_the_split_build_and_the_merge_kernel_are_the_same_attention(monkeypatch):
    # MERGE_IN_KERNEL off (the A/B setting): the partials kernel as written, then the merge
    # kernel, against the portable attention as above and against the fused launch.
    name, make, dtype, D, B, rep, n, warps = CASES[0]
    cache = make()
    q_heads = _filled(cache, n, B=B, H=2, rep=rep, D=D, dtype=dtype)
    expected = np.array(cache.attention(q_heads, scale=D**-0.5))
    fused, _ = _emulated_step(cache, q_heads, D**-0.5)
    monkeypatch.setattr(fused_decode, "MERGE_IN_KERNEL", False)
    split, made = _emulated_step(cache, q_heads, D**-0.5)
    assert sorted((k.name, k.calls) for k in made if k.calls) == [("vq_affine_decode_merge", 1), ("vq_affine_decode_partials", 1)]
    split, fused = np.array(split), np.array(fused)
    assert np.allclose(split, expected, atol=2e-5, rtol=2e-5) and np.allclose(split, fused, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("constant, template_name", [("WINDOW_ROW_VECTORS", "WRV"), ("L2_PREFETCH", "PF")],
                         ids=["row-vectors", "l2-prefetch"])
@pytest.mark.parametrize("case", [0, 1, 7, 8], ids=lambda i: CASES[i][0])
def test_the_exact_blocks_row_vectors_give_the_element_loads_output(monkeypatch, case, constant, template_name):
    # WINDOW_ROW_VECTORS (template WRV, off by default): the exact block's sink and window rows
    # read 16 bytes a load; the same values summed in the same order: the same output bit for
    # bit (fp32 and 16-bit queries, a sink, 1 / 4 / 8 rows, head_dim 64 and 128). L2_PREFETCH
    # (template PF, off by default) only adds hints (no-ops in the emulation): the same output.
    name, make, dtype, D, B, rep, n, warps = CASES[case]
    cache = make()
    q_heads = _filled(cache, n, B=B, H=2, rep=rep, D=D, dtype=dtype)
    outputs, templates = [], []
    real = cuda_emulation.EmulatedKernel.__call__
    monkeypatch.setattr(cuda_emulation.EmulatedKernel, "__call__",
                        lambda self, **k: templates.append(dict(k["template"])) or real(self, **k))
    for vectors in (0, 1):
        monkeypatch.setattr(fused_decode, constant, vectors)
        cache.__dict__.pop("_fused_plan", None)  # the launch plan keeps the template it was built with
        templates.clear()
        got, made = _emulated_step(cache, q_heads, D**-0.5)
        assert [k.calls for k in made if k.calls] == _launches() and templates[0][template_name] == vectors
        outputs.append(np.array(got.astype(mx.float32)))
    assert np.array_equal(outputs[0], outputs[1])


class _Recorded:
    """An emulated kernel that keeps the inputs of each launch."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __call__(self, **kwargs):
        self.launches.append(kwargs["inputs"])
        return self.kernel(**kwargs)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "fp32"])
def test_kivis_default_sink_is_attended_through_the_partials_kernels_sink_inputs(monkeypatch, dtype):
    # KIVI's default config at the 8B head shape (GQA 4, head_dim 128, residual 128): its exact
    # sink (token 0) reaches the partials kernel as sk / sv with n_sink = 1 in meta, the window
    # as the cache's window alone (no concatenation: the step is the two kernels), and the
    # output is the portable attention's (where the sink's exact K/V replace its codes).
    # (Template constants as in CASES: the programs are built by the module's fixture.)
    cache = KIVICache(KVCacheConfig(method="kivi"))
    q_heads = _filled(cache, 1100, B=1, H=2, rep=4, D=128, dtype=dtype)
    assert cache.residual_length == 128 and cache._sink_length() == 1
    expected = np.array(cache.attention(q_heads.astype(mx.float32), scale=128**-0.5))
    recorded = []
    real = cuda_emulation.cuda_kernel
    monkeypatch.setattr(cuda_emulation, "cuda_kernel", lambda *a, **k: recorded.append(_Recorded(real(*a, **k))) or recorded[-1])
    got, made = _emulated_step(cache, q_heads, 128**-0.5)
    assert [k.name for k in made if k.launches] == ["vq_affine_decode_partials_merged"]
    assert [len(k.launches) for k in made if k.launches] == [1]
    inputs = dict(zip(fused_decode.PARTIALS_INPUTS, next(k for k in made if k.launches).launches[0]))
    assert mx.array_equal(inputs["sk"], cache.sink_keys).item() and inputs["sk"].shape == (1, 2, 1, 128)
    assert mx.array_equal(inputs["sv"], cache.sink_values).item()
    assert mx.array_equal(inputs["wk"], cache.window_keys).item() and mx.array_equal(inputs["wv"], cache.window_values).item()
    assert inputs["meta"].tolist()[4:] == [1, 1]  # n_skip, n_sink
    got = np.array(got.astype(mx.float32))
    print(f"kivi default {dtype}: max |kernel - portable| = {np.abs(got - expected).max():.2e}")
    tol = {mx.float32: 2e-5, mx.bfloat16: 1e-2}[dtype]  # the output's rounding
    assert np.allclose(got, expected, atol=tol, rtol=tol), np.abs(got - expected).max()
    if dtype == mx.float32:
        # The comparison sees the sink: token 0 read from its placeholder codes instead of its
        # exact K/V moves the output by far more than the tolerance (in bf16 it would not).
        cache.sink_keys = cache.sink_values = None
        placeholder = np.array(cache.attention(q_heads, scale=128**-0.5))
        print(f"kivi default fp32: max |exact sink - placeholder codes| = {np.abs(placeholder - expected).max():.2e}")
        assert np.abs(placeholder - expected).max() > 10 * tol


@pytest.mark.parametrize("name, bits, dtype, D, B, rep, n", ROTATED_CASES, ids=[c[0] for c in ROTATED_CASES])
def test_the_emulated_rotated_step_is_the_portable_attention(monkeypatch, name, bits, dtype, D, B, rep, n):
    cache = _rotated(bits)
    q_heads = _filled(cache, n, B=B, H=2, rep=rep, D=D, dtype=dtype)
    assert cache.n_compressed > 0 and cache.sink_deltas is not None  # the exact sink is in play
    expected = np.array(cache.attention(q_heads.astype(mx.float32), scale=D**-0.5))
    got, made = _emulated_step(cache, q_heads, D**-0.5)
    assert sorted(k.name for k in made if k.calls) == ["vq_rotated_decode_partials_merged"]
    assert got.dtype == dtype and got.shape == q_heads.shape
    tol = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]  # the output's rounding
    got = np.array(got.astype(mx.float32))
    print(f"{name}: max |kernel - portable| {np.abs(got - expected).max():.3g}")
    assert np.allclose(got, expected, atol=tol, rtol=tol), np.abs(got - expected).max()


def _mutated_rotated(monkeypatch):
    old, new = ROTATED_MUTATION
    assert old in fused_decode_rotated._PARTIALS, f"fused_decode_rotated no longer contains {old!r}: pick a new mutation"
    monkeypatch.setattr(fused_decode_rotated, "_PARTIALS", fused_decode_rotated._PARTIALS.replace(old, new, 1))


def test_a_corrupted_rotated_kernel_source_fails_the_comparison(monkeypatch):
    cache = _rotated(4)
    q_heads = _filled(cache, 300, B=1, H=2, rep=8, D=128, dtype=mx.float32)
    expected = np.array(cache.attention(q_heads, scale=128**-0.5))
    good, _ = _emulated_step(cache, q_heads, 128**-0.5)
    _mutated_rotated(monkeypatch)
    got, made = _emulated_step(cache, q_heads, 128**-0.5)
    assert [k.calls for k in made if k.calls] == _launches()
    good_err, bad_err = np.abs(np.array(good) - expected).max(), np.abs(np.array(got) - expected).max()
    print(f"rotated, 8 rows: max |kernel - portable| {good_err:.3g}, corrupted {bad_err:.3g}")
    assert good_err < 2e-5 and bad_err > 1e-3


@pytest.mark.parametrize("name, attr, old, new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_corrupted_kernel_source_fails_the_comparison(monkeypatch, name, attr, old, new):
    cache = _kivi(bit_width_inlier=2)()
    q_heads = _filled(cache, 1100, B=1, H=2, rep=4, D=128, dtype=mx.float32)
    expected = np.array(cache.attention(q_heads, scale=128**-0.5))
    _mutated(monkeypatch, attr, old, new)
    if attr == "_MERGE":  # the merge kernel runs in the split build only
        monkeypatch.setattr(fused_decode, "MERGE_IN_KERNEL", False)
    got, made = _emulated_step(cache, q_heads, 128**-0.5)
    assert [k.calls for k in made if k.calls] == _launches()
    print(f"{name}: max |corrupted kernel - portable| = {np.abs(np.array(got) - expected).max():.2e}")
    assert np.abs(np.array(got) - expected).max() > 1e-4  # 5x the tolerance above, at least


@pytest.mark.parametrize("kind", ["kivi", "turboquant_rvq"])
def test_the_kernels_read_a_window_written_in_place(monkeypatch, kind):
    # base.DECODE_WINDOW_IN_PLACE: decode steps write their token into window buffers with
    # slack rows (cache/window_buffer.py); the kernels get the buffers whole and the filled
    # rows as wn's length, and each step's output is the portable attention's.
    monkeypatch.setattr(base, "DECODE_WINDOW_IN_PLACE", 1)
    # The uncompiled launch reading the buffers (wn's length the filled rows); the compiled one
    # (as shipped, the count as data) is tests/cache/test_compiled_launch.py's.
    monkeypatch.setattr(fused_decode, "COMPILED_LAUNCH", False)
    cache = _kivi(bit_width_inlier=2)() if kind == "kivi" else _rotated(4)
    q_heads = _filled(cache, 700 if kind == "kivi" else 300, B=1, H=2, rep=4, D=128, dtype=mx.float32)
    recorded = []
    real = cuda_emulation.cuda_kernel
    monkeypatch.setattr(cuda_emulation, "cuda_kernel", lambda *a, **k: recorded.append(_Recorded(real(*a, **k))) or recorded[-1])
    names = fused_decode.PARTIALS_INPUTS if kind == "kivi" else fused_decode_rotated._INPUTS
    for step in range(3):
        buf_k, _, n = cache.window_buffers()
        assert buf_k.shape[2] > n  # slack rows the kernel must not read
        expected = np.array(cache.attention(q_heads, scale=128**-0.5))
        got, made = _emulated_step(cache, q_heads, 128**-0.5)
        launch = next(k for k in made if k.launches).launches[-1]
        inputs = dict(zip(names, launch))
        assert inputs["wk"].shape[2] == buf_k.shape[2] and inputs["wn"].shape == (n,)
        got = np.array(got)
        assert np.allclose(got, expected, atol=2e-5, rtol=2e-5), (step, np.abs(got - expected).max())
        mx.random.seed(50 + step)
        cache.update_and_fetch(mx.random.normal((1, 2, 1, 128)), mx.random.normal((1, 2, 1, 128)))
        q_heads = 2 * mx.random.normal((1, 8, 1, 128))
