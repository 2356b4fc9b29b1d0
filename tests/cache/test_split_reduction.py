"""The split p @ V equals the single quantized_matmul it replaces; on the CPU the product goes
through unpacked_products (the codes read as planes) where it reads the width."""

import mlx.core as mx
import pytest

from veloxquant_mlx.cache import unpacked_products
from veloxquant_mlx.cache.split_reduction import chunk_for, quantized_scores, quantized_weighted_sum


def test_chunk_choice():
    assert chunk_for(4096) is None  # short: one call
    assert chunk_for(8192) == 1024  # 8 chunks of 1024
    assert chunk_for(32768) == 2048
    assert chunk_for(8192 + 256) == 256  # only 256 divides; 33 chunks


@pytest.mark.parametrize("planes", [False, True], ids=["split", "planes"])
def test_split_equals_single_call(monkeypatch, planes):
    # planes False: the split MLX kernels (a GPU's path); True: the CPU's unpacked products.
    monkeypatch.setattr(unpacked_products, "applies", lambda: planes)
    mx.random.seed(3)
    values = mx.random.normal((1, 2, 8192 + 256, 64))
    codes, scales, biases = mx.quantize(values, group_size=32, bits=2)
    p = mx.softmax(mx.random.normal((1, 2, 3, 8192 + 256)), axis=-1)
    single = mx.quantized_matmul(p, codes, scales, biases, transpose=False, group_size=32, bits=2)
    split = quantized_weighted_sum(p, codes, scales, biases, group_size=32, bits=2)
    assert split.shape == single.shape == (1, 2, 3, 64) and split.dtype == p.dtype
    assert mx.allclose(split, single, atol=1e-5, rtol=1e-4).item()


def test_the_cpu_takes_the_planes_for_the_widths_they_read(monkeypatch):
    monkeypatch.setattr(unpacked_products, "applies", lambda: True)
    calls = []
    original = unpacked_products.affine_weighted_sum
    monkeypatch.setattr(unpacked_products, "affine_weighted_sum",
                        lambda *a, **k: calls.append(k["bits"]) or original(*a, **k))
    p = mx.softmax(mx.random.normal((1, 2, 3, 64)), axis=-1).astype(mx.bfloat16)
    for bits in (2, 5):  # 5: no planes; MLX's kernel
        codes, scales, biases = mx.quantize(mx.random.normal((1, 2, 64, 64)), group_size=32, bits=bits)
        out = quantized_weighted_sum(p, codes, scales.astype(mx.bfloat16), biases.astype(mx.bfloat16),
                                     group_size=32, bits=bits)
        assert out.dtype == mx.bfloat16
    assert calls == [2]


@pytest.mark.parametrize("planes", [False, True], ids=["kernel", "planes"])
def test_scores_are_the_transposed_kernels(monkeypatch, planes):
    monkeypatch.setattr(unpacked_products, "applies", lambda: planes)
    keys = mx.random.normal((1, 2, 300, 64), key=mx.random.key(8))
    codes, scales, biases = mx.quantize(keys, group_size=32, bits=3)
    x = mx.random.normal((1, 2, 4, 64), key=mx.random.key(9))
    ref = mx.quantized_matmul(x, codes, scales, biases, transpose=True, group_size=32, bits=3)
    got = quantized_scores(x, codes, scales, biases, group_size=32, bits=3)
    assert got.shape == ref.shape == (1, 2, 4, 300) and got.dtype == x.dtype
    assert mx.allclose(got, ref, atol=1e-5, rtol=1e-4).item()
