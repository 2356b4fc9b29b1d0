"""MiniCache's paired layers and fused_decode_merged's CUDA kernel: what the kernel is handed,
which shapes it takes, the portable path it is checked against, and (on CUDA only) the kernel
against that path (one layer's timing: python -m veloxquant_mlx.bench.attention with
`minicache:minicache_start_fraction=0`, which times a paired layer).

On the CPU the kernel itself runs under the emulation (test_fused_decode_minicache_emulated.py);
here the wiring is checked with the kernel replaced by a recorder, and the portable path (the
reference of both) against a reconstruction of the stored history in numpy. The CUDA tests run
where MLX's CUDA backend is the default device (the H200 through the device tool).
"""


import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import fused_decode, fused_decode_merged
from veloxquant_mlx.cache.minicache import BLOCK, MiniCacheCache
from tests.cache.cuda_marks import cuda_test as cuda_only

on_cuda = fused_decode._on_cuda()


def _pair(n, *, B, H, rep, D, dtype, seed=0, **fields):
    """A lower / upper pair after a prefill of n tokens (merged in blocks of 32, the rest in
    their windows) and one decode token each: (lower, upper, [queries of each])."""
    config = KVCacheConfig(method="minicache", minicache_start_fraction=0.0, **fields)
    lower, upper = MiniCacheCache.build_layers(config, 2)
    mx.random.seed(seed)
    # A component shared by both layers plus each layer's own noise: weak for most tokens
    # (cosine ~0.99, merged), strong for ~1 in 10 (cosine ~0.6, below the 0.9 threshold), so
    # blocks of 32 hold both used and unused retained slots. Keys get an offset and outlier
    # channels.
    outliers = mx.where(mx.arange(D) % 16 == 3, 4.0, 1.0)
    shared_k = mx.random.normal((B, H, n + 1, D)) * outliers + 0.5
    shared_v = mx.random.normal((B, H, n + 1, D))
    noise = mx.where(mx.random.uniform(shape=(B, H, n + 1, 1)) < 0.1, 0.8, 0.05)
    layers = []
    for cache in (lower, upper):
        k = shared_k + noise * mx.random.normal(shared_k.shape) * outliers
        v = shared_v + noise * mx.random.normal(shared_v.shape)
        layers.append((cache, k.astype(dtype), v.astype(dtype)))
    for cache, k, v in layers:
        cache.update_and_fetch(k[:, :, :n], v[:, :, :n])
    upper._flush()  # the pair merges its whole blocks (as the upper layer's attention does)
    queries = []
    for cache, k, v in layers:
        cache.update_and_fetch(k[:, :, n:], v[:, :, n:])
        queries.append((2 * mx.random.normal((B, rep * H, 1, D))).astype(dtype))
    mx.eval(lower.store, upper.store, queries)
    return lower, upper, queries


def test_supported_shapes():
    # the 8B shape with the defaults: fp16 directions, 4 slots, 4 rows per kv head
    assert fused_decode_merged.supports(128, 128, 4, 4, None)
    assert fused_decode_merged.supports(128, 128, 4, 4, 4)  # 4-bit directions
    assert not fused_decode_merged.supports(128, 128, 4, 4, 3)  # 3-bit codes straddle words
    assert not fused_decode_merged.supports(96, 96, 4, 4, None)  # 8 lanes x 8-channel chunks
    assert not fused_decode_merged.supports(128, 128, 4, 9, None)  # > 8 rows: registers
    assert fused_decode_merged.supports(64, 64, 0, 1, None)
    # the largest: 256 dims, 16 slots, 8 rows = 42,240 bytes of shared memory
    assert fused_decode_merged.shared_bytes(256, 256, 16, 8) == 42240
    assert fused_decode_merged.supports(256, 256, 16, 8, None)
    assert fused_decode_merged.tokens_per_block(32768, 8) == 1024  # 32-token tiles, 8 per warp (1024 target warps)
    assert fused_decode_merged.tokens_per_block(100, 1) == 128


class _Kernel:
    def attend(self, queries, **kwargs):
        return "kernel output"


def _spy_launch(monkeypatch, seen: dict) -> None:
    """merged_launch recorded (args, kwargs) in `seen`; the step's kernel a stand-in."""
    monkeypatch.setattr(fused_decode_merged, "_partials_kernel", lambda: _Kernel())
    monkeypatch.setattr(fused_decode_merged, "merged_launch", lambda *a, **k: seen.update(args=a, kwargs=k)
                        or ([None] * len(fused_decode_merged._INPUTS), {}, fused_decode_merged.WINDOW_INPUTS))


@pytest.mark.parametrize("role", ["lower", "upper"])
def test_decode_step_hands_the_kernel_the_pairs_arrays(monkeypatch, role):
    # The wiring from a paired layer to the kernel, checked on any device: with the kernels
    # reported active, both layers pass the lower layer's directions (the same arrays, no copy)
    # and their own magnitudes, retained slots and window.
    lower, upper, queries = _pair(300, B=1, H=2, rep=4, D=128, dtype=mx.float16)
    cache, q_heads = (lower, queries[0]) if role == "lower" else (upper, queries[1])
    seen = {}
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    _spy_launch(monkeypatch, seen)
    assert cache.attention(q_heads, scale=0.5) == "kernel output"
    args, kwargs = seen["args"], seen["kwargs"]
    assert args[0] is q_heads and args[1] == 0.5
    assert args[2] is lower.store["dir_k"] and args[3] is lower.store["dir_v"]
    s = cache.store
    assert args[4] is s["mag_k"] and args[5] is s["mag_v"]
    assert args[6] == (s["ret_k"], s["ret_v"], s["retpos_k"], s["retpos_v"])
    assert args[7] is cache.window_keys and args[8] is cache.window_values
    assert kwargs == {"n_valid": 288, "slots": 4, "n_kv_heads": 2, "meta_cache": cache._merged_meta,
                      "direction_bits": None, "direction_side": None}
    # Not taken: kernels off, 3-bit directions (supports() refuses), plain layers.
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: False)
    assert cache._fused_decode(q_heads, 0.5) is None
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    three, _, q3 = _pair(100, B=1, H=2, rep=4, D=128, dtype=mx.float16, minicache_bits=3)
    assert three._fused_decode(q3[0], 0.5) is None
    plain = MiniCacheCache(KVCacheConfig(method="minicache"), 0, 4)
    plain.update_and_fetch(mx.zeros((1, 2, 40, 128), mx.float16), mx.zeros((1, 2, 40, 128), mx.float16))
    assert plain.role == "plain" and plain._fused_decode(q_heads, 0.5) is None


@pytest.mark.parametrize("role", ["lower", "upper"])
def test_quantized_directions_hand_the_lower_layers_codes_scales_and_biases(monkeypatch, role):
    lower, upper, queries = _pair(100, B=1, H=2, rep=4, D=64, dtype=mx.float16, minicache_bits=4)
    cache, q_heads = (lower, queries[0]) if role == "lower" else (upper, queries[1])
    seen = {}
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    _spy_launch(monkeypatch, seen)
    cache._fused_decode(q_heads, 0.5)
    s = lower.store
    assert seen["args"][2] is s["dir_k"] and s["dir_k"].dtype == mx.uint32 and seen["args"][3] is s["dir_v"]
    assert seen["kwargs"]["direction_bits"] == 4
    assert seen["kwargs"]["direction_side"] == (s["dirscale_k"], s["dirbias_k"], s["dirscale_v"], s["dirbias_v"])


def test_no_slots_hand_no_retained_arrays(monkeypatch):
    lower, upper, queries = _pair(100, B=1, H=2, rep=4, D=64, dtype=mx.float16, minicache_retain_slots=0)
    seen = {}
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    _spy_launch(monkeypatch, seen)
    upper._fused_decode(queries[1], 0.5)
    assert seen["args"][6] is None and seen["kwargs"]["slots"] == 0


def _reconstructed(cache, part):
    """The layer's merged history (B, H, n_compressed, D) rebuilt in numpy from the store:
    ||x|| e, with each merged block's used slots' exact vectors at their positions."""
    source = cache._direction_store()
    n = cache.n_compressed
    x = np.array(cache.store[f"mag_{part}"].astype(mx.float32))[..., :n, None] * np.array(
        source[f"dir_{part}"].astype(mx.float32))[:, :, :n]
    ret = np.array(cache.store[f"ret_{part}"].astype(mx.float32))
    pos = np.array(cache.store[f"retpos_{part}"])
    for b, h in np.ndindex(x.shape[:2]):
        for i in range(n // BLOCK * cache.slots):
            if pos[b, h, i] >= 0:
                assert i // cache.slots == pos[b, h, i] // BLOCK  # a slot lies in its own block
                x[b, h, pos[b, h, i]] = ret[b, h, i]
    return x


def test_the_portable_path_reads_only_the_merged_blocks_slots():
    # The store's growth slack holds zero-filled slots (position 0): they must not take part.
    # Before this was fixed they put a zero vector over token 0, the attention sink, whenever
    # the capacity exceeded the merged tokens (i.e. almost always), in _decode, _scores and
    # _weighted_values alike.
    lower, upper, queries = _pair(300, B=1, H=2, rep=4, D=64, dtype=mx.float32)
    assert upper.capacity > upper.n_compressed == 288
    for cache, q in ((lower, queries[0]), (upper, queries[1])):
        keys, values = cache._decode()
        k_ref, v_ref = _reconstructed(cache, "k"), _reconstructed(cache, "v")
        assert np.abs(k_ref[:, :, 0]).max() > 1  # token 0 is not zero
        assert np.allclose(np.array(keys), k_ref, atol=1e-5) and np.allclose(np.array(values), v_ref, atol=1e-5)
        # The attention over the compressed form is the attention over that history + window.
        k_all = mx.concatenate([mx.array(k_ref), cache.window_keys.astype(mx.float32)], axis=2)
        v_all = mx.concatenate([mx.array(v_ref), cache.window_values.astype(mx.float32)], axis=2)
        expected = mx.fast.scaled_dot_product_attention(
            q, mx.repeat(k_all, 4, axis=1), mx.repeat(v_all, 4, axis=1), scale=0.125)
        assert mx.allclose(cache.attention(q, scale=0.125), expected, atol=1e-5).item()


# Each case JIT-compiles its own kernel (~10-20 s on the H200): a list, not a product.
# (name, dtype, head dim, batch, GQA rows, prefill tokens, config fields)
KERNEL_CASES = [
    ("default bf16 hd128 gqa4 (8B shape)", mx.bfloat16, 128, 1, 4, 3000, {}),
    ("no slots fp16 hd64 batch2 mha", mx.float16, 64, 2, 1, 1000, {"minicache_retain_slots": 0}),
    ("16 slots fp32 hd128 gqa8", mx.float32, 128, 1, 8, 1000, {"minicache_retain_slots": 16}),
    ("4-bit directions bf16 hd128 gqa4", mx.bfloat16, 128, 1, 4, 2000, {"minicache_bits": 4}),
]


def _kernel_against_portable(monkeypatch, lower, upper, queries, D, dtype):
    for cache, q_heads in ((lower, queries[0]), (upper, queries[1])):
        # The reference: the portable path with float32 queries (in fp16 / bf16 it rounds its
        # scores and sums: at 5000 tokens in bf16 0.024 off the float32 result, while the
        # kernel computes in float32 and rounds once at the end).
        monkeypatch.setenv(fused_decode.ENV_SWITCH, "0")
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
        difference = mx.abs(fused - portable).max().item()
        print(f"{cache.role}: max |kernel - portable| = {difference:.2e}")
        # The output's rounding; float32 matmuls of the reference may run in TF32 on the GPU.
        tol = 2e-2 if dtype == mx.bfloat16 else 3e-3
        assert mx.allclose(fused, portable, atol=tol, rtol=tol).item(), difference


@cuda_only
@pytest.mark.parametrize("name, dtype, D, B, rep, n, fields", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_kernel_step_matches_the_portable_step(monkeypatch, name, dtype, D, B, rep, n, fields):
    H = 8 if "8B" in name else 2
    lower, upper, queries = _pair(n, B=B, H=H, rep=rep, D=D, dtype=dtype, **fields)
    _kernel_against_portable(monkeypatch, lower, upper, queries, D, dtype)


@cuda_only
def test_kernel_with_many_tiles_per_warp_matches_the_portable_step(monkeypatch):
    # Few target warps: one block per head, every warp walks 39 32-token tiles (the online
    # softmax across tiles); same template as the 8B case.
    monkeypatch.setattr(fused_decode_merged, "TARGET_WARPS", 1)
    lower, upper, queries = _pair(5000, B=1, H=2, rep=4, D=128, dtype=mx.bfloat16)
    assert upper.n_compressed == 4992 < fused_decode_merged.tokens_per_block(4992, 2) == 32 * 4 * 256
    _kernel_against_portable(monkeypatch, lower, upper, queries, 128, mx.bfloat16)
