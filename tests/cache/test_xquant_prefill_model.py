"""A tiny random llama's chunked prefill with the CUDA prefill kernels on (run on the CPU by the
thread-level emulation, tests/cache/cuda_emulation.py: the H200's path) against the portable
path: every chunk's logits and every layer's cache arrays bit for bit.

On the H200's path a chunk's prefill builds each layer's K/V with fused_prefill_affine's kernel
(xquant) or fused_prefill_merged's (minicache's pairs) and encodes xquant's blocks with
fused_encode_xquant's kernels; here those kernels meet the model as it calls them (the
integration's attention dispatcher installed, mlx-lm's chunking)."""

import mlx.core as mx
import pytest

from tests.cache import cuda_emulation
from tests.cache.test_cross_layer_tiny_llama import tiny_llama
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import fused_encode_xquant
from veloxquant_mlx.cache.cross_layer import CrossLayerCoordinator
from veloxquant_mlx.integration import dispatch as dispatch_module

emulation = pytest.mark.skipif(
    cuda_emulation.COMPILER is None, reason="needs g++ with C++20 std::barrier and _Float16 for the kernels' CPU emulation"
)

CHUNK, CHUNKS = 48, 3


@pytest.fixture
def dispatch():
    names = ["mlx_lm.models.llama"]
    dispatch_module.install(names)
    yield
    dispatch_module.uninstall(names)


def chunked_prefill(config: KVCacheConfig, kernels: bool):
    """(logits of each chunk's last position, every layer's arrays, the kernels that ran)."""
    model = tiny_llama()
    caches = CrossLayerCoordinator.build_layers(config, len(model.layers))
    tokens = mx.random.randint(0, 256, (CHUNK * CHUNKS,), key=mx.random.key(11))
    logits, made = [], []
    for start in range(0, CHUNK * CHUNKS, CHUNK):
        def step():
            out = model(tokens[None, start : start + CHUNK], cache=caches)[:, -1]
            mx.eval(out, [c.state for c in caches])  # as mlx-lm evaluates after each chunk
            return out
        if kernels:
            with pytest.MonkeyPatch.context() as patch, cuda_emulation.emulated_kernels() as built:
                patch.setattr(fused_encode_xquant, "_kernels_enabled", lambda: True)
                logits.append(step())
            made += [k for k in built if k.calls]
        else:
            logits.append(step())
    arrays = [[a for a in c.state if isinstance(a, mx.array)] for c in caches]
    return logits, arrays, sorted({k.name for k in made})


def check_bit_for_bit(config: KVCacheConfig, expected_kernels: list[str]):
    portable_logits, portable_arrays, ran = chunked_prefill(config, kernels=False)
    assert not ran
    logits, arrays, ran = chunked_prefill(config, kernels=True)
    assert ran == expected_kernels
    for i, (a, b) in enumerate(zip(portable_logits, logits)):
        assert mx.array_equal(a, b).item(), f"chunk {i}: max |diff| {mx.abs(a - b).max().item():.3g}"
    for layer, (xs, ys) in enumerate(zip(portable_arrays, arrays)):
        assert len(xs) == len(ys)
        for a, b in zip(xs, ys):
            assert a.shape == b.shape and mx.array_equal(a, b).item(), f"layer {layer}"


@emulation
def test_xquant_prefill_with_the_kernels_is_the_portable_prefill(dispatch):
    config = KVCacheConfig(method="xquant", bit_width_inlier=2, xquant_residual_length=16)
    check_bit_for_bit(config, ["vq_affine_prefill_kv", "vq_xquant_encode_kv", "vq_xquant_fit_kv"])
