"""GEAR's fused decode step: the shapes it takes, its wiring from a GEARCache to the kernels (any
device), and on CUDA the kernels against the portable path.

The kernels' source is checked on the CPU under the CUDA emulation
(test_fused_decode_gear_emulated.py). The CUDA tests run where MLX's CUDA backend is the default
device (the H200 through the device tool): a whole decode step with the kernels against the same
step with VELOXQUANT_CUDA_KERNELS=0, for a few shapes (each compiles its own kernel, ~10 s).
"""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import fused_decode, fused_decode_gear
from veloxquant_mlx.cache.gear import GEARCache
from tests.cache.cuda_marks import cuda_test as cuda_only
from tests.cache.gear_clash_data import clashing_cache

on_cuda = fused_decode._on_cuda()


def _gear(**fields):
    return lambda: GEARCache(KVCacheConfig(method="gear", **fields))


def _filled(cache, n, *, B=1, H=2, rep=4, D=128, dtype=mx.float32, seed=0):
    """A cache after a prefill of n tokens and one decode token; returns the step's queries."""
    mx.random.seed(seed)
    k = mx.random.normal((B, H, n, D)) + 0.5
    cache.update_and_fetch(k.astype(dtype), mx.random.normal((B, H, n, D)).astype(dtype))
    mx.eval(cache.attention(mx.random.normal((B, rep * H, 1, D)).astype(dtype), scale=D**-0.5))
    cache.update_and_fetch(mx.random.normal((B, H, 1, D)).astype(dtype), mx.random.normal((B, H, 1, D)).astype(dtype))
    return mx.random.normal((B, rep * H, 1, D)).astype(dtype)


def test_supported_shapes():
    # the default on the 8B shape: head_dim 128, 2 bits, group 32, rank 4, 1% outliers, 4 rows
    assert fused_decode_gear.supports(128, 128, 32, 2, 4, 256, 4, True)
    assert fused_decode_gear.supports(128, 128, 32, 4, 4, 256, 1, True)  # MHA, 4 bits
    assert fused_decode_gear.supports(128, 128, 32, 8, 0, 256, 8, False)  # rank 0, no outliers
    assert fused_decode_gear.supports(64, 64, 64, 2, 8, 256, 4, True)  # 4 rows x rank 8 = 32
    assert not fused_decode_gear.supports(128, 128, 32, 3, 4, 256, 4, True)  # 3-bit codes straddle words
    assert not fused_decode_gear.supports(128, 128, 32, 2, 8, 256, 8, True)  # 8 rows x rank 8 > 32
    assert not fused_decode_gear.supports(128, 128, 32, 2, 9, 256, 2, True)  # rank over 8
    assert not fused_decode_gear.supports(128, 128, 32, 2, 0, 256, 9, False)  # rows over 8
    assert not fused_decode_gear.supports(128, 128, 32, 2, 4, 64, 4, True)  # a tile would straddle blocks
    # 8 rows at head_dim 256: fused_decode's 41 KB plus 32 KB of sparse value sums
    assert fused_decode.supports(256, 256, 32, 2, 2, rows=8)
    assert not fused_decode_gear.supports(256, 256, 32, 2, 4, 256, 8, True)
    assert fused_decode_gear.supports(256, 256, 32, 2, 4, 256, 8, False)
    # 132 = fused_decode.TILE_SLOTS: the tile's probability slots per warp (tile_slot)
    assert fused_decode_gear.shared_bytes(128, 128, 4, True) == 4 * (4 * (128 + 4 * 132 + 8) + 4 * 4 * 128) + 16  # + MMA's word per warp (off)


class _Kernel:
    def attend(self, queries, **kwargs):
        return "kernel output"


def _spy(monkeypatch):
    seen = {}
    kernel = _Kernel()
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    monkeypatch.setattr(fused_decode_gear, "_partials_kernel", lambda: kernel)
    monkeypatch.setattr(fused_decode, "affine_launch",
                        lambda *a, **k: seen.update(args=a, kwargs=k) or (kernel, [None] * 20, {}))
    return seen


@pytest.mark.parametrize("name, make", [
    ("default", _gear()),
    ("rank 0 no outliers", _gear(gear_rank=0, gear_outlier_fraction=0.0)),
])
def test_decode_step_hands_the_kernels_the_caches_arrays(monkeypatch, name, make):
    cache = make()
    q_heads = _filled(cache, 700)
    assert cache.n_compressed == 512 and cache.capacity == 512 and cache.window_keys.shape[2] == 189
    seen = _spy(monkeypatch)
    assert cache.attention(q_heads, scale=0.5) == "kernel output"  # GEARCache.attention -> the kernels
    args, kwargs = seen["args"], seen["kwargs"]
    assert args[0] is q_heads and args[1] == 0.5
    s = cache.store
    assert mx.array_equal(args[2], s["k_codes"].reshape(1, 2, 128, 512 * 2 // 32)).item()
    assert args[3] is s["k_scales"] and args[4] is s["k_zeros"]
    assert args[5] is s["v_codes"] and args[6] is s["v_scales"] and args[7] is s["v_zeros"]
    assert args[8] is cache.window_keys and args[9] is cache.window_values
    assert kwargs["n_valid"] == 512 and kwargs["n_kv_heads"] == 2 and kwargs["group_size"] == 32
    assert kwargs["key_bits"] == kwargs["value_bits"] == 2
    assert kwargs["meta_cache"] is cache._fused_meta and isinstance(kwargs["kernel"], _Kernel)
    extra, template = kwargs["extra_inputs"], dict(kwargs["extra_template"])
    assert len(extra) == len(fused_decode_gear.GEAR_INPUTS) == 8
    if cache.rank:
        names = ["k_lr_tokens", "k_lr_channels", "k_out_index", "k_out_values",
                 "v_lr_tokens", "v_lr_channels", "v_out_index", "v_out_values"]
        assert all(got is s[n] for got, n in zip(extra, names))
        assert template == {"RANK": 4, "BLK": 256, "KCNT": 328, "VCNT": 328, "KIT": mx.uint16, "VIT": mx.uint16, "OB": 4,
                            "OSORT": 1, "KSL": 1, "KPLAIN": 1}
    else:
        assert all(a.shape == (1,) for a in extra)  # dummies the kernel never reads
        assert template == {"RANK": 0, "BLK": 256, "KCNT": 0, "VCNT": 0, "KIT": mx.uint16, "VIT": mx.uint16, "OB": 4,
                            "OSORT": 1, "KSL": 1, "KPLAIN": 1}
    # Off (or a shape it refuses): None, and GEARCache.attention takes the portable path.
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: False)
    assert cache._fused_decode(q_heads, 0.5) is None


def test_a_refused_shape_takes_the_portable_path(monkeypatch):
    cache = _gear(gear_bits=3)()
    q_heads = _filled(cache, 300)
    seen = _spy(monkeypatch)
    assert cache._fused_decode(q_heads, 0.5) is None and not seen
    out = cache.attention(q_heads, scale=0.5)
    assert out.shape == q_heads.shape and not seen


# Each combination JIT-compiles its own kernel (~10-20 s on the H200): a list, not a product.
# (name, cache factory, dtype, head dim, batch, kv heads, GQA rows, prefill tokens)
KERNEL_CASES = [
    ("gear-2 bf16 8B-shaped", _gear(), mx.bfloat16, 128, 1, 8, 4, 4100),
    ("gear-4 r2 5% fp16 hd64 batch2 mha", _gear(gear_bits=4, gear_rank=2, gear_outlier_fraction=0.05),
     mx.float16, 64, 2, 2, 1, 1000),
    # 16-bit only: a float32 cache keeps fp16 side data, and the portable path would hand
    # quantized_matmul float32 queries with fp16 scales (the emulated test covers QT float32)
    ("gear-2 r0 no outliers bf16 hd128 gqa8", _gear(gear_rank=0, gear_outlier_fraction=0.0),
     mx.bfloat16, 128, 1, 2, 8, 1000),
]


def _kernel_step(monkeypatch, cache, q_heads, D):
    """The cache's attention for q_heads, checked to have gone through the kernels' decode step
    once."""
    calls = []
    step = fused_decode_gear.decode_step
    monkeypatch.setattr(fused_decode_gear, "decode_step", lambda *a: calls.append(1) or step(*a))
    fused = cache.attention(q_heads, scale=D**-0.5)
    assert calls == [1] and fused is not None
    return fused


def _kernel_against_portable(monkeypatch, cache, q_heads, D, dtype):
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
    portable = cache.attention(q_heads, scale=D**-0.5).astype(mx.float32)
    monkeypatch.setenv(fused_decode.ENV_SWITCH, "1")
    fused = _kernel_step(monkeypatch, cache, q_heads, D)
    assert fused.dtype == dtype and fused.shape == q_heads.shape
    fused = fused.astype(mx.float32)
    diff = mx.abs(fused - portable).max().item()
    print(f"max |kernel - portable| = {diff:.2e}")
    tol = 2e-2 if dtype == mx.bfloat16 else 2e-3
    assert mx.allclose(fused, portable, atol=tol, rtol=tol).item(), diff


@cuda_only
@pytest.mark.parametrize("name, make, dtype, D, B, H, rep, n", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_step_matches_the_portable_step(monkeypatch, name, make, dtype, D, B, H, rep, n):
    cache = make()
    q_heads = _filled(cache, n, B=B, H=H, rep=rep, D=D, dtype=dtype)
    _kernel_against_portable(monkeypatch, cache, q_heads, D, dtype)


# The scan's switches: as shipped, every key add atomic, the full scan (before session 29).
SCAN_SETTINGS = [{}, {"PLAIN_KEY_ADDS": False}, {"SORTED_SCAN": False}]


@cuda_only
@pytest.mark.parametrize("switches", SCAN_SETTINGS, ids=["shipped", "key atomics", "full scan"])
def test_kernel_with_entries_meeting_on_one_target_matches_the_portable_step(monkeypatch, switches):
    # Steps of the sparse scans whose lanes meet on one token (keys: plain adds elsewhere) or
    # channel (values) (gear_clash_data): a clash the kernel missed would lose a spike's add.
    # In float32 against the portable step on the CPU (float32 queries there: in bf16 the
    # spikes' logits, ~25, round by ~0.1, and on CUDA the bf16 kernel and portable step
    # differed by 4.3 of ~9, results/cuda_tests_h200_s29_plain.txt).
    for name, value in switches.items():
        monkeypatch.setattr(fused_decode_gear, name, value)
    cache = clashing_cache(_gear()(), heads=8, tokens=4100)
    q_heads = mx.random.normal((1, 32, 1, 128))
    with mx.stream(mx.cpu):
        assert not fused_decode.kernels_enabled()
        expected = cache.attention(q_heads, scale=128**-0.5)
        mx.eval(expected)
    got = _kernel_step(monkeypatch, cache, q_heads, 128)
    assert got.dtype == mx.float32
    diff = (mx.abs(got - expected).max() / mx.abs(expected).max()).item()
    print(f"clashing entries: max |kernel - portable| / max |portable| = {diff:.2e}")
    assert diff <= 1e-4, diff


@cuda_only
def test_kernel_with_many_tiles_per_warp_matches_the_portable_step(monkeypatch):
    # Few target warps: every warp walks many 128-token tiles (online softmax and the sparse
    # value sums' rescale across tiles); same template as the 8B-shaped case.
    monkeypatch.setattr(fused_decode, "TARGET_WARPS", 1)
    cache = _gear()()
    q_heads = _filled(cache, 5000, B=1, H=2, rep=4, D=128, dtype=mx.bfloat16)
    assert fused_decode.tokens_per_block(cache.n_compressed, 2) == 128 * 4 * 64
    _kernel_against_portable(monkeypatch, cache, q_heads, 128, mx.bfloat16)
