"""The fused decode path: its algorithm on the CPU, and the CUDA kernels against the portable path.

On the CPU the kernels cannot run: there we check that the portable path is what runs, and that
the kernels' algorithm (flash-decoding partials per block of history tokens, merged with the
exact window's; tests/cache/split_softmax_reference.py) is the attention the portable path
computes. The CUDA tests run where MLX's CUDA backend is the default device (the H200 through
the device tool): a whole decode step with the kernels against the same step with
VELOXQUANT_CUDA_KERNELS=0, over the kernels' shapes (bits, head dims, dtypes, GQA rows, batch).
"""

import contextlib

import mlx.core as mx
import pytest

from tests.cache.cuda_emulation import emulated_kernels
from tests.cache.split_softmax_reference import merge_with_window, reference_partials
from veloxquant_mlx import KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache import fused_decode, partials_merge_source
from veloxquant_mlx.cache.kivi import KIVICache
from veloxquant_mlx.cache.xquant import XQuantCache
from tests.cache.cuda_marks import cuda_test as cuda_only

on_cuda = fused_decode._on_cuda()


def _filled(cache, n, *, B=1, H=2, rep=4, D=64, Dv=64, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    k = mx.random.normal((B, H, n, D)).astype(dtype)
    v = mx.random.normal((B, H, n, Dv)).astype(dtype)
    cache.update_and_fetch(k, v)
    mx.eval(cache.attention(mx.random.normal((B, rep * H, n, D)).astype(dtype), scale=D**-0.5, mask="causal"))
    return cache


def _decode_step(cache, *, B=1, H=2, rep=4, D=64, Dv=64, dtype=mx.float32, seed=1):
    mx.random.seed(seed)
    cache.update_and_fetch(
        mx.random.normal((B, H, 1, D)).astype(dtype), mx.random.normal((B, H, 1, Dv)).astype(dtype)
    )
    return mx.random.normal((B, rep * H, 1, D)).astype(dtype)


def test_the_kernels_algorithm_is_the_portable_attention():
    cache = _filled(KIVICache(KVCacheConfig(method="kivi", bit_width_inlier=2, kivi_residual_length=32)), 700)
    q_heads = _decode_step(cache)
    assert cache.n_compressed == 640 and cache.capacity == 768  # slack columns to ignore
    expected = cache.attention(q_heads, scale=0.125)
    # The same step through partials: queries folded like the kernels fold GQA rows.
    q = (q_heads * 0.125).reshape(1, 2, 4, 64)
    keys, values = cache._decode()
    per_block = fused_decode.affine_tokens_per_block(cache.n_compressed, 2)
    for block in (per_block, 128, 100):  # 100 leaves a ragged last block
        o, m, l = reference_partials(q, keys, values, cache.n_compressed, block)
        got = merge_with_window(q, o, m, l, cache.window_keys, cache.window_values)
        # On a GPU float32 matmuls may run in TF32: a looser tolerance there.
        tol = 2e-3 if on_cuda else 2e-5
        assert mx.allclose(got.reshape(expected.shape), expected, atol=tol).item()


def test_cpu_takes_the_portable_path_and_the_switch_is_checked(monkeypatch):
    if not on_cuda:
        assert not fused_decode.kernels_enabled()
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "yes")
    with pytest.raises(QuantizerConfigError, match="VELOXQUANT_CUDA_KERNELS='yes'.*allowed is 0"):
        fused_decode.kernels_enabled()
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    assert not fused_decode.kernels_enabled()


def test_blocks_fill_the_gpu_within_bounds():
    # 128-token tiles, 4 warps per block, ~8192 warps over all heads, at most 64 tiles per warp
    assert fused_decode.tokens_per_block(4096, 8) == 512
    assert fused_decode.tokens_per_block(32768, 8) == 512
    assert fused_decode.tokens_per_block(131072, 8) == 512
    # past 128K two tiles a warp (~1030 blocks), not three (~690: one wave and a few blocks alone)
    assert fused_decode.tokens_per_block(131584, 8) == 1024
    assert fused_decode.tokens_per_block(10**8, 64) == 128 * 4 * 64
    # a kernel's own target (minicache's merged kernel keeps 4096)
    assert fused_decode.tokens_per_block(131584, 8, target_warps=4096) == 1536
    # kivi's and xquant's launches (AFFINE_TARGET_WARPS, ~1024 warps): twice the tiles per warp
    # at 32K, four at 64K (8 heads); from 6 tiles per warp on twice the warps (~2048: 3 tiles
    # per warp at 96K, 4 at 128K, not 6 and 8); GEAR's launch keeps the split above
    assert fused_decode.affine_tokens_per_block(4096, 8) == 512
    assert fused_decode.affine_tokens_per_block(32768, 8) == 1024
    assert fused_decode.affine_tokens_per_block(65536, 8) == 2048
    assert fused_decode.affine_tokens_per_block(98304 - 128, 8) == 3072  # 6136 tiles: under 6 per warp
    assert fused_decode.affine_tokens_per_block(98304, 8) == 1536
    assert fused_decode.affine_tokens_per_block(131072, 8) == 2048


def test_supported_shapes():
    assert fused_decode.supports(128, 128, 32, 2, 2, rows=4)
    assert fused_decode.supports(64, 64, 64, 4, 8, rows=8)
    assert not fused_decode.supports(128, 128, 32, 3, 2)  # 3-bit codes straddle words
    assert not fused_decode.supports(128, 128, 16, 2, 2)  # a 32-token tile spans two groups
    assert fused_decode.supports(128, 128, 32, 2, 2, rows=16)
    assert not fused_decode.supports(128, 128, 32, 2, 2, rows=32)  # shared memory
    # 19 rows of (96 + 4 * 132 + 8) floats = 48,032 bytes (132: the tile's probability slots,
    # TILE_SLOTS), + 16 (MMA's B fragments, one word per warp while off) leave each warp 240
    # bytes of stage: a stage of 8 value tokens with float32 scales needs 512; 18 rows (45,520)
    # leave 880, enough for 8 tokens and 12 key channels (the
    # emulation reads the kernel's static shared memory: tests/cache/cuda_emulation.py)
    assert not fused_decode.supports(96, 128, 32, 2, 2, rows=19)
    assert fused_decode.supports(96, 128, 32, 2, 2, rows=18)
    assert fused_decode.shared_bytes(96, 128, 19) == 48_048 and fused_decode.TILE_SLOTS == 132
    assert fused_decode.stage_template(96, 128, 18, 32, 2, 2, 4) == (("STAGE_WORDS", 220), ("KSC", 12), ("VST", 8))
    # The 8B shape: a whole tile of 2-bit keys and of values per stage (6 KB per warp)
    assert fused_decode.stage_template(128, 128, 4, 32, 2, 2, 2) == (("STAGE_WORDS", 1536), ("KSC", 128), ("VST", 128))
    assert fused_decode.supports(64, 64, 32, 2, 2)  # 4 words per value token: 4 lanes
    assert not fused_decode.supports(96, 96, 32, 2, 2)  # 6 words: 2 lanes of 48 channels > G
    # One row: whole words per lane (the largest power of two up to 8 dividing the words)
    assert [fused_decode.lanes_per_token(dv, b, 1) for dv, b in ((128, 2), (64, 2), (64, 4), (96, 4), (16, 2), (8, 2))] == [8, 4, 8, 4, 1, None]
    # More rows: lanes double (up to 16) until rows x channels per lane <= 32, never straddling words
    assert [fused_decode.lanes_per_token(dv, b, 4) for dv, b in ((128, 2), (64, 2), (64, 4), (96, 4), (16, 2))] == [16, 8, 8, 4, 2]
    assert [fused_decode.lanes_per_token(dv, b, 8) for dv, b in ((128, 2), (128, 4), (128, 8), (96, 4), (64, 2))] == [16, 16, 16, 4, 16]


def test_meta_is_rebuilt_only_when_its_values_change():
    meta = fused_decode.FusedDecodeMeta()
    first = meta.get(640, 128, 5, 0.125)
    assert meta.get(640, 128, 5, 0.125) is first
    assert meta.get(672, 128, 6, 0.125).tolist()[:3] == [672, 128, 6]
    assert meta.get(672, 128, 6, 0.125, 1).tolist()[4:] == [1]  # n_skip (the other kernels' meta)
    assert meta.get(672, 128, 6, 0.125, 1, 1).tolist()[4:] == [1, 1]  # n_skip, n_sink (this kernel's)
    assert meta.get(672, 128, 6, 0.125, 1, 0).tolist()[4:] == [1, 0]


def test_skip_must_leave_the_first_tile_a_token():
    cache = _filled(_kivi(bit_width_inlier=2)(), 700, D=128, Dv=128)
    q = _decode_step(cache, D=128, Dv=128)
    for skip in (-1, 128):
        with pytest.raises(QuantizerConfigError, match=f"skip={skip} leading tokens of 640; allowed is 0 <= skip < min"):
            fused_decode.affine_decode_attention(
                q, 0.1, *[cache.store[k] for k in ("key_codes", "key_scales", "key_biases", "value_codes", "value_scales", "value_biases")],
                cache.window_keys, cache.window_values, n_valid=640, group_size=32, key_bits=2,
                value_bits=2, n_kv_heads=2, meta_cache=fused_decode.FusedDecodeMeta(), skip=skip)


def _kivi(**fields):
    return lambda: KIVICache(KVCacheConfig(method="kivi", kivi_residual_length=32, **fields))


# Each combination JIT-compiles its own kernel (~10-20 s on the H200): a list, not a product.
KERNEL_CASES = [
    ("kivi-2 bf16 hd128 gqa4", _kivi(bit_width_inlier=2), mx.bfloat16, 128, 1, 4),
    ("kivi-4/2 fp16 hd64 batch2 mha", _kivi(key_bits=4, value_bits=2), mx.float16, 64, 2, 1),
    ("kivi-8 fp32 hd128 gqa8", _kivi(bit_width_inlier=8), mx.float32, 128, 1, 8),
    ("kivi-2 fp16 hd128 gqa8 half-word lanes", _kivi(bit_width_inlier=2), mx.float16, 128, 1, 8),
    # the default config at the 8B shape (the template of the kivi-2 bf16 case: no new compile);
    # its exact sink goes in as the partials kernel's sk / sv inputs
    ("kivi default bf16 hd128 gqa4 sink inputs", lambda: KIVICache(KVCacheConfig(method="kivi")), mx.bfloat16, 128, 1, 4),
    ("xquant-2 bf16 hd128 gqa4", lambda: XQuantCache(KVCacheConfig(method="xquant", bit_width_inlier=2,
                                                                   xquant_residual_length=32)),
     mx.bfloat16, 128, 1, 4),
]


@cuda_only
@pytest.mark.parametrize("name, make, dtype, D, B, rep", KERNEL_CASES)
def test_kernel_step_matches_the_portable_step(monkeypatch, name, make, dtype, D, B, rep):
    shape = dict(B=B, rep=rep, D=D, Dv=D, dtype=dtype)
    cache = _filled(make(), 1000, **shape)
    q_heads = _decode_step(cache, **shape)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    portable = cache.attention(q_heads, scale=D**-0.5).astype(mx.float32)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    calls = []
    planned = fused_decode.planned_attend
    monkeypatch.setattr(fused_decode, "planned_attend", lambda *a, **k: calls.append(1) or planned(*a, **k))
    fused = cache.attention(q_heads, scale=D**-0.5)
    assert calls == [1], "the kernel did not run"
    assert fused.dtype == dtype and fused.shape == q_heads.shape
    fused = fused.astype(mx.float32)
    tol = 2e-2 if dtype == mx.bfloat16 else 2e-3
    assert mx.allclose(fused, portable, atol=tol, rtol=tol).item(), mx.abs(fused - portable).max().item()


@cuda_only
@pytest.mark.parametrize("constant, template_name", [("MMA_SCORES", "MMA"), ("MMA_VALUES", "MMAV"), ("L2_PREFETCH", "PF")],
                         ids=["scores", "values", "l2-prefetch"])
@pytest.mark.parametrize("name, make, dtype, D, B, rep, warps", [
    (*KERNEL_CASES[0], None), (*KERNEL_CASES[4], None), (*KERNEL_CASES[5], None), (*KERNEL_CASES[0], 1)],
    ids=["kivi-2", "kivi-default-sink", "xquant-2", "kivi-2-many-tiles"])
def test_tensor_core_scores_match_the_portable_step_and_the_fma_kernel(monkeypatch, name, make, dtype, D, B, rep, warps,
                                                                       constant, template_name):
    # fused_decode.MMA_SCORES and MMA_VALUES (on as shipped since session 30), each switched on
    # and off on the GPU's own mma.sync: the same attention as the portable path and as the FMA
    # build, within the bf16 output's rounding; L2_PREFETCH (off as shipped) only adds hints.
    if warps:
        monkeypatch.setattr(fused_decode, "AFFINE_TARGET_WARPS", warps)
    shape = dict(B=B, rep=rep, D=D, Dv=D, dtype=dtype)
    cache = _filled(make(), 5000 if warps else 1000, **shape)
    q_heads = _decode_step(cache, **shape)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    portable = cache.attention(q_heads, scale=D**-0.5).astype(mx.float32)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    outputs, templates = {}, []
    launch = fused_decode.PartialsKernel.attend
    monkeypatch.setattr(fused_decode.PartialsKernel, "attend",
                        lambda self, *a, **k: templates.append(dict(k["template"])) or launch(self, *a, **k))
    for on in (0, 1):
        monkeypatch.setattr(fused_decode, constant, on)
        cache.__dict__.pop("_fused_plan", None)  # the plan keeps the template it was built with
        outputs[on] = cache.attention(q_heads, scale=D**-0.5).astype(mx.float32)
        assert templates[-1][template_name] == on
    for got in (outputs[1], portable):
        assert mx.allclose(outputs[1], got, atol=2e-2, rtol=2e-2).item(), mx.abs(outputs[1] - got).max().item()
    assert mx.allclose(outputs[0], outputs[1], atol=2e-2, rtol=2e-2).item()


@cuda_only
def test_kernel_with_many_tiles_per_warp_matches_the_portable_step(monkeypatch):
    # Few target warps: every warp walks several 128-token tiles (the online softmax across
    # tiles); same template as the kivi-2 bf16 case. 4960 compressed tokens of 2 heads are 78
    # tiles, at least AFFINE_LONG_TILES_PER_WARP per warp of 1 target: the long-history rule
    # doubles it to 2 warps, so each head's one history block holds its 39 tiles, ~10 a warp.
    monkeypatch.setattr(fused_decode, "AFFINE_TARGET_WARPS", 1)
    shape = dict(B=1, rep=4, D=128, Dv=128, dtype=mx.bfloat16)
    cache = _filled(_kivi(bit_width_inlier=2)(), 5000, **shape)
    assert cache.n_compressed == 4960
    assert fused_decode.affine_tokens_per_block(cache.n_compressed, 2) == 128 * 4 * 39
    q_heads = _decode_step(cache, **shape)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    portable = cache.attention(q_heads, scale=128**-0.5).astype(mx.float32)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    fused = cache.attention(q_heads, scale=128**-0.5).astype(mx.float32)
    assert mx.allclose(fused, portable, atol=2e-2, rtol=2e-2).item(), mx.abs(fused - portable).max().item()


@pytest.mark.parametrize("skip", [1, 3])
def test_kernel_skip_with_the_skipped_tokens_as_exact_prefix_is_the_same_attention(monkeypatch, skip):
    # Skipping the first tokens of the history and handing their decoded K/V in as exact tokens
    # attends to the same set of tokens: the same output as the plain kernel step. The cache
    # keeps no exact sink of its own, so the plain step's compressed column 0 is token 0's
    # codes (with the sink it holds a placeholder only the sink's own path replaces: the H200
    # run of session 5 found this test comparing against that placeholder). On the CPU the
    # kernels run under the emulation, on CUDA for real.
    shape = dict(B=1, rep=4, D=128, Dv=128, dtype=mx.float16)
    cache = _kivi(bit_width_inlier=2)()
    cache.exact_sink_tokens = 0
    _filled(cache, 1000, **shape)
    assert cache.sink_keys is None
    q_heads = _decode_step(cache, **shape)
    keys, values = cache._decode()
    s = cache.store
    arrays = lambda: tuple(s[k] for k in ("key_codes", "key_scales", "key_biases", "value_codes", "value_scales", "value_biases"))
    step = lambda **kw: fused_decode.decode_step(cache, q_heads, 128**-0.5, arrays, group_size=32,
                                                 key_bits=2, value_bits=2, **kw).astype(mx.float32)
    with contextlib.nullcontext() if on_cuda else emulated_kernels():
        plain = step()
        skipped = step(skip=skip, exact_prefix=(keys[:, :, :skip], values[:, :, :skip]))
        dropped = step(skip=skip)
        mx.eval(plain, skipped, dropped)
    assert mx.allclose(plain, skipped, atol=2e-3, rtol=2e-3).item(), mx.abs(plain - skipped).max().item()
    # Skipping without handing the tokens back changes the output (the skip is real).
    assert not mx.allclose(plain, dropped, atol=1e-4).item()


class _FakeKernel:
    def __init__(self, seen):
        self.seen = seen

    def attend(self, queries, *, inputs, **shape):
        self.seen.setdefault("steps", []).append((queries, inputs, shape))
        return "kernel output"


def _spy_launch(monkeypatch) -> dict:
    """Kernels reported active; affine_launch recorded (args, kwargs, calls) and each step's
    attend (queries, inputs, shape) in `steps`."""
    seen = {"launches": 0}

    def launch(*a, **k):
        seen.update(args=a, kwargs=k, launches=seen["launches"] + 1)
        return _FakeKernel(seen), [f"input {i}" for i in range(13)], {"n_blocks": 3}

    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    monkeypatch.setattr(fused_decode, "affine_launch", launch)
    monkeypatch.setattr(fused_decode, "_kernels", lambda: (_FakeKernel(seen), None))
    return seen


def test_a_launch_plan_serves_the_steps_until_the_store_changes(monkeypatch):
    # Between two flushes a step swaps its queries and window into the plan's inputs; the checks,
    # split, meta and constants are not redone. A store write (here a growth) drops the plan.
    cache = _filled(_kivi(bit_width_inlier=2)(), 700, D=128, Dv=128)
    q_heads = _decode_step(cache, D=128, Dv=128)
    seen = _spy_launch(monkeypatch)
    for _ in range(3):
        assert cache._fused_decode(q_heads, 0.5) == "kernel output"
    assert seen["launches"] == 1 and len(seen["steps"]) == 3
    queries, inputs, shape = seen["steps"][-1]
    state = shape.pop("state")
    # baked: the cache's own baked_constants (unset: the module's BAKED_CONSTANTS decides);
    # compiled: not here, the window concatenated (the kernels are stubbed, not enabled, when
    # the steps' tokens are written); verbatim: the text as shipped (compacted)
    assert queries is q_heads and inputs[0] is q_heads
    assert shape == {"n_blocks": 3, "baked": None, "compiled": False, "verbatim": False, "inline": False}
    assert state is cache._fused_launch  # one FusedLaunchState per cache, across its plans
    assert mx.array_equal(inputs[7], cache.window_keys).item() and mx.array_equal(inputs[8], cache.window_values).item()
    assert inputs[1:7] == [f"input {i}" for i in range(1, 7)] and inputs[9:12] == [f"input {i}" for i in range(9, 12)]
    # wn: the window's filled rows as a view's length (the kernels read its shape, not its bytes)
    assert inputs[12] is fused_decode.window_rows(cache.window_keys.shape[2]) and inputs[12].shape == (cache.window_keys.shape[2],)
    assert cache._fused_decode(q_heads.astype(mx.float16), 0.5) == "kernel output"  # other queries: a new plan
    assert seen["launches"] == 2
    cache._ensure_capacity(cache.capacity + 1)
    assert "_fused_plan" not in cache.__dict__
    cache._fused_decode(q_heads, 0.5)
    assert seen["launches"] == 3


@pytest.mark.parametrize("name, make", [(c[0], c[1]) for c in KERNEL_CASES if c[0].startswith(("kivi-2", "xquant"))])
def test_decode_step_hands_the_kernels_the_caches_arrays(monkeypatch, name, make):
    # The wiring from a cache to the kernels, checked on any device: with the kernels reported
    # active, decode_step passes the cache's codes, window, history length and heads.
    cache = _filled(make(), 700, D=128, Dv=128)
    q_heads = _decode_step(cache, D=128, Dv=128)
    seen = _spy_launch(monkeypatch)
    assert cache._fused_decode(q_heads, 0.5) == "kernel output"
    args, kwargs = seen["args"], seen["kwargs"]
    assert args[0] is q_heads and args[1] == 0.5
    assert args[8] is cache.window_keys and args[9] is cache.window_values  # nothing concatenated
    if cache.method == "kivi":  # its exact sink (token 0): skipped in the codes, inputs of its own
        assert kwargs["skip"] == 1
        assert kwargs["sink"][0] is cache.sink_keys and kwargs["sink"][1] is cache.sink_values
    else:
        assert kwargs["skip"] == 0 and kwargs["sink"] is None
    assert kwargs["n_valid"] == cache.n_compressed == 640 and kwargs["n_kv_heads"] == 2
    assert kwargs["meta_cache"] is cache._fused_meta
    s = cache.store
    if cache.method == "kivi":
        expected = [s[k] for k in ("key_codes", "key_scales", "key_biases", "value_codes", "value_scales", "value_biases")]
    else:  # xquant reads its codes through _codes(): K^T words as one stream per channel
        k_codes, v_codes = cache._codes()
        expected = [k_codes, s["k_scale"], s["k_zero"], v_codes, s["v_scale"], s["v_zero"]]
    for got, want in zip(args[2:8], expected):
        assert got.shape == want.shape and got.dtype == want.dtype and mx.array_equal(got, want).item()
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: False)
    assert cache._fused_decode(q_heads, 0.5) is None


def test_decode_step_hands_an_exact_prefix_in_as_the_kernels_sink(monkeypatch):
    # The prefix is not concatenated to the window (two copy kernels per step): the partials
    # kernel takes it as its sink inputs (sk, sv), attended before the window.
    cache = _filled(_kivi(bit_width_inlier=2)(), 700, D=128, Dv=128)
    q_heads = _decode_step(cache, D=128, Dv=128)
    seen = _spy_launch(monkeypatch)
    keys, values = cache._decode()
    prefix = (keys[:, :, :1], values[:, :, :1])
    fused_decode.decode_step(cache, q_heads, 0.5, lambda: (None,) * 6, group_size=32, key_bits=2,
                             value_bits=2, skip=1, exact_prefix=prefix)
    assert seen["args"][8] is cache.window_keys and seen["args"][9] is cache.window_values
    assert seen["kwargs"]["skip"] == 1 and seen["kwargs"]["sink"] is prefix


def test_partials_launch_gets_the_sink_or_dummies_and_its_length_in_meta(monkeypatch):
    cache = _filled(_kivi(bit_width_inlier=2)(), 700, D=128, Dv=128)
    q = _decode_step(cache, D=128, Dv=128)
    arrays = [cache.store[k] for k in ("key_codes", "key_scales", "key_biases", "value_codes", "value_scales", "value_biases")]
    launches = []

    def kernel(**kw):
        launches.append(kw)
        return "partials"

    launch = lambda **kw: fused_decode.affine_partials(  # noqa: E731
        q, 0.1, *arrays, cache.window_keys, cache.window_values, n_valid=640, group_size=32, key_bits=2,
        value_bits=2, n_kv_heads=2, meta_cache=fused_decode.FusedDecodeMeta(), kernel=kernel, **kw)
    launch(skip=1, sink=(cache.sink_keys, cache.sink_values))
    launch()
    names = fused_decode.PARTIALS_INPUTS
    with_sink, without = ({n: a for n, a in zip(names, k["inputs"])} for k in launches)
    assert mx.array_equal(with_sink["sk"], cache.sink_keys).item() and with_sink["sk"].shape == (1, 2, 1, 128)
    assert mx.array_equal(with_sink["sv"], cache.sink_values).item()
    assert with_sink["wk"].shape == cache.window_keys.shape  # the window alone
    assert with_sink["meta"].tolist()[4:] == [1, 1] and without["meta"].tolist()[4:] == [0, 0]
    assert without["sk"].shape == without["sv"].shape == (1,) and without["sk"].dtype == q.dtype
    with pytest.raises(QuantizerConfigError, match=r"sink keys \(1, 2, 1, 64\).*allowed are \(B, H, S, D\)"):
        launch(sink=(cache.sink_keys[..., :64], cache.sink_values))


def test_history_blocks_split_and_their_limit(monkeypatch):
    # 1100 tokens, 2 heads: 18 tiles, far below TARGET_WARPS, so one tile per warp: blocks of 512
    assert fused_decode.history_blocks(1100, 2, "k") == (512, 3, 4)
    assert fused_decode.history_blocks(1100, 2, "k", fused_decode.affine_tokens_per_block) == (512, 3, 4)
    # another kernel's split (e.g. 32-token tiles) is honoured
    assert fused_decode.history_blocks(1100, 2, "k", lambda n, h: 128) == (128, 9, 10)
    monkeypatch.setattr(partials_merge_source, "MAX_BLOCKS", 3)
    with pytest.raises(QuantizerConfigError, match="k: 1100 history tokens need 4 blocks, more than the merge kernel's 3"):
        fused_decode.history_blocks(1100, 2, "k")


def test_fused_launches_of_one_cache_share_counters_and_follow_each_other(monkeypatch):
    # The merge-fused kernel counts its blocks in counters that outlive the launch (it leaves
    # them at zero); a later launch takes the last one's output as an input, so two launches
    # in one evaluated graph cannot overlap on the counters. No output is zero-filled.
    calls = []

    def factory(*, name, input_names, output_names, source, header="", **_):
        def launch(*, inputs, output_shapes, output_dtypes, **launch_args):
            calls.append((input_names, inputs, {**launch_args, "outputs": len(output_shapes)}))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return launch

    monkeypatch.setattr(mx.fast, "cuda_kernel", factory, raising=False)
    monkeypatch.setattr(fused_decode, "MERGE_IN_KERNEL", True)
    kernel = fused_decode.PartialsKernel("vq_test_partials", ["q", "meta"], "", "")
    queries = mx.zeros((1, 8, 1, 16), mx.bfloat16)
    state = fused_decode.FusedLaunchState()
    shape = dict(template=[("R", 4), ("DV", 16)], n_blocks=3, heads=2, value_dim=16)
    first = kernel.attend(queries, inputs=[queries, "meta"], state=state, **shape)
    second = kernel.attend(queries, inputs=[queries, "meta"], state=state, **shape)
    (names, a, args_a), (_, b, _) = calls
    assert names == ["q", "meta", "counts", "scratch", "after"] and "init_value" not in args_a
    assert a[2] is b[2] is state.counts and state.counts.shape == (2,) and state.counts.dtype == mx.int32
    # the partials' scratch is an input kept by the state, not an output: one output per launch
    assert a[3] is b[3] is state.scratch and state.scratch.dtype == mx.float32
    assert state.scratch.shape[0] >= fused_decode.scratch_floats(2, 3, 4, 16)
    assert args_a["outputs"] == 1
    assert a[4] is queries and b[4] is first and state.last_out is second
    kernel.attend(queries, inputs=[queries, "meta"], state=state, **{**shape, "heads": 4})
    assert calls[-1][1][2] is state.counts and state.counts.shape == (4,)  # other heads: new counters
    assert calls[-1][1][3] is a[3]  # the scratch is still large enough: kept
    big = fused_decode.SCRATCH_STEP  # blocks enough to outgrow it: a larger scratch
    kernel.attend(queries, inputs=[queries, "meta"], state=state, **{**shape, "n_blocks": big})
    assert calls[-1][1][3] is state.scratch is not a[3]
    assert state.scratch.shape[0] >= fused_decode.scratch_floats(2, big, 4, 16)


def test_launch_bounds_header_redefines_the_kernel_declaration_under_cuda_compilers_only():
    from veloxquant_mlx.cache.fused_decode import launch_bounds_header

    assert launch_bounds_header(0) == ""
    text = launch_bounds_header(5)
    lines = [line.strip() for line in text.strip().splitlines() if not line.strip().startswith("//")]
    assert lines == ["#if defined(__CUDACC__) || defined(__CUDACC_RTC__)", "#undef __global__",
                     "#define __global__ __location__(global) __launch_bounds__(128, 5)", "#endif"]
    for bad in (-1, 17, 2.0, True, "5", None):
        with pytest.raises(QuantizerConfigError, match=r"min_blocks=.* is invalid: allowed is an integer in 0\.\.16"):
            launch_bounds_header(bad)
