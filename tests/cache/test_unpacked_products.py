"""unpacked_products: the CPU's decode products over codes unpacked for a float matmul give the
values mx.dequantize gives, bit for bit, and the products MLX's affine kernels give (to float32
rounding), in one chunk or several."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache import code_planes, sign_lookup, sign_plane, unpacked_products
from veloxquant_mlx.errors import QuantizerConfigError

from .other_thread import failures_in_another_threads_stream


def _quantized(bits: int, group: int, dim: int = 64, tokens: int = 300, scale_dtype=mx.float16, seed: int = 0):
    """(rows (1, 3, tokens, dim) float32, words, scales, biases) as mx.quantize stores them."""
    rows = mx.random.normal((1, 3, tokens, dim), key=mx.random.key(seed))
    words, scales, biases = mx.quantize(rows, group_size=group, bits=bits)
    return rows, words, scales.astype(scale_dtype), biases.astype(scale_dtype)


@pytest.mark.parametrize("bits", code_planes.SUPPORTED_BITS)
def test_planes_hold_the_codes_mx_dequantize_reads(bits):
    # Plane j's column u is the row's coordinate k u + j: interleaved and uncentered, the planes
    # are the codes mx.dequantize reads back with unit scales and zero biases.
    words = mx.random.randint(0, 1 << 30, (1, 3, 300, 64 * bits // 32), key=mx.random.key(bits)).astype(mx.uint32)
    words = words | mx.left_shift(words, 2)  # the top bits set too
    group = 64
    ones = mx.ones((1, 3, 300, 1))
    theirs = (mx.dequantize(words, ones, ones * 0, group_size=group, bits=bits) if bits != 1
              else sign_plane.sign_values(words, ones.astype(mx.float16)) * 0.5 + 0.5)
    planes = code_planes.planes(words, bits)
    assert len(planes) == code_planes.per_unit(bits) and planes[0].dtype == mx.float32
    ours = mx.stack(planes, axis=-1).reshape(1, 3, 300, 64) + code_planes.midpoint(bits)
    assert np.array_equal(np.array(ours), np.array(theirs.astype(mx.float32)))


def _close(ours, theirs):
    ours, theirs = np.array(ours), np.array(theirs.astype(mx.float32))
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1e-5 * max(1.0, np.abs(theirs).max())


@pytest.mark.parametrize("bits", unpacked_products.SUPPORTED_BITS)
@pytest.mark.parametrize("chunk_bytes", [unpacked_products.CHUNK_BYTES, 64 * 64 * 4 * 3])
def test_products_are_the_affine_kernels(monkeypatch, bits, chunk_bytes):
    # The second chunk size holds 64 tokens of the 3 heads: 300 tokens take 5 chunks.
    monkeypatch.setattr(unpacked_products, "CHUNK_BYTES", chunk_bytes)
    _, words, scales, biases = _quantized(bits, 32)
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    x = mx.random.normal((1, 3, 4, 64), key=mx.random.key(1))
    p = mx.softmax(mx.random.normal((1, 3, 4, 300), key=mx.random.key(2)), axis=-1)
    _close(unpacked_products.affine_scores(x, words, scales, biases, group_size=32, bits=bits),
           mx.quantized_matmul(x, words, scales, biases, transpose=True, group_size=32, bits=bits))
    _close(unpacked_products.affine_weighted_sum(p, words, scales, biases, group_size=32, bits=bits),
           mx.quantized_matmul(p, words, scales, biases, transpose=False, group_size=32, bits=bits))


@pytest.mark.parametrize("chunk_bytes", [unpacked_products.CHUNK_BYTES, 64 * 128 * 4 * 2])
def test_sign_plane_weighted_sum_is_the_plane_read_back(monkeypatch, chunk_bytes):
    # Against the plane read back in float32 (sign_plane.sign_values), not against
    # sign_plane.sign_weighted_sum: on the CPU that routes here.
    monkeypatch.setattr(unpacked_products, "CHUNK_BYTES", chunk_bytes)
    words = mx.random.randint(0, 1 << 30, (1, 2, 200, 4), key=mx.random.key(3)).astype(mx.uint32)
    words = words | mx.left_shift(words, 2)  # the top bits set too
    mags = mx.abs(mx.random.normal((1, 2, 200, 1), key=mx.random.key(4))).astype(mx.float16)
    p = mx.softmax(mx.random.normal((1, 2, 3, 200), key=mx.random.key(6)), axis=-1)
    _close(unpacked_products.sign_weighted_sum(p, words, mags), p @ sign_plane.sign_values(words, mags))


def test_chunks_cover_the_tokens_within_the_bytes(monkeypatch):
    monkeypatch.setattr(unpacked_products, "CHUNK_BYTES", 1000 * 4 * 10)
    assert unpacked_products.token_chunks(2500, 10) == [(0, 1000), (1000, 2000), (2000, 2500)]
    assert unpacked_products.token_chunks(999, 10) == [(0, 999)]
    assert unpacked_products.token_chunks(3, 10 ** 9) == [(0, 1), (1, 2), (2, 3)]  # one token at least
    assert unpacked_products.token_chunks(0, 10) == [(0, 0)]


def test_no_tokens_give_empty_products():
    _, words, scales, biases = _quantized(3, 32, tokens=0)
    x = mx.ones((1, 3, 4, 64))
    assert unpacked_products.affine_scores(x, words, scales, biases, group_size=32, bits=3).shape == (1, 3, 4, 0)
    out = unpacked_products.affine_weighted_sum(mx.ones((1, 3, 4, 0)), words, scales, biases, group_size=32, bits=3)
    assert out.shape == (1, 3, 4, 64) and not mx.any(out).item()


def test_unsupported_widths_and_groups_are_refused():
    _, words, scales, biases = _quantized(4, 32)
    with pytest.raises(QuantizerConfigError, match="bits=5; allowed are 2, 3, 4, 8"):
        unpacked_products.affine_scores(mx.ones((1, 3, 4, 64)), words, scales, biases, group_size=32, bits=5)
    with pytest.raises(QuantizerConfigError, match="rows of 64 codes in groups of 64 with 2 scales per row"):
        unpacked_products.affine_weighted_sum(mx.ones((1, 3, 4, 300)), words, scales, biases, group_size=64, bits=4)


def test_it_serves_the_cpu_only(monkeypatch):
    assert unpacked_products.applies() == (mx.default_device().type == mx.DeviceType.cpu)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 0))
    assert not unpacked_products.applies()


def test_functions_first_built_in_another_threads_stream_serve_this_thread():
    code_planes._planes_function.cache_clear()
    unpacked_products._group_mask.cache_clear()
    sign_lookup.byte_bits.cache_clear()
    sign_lookup._compiled_scores.cache_clear()
    unpacked_products._compiled.cache_clear()
    _, words, scales, biases = _quantized(3, 32)
    signs_words = mx.random.randint(0, 1 << 30, (1, 3, 8, 2), key=mx.random.key(7)).astype(mx.uint32)
    mags = mx.ones((1, 3, 8, 1), dtype=mx.float16)
    x = mx.ones((1, 3, 4, 64))
    mx.eval(words, scales, biases, signs_words, mags, x)

    def products():
        return (sign_lookup.sign_scores(x, signs_words, mags),
                unpacked_products.affine_scores(x, words, scales, biases, group_size=32, bits=3),
                unpacked_products.affine_weighted_sum(mx.ones((1, 3, 4, 300)), words, scales, biases,
                                                      group_size=32, bits=3))

    assert not failures_in_another_threads_stream(products)
    mx.eval(products())
