"""sign_lookup: the CPU's scores against a sign plane through per-byte tables give x . a (2b - 1)
per token, as the plane read back in float32 does (to float32 rounding), in one chunk or
several, and sign_plane.sign_scores takes it on the CPU."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.cache import sign_lookup, sign_plane, unpacked_products
from veloxquant_mlx.errors import QuantizerConfigError


def _plane(lead, tokens: int, d: int, seed: int):
    words = mx.random.randint(0, 1 << 30, (*lead, tokens, d // 32), key=mx.random.key(seed)).astype(mx.uint32)
    words = words | mx.left_shift(words, 2)  # the top bits set too
    mags = mx.abs(mx.random.normal((*lead, tokens, 1), key=mx.random.key(seed + 1))).astype(mx.float16)
    return words, mags


def _close(ours, theirs):
    ours, theirs = np.array(ours), np.array(theirs.astype(mx.float32))
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1e-5 * max(1.0, np.abs(theirs).max())


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("chunk_bytes", [unpacked_products.CHUNK_BYTES, 48 * 4 * 2 * 3 * 4])
def test_scores_are_the_plane_read_back(monkeypatch, d, chunk_bytes):
    # The second chunk size holds 48 tokens' gathered sums of the 2 heads' 3 rows at d 32 (and
    # fewer tokens at d 64, 128): 200 tokens take several chunks, the last one shorter.
    monkeypatch.setattr(unpacked_products, "CHUNK_BYTES", chunk_bytes)
    words, mags = _plane((1, 2), 200, d, seed=d)
    x = mx.random.normal((1, 2, 3, d), key=mx.random.key(5))
    reference = x @ sign_plane.sign_values(words, mags).swapaxes(-1, -2)
    ours = sign_lookup.sign_scores(x, words, mags)
    assert ours.dtype == mx.float32
    _close(ours, reference)


def test_each_bit_is_its_coordinate():
    # One bit set per token, at coordinate t: the score is x's coordinate t times a, less the
    # others' (a (2b - 1) is +a there, -a elsewhere).
    d = 64
    rows = np.zeros((1, 1, d, d // 32), dtype=np.uint32)
    for t in range(d):
        rows[0, 0, t, t // 32] = 1 << (t % 32)
    words, mags = mx.array(rows), mx.full((1, 1, d, 1), 0.5, dtype=mx.float16)
    x = mx.arange(d, dtype=mx.float32).reshape(1, 1, 1, d)
    expected = 0.5 * (2 * np.arange(d) - np.arange(d).sum())
    assert np.allclose(np.array(sign_lookup.sign_scores(x, words, mags))[0, 0, 0], expected)


def test_queries_in_bf16_are_scored_in_float32():
    words, mags = _plane((1, 2), 64, 128, seed=9)
    x = mx.random.normal((1, 2, 4, 128), key=mx.random.key(11)).astype(mx.bfloat16)
    reference = x.astype(mx.float32) @ sign_plane.sign_values(words, mags).swapaxes(-1, -2)
    _close(sign_lookup.sign_scores(x, words, mags), reference)


def test_no_tokens_give_no_scores():
    words, mags = _plane((1, 2), 0, 64, seed=1)
    assert sign_lookup.sign_scores(mx.ones((1, 2, 3, 64)), words, mags).shape == (1, 2, 3, 0)


def test_queries_of_another_dimension_are_refused():
    words, mags = _plane((1, 2), 8, 64, seed=1)
    with pytest.raises(QuantizerConfigError, match="queries of 128 coordinates against sign rows of 64"):
        sign_lookup.sign_scores(mx.ones((1, 2, 3, 128)), words, mags)


def test_sign_plane_scores_take_it_on_the_cpu(monkeypatch):
    words, mags = _plane((1, 2), 40, 64, seed=3)
    x = mx.random.normal((1, 2, 3, 64), key=mx.random.key(4))
    assert unpacked_products.applies()
    ours = np.array(sign_plane.sign_scores(x, words, mags))
    assert np.array_equal(ours, np.array(sign_lookup.sign_scores(x, words, mags)))
    # Off the CPU the widened plane's affine kernel runs (here on the CPU stream, to compare).
    monkeypatch.setattr(unpacked_products, "applies", lambda: False)
    _close(mx.array(ours), sign_plane.sign_scores(x, words, mags))
