"""bench.kernel_probe: its kernel variants are cut from the shipped source at markers that must
exist, and off CUDA it refuses with a usage error instead of timing nothing."""

import pytest

from veloxquant_mlx.bench import kernel_probe
from veloxquant_mlx.cache import fused_decode


def test_variants_cut_one_half_of_the_shipped_kernel():
    full = kernel_probe.variant_source("full")
    assert full == fused_decode._PARTIALS
    noscore, novalue = kernel_probe.variant_source("noscore"), kernel_probe.variant_source("novalue")
    assert "__ldg(col + (size_t)d * wk_words)" in full and "__ldg(col + (size_t)d * wk_words)" not in noscore
    assert "words[k][i] = __ldg(row + i)" in full and "words[k][i] = __ldg(row + i)" not in novalue
    assert "online softmax" in noscore and "online softmax" in novalue
    with pytest.raises(ValueError, match="allowed are full, noscore, novalue"):
        kernel_probe.variant_source("half")


def test_off_cuda_it_is_a_usage_error(capsys):
    if fused_decode._on_cuda():
        pytest.skip("this machine runs MLX on CUDA: the probe would run")
    assert kernel_probe.main(["--parts", "read", "--no-openblas"]) == 2
    assert "needs MLX's CUDA backend" in capsys.readouterr().err


def test_parts_are_checked():
    with pytest.raises(SystemExit):
        kernel_probe.parse_args(["--parts", "read,everything"])
