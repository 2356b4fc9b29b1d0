"""turboquant_rvq's fused decode kernel: its algorithm on the CPU, its wiring, and (on CUDA) the
kernel itself against the portable path.

On the CPU the kernel cannot run: tests/cache/rotated_decode_reference.py performs its arithmetic
(codes read as the kernel reads them, scores in its per-group form, blocks of tokens, the exact
block in the original basis rotated at the end, the merge, one unrotation) on the arrays the
kernel is handed, and these tests check it against the portable attention over bits, dtypes,
GQA, head dims, the sink and window lengths. The CUDA tests run where MLX's CUDA backend is the
default device (the H200 through the device tool): a decode step with the kernel against the
same step with VELOXQUANT_CUDA_KERNELS=0.
"""

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation, rotated_decode_reference as ref
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import fused_decode, fused_decode_rotated as fdr
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache
from tests.cache.cuda_marks import cuda_test as cuda_only

on_cuda = fused_decode._on_cuda()


def _cache(bits=4, sink=True, key_bits=None, value_bits=None, **attrs):
    fields = {"bit_width_inlier": bits}
    if key_bits:
        fields["key_bits"] = key_bits
    if value_bits:
        fields["value_bits"] = value_bits
    cache = TurboQuantRVQCache(KVCacheConfig(method="turboquant_rvq", **fields))
    if not sink:
        cache.exact_sink_tokens = 0
    for name, value in attrs.items():
        setattr(cache, name, value)  # e.g. a shorter exact window for window-length sweeps
    return cache


def _keys_values(n, B, H, D, dtype, seed):
    """Keys with outlier channels and an offset (as real keys have), Gaussian values."""
    mx.random.seed(seed)
    k = mx.random.normal((B, H, n, D))
    k = k * mx.where(mx.arange(D) % 16 == 3, 6.0, 1.0) + mx.where(mx.arange(D) < 4, 2.0, 0.0)
    return k.astype(dtype), mx.random.normal((B, H, n, D)).astype(dtype)


def _filled(cache, n, *, B=1, H=2, rep=4, D=64, dtype=mx.float32, seed=0):
    k, v = _keys_values(n, B, H, D, dtype, seed)
    cache.update_and_fetch(k, v)
    mx.eval(cache.attention(mx.random.normal((B, rep * H, n, D)).astype(dtype), scale=D**-0.5, mask="causal"))
    return cache


def _step(cache, *, B=1, H=2, rep=4, D=64, dtype=mx.float32, seed=1):
    k, v = _keys_values(1, B, H, D, dtype, seed)
    cache.update_and_fetch(k, v)
    mx.random.seed(seed + 1000)
    return (2 * mx.random.normal((B, rep * H, 1, D))).astype(dtype)


def _tol(dtype):
    return {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 3e-2}[dtype]


# (name, bits / key_bits / value_bits, sink, dtype, D, B, rep)
ALGORITHM_CASES = [
    ("4-bit fp32 hd64 gqa4 sink", dict(bits=4), True, mx.float32, 64, 1, 4),
    ("4-bit bf16 hd128 gqa4 sink", dict(bits=4), True, mx.bfloat16, 128, 1, 4),
    ("4-bit fp16 hd128 mha no-sink batch2", dict(bits=4), False, mx.float16, 128, 2, 1),
    ("2-bit fp32 hd128 gqa4 sink", dict(bits=2), True, mx.float32, 128, 1, 4),
    ("2-bit bf16 hd64 mha no-sink", dict(bits=2), False, mx.bfloat16, 64, 1, 1),
    ("1-bit fp32 hd64 gqa4 sink", dict(bits=1), True, mx.float32, 64, 1, 4),
    ("1-bit fp16 hd128 gqa8 no-sink", dict(bits=1), False, mx.float16, 128, 1, 8),
    ("3-bit fp32 hd64 gqa4 sink", dict(bits=3), True, mx.float32, 64, 1, 4),
    ("keys 4 values 2 fp32 hd128 gqa4", dict(key_bits=4, value_bits=2), True, mx.float32, 128, 1, 4),
    ("keys 1 values 4 fp32 hd64 gqa2", dict(key_bits=1, value_bits=4), True, mx.float32, 64, 1, 2),
    # more than 4 rows: value lanes of 8 channels (3-bit codes crossing words at 24 bits a lane)
    ("4-bit bf16 hd128 gqa8 sink", dict(bits=4), True, mx.bfloat16, 128, 1, 8),
    ("3-bit fp32 hd64 gqa6 sink", dict(bits=3), True, mx.float32, 64, 1, 6),
]


@pytest.mark.parametrize("name, bits, sink, dtype, D, B, rep", ALGORITHM_CASES, ids=[c[0] for c in ALGORITHM_CASES])
def test_the_kernels_algorithm_is_the_portable_attention(name, bits, sink, dtype, D, B, rep):
    shape = dict(B=B, rep=rep, D=D, dtype=dtype)
    cache = _filled(_cache(sink=sink, **bits), 300, **shape)
    q_heads = _step(cache, **shape)
    assert cache.n_compressed == 192 and cache.capacity > cache.n_compressed  # slack columns
    assert (cache.sink_deltas is not None) == sink
    expected = np.array(cache.attention(q_heads, scale=D**-0.5).astype(mx.float32))
    per_block = fdr.tokens_per_block(cache.n_compressed, B * 2)
    for split in (per_block, 64, 50):  # 50 leaves ragged blocks
        got = ref.reference_step(cache, q_heads, D**-0.5, split)
        err = np.abs(got - expected).max()
        assert err < _tol(dtype) * max(1.0, np.abs(expected).max()), (name, split, err)


def test_every_window_length_and_the_first_blocks():
    # A short exact window (no recent tokens kept, blocks of 32): decode steps see windows of
    # every length 1..32 and histories of 1, 2, 3 blocks (the first one holding the sink).
    cache = _filled(_cache(bits=4, exact_window=0, encode_block=32), 33, D=64)
    seen, histories = set(), set()
    for step in range(70):
        q_heads = _step(cache, D=64, seed=10 + step)
        if cache.window_keys is None or not cache.n_compressed:
            mx.eval(cache.attention(q_heads, scale=0.125))
            continue
        seen.add(cache.window_keys.shape[2])
        histories.add(cache.n_compressed)
        got = ref.reference_step(cache, q_heads, 0.125, 32)  # before attention flushes
        expected = np.array(cache.attention(q_heads, scale=0.125).astype(mx.float32))
        assert np.abs(got - expected).max() < 1e-4, step
    assert seen == set(range(1, 33)) and histories == {32, 64, 96}


def test_value_lanes_follow_the_value_sum_budget(monkeypatch):
    # The shipped budget (32 sums): 16 channels up to 2 rows, 8 from 3 on (the 8B shape's 4
    # rows among them); the session-4 budget (64): 16 up to 4 rows.
    assert fdr.MAX_VALUE_SUMS == 32
    assert [fdr.channels_per_lane(r) for r in range(1, 9)] == [16] * 2 + [8] * 6
    monkeypatch.setattr(fdr, "MAX_VALUE_SUMS", 64)
    assert [fdr.channels_per_lane(r) for r in range(1, 9)] == [16] * 4 + [8] * 4


def test_codes_are_read_as_the_encoder_wrote_them():
    # The kernel's bit reads (key chunks, value lanes of 16 and 8 channels with the funnel shift
    # or a plain shift, sign words) against MLX's own dequantize of the same words: 2- and 3-bit
    # codes (3-bit lanes cross words: 48 bits at 16 channels, 24 at 8).
    mx.random.seed(3)
    for bits in (2, 3):
        for dim in (64, 128):
            x = mx.random.normal((5, dim))
            words, _, _ = mx.quantize(x, group_size=64 if dim >= 64 else dim, bits=bits)
            truth = np.array(mx.dequantize(words, mx.ones((5, dim // 64)), mx.zeros((5, dim // 64)),
                                           group_size=64, bits=bits))
            assert np.array_equal(ref.key_codes(np.array(words), bits, dim), truth), (bits, dim)
            for channels in (16, 8):
                got = ref.value_codes(np.array(words), bits, dim, channels)
                assert np.array_equal(got, truth), (bits, dim, channels)
    from veloxquant_mlx.cache.packing import pack_codes
    signs = mx.random.uniform(shape=(3, 128)) > 0.5
    assert np.array_equal(ref.sign_bits(np.array(pack_codes(signs, 1)), 128), np.array(signs, dtype=np.float64))


# (bits / key_bits / value_bits, sink, D, rep, batch, history tokens, TARGET_WARPS or None)
EMULATION_CASES = [
    (dict(bits=4), True, 128, 4, 1, 300, None),  # the default: 3-bit codes straddle words
    (dict(bits=2), True, 64, 4, 1, 300, None),  # two sign planes
    (dict(bits=1), False, 64, 1, 2, 300, None),  # sign plane only, MHA, batch 2
    (dict(key_bits=4, value_bits=2), True, 128, 8, 1, 300, None),  # 8-channel lanes, 8 bits each
    (dict(bits=4), True, 128, 8, 1, 300, None),  # 8-channel lanes of 3-bit codes crossing words
    (dict(bits=3), True, 64, 5, 1, 300, None),  # 8-channel lanes of 2-bit codes, 5 rows
    (dict(bits=4), True, 256, 5, 1, 300, None),  # 32 lanes per value token (one token a round)
    (dict(key_bits=1, value_bits=4), True, 64, 2, 1, 300, None),
    (dict(bits=3), True, 128, 4, 1, 700, 1),  # many tiles per warp in one block
]


def _emulation_config(case):
    bits, sink, D, rep, B, n, warps = case
    cache = _cache(**bits)
    return (D, D, rep, cache.key_bits - 1, cache.value_bits - 1, 64, 64)


@pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier for the kernel's CPU emulation")
@pytest.mark.parametrize("case", EMULATION_CASES, ids=lambda c: f"{c[0]}-sink{c[1]}-d{c[2]}-r{c[3]}-b{c[4]}-n{c[5]}")
def test_the_kernel_source_run_by_a_thread_emulation_is_the_portable_attention(monkeypatch, case):
    # The CUDA source itself, compiled by g++ with one std::thread per CUDA thread
    # (tests/cache/cuda_emulation.py), on the arrays decode_step hands it; fused_decode's merge
    # in numpy. float32 inputs.
    bits, sink, D, rep, B, n, warps = case
    if warps:
        monkeypatch.setattr(fdr, "TARGET_WARPS", warps)
    lib = cuda_emulation.compiled(tuple(_emulation_config(c) for c in EMULATION_CASES))
    shape = dict(B=B, rep=rep, D=D, dtype=mx.float32)
    cache = _filled(_cache(sink=sink, **bits), n, **shape)
    q_heads = _step(cache, **shape)
    stores = fdr.store_arrays(cache)
    sink_kv = fdr.exact_sink(cache)
    n_sink = 0 if sink_kv is None else sink_kv[0].shape[2]
    BH = B * cache.n_kv_heads
    per_block = fdr.tokens_per_block(cache.n_compressed - n_sink, BH)
    n_hist = -(-(cache.n_compressed - n_sink) // per_block)
    meta = np.array(fused_decode.FusedDecodeMeta().get(cache.n_compressed, per_block, n_hist, D**-0.5, n_sink))
    arrays = [np.array(a.astype(mx.float32)) if a.dtype != mx.uint32 else np.array(a)
              for a in (q_heads, *cache._signs, cache.key_mean, *stores, cache.window_keys, cache.window_values,
                        *(sink_kv or (mx.zeros((1,)), mx.zeros((1,)))))]
    parts = cuda_emulation.run_partials(
        lib, _emulation_config(case), arrays, meta, cache.window_keys.shape, stores[3].shape,
        n_hist + 1, BH, rep, D,
    )
    got = cuda_emulation.merge(*parts).reshape(q_heads.shape)
    expected = np.array(cache.attention(q_heads, scale=D**-0.5))  # flushes nothing: window < 128
    assert n_hist >= (2 if not warps else 1)
    assert np.abs(got - expected).max() < 2e-5, np.abs(got - expected).max()


# The cache's own decode path (fdr.decode_step's launch, template and header included) with the
# emulated kernel, at the shipped value-sum budget and at session 4's through the constant:
# (MAX_VALUE_SUMS, dtype, query rows, head_dim, value channels per lane). The 8B shape (bf16, 4
# rows, d 128, 4 bits: 3-bit stage-1 codes, a lane's 24 bits cross at most one word) takes 8
# channels at 32 sums, 16 (48 bits, the funnel shift over three words) at 64; SmolLM2's 3 rows
# of d 64 the same.
BUDGET_CASES = [
    (32, mx.bfloat16, 4, 128, 8),
    (64, mx.bfloat16, 4, 128, 16),
    (32, mx.float16, 3, 64, 8),
    (64, mx.float32, 3, 64, 16),
]


@pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier for the kernel's CPU emulation")
@pytest.mark.parametrize("budget, dtype, rep, D, channels", BUDGET_CASES,
                         ids=[f"sums{c[0]}-{str(c[1]).split('.')[-1]}-r{c[2]}-d{c[3]}" for c in BUDGET_CASES])
def test_the_emulated_decode_step_at_each_value_sum_budget(monkeypatch, budget, dtype, rep, D, channels):
    monkeypatch.setattr(fdr, "MAX_VALUE_SUMS", budget)
    assert fdr.channels_per_lane(rep) == channels
    shape = dict(B=1, rep=rep, D=D, dtype=dtype)
    cache = _filled(_cache(bits=4), 300, **shape)
    q_heads = _step(cache, **shape)
    # The portable step in float32 (the kernel computes in float32 from bf16/fp16 inputs); the
    # window stays under residual + block tokens, so neither call flushes.
    expected = np.array(cache.attention(q_heads.astype(mx.float32), scale=D**-0.5))
    got, made = cuda_emulation.emulated_decode_step(cache, q_heads, D**-0.5)
    partials = [k for k in made if k.name == "vq_rotated_decode_partials_merged" and k.calls]
    assert len(partials) == 1 and f"VQ_MAX_VALUE_SUMS = {budget};" in partials[0].header
    assert got.dtype == dtype and got.shape == q_heads.shape
    tol = {mx.float32: 2e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]  # the output's rounding
    got = np.array(got.astype(mx.float32))
    assert np.allclose(got, expected, atol=tol, rtol=tol), np.abs(got - expected).max()


def test_each_budget_builds_and_launches_its_own_kernel(monkeypatch):
    # The factory is keyed on the budget and the launch passes it as a template argument: MLX's
    # CUDA backend keys its compiled modules on the name and the template only, so a probe that
    # sets MAX_VALUE_SUMS between two calls in one process gets the other lane split.
    cache = _filled(_cache(bits=4), 300, D=128, dtype=mx.bfloat16)
    q_heads = _step(cache, D=128, dtype=mx.bfloat16)
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        for budget in (32, 64, 32):
            monkeypatch.setattr(fdr, "MAX_VALUE_SUMS", budget)
            cache.attention(q_heads, scale=128**-0.5)
    launches = [(k, dict(sig.template)) for k, sig in captured if k.name == "vq_rotated_decode_partials_merged"]
    assert [t["VQ_MAX_VALUE_SUMS"] for _, t in launches] == [32, 64, 32]
    assert launches[0][0] is launches[2][0] and launches[0][0] is not launches[1][0]
    assert "VQ_MAX_VALUE_SUMS = 64;" in launches[1][0].header
    assert fdr._HEADER == fdr._header(32)  # the emulation's older interface: the shipped budget


def test_the_8b_shape_launches_a_bounded_kernel_and_other_shapes_an_unbounded_one(monkeypatch):
    # Launch bounds (fused_decode.launch_bounds_header) only at the shape measured with them
    # (bf16 / fp16, 4 rows, d 128); a probe setting MIN_BLOCKS_PER_SM = 0 gets the unbounded
    # kernel, another kernel object under another name (the header is in the name's digest).
    def launched(D, rep, dtype):
        cache = _filled(_cache(bits=4), 300, D=D, rep=rep, dtype=dtype)
        q_heads = _step(cache, D=D, rep=rep, dtype=dtype)
        with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
            cache.attention(q_heads, scale=D**-0.5)
        (kernel,) = {k for k, _ in captured if k.name == "vq_rotated_decode_partials_merged"}
        return kernel

    bounds = "__launch_bounds__(128, 5)"
    assert fdr.MIN_BLOCKS_PER_SM == 5
    bounded = launched(128, 4, mx.bfloat16)
    assert bounds in bounded.header and "defined(__CUDACC_RTC__)" in bounded.header
    assert bounds in launched(128, 4, mx.float16).header
    for D, rep, dtype in ((128, 8, mx.float16), (128, 1, mx.float32), (64, 3, mx.bfloat16), (128, 4, mx.float32)):
        assert "__launch_bounds__" not in launched(D, rep, dtype).header, (D, rep, dtype)
    monkeypatch.setattr(fdr, "MIN_BLOCKS_PER_SM", 0)
    unbounded = launched(128, 4, mx.bfloat16)
    assert "__launch_bounds__" not in unbounded.header and unbounded is not bounded
    assert fdr.launch_bounds(4, 128, mx.bfloat16) == 0


def test_supported_shapes():
    assert fdr.supports(128, 128, 3, 3, rows=4)  # the default: 4 bits, Llama GQA 32/8
    assert fdr.supports(64, 64, 0, 1, rows=1)
    assert fdr.supports(128, 128, 2, 3, rows=8)
    assert fdr.supports(256, 256, 3, 3, rows=4)
    assert fdr.supports(256, 256, 3, 3, rows=7)  # 8-channel lanes: 32 lanes per value token
    assert not fdr.supports(256, 256, 3, 3, rows=8)  # shared memory
    assert not fdr.supports(128, 128, 3, 3, rows=9)  # the lanes' accumulators
    assert not fdr.supports(96, 96, 3, 3, rows=4)  # not a power of two
    assert not fdr.supports(16, 16, 3, 3, rows=4)
    assert not fdr.supports(128, 128, 4, 3, rows=4)  # turboquant_rvq's stage 1 is at most 3 bits


def test_blocks_fill_the_gpu_within_bounds():
    # TARGET_WARPS 2048 over 8 heads: 64 blocks of 4 warps per head, at least one 32-token
    # tile per warp (128 tokens a block).
    assert fdr.TARGET_WARPS == 2048
    assert fdr.tokens_per_block(4096, 8) == 128
    assert fdr.tokens_per_block(32768, 8) == 512
    assert fdr.tokens_per_block(131072, 8) == 2048
    assert fdr.tokens_per_block(10**9, 8) == 32 * 4 * fdr.MAX_TILES_PER_WARP


def test_exact_sink_is_token_zero_and_is_kept_until_the_deltas_change():
    cache = _filled(_cache(bits=4), 300, D=64)
    k, v = _keys_values(300, 1, 2, 64, mx.float32, 0)
    sk, sv = fdr.exact_sink(cache)
    assert np.abs(np.array(sk) - np.array(k[:, :, :1])).max() < 1e-5
    assert np.abs(np.array(sv) - np.array(v[:, :, :1])).max() < 1e-5
    assert fdr.exact_sink(cache)[0] is sk  # derived once
    cache.sink_deltas = tuple(d + 0 for d in cache.sink_deltas)
    assert fdr.exact_sink(cache)[0] is not sk
    assert fdr.exact_sink(_filled(_cache(bits=4, sink=False), 300, D=64)) is None


@pytest.mark.parametrize("bits, sink", [(4, True), (2, False), (1, True)])
def test_decode_step_hands_the_kernel_the_caches_arrays(monkeypatch, bits, sink):
    # The wiring from the cache to the kernel entry, checked on any device.
    cache = _filled(_cache(bits=bits, sink=sink), 300, D=128)
    q_heads = _step(cache, D=128)
    seen = {}

    class Kernel:
        def attend(self, queries, **kwargs):
            return "kernel output"

    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    monkeypatch.setattr(fdr, "_partials_kernel", lambda budget, bounds: Kernel())
    monkeypatch.setattr(fdr, "rotated_launch",
                        lambda *a, **k: seen.update(args=a, kwargs=k) or ([None] * 20, {}, fdr.WINDOW_INPUTS))
    assert cache.attention(q_heads, scale=0.5) == "kernel output"  # through base.attention
    args, kwargs = seen["args"], seen["kwargs"]
    assert args[0] is q_heads and args[1] == 0.5
    assert args[2] is cache._signs[0] and args[3] is cache._signs[1] and args[4] is cache.key_mean
    s = cache.store
    b1 = bits - 1
    names = {0: [None, None, None], 1: ["codes1", "scale1", None], 3: ["codes1", "scales1", "zeros1"]}[b1]
    for p, got in (("k", args[5][:5]), ("v", args[5][5:])):
        for name, arr in zip(names + ["codes2", "scale2"], got):
            if name is None:
                assert arr.size == 1  # a dummy the kernel never reads
            else:
                assert arr is s[f"{p}_{name}"], (p, name)
    assert args[6] is cache.window_keys and args[7] is cache.window_values  # unrotated
    assert (args[8] is None) == (not sink)
    if sink:
        assert args[8] is fdr.exact_sink(cache)
    assert kwargs["n_valid"] == cache.n_compressed and kwargs["n_kv_heads"] == 2
    assert kwargs["key_stage1_bits"] == kwargs["value_stage1_bits"] == b1
    assert kwargs["key_group"] == kwargs["value_group"] == 64
    assert kwargs["meta_cache"] is cache._rotated_meta
    # A shape the kernel does not take (9 query rows per kv head) and the switch: portable.
    assert fdr.decode_step(cache, mx.zeros((1, 18, 1, 128)), 0.5) is None
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: False)
    assert cache._fused_decode(q_heads, 0.5) is None


def test_meta_is_rebuilt_only_when_its_values_change():
    meta = fused_decode.FusedDecodeMeta()
    first = meta.get(640, 128, 5, 0.125, 1)
    assert meta.get(640, 128, 5, 0.125, 1) is first
    assert meta.get(704, 128, 6, 0.125, 1).tolist() == [704, 128, 6, 1040187392, 1]


# Each combination JIT-compiles its own kernel (a few seconds each on the H200): a list.
KERNEL_CASES = [
    ("4-bit bf16 hd128 gqa4 sink", dict(bits=4), True, mx.bfloat16, 128, 1, 4, 1000),
    ("4-bit fp16 hd64 mha no-sink batch2", dict(bits=4), False, mx.float16, 64, 2, 1, 700),
    ("2-bit fp32 hd128 gqa8 sink", dict(bits=2), True, mx.float32, 128, 1, 8, 700),
    ("4-bit bf16 hd128 gqa8 sink", dict(bits=4), True, mx.bfloat16, 128, 1, 8, 3000),  # 70B-class GQA
    ("1-bit bf16 hd64 gqa4 sink", dict(bits=1), True, mx.bfloat16, 64, 1, 4, 700),
    ("keys 4 values 3 fp32 hd128 gqa4", dict(key_bits=4, value_bits=3), True, mx.float32, 128, 1, 4, 5000),
]


@cuda_only
@pytest.mark.parametrize("name, bits, sink, dtype, D, B, rep, n", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_step_matches_the_portable_step(monkeypatch, name, bits, sink, dtype, D, B, rep, n):
    shape = dict(B=B, rep=rep, D=D, dtype=dtype)
    cache = _filled(_cache(sink=sink, **bits), n, **shape)
    for step in range(3):  # windows of different lengths
        q_heads = _step(cache, seed=20 + step, **shape)
        monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
        # The portable step with a float32 query computes in float32 throughout (the kernel
        # does too, from bf16/fp16 inputs); the window stays under residual + block tokens, so
        # neither call flushes.
        portable = cache.attention(q_heads.astype(mx.float32), scale=D**-0.5)
        monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
        calls = []
        planned = fused_decode.planned_attend
        monkeypatch.setattr(fused_decode, "planned_attend", lambda *a, **k: calls.append(1) or planned(*a, **k))
        fused = cache.attention(q_heads, scale=D**-0.5)
        monkeypatch.setattr(fused_decode, "planned_attend", planned)
        assert calls == [1], "the kernel did not run"
        assert fused.dtype == dtype and fused.shape == q_heads.shape
        fused = fused.astype(mx.float32)
        err = mx.abs(fused - portable)
        tol = {mx.bfloat16: 1.5e-2, mx.float16: 3e-3, mx.float32: 1e-4}[dtype]  # output rounding
        worst = int(mx.argmax(err.reshape(-1)).item())
        assert mx.allclose(fused, portable, atol=tol, rtol=tol).item(), (
            f"{name} step {step}: max |diff| {err.max().item():.4g} at flat index {worst} "
            f"(fused {fused.reshape(-1)[worst].item():.5g}, portable {portable.reshape(-1)[worst].item():.5g}), "
            f"window {cache.window_keys.shape[2]}, history {cache.n_compressed}"
        )


@cuda_only
def test_kernel_with_many_tiles_per_warp_matches_the_portable_step(monkeypatch):
    # Few target warps: every warp walks many 32-token tiles (online softmax across tiles).
    monkeypatch.setattr(fdr, "TARGET_WARPS", 1)
    shape = dict(B=1, rep=4, D=128, dtype=mx.bfloat16)
    cache = _filled(_cache(bits=4), 3000, **shape)
    q_heads = _step(cache, **shape)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    portable = cache.attention(q_heads.astype(mx.float32), scale=128**-0.5)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    fused = cache.attention(q_heads, scale=128**-0.5).astype(mx.float32)
    assert mx.allclose(fused, portable, atol=1.5e-2, rtol=1.5e-2).item(), mx.abs(fused - portable).max().item()
