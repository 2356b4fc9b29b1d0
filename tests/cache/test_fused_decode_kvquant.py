"""KVQuant's fused decode kernel (fused_decode_codebook.py): supported shapes, the wiring from the
cache to the kernel launch (any device), and on CUDA the kernel step against the portable step.

The kernel's source is checked on the CPU by test_fused_decode_kvquant_emulated.py (the thread
emulation of mx.fast.cuda_kernel). The CUDA tests run where MLX's CUDA backend is the default
device (the H200 through the device tool); each case JIT-compiles its own kernel (~10 s).
"""


import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig, QuantizerConfigError
from veloxquant_mlx.cache import fused_decode, fused_decode_codebook
from veloxquant_mlx.cache.kvquant import KVQuantCache
from tests.cache.cuda_marks import cuda_test as cuda_only

on_cuda = fused_decode._on_cuda()


def _kvquant(**fields):
    return KVQuantCache(KVCacheConfig(method="kvquant", **fields))


def _filled(cache, n, *, B=1, H=2, rep=4, D=128, dtype=mx.float32, seed=0):
    """A cache after a prefill of n tokens (flushed into blocks by one attention call) and one
    decode token: returns the decode step's queries."""
    mx.random.seed(seed)
    k = mx.random.normal((B, H, n, D)) * mx.where(mx.arange(D) % 16 == 3, 4.0, 1.0) + 0.5
    cache.update_and_fetch(k.astype(dtype), mx.random.normal((B, H, n, D)).astype(dtype))
    mx.eval(cache.attention(mx.random.normal((B, rep * H, 1, D)).astype(dtype), scale=D**-0.5))
    cache.update_and_fetch(mx.random.normal((B, H, 1, D)).astype(dtype), mx.random.normal((B, H, 1, D)).astype(dtype))
    return (2 * mx.random.normal((B, rep * H, 1, D))).astype(dtype)


def test_supported_shapes():
    # The default config on the 8B shape (bits 3, G 32, 1% outliers, GQA 4, head dim 128).
    assert fused_decode_codebook.supports(128, 128, 32, 3, 4)
    for bits in (2, 3, 4):
        for group in (32, 64, 128):
            assert fused_decode_codebook.supports(128, 128, group, bits, 8)
    assert fused_decode_codebook.supports(64, 64, 32, 2, 1, value_outliers=False)
    assert fused_decode_codebook.supports(256, 256, 32, 3, 4)
    assert not fused_decode_codebook.supports(128, 128, 32, 8, 4)  # bits 2, 3, 4 only
    assert not fused_decode_codebook.supports(128, 128, 30, 3, 4)  # a lane's 4 tokens in one block
    assert not fused_decode_codebook.supports(128, 128, 32, 3, 9)  # R <= 8: accumulators in registers
    assert not fused_decode_codebook.supports(128, 80, 32, 3, 4)  # the merge reduces whole warps
    assert not fused_decode_codebook.supports(512, 128, 32, 3, 4)
    assert not fused_decode_codebook.supports(100, 128, 32, 3, 4)  # key side data loaded in channel pairs
    # Shared memory: R = 4, D = DV = 256 with value outliers: 37.5 KB; R = 8 would need 74 KB
    # (and is refused for registers above head dim 128 anyway).
    assert fused_decode_codebook.shared_bytes(256, 256, 8, 3, True) > 48 * 1024
    assert fused_decode_codebook.shared_bytes(256, 256, 4, 3, True) <= 48 * 1024
    assert not fused_decode_codebook.supports(256, 256, 32, 3, 8)
    assert not fused_decode_codebook.supports(256, 256, 32, 4, 7, value_outliers=False)  # spilled
    # queries, 4 warps' tiles (4 * 33 token slots of 4 rows), value-outlier corrections, the parked
    # value sums (a 1-float stand-in per warp when not parked), codebooks, per-warp maxima / sums
    assert fused_decode_codebook.shared_bytes(128, 128, 4, 3, True) == 4 * (512 + 4 * 132 * 4 + 2048 + 4 + 16 + 32)
    assert fused_decode_codebook.shared_bytes(128, 128, 4, 3, True, parked=True) == 4 * (
        512 + 4 * 132 * 4 + 2048 + 4 * 4 * 8 * 32 + 16 + 32)


def test_value_channels_per_lane_follow_the_accumulator_budget(monkeypatch):
    # rows x channels <= MAX_LANE_ACCUMULATORS (channels 16 down to 4): at 32, 8 channels at the
    # 8B shape's 4 rows (16 lanes per 128-channel token), 4 at 8 rows (32 lanes).
    assert fused_decode_codebook.MAX_LANE_ACCUMULATORS == 32
    split = {rows: fused_decode_codebook.channels_per_lane(rows) for rows in range(1, 9)}
    assert split == {1: 16, 2: 16, 3: 8, 4: 8, 5: 4, 6: 4, 7: 4, 8: 4}
    assert [fused_decode_codebook.lanes_per_token(128, r) for r in (1, 4, 8)] == [8, 16, 32]
    assert fused_decode_codebook.lanes_per_token(256, 8) is None  # 64 lanes: refused
    assert fused_decode_codebook.lanes_per_token(256, 4) == 32
    # The old setting through the constant: 16 channels up to 4 rows, 8 above.
    monkeypatch.setattr(fused_decode_codebook, "MAX_LANE_ACCUMULATORS", 64)
    split = {rows: fused_decode_codebook.channels_per_lane(rows) for rows in range(1, 9)}
    assert split == {1: 16, 2: 16, 3: 16, 4: 16, 5: 8, 6: 8, 7: 8, 8: 8}
    assert fused_decode_codebook.supports(256, 256, 32, 3, 4)


def test_a_new_accumulator_setting_builds_a_kernel_of_its_own(monkeypatch):
    # The kernel factory is keyed on the budget, the parking and the batches: a probe that sets a constant
    # never reuses the kernel object built for the other setting.
    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kwargs: made.append(kwargs) or object())
    fused_decode_codebook._partials_kernel.cache_clear()
    try:
        a = fused_decode_codebook._partials_kernel(32, True, (8, 4))
        assert fused_decode_codebook._partials_kernel(32, True, (8, 4)) is a
        others = [fused_decode_codebook._partials_kernel(64, True, (8, 4)), fused_decode_codebook._partials_kernel(32, False, (8, 4)),
                  fused_decode_codebook._partials_kernel(32, True, (1, 4)), fused_decode_codebook._partials_kernel(32, True, (8, 1))]
        assert all(k is not a for k in others)
        assert made == []  # built on first use, one build per setting
        for k in (a, *others):
            assert k.fused is k.fused
        assert len(made) == 5
    finally:
        fused_decode_codebook._partials_kernel.cache_clear()


def test_value_sums_park_in_shared_memory_where_it_fits(monkeypatch):
    # The 8B shape parks (35 KB of shared memory); 8 rows with value outliers would take 54 KB, head
    # dim 256 at 4 rows with them 53 KB: their sums stay in registers. Off: nowhere.
    assert fused_decode_codebook.parks(128, 128, 4, 3, True)
    assert fused_decode_codebook.shared_bytes(128, 128, 4, 3, True, parked=True) == 35264
    assert fused_decode_codebook.parks(64, 64, 3, 3, True)
    assert fused_decode_codebook.parks(128, 128, 8, 3, False)
    assert not fused_decode_codebook.parks(128, 128, 8, 3, True)
    assert not fused_decode_codebook.parks(256, 256, 4, 3, True)
    monkeypatch.setattr(fused_decode_codebook, "PARK_ACCUMULATORS", False)
    assert not fused_decode_codebook.parks(128, 128, 4, 3, True)


def test_cpu_takes_the_portable_path():
    cache = _kvquant()
    q_heads = _filled(cache, 100)
    if not on_cuda:
        assert cache._fused_decode(q_heads, 0.1) is None


@pytest.mark.parametrize("outliers", [True, False])
def test_decode_step_hands_the_kernel_the_caches_arrays(monkeypatch, outliers):
    # The wiring from the cache to the launch, checked on any device: with the kernels reported
    # active, the launch gets the store's arrays, the window, the exact sink, skip 1, the
    # template constants and the grid; its partials go to fused_decode's merge.
    fields = {} if outliers else {"kvquant_outlier_fraction": 0.0}
    cache = _kvquant(kvquant_bits=3, **fields)
    q_heads = _filled(cache, 700)
    seen = {}

    class Kernel:
        def attend(self, queries, **kwargs):
            seen["launch"], seen["queries"] = kwargs, queries
            return "kernel output"

    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    monkeypatch.setattr(fused_decode_codebook, "_partials_kernel", lambda accumulators, park, batches: Kernel())
    assert cache._fused_decode(q_heads, 0.5) == "kernel output"
    assert seen["queries"] is q_heads
    launch = seen["launch"]
    inputs = launch["inputs"]
    s = cache.store
    assert inputs[0] is q_heads
    for got, name in zip(inputs[1:9], ["key_codes", "key_scale", "key_zero", "key_codebook", "value_codes",
                                       "value_scale", "value_zero", "value_codebook"]):
        assert got is s[name], name
    if outliers:
        for got, name in zip(inputs[9:13], ["key_outlier_position", "key_outlier_value",
                                            "value_outlier_position", "value_outlier_value"]):
            assert got is s[name], name
    else:
        assert [a.size for a in inputs[9:13]] == [1, 1, 1, 1]  # stand-ins the kernel does not read
    # the window as it is, the sink as inputs of their own (no concatenation per step)
    assert mx.array_equal(inputs[13], cache.window_keys).item() and mx.array_equal(inputs[14], cache.window_values).item()
    assert inputs[15] is s["sink_keys"] and inputs[16] is s["sink_values"] and s["sink_keys"].shape[2] == 1
    n_valid = cache.n_compressed
    assert n_valid == 672
    per_block = fused_decode.tokens_per_block(n_valid, 2)
    n_hist = -(-n_valid // per_block)
    assert inputs[17].tolist()[:3] == [n_valid, per_block, n_hist] and inputs[17].tolist()[4] == 1  # skip 1
    template = dict(launch["template"])
    n_out = 41 if outliers else 0  # round(0.01 * 32 * 128)
    assert template == {"D": 128, "DV": 128, "R": 4, "G": 32, "BITS": 3, "LPT": 16, "NOK": n_out,
                        "NOV": n_out, "PARK": True, "UB": 8, "OB": 8, "KSL": 0, "QT": mx.float32, "ST": mx.float32,
                        "WB": 0}
    assert (launch["n_blocks"], launch["heads"], launch["value_dim"]) == (n_hist + 1, 2, 128)
    # Off, or a shape the kernel refuses: the portable path (supports() is asked when a launch
    # plan is made: a new cache's first step, or after a store write).
    monkeypatch.setattr(fused_decode_codebook, "supports", lambda *a, **k: False)
    cache.__dict__.pop("_fused_plan")
    assert cache._fused_decode(q_heads, 0.5) is None
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: False)
    assert cache._fused_decode(q_heads, 0.5) is None


def test_the_plan_key_the_kernel_and_the_template_take_one_reading_of_the_batches(monkeypatch):
    # decode_step reads UNALIGNED_VALUE_BATCH / OUTLIER_BATCH / KEY_SLOTS_BY_ROW once and hands
    # them to the launch: the kernel object asked for and the template's UB / OB / KSL are that
    # reading.
    cache = _kvquant(kvquant_bits=3)
    q_heads = _filled(cache, 700)
    asked, seen = [], {}

    class Kernel:
        def attend(self, queries, **kwargs):
            seen.update(kwargs)
            return "kernel output"

    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    monkeypatch.setattr(fused_decode_codebook, "_partials_kernel", lambda a, p, batches: asked.append(batches) or Kernel())
    launch, handed = fused_decode_codebook.codebook_launch, []
    monkeypatch.setattr(fused_decode_codebook, "codebook_launch",
                        lambda *a, **k: handed.append(k["batches"]) or launch(*a, **k))
    monkeypatch.setattr(fused_decode_codebook, "UNALIGNED_VALUE_BATCH", 2)
    monkeypatch.setattr(fused_decode_codebook, "OUTLIER_BATCH", 8)
    monkeypatch.setattr(fused_decode_codebook, "KEY_SLOTS_BY_ROW", True)
    assert cache._fused_decode(q_heads, 0.5) == "kernel output"
    template = dict(seen["template"])
    assert handed == [(2, 8, True)] and (template["UB"], template["OB"], template["KSL"]) == (2, 8, 1)
    assert set(asked) == {(2, 8, True)}
    # The launch takes the batches handed to it over the module's constants.
    kernel, _, shape = launch(q_heads, 0.5, cache.store, cache.window_keys, cache.window_values, None,
                              n_valid=cache.n_compressed, group_size=32, bits=3, n_kv_heads=2,
                              meta_cache=fused_decode.FusedDecodeMeta(), batches=(1, 1, False))
    template = dict(shape["template"])
    assert (template["UB"], template["OB"], template["KSL"]) == (1, 1, 0) and asked[-1] == (1, 1, False)


def test_launch_refuses_a_sink_beyond_the_first_tile_and_partial_blocks():
    cache = _kvquant()
    q_heads = _filled(cache, 700)
    call = lambda n_valid, sink: fused_decode_codebook.codebook_partials(
        q_heads, 0.1, cache.store, cache.window_keys, cache.window_values, sink, n_valid=n_valid,
        group_size=32, bits=3, n_kv_heads=2, meta_cache=fused_decode.FusedDecodeMeta())
    long_sink = (mx.zeros((1, 2, 128, 128)), mx.zeros((1, 2, 128, 128)))
    with pytest.raises(QuantizerConfigError, match="codebook fused decode: skip=128 leading tokens of 672; allowed is 0 <= skip < min"):
        call(672, long_sink)
    sink = (cache.store["sink_keys"], cache.store["sink_values"])
    with pytest.raises(QuantizerConfigError, match="660 history tokens is invalid: allowed is a multiple of the group size 32"):
        call(660, sink)


# Each case JIT-compiles its own kernel (~10 s on the H200): a list, not a product.
KERNEL_CASES = [
    # the default config on the 8B shape's heads (GQA 4, head dim 128, bf16), a few thousand tokens
    ("kvquant-3 default bf16 hd128 gqa4", {}, mx.bfloat16, 128, 1, 4, 3000),
    ("kvquant-2 fp16 hd128 batch2 mha", {"kvquant_bits": 2}, mx.float16, 128, 2, 1, 1500),
    ("kvquant-4 fp32 hd64 gqa8 no outliers", {"kvquant_bits": 4, "kvquant_outlier_fraction": 0.0},
     mx.float32, 64, 1, 8, 1500),
    ("kvquant-3 g64 bf16 hd128 gqa4", {"kvquant_group_size": 64}, mx.bfloat16, 128, 1, 4, 1500),
]


@cuda_only
@pytest.mark.parametrize("name, fields, dtype, D, B, rep, n", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_step_matches_the_portable_step(monkeypatch, name, fields, dtype, D, B, rep, n):
    cache = _kvquant(**fields)
    q_heads = _filled(cache, n, B=B, rep=rep, D=D, dtype=dtype)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    # float32 queries: the portable path in 16 bits rounds its scores and sums, the kernel
    # computes in float32 and rounds the output once.
    portable = cache.attention(q_heads.astype(mx.float32), scale=D**-0.5)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    # decode_step launches through fused_decode.planned_attend (since 3cc9584), which returns
    # None where the kernel refuses the shape: the step's one launch must return an output.
    ran = []
    planned = fused_decode.planned_attend
    monkeypatch.setattr(fused_decode, "planned_attend",
                        lambda *a, **k: ran.append(planned(*a, **k)) or ran[-1])
    fused = cache.attention(q_heads, scale=D**-0.5)
    assert len(ran) == 1 and ran[0] is not None, "the kernel did not run"
    assert fused.dtype == dtype and fused.shape == q_heads.shape
    fused = fused.astype(mx.float32)
    diff = mx.abs(fused - portable).max().item()
    print(f"{name}: {cache.n_compressed} history tokens, max |kernel - portable| = {diff:.3g}")
    # On a GPU float32 matmuls of the portable path may run in TF32: 2e-3 for float32 too.
    tol = {mx.float32: 2e-3, mx.float16: 4e-3, mx.bfloat16: 2e-2}[dtype]
    assert mx.allclose(fused, portable, atol=tol, rtol=tol).item(), diff


@cuda_only
def test_kernel_with_many_tiles_per_warp_matches_the_portable_step(monkeypatch):
    # Few target warps: each warp walks many 128-token tiles; same template as the default case.
    monkeypatch.setattr(fused_decode, "TARGET_WARPS", 1)
    cache = _kvquant()
    q_heads = _filled(cache, 5000, dtype=mx.bfloat16)
    assert fused_decode.tokens_per_block(cache.n_compressed, 2) == 128 * 4 * 64
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    portable = cache.attention(q_heads.astype(mx.float32), scale=128**-0.5)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    fused = cache.attention(q_heads, scale=128**-0.5).astype(mx.float32)
    assert mx.allclose(fused, portable, atol=2e-2, rtol=2e-2).item(), mx.abs(fused - portable).max().item()


# The kernel compiled by nvcc for sm_90 (spills, CUDA's front end): tests/cache/test_kernels_nvcc.py
# (kvquant among every method, from its real decode step, SmolLM2's heads included).
