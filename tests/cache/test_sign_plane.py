"""cache/sign_plane.py: the sign plane read at 2 and 4 bits (or, on the CPU, as planes), against a
dense reference."""

import mlx.core as mx
import pytest

from veloxquant_mlx.cache import unpacked_products
from veloxquant_mlx.cache.packing import pack_codes, unpack_codes
from veloxquant_mlx.cache.sign_plane import sign_scores, sign_values, sign_weighted_sum, token_chunks, widen


def _plane(tokens, dim, heads=3, seed=0):
    mx.random.seed(seed)
    bits = mx.random.bernoulli(0.5, (2, heads, tokens, dim))
    words = pack_codes(bits, 1)
    mags = mx.random.uniform(0.1, 2.0, (2, heads, tokens, 1)).astype(mx.float16)
    dense = (2 * unpack_codes(words, 1, dim).astype(mx.float32) - 1) * mags.astype(mx.float32)
    return bits, words, mags, dense


@pytest.fixture(params=["widened", "planes"])
def product_path(request, monkeypatch):
    """The products' two paths, both run on this CPU: `widened` as a GPU backend runs them (MLX's
    affine kernels over the widened words), `planes` as the CPU does (unpacked_products)."""
    monkeypatch.setattr(unpacked_products, "applies", lambda: request.param == "planes")
    return request.param


@pytest.mark.parametrize("bits", [2, 4])
def test_widen_is_mlx_packing_of_the_same_codes(bits):
    signs, words, _, _ = _plane(7, 64)
    assert mx.array_equal(widen(words, bits), pack_codes(signs, bits)).item()
    # An affine dequantize of the widened words reads the codes back.
    ones, zeros = mx.ones((2, 3, 7, 1)), mx.zeros((2, 3, 7, 1))
    codes = mx.dequantize(widen(words, bits), ones, zeros, group_size=64, bits=bits)
    assert mx.array_equal(codes, signs.astype(mx.float32)).item()


@pytest.mark.parametrize("dim", [32, 128, 256])
def test_products_and_values_match_dense_reference(dim, product_path):
    tokens = 300
    _, words, mags, dense = _plane(tokens, dim)
    x = mx.random.normal((2, 3, 5, dim))
    p = mx.softmax(mx.random.normal((2, 3, 5, tokens)), axis=-1)
    assert mx.array_equal(sign_values(words, mags), dense).item()
    scores, values = sign_scores(x, words, mags), sign_weighted_sum(p, words, mags)
    assert scores.shape == (2, 3, 5, tokens) and values.shape == (2, 3, 5, dim)
    assert mx.allclose(scores, x @ dense.swapaxes(-1, -2), rtol=1e-5, atol=1e-4).item()
    assert mx.allclose(values, p @ dense, rtol=1e-5, atol=1e-5).item()


def test_long_weighted_sum_is_split_and_still_exact(product_path):
    tokens = 8192  # split_reduction chunks it (>= 8192 tokens)
    _, words, mags, dense = _plane(tokens, 64, heads=1)
    p = mx.softmax(mx.random.normal((2, 1, 3, tokens)) * 4, axis=-1)
    assert mx.allclose(sign_weighted_sum(p, words, mags), p @ dense, rtol=1e-4, atol=1e-6).item()


def test_low_precision_inputs_keep_their_dtype(product_path):
    _, words, mags, dense = _plane(300, 64)
    x = mx.random.normal((2, 3, 4, 64))
    got = sign_scores(x.astype(mx.bfloat16), words, mags)
    assert got.dtype == mx.bfloat16
    ref = x @ dense.swapaxes(-1, -2)
    assert (mx.abs(got.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item() < 2e-2


def test_chunked_products_equal_whole_ones_and_bound_the_transient(product_path):
    tokens = 3 * 256 + 64
    _, words, mags, dense = _plane(tokens, 64)
    x = mx.random.normal((2, 3, 5, 64))
    p = mx.softmax(mx.random.normal((2, 3, 5, tokens)), axis=-1)
    # 256 tokens of 4-bit widened words: four chunks, the last one short.
    per_token_4bit = words.nbytes // tokens * 4
    assert token_chunks(words, 4, 256 * per_token_4bit) == [(0, 256), (256, 512), (512, 768), (768, 832)]
    assert token_chunks(words, 4, 1 << 30) == [(0, tokens)]
    small = 256 * per_token_4bit
    assert mx.allclose(sign_scores(x, words, mags, small), sign_scores(x, words, mags), atol=1e-5).item()
    got = sign_weighted_sum(p, words, mags, small)
    assert mx.allclose(got, p @ dense, rtol=1e-5, atol=1e-5).item()
