"""The outlier selection kernel (outlier_select_kernel.py) against a stable ascending argsort's
first `count` entries: on the CPU through the thread-level CUDA emulation
(tests/cache/cuda_emulation.py), on MLX's CUDA backend for real (`pytest -m cuda`), and compiled
by nvcc for sm_90 without spills (slow)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from veloxquant_mlx.cache import outlier_select_kernel

needs_compiler = pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")


def _stable_first(scores: np.ndarray, count: int) -> np.ndarray:
    """The rule the kernel keeps: positions of the `count` smallest, ties to the lower position,
    in ascending (score, position) order. -0.0 and +0.0 compare equal, as floats do."""
    return np.argsort(scores, axis=-1, kind="stable")[..., :count].astype(np.uint32)


def _rows(kind: str, shape, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "random":  # outlier scores as the caches make them: -|x - mean| / std
        return -np.abs(rng.standard_normal(shape)).astype(np.float32)
    if kind == "ties":  # few distinct values: the count-th smallest is tied many times over
        return -rng.integers(0, 4, size=shape).astype(np.float32)
    if kind == "zeros":  # an all-zero block's scores: every entry -0.0 or +0.0
        signs = rng.integers(0, 2, size=shape).astype(bool)
        return np.where(signs, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    if kind == "signed":  # both signs, extreme magnitudes, subnormals
        x = rng.standard_normal(shape).astype(np.float32) * np.float32(1e30)
        x.flat[::7] = np.float32(1e-42)
        x.flat[::11] = np.float32(-1e-42)
        return x
    if kind == "distinct":  # no two scores equal, both signs: the untied path throughout
        n = shape[-1]
        rows = [rng.permutation(n) - n // 2 for _ in range(int(np.prod(shape[:-1])))]
        return (np.stack(rows).reshape(shape) * np.float32(0.25)).astype(np.float32)
    raise ValueError(kind)


def _cut_ties(shape, count: int, tied: int, tied_picked: int, seed: int = 0) -> np.ndarray:
    """Rows whose count-th smallest score, -1.0, is held by `tied` entries at random positions,
    `tied_picked` of them among the first `count` (tied > tied_picked: the kernel's ordered path
    breaks the tie by position; tied == tied_picked: every copy picked, the untied path). The
    scores below it repeat too (their order among the picks is by position), as do those above."""
    rng = np.random.default_rng(seed)
    n = shape[-1]
    below = count - tied_picked
    assert 0 <= below and tied_picked <= tied and below + tied <= n
    rows = []
    for _ in range(int(np.prod(shape[:-1]))):
        row = np.concatenate([-rng.integers(2, 6, size=below), np.full(tied, -1),
                              rng.integers(0, 4, size=n - below - tied)])
        rows.append(rng.permutation(row))
    return np.stack(rows).reshape(shape).astype(np.float32)


CASES = [
    # (row shape, count, data)
    ((2, 3, 4096), 41, "random"),  # KVQuant's 8B blocks: 32 tokens x 128 channels, 1% outliers
    ((1, 2, 8192), 164, "random"),  # GEAR-sized blocks: 64 tokens x 128, 2%
    ((2, 2, 4096), 41, "ties"),
    ((1, 2, 2048), 20, "zeros"),
    ((3, 1000), 300, "signed"),  # a row length that is no multiple of the block's threads
    ((2, 64), 64, "random"),  # every entry picked
    ((2, 100), 1, "ties"),
    ((1, 2, 32768), 328, "random"),  # GEAR's 256 x 128 blocks: keys made again from the scores
    ((1, 16384), 50, "ties"),
    ((2, 4096), 41, "distinct"),
    ((1, 32768), 328, "distinct"),
    ((2, 16384), 1, "random"),  # one pick, keys in global memory
    ((1, 4096), 4096, "ties"),  # the whole row (the picks leave the keys in global memory)
]


@needs_compiler
@pytest.mark.parametrize("shape, count, data", CASES)
def test_emulated_kernel_picks_a_stable_sorts_first_entries(shape, count, data):
    scores = _rows(data, shape)
    with cuda_emulation.emulated_kernels() as made:
        got = outlier_select_kernel.smallest(mx.array(scores), count)
        mx.eval(got)
    assert [k.name.split("__")[0] for k in made] == ["vq_outlier_select"]
    assert got.dtype == mx.uint32 and got.shape == (*shape[:-1], count)
    np.testing.assert_array_equal(np.array(got), _stable_first(scores, count))


@needs_compiler
@pytest.mark.parametrize("shape, count, tied, tied_picked", [
    ((2, 4096), 41, 300, 20),  # keys in shared memory
    ((1, 32768), 328, 2000, 100),  # GEAR's rows: keys in global memory, 1024 threads
    ((2, 8192), 164, 164, 1),  # one tie picked
    ((2, 4096), 41, 30, 30),  # every copy of the count-th score picked: the untied path
    ((1, 32768), 328, 200, 200),
    ((2, 1000), 1000, 10, 10),  # the whole row
])
def test_emulated_kernel_breaks_a_tie_at_the_count_th_score_by_position(shape, count, tied, tied_picked):
    scores = _cut_ties(shape, count, tied, tied_picked, seed=count)
    with cuda_emulation.emulated_kernels():
        got = np.array(outlier_select_kernel.smallest(mx.array(scores), count))
    np.testing.assert_array_equal(got, _stable_first(scores, count))


@needs_compiler
@pytest.mark.parametrize("data", ["random", "distinct", "ties", "signed", "zeros"])
@pytest.mark.parametrize("shape, count", [((2, 4096), 41), ((3, 1000), 300), ((2, 100), 1), ((1, 64), 64)])
def test_emulated_kernel_with_the_keys_in_global_memory_for_any_row(monkeypatch, shape, count, data):
    """The 1024-thread launch that reads the keys from the scores at every pass (GEAR's rows),
    forced on small rows: rows shorter than the block, lengths no multiple of it."""
    monkeypatch.setattr(outlier_select_kernel, "_keys_shared", lambda entries, count: False)
    scores = _rows(data, shape, seed=len(data))
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        outlier_select_kernel.smallest(mx.array(scores), count)
    assert dict(captured[0][1].template)["KS"] == 0
    with cuda_emulation.emulated_kernels():
        got = np.array(outlier_select_kernel.smallest(mx.array(scores), count))
    np.testing.assert_array_equal(got, _stable_first(scores, count))


@pytest.mark.parametrize("entries, count, keys_shared, threads", [
    (4096, 41, 1, 256),  # KVQuant's rows
    (8192, 164, 1, 256),
    (32768, 328, 0, 1024),  # GEAR's rows
    (4096, 4096, 0, 1024),  # the picks leave no room for the keys
])
def test_the_launch_keeps_the_keys_in_shared_memory_where_they_fit(entries, count, keys_shared, threads):
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        outlier_select_kernel.smallest(mx.zeros((3, entries)), count)
    template = dict(captured[0][1].template)
    assert (template["KS"], template["TPB"]) == (keys_shared, threads)
    assert outlier_select_kernel.fits(entries, count)


@needs_compiler
def test_the_picks_are_argpartitions_set_where_the_count_th_score_is_not_tied():
    scores = _rows("random", (2, 4, 4096), seed=3)
    with cuda_emulation.emulated_kernels():
        got = np.array(outlier_select_kernel.smallest(mx.array(scores), 41))
    reference = np.array(mx.argpartition(mx.array(scores), kth=40, axis=-1)[..., :41])
    np.testing.assert_array_equal(np.sort(got, axis=-1), np.sort(reference, axis=-1))


def test_what_does_not_fit_is_refused_with_the_limit():
    assert outlier_select_kernel.fits(8192, 164) and outlier_select_kernel.fits(32768, 328)
    assert outlier_select_kernel.fits(4096, 4096)  # the keys then left in global memory
    assert not outlier_select_kernel.fits(8192, 8192) and not outlier_select_kernel.fits(100, 0)
    assert not outlier_select_kernel.fits(100, 101)
    with pytest.raises(ValueError, match="outlier selection of 8192 among 8192 entries"):
        outlier_select_kernel.smallest(mx.zeros((1, 8192)), 8192)


def test_enabled_follows_the_switch_and_the_backend(monkeypatch):
    from veloxquant_mlx.cache import fused_decode

    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: True)
    assert outlier_select_kernel.enabled()
    monkeypatch.setattr(outlier_select_kernel, "ENABLED", False)
    assert not outlier_select_kernel.enabled()
    monkeypatch.setattr(outlier_select_kernel, "ENABLED", True)
    monkeypatch.setattr(fused_decode, "kernels_enabled", lambda: False)
    assert not outlier_select_kernel.enabled()


@cuda_test
@pytest.mark.parametrize("shape, count, data", CASES + [((8, 64, 4096), 41, "random")])
def test_kernel_on_cuda_picks_a_stable_sorts_first_entries(shape, count, data):
    scores = _rows(data, shape)
    got = outlier_select_kernel.smallest(mx.array(scores), count)
    np.testing.assert_array_equal(np.array(got), _stable_first(scores, count))


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        outlier_select_kernel.smallest(mx.zeros((2, 4096)), 41)
        outlier_select_kernel.smallest(mx.zeros((2, 8192)), 164)
        outlier_select_kernel.smallest(mx.zeros((2, 32768)), 328)
        outlier_select_kernel.smallest_pair(mx.zeros((2, 32768)), mx.zeros((2, 32768)), 328, by_position=True)
    sources = sorted({kernel.cuda_source(sig) for kernel, sig in captured})
    assert len(sources) == 4
    for i, source in enumerate(sources):
        compiled_without_spills(source, tmp_path, i)


@needs_compiler
@pytest.mark.parametrize("first, second, count", [((3, 2, 4096), (2, 2, 4096), 41), ((1, 2, 32768), (1, 2, 32768), 328)])
def test_a_paired_launch_picks_what_each_side_s_own_launch_picks(first, second, count):
    """Two arrays of rows in one launch (paired_rows; rows of 4096: keys in shared memory, of
    32768: in global memory, as GEAR's): each side's picks are its own launch's, bit for bit."""
    a, b = mx.array(_rows("random", first, seed=1)), mx.array(_rows("ties", second, seed=2))
    with cuda_emulation.emulated_kernels() as made:
        paired = outlier_select_kernel.smallest_pair(a, b, count)
        alone = outlier_select_kernel.smallest(a, count), outlier_select_kernel.smallest(b, count)
        by_position = outlier_select_kernel.smallest_pair(a, b, count, by_position=True)
        mx.eval(paired, alone, by_position)
    assert sorted({k.name.split("__")[0] for k in made}) == ["vq_outlier_select", "vq_outlier_select_pair"]
    for got, want, ordered, scores in zip(paired, alone, by_position, (a, b)):
        np.testing.assert_array_equal(np.array(got), np.array(want))
        np.testing.assert_array_equal(np.array(got), _stable_first(np.array(scores), count))
        # by_position: the same picks in ascending position (GEAR's stored order)
        np.testing.assert_array_equal(np.array(ordered), np.sort(_stable_first(np.array(scores), count), axis=-1))


def test_a_paired_selection_takes_rows_of_one_length():
    with pytest.raises(ValueError, match="rows of one length: got 4096 and 2048"):
        outlier_select_kernel.smallest_pair(mx.zeros((2, 4096)), mx.zeros((2, 2048)), 41)


@cuda_test
def test_a_paired_launch_on_cuda_picks_what_each_side_s_own_launch_picks():
    a, b = mx.array(_rows("random", (1, 8, 8, 32768), seed=3)), mx.array(_rows("random", (1, 8, 8, 32768), seed=4))
    for got, scores in zip(outlier_select_kernel.smallest_pair(a, b, 328), (a, b)):
        np.testing.assert_array_equal(np.array(got), np.array(outlier_select_kernel.smallest(scores, 328)))
    for got, scores in zip(outlier_select_kernel.smallest_pair(a, b, 328, by_position=True), (a, b)):
        np.testing.assert_array_equal(np.array(got), np.sort(_stable_first(np.array(scores), 328), axis=-1))


@needs_compiler
def test_one_paired_build_serves_every_row_count():
    """The first side's row count comes from its shape in the kernel, not from a template
    constant: chunks of other lengths reuse the compiled module."""
    with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
        for rows in (2, 5):
            outlier_select_kernel.smallest_pair(mx.zeros((rows, 4096)), mx.zeros((3, 4096)), 41)
    assert len({kernel.cuda_source(sig) for kernel, sig in captured}) == 1
