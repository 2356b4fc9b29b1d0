"""The codebook fit's kernels (kvquant_fit_kernel.py) against the MLX ops' fit, bit for bit: on the
CPU through the thread-level CUDA emulation (tests/cache/cuda_emulation.py), on MLX's CUDA
backend for real (`pytest -m cuda`), and compiled by nvcc for sm_90 without spills (slow)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.cache import cuda_emulation
from tests.cache.cuda_marks import cuda_test
from tests.cache.test_kernels_nvcc import NVCC, compiled_without_spills
from veloxquant_mlx.cache import kvquant_fit_kernel, nonuniform_codebook
from veloxquant_mlx.cache.nonuniform_codebook import fit_codebook

needs_compiler = pytest.mark.skipif(cuda_emulation.COMPILER is None, reason="needs g++ with C++20 for the CUDA emulation")


def _samples(kind: str, heads: int, n: int) -> mx.array:
    """Normalized-looking samples in [-1, 1]: smooth, or coarse with ties, zeros of both signs
    and levels that lose all their samples (fewer distinct values than levels)."""
    x = mx.tanh(mx.random.normal((1, heads, n), key=mx.random.key(n + heads)))
    if kind == "coarse":
        x = mx.round(x * 3) / 3
        x = mx.where(mx.arange(n) % 7 == 0, -0.0, x)
    if kind == "few":  # -1, -0.0, +0.0, 1: duplicate starting levels, levels left without samples
        x = mx.round(x)
    return x


def _ops_fit(monkeypatch, x, levels, iterations):
    monkeypatch.setattr(nonuniform_codebook, "_fit_kernels_apply", lambda n: False)
    monkeypatch.setattr(nonuniform_codebook, "_fit_compiled", lambda: False)  # as off the CPU
    out = fit_codebook(x, levels, iterations)
    mx.eval(out)
    monkeypatch.undo()
    return out


@needs_compiler
@pytest.mark.parametrize("kind, heads, n, levels", [("smooth", 2, 600, 8), ("coarse", 3, 500, 4), ("few", 2, 300, 8), ("smooth", 1, 700, 16)])
def test_kernel_fit_is_the_ops_fit_bit_for_bit(monkeypatch, kind, heads, n, levels):
    x = _samples(kind, heads, n)
    reference = _ops_fit(monkeypatch, x, levels, 6)
    monkeypatch.setattr(nonuniform_codebook, "_fit_compiled", lambda: False)
    with cuda_emulation.emulated_kernels() as made:
        ours = fit_codebook(x, levels, 6)
        mx.eval(ours)
    assert sorted({k.name for k in made}) == ["vq_kvquant_fit_product", "vq_kvquant_fit_update"]
    assert ours.shape == reference.shape and ours.dtype == mx.float32
    assert np.array_equal(np.array(mx.view(ours, mx.uint32)), np.array(mx.view(reference, mx.uint32)))


def test_the_kernels_apply_off_the_cpu_only_with_kernels_on(monkeypatch):
    monkeypatch.setattr(kvquant_fit_kernel, "enabled", lambda: True)
    assert nonuniform_codebook._fit_kernels_apply(8)
    assert not nonuniform_codebook._fit_kernels_apply(32)  # no template for 5 bits
    monkeypatch.setattr(kvquant_fit_kernel, "enabled", lambda: False)
    assert not nonuniform_codebook._fit_kernels_apply(8)


@cuda_test
@pytest.mark.parametrize("kind, heads, n, levels", [("smooth", 8, 16384, 8), ("coarse", 3, 4096, 4), ("smooth", 8, 20000, 16)])
def test_kernel_fit_on_cuda_is_the_ops_fit_bit_for_bit(monkeypatch, kind, heads, n, levels):
    x = _samples(kind, heads, n)
    reference = _ops_fit(monkeypatch, x, levels, 20)
    ours = fit_codebook(x, levels, 20)  # on CUDA: the kernels (kernels on by default)
    mx.eval(ours)
    assert np.array_equal(np.array(mx.view(ours, mx.uint32)), np.array(mx.view(reference, mx.uint32)))


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit)")
def test_fit_kernels_compile_for_sm90_without_spills(monkeypatch, tmp_path):
    monkeypatch.setattr(nonuniform_codebook, "_fit_compiled", lambda: False)
    sources = set()
    for levels in (4, 8, 16):
        with cuda_emulation.signatures_only() as captured, cuda_emulation.emulated_kernels():
            fit_codebook(_samples("smooth", 2, 300), levels, 1)
        sources |= {kernel.cuda_source(sig) for kernel, sig in captured}
    assert len(sources) == 6  # product and update, for 2, 3 and 4 bits
    for i, source in enumerate(sorted(sources)):
        compiled_without_spills(source, tmp_path, i)
