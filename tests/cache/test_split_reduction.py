"""The split p @ V equals the single quantized_matmul it replaces."""

import mlx.core as mx

from veloxquant_mlx.cache.split_reduction import chunk_for, quantized_weighted_sum


def test_chunk_choice():
    assert chunk_for(4096) is None  # short: one call
    assert chunk_for(8192) == 1024  # 8 chunks of 1024
    assert chunk_for(32768) == 2048
    assert chunk_for(8192 + 256) == 256  # only 256 divides; 33 chunks


def test_split_equals_single_call():
    mx.random.seed(3)
    values = mx.random.normal((1, 2, 8192 + 256, 64))
    codes, scales, biases = mx.quantize(values, group_size=32, bits=2)
    p = mx.softmax(mx.random.normal((1, 2, 3, 8192 + 256)), axis=-1)
    single = mx.quantized_matmul(p, codes, scales, biases, transpose=False, group_size=32, bits=2)
    split = quantized_weighted_sum(p, codes, scales, biases, group_size=32, bits=2)
    assert split.shape == single.shape == (1, 2, 3, 64)
    assert mx.allclose(split, single, atol=1e-5, rtol=1e-4).item()
