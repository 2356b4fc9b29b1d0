"""The kvquant helpers on their own: codebook fitting / lookup and the sparse-outlier split."""

import mlx.core as mx
import pytest

from veloxquant_mlx.cache.nonuniform_codebook import fit_codebook, lookup, lookup_packed, nearest_level
from veloxquant_mlx.cache.packing import pack_codes, unpack_codes
from veloxquant_mlx.cache.sparse_outliers import (
    gather_entries,
    replace_with_vector_mean,
    scatter_entries,
    select_outliers,
)


@pytest.mark.parametrize("bits,n", [(2, 2048), (3, 2048), (3, 64), (4, 100), (3, 63), (2, 7)])
def test_lookup_packed_equals_unpack_then_lookup(bits, n):
    mx.random.seed(bits)
    codes = mx.random.randint(0, 1 << bits, (2, 3, 5, n)).astype(mx.uint8)
    levels = mx.sort(mx.random.normal((2, 3, 1 << bits)), axis=-1)
    words = pack_codes(codes, bits)
    assert words.dtype == mx.uint32
    expected = lookup(levels, unpack_codes(words, bits, n))
    assert mx.array_equal(lookup_packed(levels, words, bits, n), expected).item()
    assert mx.array_equal(expected, lookup(levels, codes)).item()


def test_fit_codebook_is_sorted_finite_and_nearest_level_is_nearest():
    mx.random.seed(0)
    x = mx.concatenate([mx.zeros((1, 2, 500)), mx.random.uniform(-1, 1, (1, 2, 500))], axis=-1)
    levels = fit_codebook(x, 8)
    assert levels.shape == (1, 2, 8)
    assert mx.all(levels[..., 1:] >= levels[..., :-1]).item() and mx.all(mx.isfinite(levels)).item()
    codes = nearest_level(x, levels)
    brute = mx.argmin(mx.abs(x[..., None] - levels[:, :, None, :]), axis=-1)
    picked = mx.take_along_axis(levels, codes.astype(mx.uint32), axis=-1)
    best = mx.take_along_axis(levels, brute.astype(mx.uint32), axis=-1)
    assert mx.allclose(mx.abs(picked - x), mx.abs(best - x)).item()


def test_fit_codebook_with_fewer_distinct_values_than_levels():
    x = mx.array([[[0.5] * 100 + [-0.5] * 100]])
    levels = fit_codebook(x, 4)
    assert mx.all(mx.isfinite(levels)).item()
    codes = nearest_level(x, levels)
    assert mx.allclose(mx.take_along_axis(levels, codes.astype(mx.uint32), axis=-1), x).item()


def test_select_outliers_per_channel_and_per_token():
    blocks = mx.zeros((1, 1, 1, 8, 4))
    blocks = blocks + mx.arange(4)  # channel offsets, no spread inside a channel
    blocks = blocks.at[0, 0, 0, 5, 2].add(50.0)  # spike in channel 2
    pos = select_outliers(blocks, 1, axis=-2)
    assert pos.dtype == mx.uint16 and pos.item() == 5 * 4 + 2
    values = gather_entries(blocks, pos)
    assert values.item() == 52.0
    dense = replace_with_vector_mean(blocks, pos, axis=-2)
    assert dense[0, 0, 0, 5, 2].item() == 2.0  # the channel's other entries
    restored = scatter_entries(dense, pos, values)
    assert mx.array_equal(restored, blocks).item()
    # per token: channel offsets are the normal spread of a token, the spike still stands out
    assert select_outliers(blocks, 1, axis=-1).item() == 5 * 4 + 2
